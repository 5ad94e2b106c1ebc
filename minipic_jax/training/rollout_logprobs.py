"""Logprobs of sampled completions under the training forward: what an RL policy loss needs.

Rollouts come from `LLM.generate_arrays` (prompts [B, L] + lengths, completions [B * n, T] +
lengths); this lays each prompt + completion out as one dense row (positions 0.., no markers:
plain prompts) and reads the log-softmax at the rows that predict each completion token, using
`training_forward` (minipic_jax/models/llama_train.py), the same math as the engine's step. For
the same weights the two logprobs agree (tests/test_array_generate.py): on-policy means on-policy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minipic_jax.models.llama_train import training_forward


def rollout_rows(prompt_ids, prompt_lens, tokens, lengths, num_samples: int):
    """Dense training rows of B * n rollouts.

    Args:
      prompt_ids: [B, L] int32 (left-aligned, padded), prompt_lens [B] int32.
      tokens: [B * n, T] int32 completions (padded), lengths [B * n] int32.
    Returns:
      (seq [R, L + T] int32, positions [R, L + T], valid [R, L + T] bool, rows [R * T] int32 the
      flat index of the position predicting each completion token, keep [R, T] bool).
    """
    plen = jnp.repeat(prompt_lens, num_samples)  # [R]
    pids = jnp.repeat(prompt_ids, num_samples, axis=0)  # [R, L]
    r, t = tokens.shape
    width = pids.shape[1] + t
    col = jnp.arange(width)[None, :]  # [1, W]
    gen_col = col - plen[:, None]  # index into the completion, < 0 inside the prompt
    from_prompt = jnp.take_along_axis(pids, jnp.clip(col, 0, pids.shape[1] - 1), axis=1)
    from_gen = jnp.take_along_axis(tokens, jnp.clip(gen_col, 0, t - 1), axis=1)
    seq = jnp.where(gen_col < 0, from_prompt, from_gen)  # [R, W]
    valid = col < (plen + lengths)[:, None]
    positions = jnp.broadcast_to(col, (r, width)).astype(jnp.int32)
    j = jnp.arange(t)[None, :]  # [1, T]
    rows = (jnp.arange(r)[:, None] * width + plen[:, None] - 1 + j).reshape(-1)  # [R * T]
    keep = j < lengths[:, None]  # [R, T]
    return seq.astype(jnp.int32), positions, valid, rows.astype(jnp.int32), keep


def rollout_logprobs(params, cfg, prompt_ids, prompt_lens, tokens, lengths, num_samples: int,
                     **forward_kw):
    """[R, T] float32 logprob of each completion token under `params` (0 past each length).
    `forward_kw` go to `training_forward` (compute_dtype, remat, attn_impl)."""
    seq, positions, valid, rows, keep = rollout_rows(prompt_ids, prompt_lens, tokens, lengths,
                                                     num_samples)
    logits = training_forward(params, seq, positions, jnp.zeros_like(positions), valid, cfg,
                              rows=rows, **forward_kw)  # [R * T, V]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, tokens.reshape(-1, 1), axis=1).reshape(tokens.shape)
    return jnp.where(keep, picked, 0.0)
