"""What every model family module provides (llama.py, qwen3_5.py, ...), and the extra metadata
hybrid models read. The engine talks to models only through these names.

A family module exposes:
  config_from_hf(hf_config: dict) -> configs.ModelConfig         # raises ValueError on unsupported
  init_params(cfg, key, dtype) -> params pytree                  # deterministic random weights
  param_axes(cfg) -> pytree of logical axis-name tuples, same structure as params
  convert_hf(get_tensor, cfg, dtype) -> params                   # get_tensor(name) -> np.ndarray
  hf_tensor_names(cfg) -> list[str]                              # every tensor convert_hf reads
  init_cache(cfg, num_pages, page_size, max_num_seqs, dtype) -> cache pytree
  forward(params, tokens, metadata, cache, cfg, *, recurrent=None, logits_indices=None,
          kv_mode="position_free", attn_impl=None, write_impl=None, attn_options=None)
          -> (logits, cache)
      tokens [T] int32; metadata kernels_pallas AttentionMetadata; logits_indices [N] int32 rows
      of T to compute logits for (default: all T) -> logits [N, V] float32. attn_impl /
      write_impl / attn_options: paged_attention's implementation and kernel_options and
      write_kv's implementation for every attention layer (the engine's decode-only steps pass
      their own). Pure and jit-able, cache donated by the caller.
"""

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RecurrentMetadata:
    """Per-sequence recurrent-state slots for hybrid models (ignored by pure-attention models)."""

    state_slots: jax.Array  # [S] int32 slot of each sequence in the recurrent-state cache
    reset: jax.Array  # [S] bool start this sequence from the zero state (first chunk of a prompt)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpanPieces:
    """SSEP span rows of a hybrid step (minipic_jax/models/qwen3_5_spans.py reads them)."""

    row_span: jax.Array  # [T] bool the row reads its piece's local recurrent pass
    piece_cu: jax.Array  # [G+1] int32 row offsets of the pieces (all rows, in order; empty tail)
    carry_local: jax.Array  # [S] bool the sequence's last piece is its final segment, a span
    # that starts in this step: it carries the span's local state on (generated tokens extend
    # the span, read as flow rows from then on), not the flow
