"""The Llama training forward: the engine's model on dense [B, L] batches with Block-Attention
masks (what the engine's paged step computes for the same segmented prompt, train as you serve).

Positions and windows come from the same layout code the engine uses (serving/layout.py; see
minipic_jax/training/batch.py): a query at logical position p with window start w attends to the
valid keys at logical positions in [w, p]. Pads (layout pads and batch padding) take no part.
Each layer may be rematerialised in the backward pass (`remat`); params may be fp32 masters, cast
to `compute_dtype` here. Attention is `jax.nn.dot_product_attention`: XLA's dense path (fp32
scores over [B, H, L, L]) or cuDNN's flash attention (bf16/fp16 only), which takes the block mask
as an additive bias and skips the tiles above the diagonal (`is_causal`: every block mask is
causal, since logical positions grow with the index over valid tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from configs.model_config import ModelConfig
from kernels_pallas.rope import apply_rope
from minipic_jax.models import llama_modules as modules
from minipic_jax.models import rope


def block_attention_mask(positions, windows, valid):
    """positions/windows [B, L] int32, valid [B, L] bool -> mask [B, 1, L, L] bool (query, key).

    A pad query attends only to itself, so no softmax row is empty (its output is ignored)."""
    pos_q, pos_k = positions[:, :, None], positions[:, None, :]
    mask = valid[:, None, :] & (pos_k <= pos_q) & (pos_k >= windows[:, :, None])
    eye = jnp.eye(positions.shape[1], dtype=bool)[None]
    return (mask | (eye & ~valid[:, :, None]))[:, None]


REMAT_POLICIES = {
    "full": None,  # recompute the whole layer
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep projection outputs
}


def attn_implementation(requested: str | None, compute_dtype) -> str:
    """The one place that picks the training attention: "xla" or "cudnn".

    requested: None or "xla" (XLA), "cudnn" (error if it cannot run), "auto" (cuDNN on a GPU
    with a bf16/fp16 compute dtype, else XLA)."""
    half = compute_dtype is not None and jnp.dtype(compute_dtype) in (jnp.bfloat16, jnp.float16)
    if requested in (None, "xla"):
        return "xla"
    if requested == "cudnn":
        if not half:
            raise ValueError(f"attn_impl='cudnn' needs compute_dtype bfloat16 or float16, got "
                             f"{compute_dtype}; use attn_impl='xla' or 'auto'")
        return "cudnn"
    if requested == "auto":
        return "cudnn" if half and jax.default_backend() == "gpu" else "xla"
    raise ValueError(f"attn_impl must be None, 'xla', 'cudnn' or 'auto', got {requested!r}")


def _remat(fn, remat):
    if remat in (False, "none"):
        return fn
    if remat is True or remat in REMAT_POLICIES:
        return jax.checkpoint(fn, policy=REMAT_POLICIES.get(remat))
    raise ValueError(f"remat must be a bool, 'none' or one of {sorted(REMAT_POLICIES)}, got "
                     f"{remat!r}")


def _dense_attend(positions, mask, cfg: ModelConfig, implementation):
    """attend(q, k, v, _) over [B*L] rows: RoPE by logical position, masked dense attention."""
    inv = rope.inv_freq(cfg)
    scaling = rope.attention_scaling(cfg)
    b, seq = positions.shape
    flat_pos = positions.reshape(-1)

    def attend(q, k, v, state):
        q = apply_rope(q, flat_pos, inv, scaling)  # [B*L, H, D]
        k = apply_rope(k, flat_pos, inv, scaling)  # [B*L, K, D]
        split = lambda a: a.reshape(b, seq, *a.shape[1:])
        out = jax.nn.dot_product_attention(split(q), split(k), split(v), mask=mask,
                                           is_causal=implementation == "cudnn",
                                           implementation=implementation)  # [B, L, H, D]
        return out.reshape(q.shape), state
    return attend


def training_forward(params: dict, tokens, positions, windows, valid, cfg: ModelConfig, *,
                     compute_dtype=None, remat: bool | str = True, attn_impl: str | None = None,
                     rows=None):
    """Dense Block-Attention forward for training.

    Args:
      params: the family's params dict (unfused), e.g. fp32 master weights.
      tokens: [B, L] int32.
      positions: [B, L] int32 logical positions (as the engine assigns them).
      windows: [B, L] int32 smallest logical key position each token may attend.
      valid: [B, L] bool; False for pads (invisible: no query output used, never attended).
      cfg: static ModelConfig.
      compute_dtype: dtype the params are cast to for the forward (None: as stored).
      remat: recompute each layer's activations in the backward pass: True or "full" (all),
        "dots" (all but the projection outputs), False or "none".
      attn_impl: None/"xla", "cudnn" or "auto" (see `attn_implementation`).
      rows: optional [R] int32 indices into the flattened [B*L] rows (e.g. the loss's rows): the
        final norm and LM head then run on those R rows only.
    Returns:
      logits [B, L, V] float32, or [R, V] when `rows` is given.
    """
    attn_impl = attn_implementation(attn_impl, compute_dtype)
    if compute_dtype is not None:
        params = jax.tree.map(lambda w: w.astype(compute_dtype), params)
    model = modules.bind(params, cfg)
    b, seq = tokens.shape
    mask = block_attention_mask(positions, windows, valid)
    x = model.embed_tokens(tokens).reshape(b * seq, cfg.hidden_size)  # [B*L, E]
    graphdef = nnx.graphdef(model.layers[0])

    def layer(layer_params, x, positions, mask):
        block = nnx.merge(graphdef, layer_params)
        return block(x, cfg, _dense_attend(positions, mask, cfg, attn_impl), None)[0]

    layer = _remat(layer, remat)
    for i, layer_params in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            x = layer(layer_params, x, positions, mask)
    if rows is not None:
        return model.logits(x[rows], cfg)  # [R, V]
    return model.logits(x, cfg).reshape(b, seq, cfg.vocab_size)
