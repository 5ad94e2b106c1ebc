"""The jitted training step: masked next-token loss on the answer tokens, grads, optax update.

State is a pytree {"trainable", "opt_state"}: trainable is the full params (fp32 masters) or,
with LoRA, only the LoRA factors (the frozen base is a separate argument, never updated).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from minipic_jax.training.batch import Batch
from minipic_jax.training.optim import make_optimizer, merge_lora


def answer_loss(logits, batch: Batch):
    """Mean NLL over loss_mask rows. logits [B, L, V] float32 -> (loss, number of rows)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch.targets[..., None], axis=-1)[..., 0]  # [B, L]
    mask = batch.loss_mask.astype(jnp.float32)
    count = mask.sum()
    return (nll * mask).sum() / jnp.maximum(count, 1.0), count


@functools.lru_cache(maxsize=8)
def make_train_step(family, cfg, optimizer: tuple, *, lora_alpha: float | None,
                    compute_dtype, remat: bool, attn_impl: str | None = None):
    """step(state, frozen, batch) -> (state, metrics); state donated. frozen: base params under
    LoRA (None otherwise). optimizer: make_optimizer's keyword arguments as sorted (name, value)
    pairs. Cached, so runs with the same arguments share one compiled step."""
    tx = make_optimizer(**dict(optimizer))

    def loss_fn(trainable, frozen, batch):
        params = trainable if lora_alpha is None else merge_lora(frozen, trainable, lora_alpha)
        logits = family.training_forward(params, batch.tokens, batch.positions, batch.windows,
                                         batch.valid, cfg, compute_dtype=compute_dtype,
                                         remat=remat, attn_impl=attn_impl)
        return answer_loss(logits, batch)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(state, frozen, batch):
        (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["trainable"], frozen, batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["trainable"])
        trainable = optax.apply_updates(state["trainable"], updates)
        metrics = {"loss": loss, "answer_tokens": count, "grad_norm": optax.tree.norm(grads)}
        return {"trainable": trainable, "opt_state": opt_state}, metrics

    return step
