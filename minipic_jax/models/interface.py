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
