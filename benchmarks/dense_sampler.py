"""The baseline of the rollout comparison (`minipic-bench rl --rollout-compare`): a plain jitted
sampling loop over the same Llama modules, as simple JAX code samples G rollouts. A dense KV
cache [G, max_len, K, D] per layer (no paging, no sharing: the prompt is prefilled once per
sample), one jitted prefill, then one jitted decode step per token from a Python loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas.rope import apply_rope
from minipic_jax.models import llama_modules as modules
from minipic_jax.models import rope


def _attend(cfg, positions, b: int, max_len: int):
    """attend(q, k, v, (k_cache, v_cache)) over [B*L] rows at `positions` [B, L]: RoPE, write the
    new keys / values into the dense cache, attend causally over it."""
    inv, scaling = rope.inv_freq(cfg), rope.attention_scaling(cfg)
    seq = positions.shape[1]
    flat = positions.reshape(-1)

    def attend(q, k, v, state):
        kc, vc = state  # [B, M, K, D]
        q = apply_rope(q, flat, inv, scaling).reshape(b, seq, *q.shape[1:])  # [B, L, H, D]
        k = apply_rope(k, flat, inv, scaling).reshape(b, seq, *k.shape[1:])
        v = v.reshape(b, seq, *v.shape[1:])
        start = positions[0, 0]
        kc = jax.lax.dynamic_update_slice_in_dim(kc, k.astype(kc.dtype), start, axis=1)
        vc = jax.lax.dynamic_update_slice_in_dim(vc, v.astype(vc.dtype), start, axis=1)
        mask = jnp.arange(max_len)[None, None, :] <= positions[:, :, None]  # [B, L, M]
        out = jax.nn.dot_product_attention(q, kc, vc, mask=mask[:, None])  # [B, L, H, D]
        return out.reshape(b * seq, *out.shape[2:]), (kc, vc)
    return attend


def forward(params, tokens, start, caches, cfg):
    """tokens [B, L] at positions start.. -> (last logits [B, V] float32, caches)."""
    b, seq = tokens.shape
    max_len = caches[0][0].shape[1]
    model = modules.bind(params, cfg)
    positions = jnp.broadcast_to(start + jnp.arange(seq, dtype=jnp.int32), (b, seq))
    x = model.embed_tokens(tokens).reshape(b * seq, cfg.hidden_size)
    graphdef = nnx.graphdef(model.layers[0])
    attend = _attend(cfg, positions, b, max_len)
    out = []
    for layer_params, cache in zip(params["layers"], caches):
        x, cache = nnx.merge(graphdef, layer_params)(x, cfg, attend, cache)
        out.append(cache)
    last = x.reshape(b, seq, -1)[:, -1]
    return model.logits(last, cfg).astype(jnp.float32), tuple(out)


def init_caches(cfg, batch: int, max_len: int, dtype):
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers))


def make_sampler(cfg, temperature: float = 1.0):
    """(prefill, decode) jitted: prefill(params, tokens [B, L], caches, key) and
    decode(params, token [B], pos, caches, key), each -> (sampled [B], caches)."""
    def pick(logits, key):
        if temperature == 0:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return jax.random.categorical(key, logits / temperature).astype(jnp.int32)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def prefill(params, tokens, caches, key):
        logits, caches = forward(params, tokens, jnp.int32(0), caches, cfg)
        return pick(logits, key), caches

    @functools.partial(jax.jit, donate_argnums=(3,))
    def decode(params, token, pos, caches, key):
        logits, caches = forward(params, token[:, None], pos, caches, cfg)
        return pick(logits, key), caches
    return prefill, decode


def sample(params, cfg, prompt, num_samples: int, max_tokens: int, seed: int = 0,
           dtype=jnp.float32, fns=None):
    """[B * num_samples, max_tokens] sampled ids (row b * num_samples + k: sample k of prompt b)
    for one prompt (a list of ids, B = 1) or B prompts of one length ([B, L] ids): every row its
    own dense cache, the prompt prefilled once per row."""
    prefill, decode = fns or make_sampler(cfg)
    rows = np.atleast_2d(np.asarray(prompt, np.int32))
    length = rows.shape[1]
    caches = init_caches(cfg, rows.shape[0] * num_samples, length + max_tokens, dtype)
    tokens = jnp.asarray(np.repeat(rows, num_samples, axis=0))
    key = jax.random.key(seed)
    tok, caches = prefill(params, tokens, caches, jax.random.fold_in(key, 0))
    out = [tok]
    for i in range(1, max_tokens):
        tok, caches = decode(params, tok, jnp.int32(length + i - 1), caches,
                             jax.random.fold_in(key, i))
        out.append(tok)
    return jnp.stack(out, axis=1)
