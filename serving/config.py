"""The engine's one configuration dataclass, validated once (vLLM option names).

Bucketing (the only place that says how shapes are padded so compiles stay bounded):
  * query tokens per step T: powers of two from `min_token_bucket` (None: 1 on CPU, 8 on an
    accelerator) up to `max_num_batched_tokens` (rounded up to a power of two);
  * sequences per step S: min(T bucket, seat count), and with `small_seq_bucket` also that many
    rows for a step of at most that many sequences (two step shapes per T bucket);
  * block-table width NB: fixed at ceil(max_model_len / block_size).
So the runner compiles at most 2 len(token_buckets) step variants per sampling mode and
attention plan.
"""

from __future__ import annotations

import dataclasses
import warnings

from kernels_pallas.paged_attention.api import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from serving.config_groups import (CHECKPOINT_STRATEGIES, CompilationConfig,  # noqa: F401
                                   GatedDeltaConfig, HybridCacheConfig, KVStoreConfig,
                                   SpanMapConfig, grouped_kwargs, option, to_flat)

KV_MODES = ("position_free", "rotated", "pic_off")
POLICIES = ("fcfs", "barrier", "isps")
HASH_ALGOS = ("xxhash64", "sha256")


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
    # option(host_only=True): the compiled step never reads it (serving/config_groups.py)
    # device pool size; None -> from gpu_memory_utilization
    num_kv_blocks: int | None = option(None, host_only=True)
    gpu_memory_utilization: float = option(0.8, host_only=True)
    enable_prefix_caching: bool = True
    # "position_free" (MiniPIC), "rotated" (baseline), "pic_off"; the step reads only
    # attention_kv_mode, which ModelRunner keys its programs by
    kv_mode: str = option("position_free", host_only=True)
    hash_algo: str = option("xxhash64", host_only=True)
    scheduling_policy: str = option("fcfs", host_only=True)  # "fcfs" | "barrier" | "isps"
    # extra batch rows for span-only prefills under isps
    isps_span_seats: int = option(8, host_only=True)
    # host tier bytes (serving/tiers/offload.py; hybrid models give half to checkpoints)
    cpu_offload_gb: float = option(0.0, host_only=True)
    pad_token_id: int | None = None
    ssep_token_id: int | None = None
    pdep_token_id: int | None = None
    # the request check's bound; the step's logprob count is a static argument of its own
    max_logprobs: int = option(20, host_only=True)
    # Smallest step size (query rows a step is padded up to); None: 1 on a CPU backend, where a
    # padded row costs its share of every matmul (SmolLM2-135M shape, one thread: a decode step's
    # matmuls took 80 ms for 1 row, 127 ms for 8), and 8 on an accelerator.
    min_token_bucket: int | None = None
    # A second, small sequence bucket: a step of at most this many sequences runs with S = this
    # many rows instead of min(T, seats); 0: none. A hybrid step's recurrent-state work follows S
    # (each GDN layer gathers and stores S states, and its packed chunk stream holds
    # ceil(T / 64) + 2 S chunks): on the H200 a 128-token step of one request at 64 seats cost
    # 16 ms, as much as 1,024 tokens at 16 seats (issue 29). Each bucket is a step variant per
    # token bucket that warm-up compiles. None: 8 on a hybrid model on an accelerator, else 0.
    small_seq_bucket: int | None = option(None, host_only=True)  # the step reads S, not this
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
    # free blocks kept back at admission (decode headroom)
    watermark_blocks: int = option(0, host_only=True)
    # write_kv implementation for attention layers (Llama family): None = the Pallas row copy
    # on GPU, XLA elsewhere; "xla" or "triton" to force one.
    write_kv_impl: str | None = None
    # Concatenate the weights that read the same input (Llama: QKV, gate/up; Qwen3.5: the GDN's
    # qkv / z / b / a, the attention's q / gate / k / v, gate/up) once at engine start, so each
    # is one GEMM per layer (fewer kernels; the engine then holds the fused arrays in
    # loaded.params). A family with nothing to fuse keeps its params.
    fuse_weights: bool = True
    # Overlap the host with the device (vLLM's option name): step N+1 is scheduled, built and
    # dispatched before step N's sampled tokens are read back; decode rows take their input
    # token from the previous step's sampled tokens on device. One step in flight at most.
    # False = the synchronous loop (schedule, run, read back, then the next step).
    async_scheduling: bool = True
    # Option groups (serving/config_groups.py): the persistent span store, hybrid models'
    # recurrent checkpoints and their span maps, the steps' compilation. `Config.from_flat`
    # (what LLM uses) also takes their vLLM-style flat keywords (kv_store_dir=...,
    # checkpoint_gb=..., span_map_gb=..., gdn_impl=..., step_command_buffer=...).
    kv_store: KVStoreConfig = option(default_factory=KVStoreConfig)
    hybrid_cache: HybridCacheConfig = option(default_factory=HybridCacheConfig)
    span_maps: SpanMapConfig = option(default_factory=SpanMapConfig)
    # hybrid models' gated delta prefill kernel (gdn_impl=...; "auto": the registry's choice)
    gdn: GatedDeltaConfig = option(default_factory=GatedDeltaConfig)
    # how the step programs compile (step_command_buffer=...: XLA command buffers on a GPU)
    compilation: CompilationConfig = option(default_factory=CompilationConfig)
    # Devices the model is split over (Megatron tensor parallelism, serving/step/sharding.py): must
    # divide the attention (and GDN) head counts and not exceed the device count. Under TP the
    # weights stay unfused (fuse_weights is ignored: a fused [q | k | v] axis would not split
    # by heads).
    tensor_parallel_size: int = 1
    # Stored step executables (serving/step/executable_store.py; was the MINIPIC_STEP_CACHE
    # environment variable): None or "on" = `<JAX compilation cache folder>/minipic_steps`
    # (none while that cache is off; None follows executable_store.DEFAULT_SETTING, which the
    # test suite sets to "off"), "off" = no store, anything else = that folder.
    step_cache: str | None = option(None, host_only=True)

    @classmethod
    def from_flat(cls, **kw) -> "Config":
        """A Config from vLLM-style flat keywords (kv_store_dir=..., checkpoint_gb=...,
        span_map_gb=...), core fields and group objects, mixed. An unknown keyword is a
        TypeError naming it and the closest known name."""
        return cls(**grouped_kwargs(cls, kw))

    def to_flat(self) -> dict:
        """Every option as a flat keyword: `Config.from_flat(**c.to_flat()) == c`."""
        return to_flat(self)

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Config.{name} must be positive, got {getattr(self, name)}")
        if self.min_token_bucket is not None and self.min_token_bucket < 1:
            raise ValueError(f"Config.min_token_bucket must be None or >= 1, "
                             f"got {self.min_token_bucket}")
        if self.small_seq_bucket is not None and self.small_seq_bucket < 0:
            raise ValueError(f"Config.small_seq_bucket must be None or >= 0, "
                             f"got {self.small_seq_bucket}")
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
        if self.cpu_offload_gb < 0:
            raise ValueError(f"Config.cpu_offload_gb must be >= 0, got {self.cpu_offload_gb}")
        if self.kv_store.dir is not None and not self.enable_prefix_caching:
            raise ValueError("kv_store_dir (Config.kv_store.dir) needs enable_prefix_caching=True (the store "
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

    def seq_buckets(self, token_bucket: int) -> tuple[int, ...]:
        """The sequence buckets S of a step of `token_bucket` rows, ascending."""
        full = min(token_bucket, self.num_seats)
        small = min(self.small_seq_bucket or full, full)
        return (small, full) if small < full else (full,)

    def seq_bucket(self, token_bucket: int, num_seqs: int | None = None) -> int:
        """The S a step of `token_bucket` rows and `num_seqs` sequences runs with (None: the
        largest, min(T, seats))."""
        buckets = self.seq_buckets(token_bucket)
        if num_seqs is None:
            return buckets[-1]
        return next((b for b in buckets if num_seqs <= b), buckets[-1])


def effective_config(config: Config, hybrid: bool) -> Config:
    """The Config an engine runs: `config` itself, or a copy (dataclasses.replace; the caller's
    object is never changed) where the model needs another setting. isps's span-only prefill
    jobs (serving/cache/span_jobs.py) serve attention-only models, so on a hybrid model isps
    falls back to fcfs, with a warning naming both. An unset small_seq_bucket becomes its
    default for the model and backend (the field's comment)."""
    changes = {}
    if hybrid and config.scheduling_policy == "isps":
        warnings.warn("scheduling_policy='isps' is not supported on hybrid models (its span-only "
                      "prefill jobs serve attention-only models); this engine runs 'fcfs'",
                      UserWarning, stacklevel=3)
        changes["scheduling_policy"] = "fcfs"
    if config.small_seq_bucket is None:
        import jax
        accelerator = jax.default_backend() != "cpu"
        changes["small_seq_bucket"] = HYBRID_SMALL_SEQ_BUCKET if hybrid and accelerator else 0
    return dataclasses.replace(config, **changes) if changes else config


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


# Config.small_seq_bucket's default on a hybrid model on an accelerator (one request's steps;
# its checkpoint and restore rows, checkpoint_plan.step_rows / restore_rows, stay at full count)
HYBRID_SMALL_SEQ_BUCKET = 8

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
