"""Sampling on device: greedy / temperature / top-k / top-p, per-row seeds, top-k logprobs.

Static switches (few compile variants): `all_greedy` skips noise, `use_filter` enables the
top-k/top-p sort, `num_logprobs` > 0 also returns the top logprobs of the raw distribution
(vLLM's default: logprobs of the model's logits before temperature and filtering).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array  # [S] float32 (0 = greedy)
    top_k: jax.Array  # [S] int32 (0 = off)
    top_p: jax.Array  # [S] float32 (1 = off)
    seed: jax.Array  # [S] uint32 per-request seed
    step: jax.Array  # [S] int32 index of the token being sampled within its request


def sample(logits, sm: SamplingMetadata, *, all_greedy: bool, use_filter: bool,
           num_logprobs: int):
    """logits [S, V] float32 -> dict(tokens [S], logprob [S], top_ids [S, k], top_logprobs [S, k])."""
    # log_softmax(x)[i] = (x[i] - max) - log(sum(exp(x - max))), evaluated only where needed
    # (the full [S, V] log-probabilities are built only for top-k logprobs).
    x_max = jnp.max(logits, axis=-1, keepdims=True)  # [S, 1]
    lse = jnp.log(jnp.sum(jnp.exp(logits - x_max), axis=-1, keepdims=True))  # [S, 1]
    greedy = first_max_index(logits, x_max)  # [S]
    if all_greedy:
        tokens = greedy
    else:
        temp = jnp.where(sm.temperature > 0, sm.temperature, 1.0)[:, None]
        scaled = logits / temp
        if use_filter:
            scaled = _top_k_top_p(scaled, sm.top_k, sm.top_p)

        def noise(seed, step):
            key = jax.random.fold_in(jax.random.key(seed), step)
            return jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)

        g = jax.vmap(noise)(sm.seed, sm.step)  # [S, V]
        sampled = jnp.argmax(scaled + g, axis=-1).astype(jnp.int32)
        tokens = jnp.where(sm.temperature > 0, sampled, greedy)
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)  # [S, 1]
    out = {"tokens": tokens, "logprob": ((picked - x_max) - lse)[:, 0]}
    if num_logprobs:
        logp = (logits - x_max) - lse  # [S, V]
        top_lp, top_ids = jax.lax.top_k(logp, num_logprobs)  # [S, k]
        out["top_ids"] = top_ids.astype(jnp.int32)
        out["top_logprobs"] = top_lp
        # rank of the sampled token (1 = most likely), vLLM's Logprob.rank
        out["rank"] = 1 + jnp.sum(logp > out["logprob"][:, None], axis=-1).astype(jnp.int32)
    return out


def first_max_index(x, x_max):
    """jnp.argmax(x, -1) as int32 (the first maximum; the first NaN in a row with one), given
    x_max = max(x, -1, keepdims=True): an index min over the matches. XLA on CPU runs argmax as
    a variadic (value, index) reduce that is not vectorised: 3.5 ms vs 0.6 ms for both on a
    [16, 49152] step (SmolLM2-135M, batch-16 decode)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    hit = (x == x_max) | jnp.isnan(x)  # a NaN row's max is NaN: its first NaN, as argmax
    return jnp.min(jnp.where(hit, iota, x.shape[-1]), axis=-1)


def _top_k_top_p(x, top_k, top_p):
    """Mask logits outside each row's top-k and nucleus top-p set to -inf."""
    vocab = x.shape[-1]
    sorted_x = jnp.sort(x, axis=-1)[:, ::-1]  # [S, V] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_x, (k - 1)[:, None], axis=-1)  # [S, 1]
    probs = jax.nn.softmax(jnp.where(jnp.arange(vocab)[None, :] < k[:, None], sorted_x, -jnp.inf),
                           axis=-1)
    cum = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each sorted entry
    # top_p >= 1 keeps everything (a float32 cumsum can reach 1.0 before the last entry)
    keep_sorted = (cum < top_p[:, None]) | (top_p[:, None] >= 1.0)
    n_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    pth = jnp.take_along_axis(sorted_x, (n_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth, pth)
    return jnp.where(x >= threshold, x, -jnp.inf)


def pack_outputs(out, num_logprobs):
    """Every sampler output in one float32 [S, C] array (ids < 2**24 are exact in float32)."""
    cols = [out["tokens"].astype(jnp.float32)[:, None], out["logprob"][:, None]]
    if num_logprobs:
        cols += [out["rank"].astype(jnp.float32)[:, None], out["top_ids"].astype(jnp.float32),
                 out["top_logprobs"]]
    return jnp.concatenate(cols, axis=1)


def unpack_outputs(packed, num_logprobs) -> dict:
    """`pack_outputs`' array read back on the host: the sampler's outputs as numpy."""
    out = {"tokens": packed[:, 0].astype(np.int64), "logprob": packed[:, 1]}
    if num_logprobs:
        k = num_logprobs
        out["rank"] = packed[:, 2].astype(np.int64)
        out["top_ids"] = packed[:, 3:3 + k].astype(np.int64)
        out["top_logprobs"] = packed[:, 3 + k:3 + 2 * k]
    return out
