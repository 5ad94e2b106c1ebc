"""`LLM.generate_arrays`: a batch of ragged prompt ids in, sampled tokens / logprobs / lengths out
as device arrays, for JAX pipelines (RL rollouts) that feed them straight to a jitted loss.

The requests run through `LLM.generate` (same scheduling, paged KV, `n > 1` samples sharing the
prompt's blocks, prefix caching), without detokenizing; the results are packed into fixed-width
arrays: `T = max_tokens` columns, so a jitted consumer sees one shape per `max_tokens`.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from minipic_jax.sampling_params import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ArrayOutputs:
    """Rollouts as arrays; row r = b * n + k is sample k of prompt b."""

    tokens: jax.Array  # [B * n, T] int32 sampled ids, 0 after each row's length
    logprobs: jax.Array  # [B * n, T] float32 logprob of each sampled token (raw logits), 0 after
    lengths: jax.Array  # [B * n] int32 tokens generated per row
    num_samples: int = dataclasses.field(metadata=dict(static=True))  # n


def _check_prompts(prompt_ids, prompt_lens) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(prompt_ids)
    lens = np.asarray(prompt_lens)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"generate_arrays: prompt_ids must be a 2-D integer array [B, L], got "
                         f"shape {ids.shape}, dtype {ids.dtype}")
    if lens.shape != (ids.shape[0],) or not np.issubdtype(lens.dtype, np.integer):
        raise ValueError(f"generate_arrays: prompt_lens must be an integer array of shape "
                         f"[{ids.shape[0]}], got shape {lens.shape}, dtype {lens.dtype}")
    bad = np.flatnonzero((lens < 1) | (lens > ids.shape[1]))
    if bad.size:
        raise ValueError(f"generate_arrays: prompt {bad[0]}: length {lens[bad[0]]} outside "
                         f"[1, {ids.shape[1]}]")
    return ids, lens


@contextlib.contextmanager
def _no_detokenizing(engine, has_stop_strings: bool):
    """Outputs without text (the arrays carry ids): the engine's tokenizer is set aside unless
    stop strings need it."""
    if has_stop_strings:
        yield
        return
    tok, engine.tokenizer = engine.tokenizer, None
    try:
        yield
    finally:
        engine.tokenizer = tok


def generate_arrays(llm, prompt_ids, prompt_lens, sampling_params=None, *,
                    cache_salt: str | None = None) -> ArrayOutputs:
    """See `LLM.generate_arrays`. Bad input raises before any work (the request is named)."""
    ids, lens = _check_prompts(prompt_ids, prompt_lens)
    sps = sampling_params or SamplingParams()
    sps = list(sps) if isinstance(sps, (list, tuple)) else [sps] * len(ids)
    if len(sps) != len(ids) or len({(sp.n, sp.max_tokens) for sp in sps}) != 1:
        raise ValueError(f"generate_arrays: one SamplingParams, or one per prompt ({len(ids)}) "
                         f"with the same n and max_tokens (the arrays' shape)")
    # the sampled token's logprob only, unless more are asked for
    sps = [sp if sp.logprobs is not None else dataclasses.replace(sp, logprobs=0) for sp in sps]
    prompts = [{"prompt_token_ids": row[:n].tolist()} for row, n in zip(ids, lens)]
    with _no_detokenizing(llm.llm_engine, any(sp.stop for sp in sps)):
        outs = llm.generate(prompts, sps, use_tqdm=False, cache_salt=cache_salt)
    n, width = sps[0].n, sps[0].max_tokens or llm.config.max_model_len
    tokens = np.zeros((len(prompts) * n, width), np.int32)
    logprobs = np.zeros((len(prompts) * n, width), np.float32)
    lengths = np.zeros(len(prompts) * n, np.int32)
    for b, out in enumerate(outs):
        for k, comp in enumerate(out.outputs):
            r, got = b * n + k, comp.token_ids
            lengths[r] = len(got)
            tokens[r, :len(got)] = got
            logprobs[r, :len(got)] = [d[t].logprob for d, t in zip(comp.logprobs, got)]
    return ArrayOutputs(jnp.asarray(tokens), jnp.asarray(logprobs), jnp.asarray(lengths), n)
