"""The model contract: what the engine needs from a model, as `typing.Protocol`s.

The engine is handed a loaded model (`EngineModel`: config, params, family, tokenizer) and talks
to it only through these names; it never imports a model package. A family is a module (or any
object) with the members of `ModelFamily`; a hybrid (recurrent + attention) family also has
those of `HybridModelFamily`. `check_family` says which member is missing, once, at engine start.

Names shared with the kernels: `block_size` is the number of token slots of one KV block
(`page_size` B in the kernels' page shape [P, B, K, D]); `kv_mode` is the attention kernels'
"position_free" | "rotated" (serving's Config.kv_mode adds "pic_off": position-free keys with
the markers ignored, see Config.attention_kv_mode).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, Protocol, runtime_checkable

import jax


# Checkpoints off the recurrent layers' chunk grid (a span prompt's first span start) that one
# prefill step may hold inside its sequences' rows: each is a break in the chunked packing (the
# rows after it start a chunk of their own, kernels_pallas/gated_delta/ragged.py `packing`), so
# the checkpoint is exact without ending its chunk there; the host's chunk_stop keeps to it
# (serving/hybrid/hybrid_prefix.py), the model sizes its packed stream by it.
CHECKPOINT_BREAKS = 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RecurrentMetadata:
    """Per-sequence recurrent-state slots for hybrid models (ignored by pure-attention models)."""

    state_slots: jax.Array  # [S] int32 slot of each sequence in the recurrent-state cache
    reset: jax.Array  # [S] bool start this sequence from the zero state (first chunk of a prompt)
    # static, known on the host: True every sequence has <= 1 new token (decode-only step), and
    # sequence i's is row i (those with none come last: the runner lays a decode-only step so;
    # the hybrid's in-place decode reads rows as sequences, qwen3_5_gdn.DECODE_SEQ_ROWS), False
    # some may have more (the recurrent layers run their chunked prefill), None decide on device
    decode: bool | None = dataclasses.field(default=None, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpanPieces:
    """SSEP span rows of a hybrid step (minipic_jax/models/qwen3_5_spans.py reads them)."""

    row_span: jax.Array  # [T] bool the row reads its piece's local recurrent pass
    piece_cu: jax.Array  # [G+1] int32 row offsets of the pieces (all rows, in order; empty tail)
    carry_local: jax.Array  # [S] bool the sequence's last piece is its final segment, a span
    # that starts in this step: it carries the span's local state on (generated tokens extend
    # the span, read as flow rows from then on), not the flow
    # warm path (serving/hybrid/span_cache.py): pieces whose span map (A, B, conv tail) the step returns,
    # [Mc] int32 piece ids (-1 = none); None: the step returns no maps
    capture: jax.Array | None = None
    # long spans captured over several steps (serving/hybrid/span_partial.py): the map so far of
    # each capture that continues one, which its piece enters (local state B, conv tail, and the
    # transition A its own composes with): dict use [Mc] bool, slot [Mc] int32, count [Mc] int32
    # (the maps' own), and the span-map pool's a [P, Lg, Hv, Dk, Dk], b [P, Lg, Hv, Dk, Dv], tail
    # [P, Lg, C, Kc-1] (each layer gathers its rows); None: every capture starts at zero
    entry: dict | None = None
    # static: the most packed chunks the local pass's span rows take (each piece padded to whole
    # chunks); the host promises the step fits (serving/hybrid/span_rows.local_chunk_bound, kept
    # by the scheduler's cut and checked by the runner). None: the worst case of piece_cu's bound
    local_chunks: int | None = dataclasses.field(default=None, metadata=dict(static=True))


@runtime_checkable
class ModelFamily(Protocol):
    """One model family (llama.py, qwen3_5.py, ...). Pure functions; cfg is the static config."""

    IS_HYBRID: bool  # True: recurrent layers too (see HybridModelFamily)

    def config_from_hf(self, hf_config: dict) -> Any:
        """HF config.json dict -> configs.ModelConfig; ValueError for what it cannot run."""

    def init_params(self, cfg, key, dtype) -> Any:
        """Deterministic random weights (a pytree)."""

    def param_axes(self, cfg) -> Any:
        """Logical axis-name tuples, the same pytree structure as the params."""

    def convert_hf(self, get_tensor, cfg, dtype, *, host: bool = False) -> Any:
        """Params from HF tensors; get_tensor(name) -> np.ndarray. host=True: the same tree of
        numpy views in the family's layout (nothing copied), for streaming to devices."""

    def hf_tensor_names(self, cfg) -> list[str]:
        """Every tensor convert_hf reads."""

    def fuse_params(self, params, *, consume: bool = False) -> Any:
        """Params with the weights that read the same input concatenated (one GEMM each); the
        identity for a family with nothing to fuse. consume: delete originals as they fuse."""

    def init_cache(self, cfg, num_pages: int, block_size: int, max_num_seqs: int,
                   dtype) -> Any:
        """Zeroed cache pytree: KV pages [P, block_size, K, D] per attention layer, held in
        its fields `k` and `v` (page zeroing and the tiers find pages by these fields:
        serving/cache/kv_pool.page_mask), and max_num_seqs recurrent-state slots per recurrent
        layer in other fields for hybrid families."""

    def forward(self, params, tokens, metadata, cache, cfg, *, recurrent=None,
                logits_indices=None, kv_mode: str = "position_free", attn_impl=None,
                write_impl=None, attn_options=None) -> tuple[Any, Any]:
        """One ragged step -> (logits [N, V] float32, cache). tokens [T] int32; metadata the
        kernels' AttentionMetadata; recurrent a RecurrentMetadata (hybrid families);
        logits_indices [N] int32 rows of T (default all). attn_impl / attn_options:
        paged_attention's implementation and options, write_impl: write_kv's, for every
        attention layer. Pure and jit-able; the caller donates the cache."""


@runtime_checkable
class HybridModelFamily(ModelFamily, Protocol):
    """A family with recurrent layers: exact states can be taken at chunk boundaries (the
    sparse prefix cache's checkpoints), read out of a slot and written back into one. Its
    `forward` also takes gdn_impl=, the gated delta prefill kernel (a name of
    kernels_pallas.gated_delta.api, resolved once by the engine: kernel_choices.gdn_choice)."""

    CHUNK: int  # recurrent checkpoint granularity (the recurrent kernel's chunk size)

    def forward_with_checkpoints(self, params, tokens, metadata, cache, cfg, *,
                                 checkpoint_at=None, **forward_kwargs) -> tuple[Any, Any, Any]:
        """`forward` plus the recurrent states at checkpoint_at [S, M] positions (or None)."""

    def extract_state(self, cache, slot: int) -> dict:
        """One slot's recurrent state as host arrays."""

    def restore_state(self, cache, slot: int, state: dict) -> Any:
        """The cache with `state` written into `slot`."""

    def state_nbytes(self, cfg) -> dict:
        """Analytic size of one sequence's recurrent state."""


class EngineModel(Protocol):
    """What the engine is handed (minipic_jax.loading.LoadedModel is one)."""

    cfg: Any  # configs.ModelConfig
    params: Any  # the family's params pytree
    family: ModelFamily
    tokenizer: Any  # None, or encode / decode / eos_token_ids / bos_token_id
    # the checkpoint files the params were converted from ((): none, e.g. random weights); their
    # bytes fingerprint the weights for the span store (serving/tiers/fingerprint.py)
    weight_files: tuple


def check_family(family) -> None:
    """TypeError naming the members of the contract that `family` lacks."""
    hybrid = hasattr(family, "IS_HYBRID") and family.IS_HYBRID
    need = HybridModelFamily if hybrid else ModelFamily
    missing = [name for name in _members(need) if not hasattr(family, name)]
    if missing:
        label = getattr(family, "__name__", type(family).__name__)
        raise TypeError(f"model family {label} does not implement serving.model_contract."
                        f"{need.__name__}: missing {', '.join(missing)}")


def _members(protocol) -> list[str]:
    names = []
    for klass in protocol.__mro__:
        if klass in (Protocol, Generic, object):
            continue
        names += [n for n in vars(klass) if not n.startswith("_")]
        names += [n for n in getattr(klass, "__annotations__", {}) if not n.startswith("_")]
    return sorted(set(names))
