"""The jitted training step: masked next-token loss on the answer tokens, grads, optax update.

State is a pytree {"trainable", "opt_state"}: trainable is the full params (fp32 masters) or,
with LoRA, only the LoRA factors (the frozen base is a separate argument, never updated).

With `loss_rows` = R (a static bound on the answer rows of any batch) the LM head and the softmax
run on those R rows only, gathered before the head: the loss is the same, and a batch of 8K
tokens with 64 answer rows no longer pays for 8K x V fp32 logits.
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


def answer_rows(loss_mask, num_rows: int):
    """loss_mask [B, L] bool -> (rows [R] int32 flat indices of the loss rows, in order, padded
    with row 0; keep [R] bool, False on the padding). R = num_rows must bound the count."""
    flat = loss_mask.reshape(-1)
    rows = jnp.nonzero(flat, size=num_rows, fill_value=0)[0].astype(jnp.int32)
    return rows, jnp.arange(num_rows) < flat.sum()


def rows_loss(logits, targets, keep):
    """Mean NLL of logits [R, V] float32 at targets [R] over keep [R] -> (loss, count)."""
    nll = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(
        logits, targets[:, None], axis=-1)[:, 0]  # [R]
    w = keep.astype(jnp.float32)
    count = w.sum()
    return (nll * w).sum() / jnp.maximum(count, 1.0), count


def max_loss_rows(answer_rows_per_example, batch_size: int) -> int:
    """A static R for `loss_rows`: batch_size x the longest answer, rounded up to 8."""
    return -(-batch_size * max(int(n) for n in answer_rows_per_example) // 8) * 8


@functools.lru_cache(maxsize=8)
def make_train_step(family, cfg, optimizer: tuple, *, lora_alpha: float | None,
                    compute_dtype, remat: bool | str, attn_impl: str | None = None,
                    loss_rows: int | None = None):
    """step(state, frozen, batch) -> (state, metrics); state donated. frozen: base params under
    LoRA (None otherwise). optimizer: make_optimizer's keyword arguments as sorted (name, value)
    pairs. loss_rows: None (logits for every row) or a bound R on the loss rows of any batch
    (`max_loss_rows`); a batch with more answer rows than R would lose some, so the caller
    guarantees the bound. Cached, so runs with the same arguments share one compiled step."""
    tx = make_optimizer(**dict(optimizer))

    def loss_fn(trainable, frozen, batch):
        params = trainable if lora_alpha is None else merge_lora(frozen, trainable, lora_alpha)
        fwd = functools.partial(family.training_forward, params, batch.tokens, batch.positions,
                                batch.windows, batch.valid, cfg, compute_dtype=compute_dtype,
                                remat=remat, attn_impl=attn_impl)
        if loss_rows is None:
            return answer_loss(fwd(), batch)
        rows, keep = answer_rows(batch.loss_mask, loss_rows)
        return rows_loss(fwd(rows=rows), batch.targets.reshape(-1)[rows], keep)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(state, frozen, batch):
        (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["trainable"], frozen, batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["trainable"])
        trainable = optax.apply_updates(state["trainable"], updates)
        metrics = {"loss": loss, "answer_tokens": count, "grad_norm": optax.tree.norm(grads)}
        return {"trainable": trainable, "opt_state": opt_state}, metrics

    return step
