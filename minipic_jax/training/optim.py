"""The optimizer (optax AdamW, warm-up + cosine, clipping, accumulation) and optional LoRA.

LoRA adds a low-rank update to the attention and MLP projections of every layer:
W' = W + (alpha / r) * A @ B over W's (input, output) axes (wq: E -> H*D, wo: H*D -> E, ...),
with A ~ N(0, 1/in) and B = 0, so training starts from the base model. `merge_lora` gives the
plain params (what the forward and the export use).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
_IN_AXES = {"wo": 2}  # input axes of each projection (1 for the others)


def make_optimizer(*, lr: float, total_steps: int, warmup_steps: int, min_lr_ratio: float,
                   weight_decay: float, clip_norm: float, grad_accum: int,
                   b1: float = 0.9, b2: float = 0.95) -> optax.GradientTransformation:
    """AdamW (no decay on 1-D weights: norms) after global-norm clipping, on a linear warm-up +
    cosine schedule over `total_steps` optimizer updates; averaged over `grad_accum` micro-steps."""
    warmup = min(warmup_steps, max(total_steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, warmup, decay_steps=max(total_steps, warmup + 1), end_value=lr * min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda w: w.ndim > 1, params)
    tx = optax.chain(optax.clip_by_global_norm(clip_norm),
                     optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay,
                                 mask=decay_mask))
    return optax.MultiSteps(tx, every_k_schedule=grad_accum) if grad_accum > 1 else tx


def _split(shape, name):
    k = _IN_AXES.get(name, 1)
    return math.prod(shape[:k]), math.prod(shape[k:])


def init_lora(params: dict, rank: int, key, targets=LORA_TARGETS) -> dict:
    """LoRA factors {"layers": ({name: {"a": [in, r], "b": [r, out]}}, ...)} in float32."""
    out = []
    for lp in params["layers"]:
        layer = {}
        for name in targets:
            n_in, n_out = _split(lp[name].shape, name)
            key, sub = jax.random.split(key)
            layer[name] = {"a": jax.random.normal(sub, (n_in, rank), jnp.float32) / n_in ** 0.5,
                           "b": jnp.zeros((rank, n_out), jnp.float32)}
        out.append(layer)
    return {"layers": tuple(out)}


def merge_lora(params: dict, lora: dict, alpha: float) -> dict:
    """params with each LoRA update added (in the params' dtype)."""
    layers = []
    for lp, ll in zip(params["layers"], lora["layers"]):
        lp = dict(lp)
        for name, f in ll.items():
            rank = f["a"].shape[1]
            delta = (alpha / rank) * (f["a"] @ f["b"])
            lp[name] = (lp[name].astype(jnp.float32) + delta.reshape(lp[name].shape)).astype(
                lp[name].dtype)
        layers.append(lp)
    return {**params, "layers": tuple(layers)}
