"""The engine's one configuration dataclass, validated once (vLLM option names).

Bucketing (the only place that says how shapes are padded so compiles stay bounded):
  * query tokens per step T: powers of two from `min_token_bucket` (None: 1 on CPU, 8 on an
    accelerator) up to `max_num_batched_tokens` (rounded up to a power of two);
  * sequences per step S: min(T bucket, seat count), so one step shape per T bucket;
  * block-table width NB: fixed at ceil(max_model_len / block_size).
So the runner compiles at most len(token_buckets) step variants per sampling mode.
"""

from __future__ import annotations

import dataclasses

from kernels_pallas.paged_attention.api import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS

KV_MODES = ("position_free", "rotated", "pic_off")
POLICIES = ("fcfs", "barrier", "isps")
HASH_ALGOS = ("xxhash64", "sha256")
CHECKPOINT_STRATEGIES = ("none", "last", "block", "balanced", "dp")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(kw_only=True)
class Config:
    """Engine options. Marker/pad ids default per model family (see `default_marker_ids`); ids
    set here are vocabulary tokens the model sees as they are."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None  # device pool size; None -> from gpu_memory_utilization
    gpu_memory_utilization: float = 0.8
    enable_prefix_caching: bool = True
    kv_mode: str = "position_free"  # "position_free" (MiniPIC), "rotated" (baseline), "pic_off"
    hash_algo: str = "xxhash64"
    scheduling_policy: str = "fcfs"  # "fcfs" | "barrier" | "isps"
    isps_span_seats: int = 8  # extra batch rows for span-only prefills under isps
    cpu_offload_gb: float = 0.0
    pad_token_id: int | None = None
    ssep_token_id: int | None = None
    pdep_token_id: int | None = None
    max_logprobs: int = 20
    # Smallest step size (query rows a step is padded up to); None: 1 on a CPU backend, where a
    # padded row costs its share of every matmul (SmolLM2-135M shape, one thread: a decode step's
    # matmuls took 80 ms for 1 row, 127 ms for 8), and 8 on an accelerator.
    min_token_bucket: int | None = None
    # Attention kernel (kernels_pallas.paged_attention.api.IMPLEMENTATIONS): "auto" (None: the
    # same) lets the kernel registry's policy pick per step kind, on a GPU the ragged Triton
    # kernel for general steps and, for decode-only steps, the Mosaic decode kernel where it
    # takes the model's shapes, else triton_decode (benchmarks/RESULTS.md, Attention: decode).
    attn_impl: str | None = "auto"
    # Kernel of decode-only steps (one query per sequence); None: as attn_impl.
    decode_attn_impl: str | None = None
    # Options of a named decode_attn_impl (a dict of its options dataclass's fields, e.g.
    # {"rope": "table"}); unset ones take the kernel's defaults, max_model_len as position bound.
    decode_attn_options: dict | None = None
    watermark_blocks: int = 0  # free blocks kept back at admission (decode headroom)
    # write_kv implementation for attention layers (Llama family): None = the Pallas row copy
    # on GPU, XLA elsewhere; "xla" or "triton" to force one.
    write_kv_impl: str | None = None
    # Concatenate the weights that read the same input (Llama: QKV, gate/up) once at engine
    # start, so each is one GEMM per layer (fewer kernels; the engine then holds the fused
    # arrays in loaded.params). A family with nothing to fuse keeps its params.
    fuse_weights: bool = True
    # Overlap the host with the device (vLLM's option name): step N+1 is scheduled, built and
    # dispatched before step N's sampled tokens are read back; decode rows take their input
    # token from the previous step's sampled tokens on device. One step in flight at most.
    # False = the synchronous loop (schedule, run, read back, then the next step).
    async_scheduling: bool = True
    # Persistent span store (serving/tiers/disk_store.py): a folder under the host tier where cached
    # blocks are written once and read back by any later process of the same model and settings;
    # None = off. kv_store_gb: its size (every file in the folder), least recently used runs
    # deleted past it. kv_store_spans_only: store SSEP span blocks only (not the prompt parts
    # around them, e.g. one-off questions). kv_store_staging_gb: device memory for runs read ahead
    # of their copy-in (staged runs and reads in flight, serving/tiers/kv_store_staging.py); None =
    # min(16 GiB, 16% of the device's memory limit), 4 GiB without memory stats (CPU). A
    # default-sized KV pool (num_kv_blocks=None) leaves it free. The H200 warm job ran 2.4x
    # the empty-store run with 4 GiB and 5.9x with 16 (benchmarks/RESULTS.md, span store).
    kv_store_dir: str | None = None
    kv_store_gb: float = 64.0
    kv_store_spans_only: bool = False
    kv_store_staging_gb: float | None = None
    # Hybrid models (prefix caching with recurrent checkpoints, serving/hybrid/hybrid_prefix.py): where a
    # prefill takes checkpoints ("none", "last", "block", "balanced", "dp": serving/
    # checkpoint_plan.py), at most checkpoints_per_prompt per prompt (None: min(4, device slots
    # / (2 max_num_seqs)), at least 1, so the tier holds twice as many prompts as run); "block" every
    # checkpoint_block_tokens. checkpoint_gb: device tier bytes (None: 5% of the device's memory
    # limit, or 64 checkpoints without memory stats); half of cpu_offload_gb holds the host tier.
    # The overlap estimates (serving/hybrid/overlap_estimate.py) halve a request's weight every
    # checkpoint_half_life requests; the global plan in get_stats() replans every
    # checkpoint_replan_every requests or when it drifted checkpoint_replan_tv (total variation).
    # checkpoint_step_tokens: what a second checkpoint in one prefill chunk costs (the chunk is
    # split: about one more engine step), in prompt tokens of compute; dp places a prompt's
    # checkpoints beyond one per chunk only where they save more (1,050 measured on the H200 at the
    # Qwen3.5-0.8B shape: benchmarks/RESULTS.md, hybrid prefix caching run 3). 0: no price. It is
    # also the least saving for which a new request waits (a few steps at most) for a checkpoint
    # that a running prefill of its prefix is about to store, rather than recompute behind it.
    checkpoint_strategy: str = "dp"
    checkpoint_step_tokens: float = 1024.0
    checkpoints_per_prompt: int | None = None
    checkpoint_block_tokens: int = 512
    checkpoint_gb: float | None = None
    checkpoint_half_life: float = 256.0
    checkpoint_replan_every: int = 64
    checkpoint_replan_tv: float = 0.1
    # checkpoint_bucket_fit: a plain hybrid prompt's chunk that overflows a token bucket by at
    # most (smallest bucket - seats) tokens stops at that bucket; the overflow rides on the next
    # step (serving/hybrid/bucket_fit.py). Off by default: on the H200 (Qwen3.5-0.8B shape, run 4 in
    # benchmarks/history/hybrid_cache.md) a prefill step costs ~10 ms more than a decode step of
    # the same bucket, more than the padding the cut saves.
    checkpoint_bucket_fit: bool = False
    # Hybrid models, SSEP spans (serving/hybrid/span_cache.py): device bytes of cached span maps (one map:
    # A and B of every recurrent layer in span_map_dtype, plus a conv tail; None: 2% of the
    # device's memory limit, or 64 maps without memory stats; 0: spans always recomputed), and
    # host bytes where evicted maps wait (0: none).
    span_map_gb: float | None = None
    span_map_host_gb: float = 0.0
    span_map_dtype: str = "float32"
    # Devices the model is split over (Megatron tensor parallelism, serving/step/sharding.py): must
    # divide the attention (and GDN) head counts and not exceed the device count. Under TP the
    # weights stay unfused (fuse_weights is ignored: a fused [q | k | v] axis would not split
    # by heads).
    tensor_parallel_size: int = 1

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Config.{name} must be positive, got {getattr(self, name)}")
        if self.min_token_bucket is not None and self.min_token_bucket < 1:
            raise ValueError(f"Config.min_token_bucket must be None or >= 1, "
                             f"got {self.min_token_bucket}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"Config.tensor_parallel_size must be >= 1, "
                             f"got {self.tensor_parallel_size}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"Config.block_size must be a power of two, got {self.block_size}")
        if self.kv_mode not in KV_MODES:
            raise ValueError(f"Config.kv_mode must be one of {KV_MODES}, got {self.kv_mode!r}")
        for name in ("attn_impl", "decode_attn_impl"):
            impl = getattr(self, name)
            if impl is not None and impl not in ATTENTION_IMPLEMENTATIONS:
                raise ValueError(f"Config.{name} must be None or one of "
                                 f"{ATTENTION_IMPLEMENTATIONS}, got {impl!r}")
        if self.decode_attn_options and (self.decode_attn_impl or self.attn_impl or "auto") \
                == "auto":
            raise ValueError("Config.decode_attn_options needs a named decode_attn_impl (with "
                             "'auto' the kernel registry picks the options too)")
        if self.write_kv_impl not in (None, "xla", "triton"):
            raise ValueError(f"Config.write_kv_impl must be None, 'xla' or 'triton', "
                             f"got {self.write_kv_impl!r}")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"Config.scheduling_policy must be one of {POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"Config.hash_algo must be one of {HASH_ALGOS}, got {self.hash_algo!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"Config.num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.watermark_blocks < 0:
            raise ValueError(f"Config.watermark_blocks must be >= 0, got {self.watermark_blocks}")
        if self.num_kv_blocks is not None:  # a default-sized pool: LLMEngine checks
            check_watermark(self, self.num_kv_blocks)
        if self.checkpoint_strategy not in CHECKPOINT_STRATEGIES:
            raise ValueError(f"Config.checkpoint_strategy must be one of {CHECKPOINT_STRATEGIES}, "
                             f"got {self.checkpoint_strategy!r}")
        if self.checkpoints_per_prompt is not None and self.checkpoints_per_prompt < 0:
            raise ValueError(f"Config.checkpoints_per_prompt must be None or >= 0, "
                             f"got {self.checkpoints_per_prompt}")
        if self.checkpoint_replan_every < 1:
            raise ValueError(f"Config.checkpoint_replan_every must be >= 1, "
                             f"got {self.checkpoint_replan_every}")
        if self.checkpoint_block_tokens < 1 or not self.checkpoint_half_life > 0:
            raise ValueError(f"Config.checkpoint_block_tokens ({self.checkpoint_block_tokens}) "
                             f"and checkpoint_half_life ({self.checkpoint_half_life}) must be > 0")
        if not self.checkpoint_step_tokens >= 0:
            raise ValueError(f"Config.checkpoint_step_tokens must be >= 0, "
                             f"got {self.checkpoint_step_tokens}")
        if self.checkpoint_gb is not None and self.checkpoint_gb < 0:
            raise ValueError(f"Config.checkpoint_gb must be None or >= 0, got {self.checkpoint_gb}")
        if not 0 < self.checkpoint_replan_tv <= 1:
            raise ValueError(f"Config.checkpoint_replan_tv must be in (0, 1], "
                             f"got {self.checkpoint_replan_tv}")
        if self.span_map_gb is not None and self.span_map_gb < 0 or self.span_map_host_gb < 0:
            raise ValueError(f"Config.span_map_gb must be None or >= 0 and span_map_host_gb >= 0, "
                             f"got {self.span_map_gb} and {self.span_map_host_gb}")
        if self.span_map_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"Config.span_map_dtype must be 'float32' or 'bfloat16', "
                             f"got {self.span_map_dtype!r}")
        if self.cpu_offload_gb < 0:
            raise ValueError(f"Config.cpu_offload_gb must be >= 0, got {self.cpu_offload_gb}")
        if self.kv_store_gb <= 0:
            raise ValueError(f"Config.kv_store_gb must be > 0, got {self.kv_store_gb}")
        if self.kv_store_staging_gb is not None and self.kv_store_staging_gb <= 0:
            raise ValueError(f"Config.kv_store_staging_gb must be > 0, "
                             f"got {self.kv_store_staging_gb}")
        if self.kv_store_dir is not None and not self.enable_prefix_caching:
            raise ValueError("Config.kv_store_dir needs enable_prefix_caching=True (the store "
                             "holds prefix-cache blocks)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"Config.max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_num_seqs ({self.max_num_seqs}) so every decode fits one step")
        ids = {k: getattr(self, k) for k in ("pad_token_id", "ssep_token_id", "pdep_token_id")
               if getattr(self, k) is not None}
        if len(set(ids.values())) != len(ids):
            raise ValueError(f"Config: pad/ssep/pdep token ids must differ, got {ids}")

    @property
    def attention_kv_mode(self) -> str:
        """The attention kernels' kv_mode: "pic_off" stores keys unrotated, as position_free does
        (it only ignores the markers)."""
        return "rotated" if self.kv_mode == "rotated" else "position_free"

    # -- derived shapes ---------------------------------------------------------------------
    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def num_seats(self) -> int:
        """Batch rows the runner reserves: request seats plus span-prefill seats under isps."""
        extra = self.isps_span_seats if self.scheduling_policy == "isps" else 0
        return self.max_num_seqs + extra

    @property
    def token_buckets(self) -> tuple[int, ...]:
        top = next_power_of_2(self.max_num_batched_tokens)
        b, out = min(self.smallest_token_bucket, top), []
        while b < top:
            out.append(b)
            b *= 2
        # one-row (CPU) steps: 3/4 of a top >= 1024 too (16 prompts of 30-60 pad 720 -> 768)
        mid = (top * 3 // 4,) if top >= 1024 and self.smallest_token_bucket == 1 else ()
        return tuple(out) + mid + (top,)

    @property
    def smallest_token_bucket(self) -> int:
        """`min_token_bucket`, or its platform default (see the field)."""
        if self.min_token_bucket is not None:
            return self.min_token_bucket
        import jax
        return CPU_MIN_TOKEN_BUCKET if jax.default_backend() == "cpu" else 8

    def token_bucket(self, n: int) -> int:
        for b in self.token_buckets:
            if n <= b:
                return b
        raise ValueError(f"{n} tokens exceed the largest bucket {self.token_buckets[-1]}")

    def seq_bucket(self, token_bucket: int) -> int:
        return min(token_bucket, self.num_seats)


def check_watermark(config: Config, num_blocks: int) -> int:
    """`num_blocks` (the pool's size, a default pool's after any shrinking), or a ValueError:
    admission keeps watermark_blocks free, so at watermark_blocks >= the pool no request could
    ever start (the engine would find nothing schedulable)."""
    if config.watermark_blocks >= num_blocks:
        raise ValueError(f"Config.watermark_blocks={config.watermark_blocks} must be less than "
                         f"the KV pool size ({num_blocks} blocks): admission keeps "
                         f"watermark_blocks free, so no request could start; lower it or raise "
                         f"num_kv_blocks")
    return num_blocks


# the smallest step on a CPU backend: one row (a padded row costs its share of every matmul there)
CPU_MIN_TOKEN_BUCKET = 1

LLAMA3_VOCAB = 128256  # Llama 3's reserved specials are its markers (Tulu3-Block-FT's ids)


def default_marker_ids(vocab_size: int) -> dict[str, int]:
    """Family defaults, in the order pad, ssep, pdep. Llama-3 vocab: its reserved specials (pad =
    <|finetune_right_pad_id|>). Any other vocab: vocab_size, vocab_size + 1, vocab_size + 2, ids
    no tokenizer produces (the logits are vocab_size wide), so no prompt text is ever read as a
    marker; the model sees each through the embedding it borrows (`marker_embedding_ids`)."""
    if vocab_size == LLAMA3_VOCAB:
        return {"pad_token_id": 128004, "ssep_token_id": 128002, "pdep_token_id": 128003}
    return {"pad_token_id": vocab_size, "ssep_token_id": vocab_size + 1,
            "pdep_token_id": vocab_size + 2}


def borrowed_embedding_ids(vocab_size: int, reserved=()) -> dict[str, int]:
    """The vocabulary ids whose embeddings out-of-vocabulary markers borrow: the three highest ids
    not in `reserved` (BOS/EOS), in the order pad, ssep, pdep. These were the marker ids before
    markers moved out of the vocabulary, so a model fine-tuned with blocks sees the embeddings it
    saw then."""
    taken = set(reserved)
    free = [i for i in range(vocab_size - 1, -1, -1) if i not in taken][:3]
    if len(free) < 3:
        raise ValueError(f"vocabulary of {vocab_size} ids has no room for pad/ssep/pdep markers")
    return dict(zip(("pad_token_id", "ssep_token_id", "pdep_token_id"), free))


def marker_embedding_ids(markers: dict[str, int], vocab_size: int,
                         reserved=()) -> dict[int, int]:
    """{marker id >= vocab_size: the vocabulary id fed to the model's embedding in its place}.
    Hashing, layouts and span semantics use the marker id; only the embedding input is mapped
    (the engine's step inputs, the training data), so serving and training see the same."""
    borrowed = borrowed_embedding_ids(vocab_size, reserved)
    return {v: borrowed[k] for k, v in markers.items() if v >= vocab_size}


def resolve_markers(config: Config, vocab_size: int) -> dict[str, int]:
    """Family defaults filled in, then checked: distinct; ids set in the Config (which keep
    today's meaning: model-visible vocabulary tokens) inside the vocabulary."""
    ids = default_marker_ids(vocab_size)
    for k in ids:
        v = getattr(config, k)
        if v is not None:
            if not 0 <= v < vocab_size:
                raise ValueError(f"{k}={v} is outside the vocabulary [0, {vocab_size})")
            ids[k] = v
    if ids["ssep_token_id"] == ids["pad_token_id"] or ids["pdep_token_id"] == ids["pad_token_id"]:
        raise ValueError(f"marker ids must differ from pad_token_id={ids['pad_token_id']}: "
                         f"ssep_token_id={ids['ssep_token_id']}, pdep_token_id={ids['pdep_token_id']}")
    if ids["ssep_token_id"] == ids["pdep_token_id"]:
        raise ValueError(f"ssep_token_id and pdep_token_id must differ, both {ids['ssep_token_id']}")
    return ids


def check_model_len(config, mcfg) -> None:
    """ValueError when Config.max_model_len exceeds the model's max_position_embeddings."""
    if config.max_model_len > (mcfg.max_position_embeddings or config.max_model_len):
        raise ValueError(f"Config.max_model_len={config.max_model_len} exceeds the model's "
                         f"max_position_embeddings={mcfg.max_position_embeddings}")


def eos_and_markers(config, mcfg, tokenizer):
    """(EOS ids of the model and tokenizer, the marker ids `resolve_markers` picks, and
    `marker_embedding_ids` of them with EOS and BOS ids reserved)."""
    eos = set(mcfg.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer is not None else ())
    reserved = eos | {i for i in (mcfg.bos_token_id,
                                  tokenizer.bos_token_id if tokenizer is not None else None)
                      if i is not None}
    markers = resolve_markers(config, mcfg.vocab_size)
    return eos, markers, marker_embedding_ids(markers, mcfg.vocab_size, reserved)
