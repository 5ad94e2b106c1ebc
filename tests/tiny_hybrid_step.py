"""One ragged prefill step of tiny_qwen3_5 (forward_with_checkpoints) over a random cache, for
tests that run the step in two forms of a switch: the sequences' state slots shuffled among
more slots than sequences, the cache filled with noise, random tokens."""

import jax
import jax.numpy as jnp
import numpy as np

from minipic_jax.models import qwen3_5


def tiny_step(counts, reset, dtype, seed: int, impl: str, ck_seqs=None):
    """(run(params, cache), params, cache, slots [S]) of a prefill step whose sequences append
    counts[s] tokens (reset[s]: from a zero state) after a first step of 5 + 3 s tokens each.
    ck_seqs: None (no checkpoints), or the sequences with a checkpoint at their end (rows of
    CheckpointRows, then one unused row)."""
    from configs.presets import PRESETS
    from kernels_pallas.gated_delta.checkpoint_rows import CheckpointRows
    from minipic_jax.models.testing import SimplePager
    from serving.model_contract import RecurrentMetadata
    cfg = PRESETS["tiny_qwen3_5"]
    n = len(counts)
    rng = np.random.default_rng(seed)
    pager = SimplePager(n, 96, 8, seed=seed)
    pager.step([5 + 3 * i for i in range(n)])
    md, logits_idx, _ = pager.step(counts)
    slots = rng.permutation(n + 3)[:n]
    rec = RecurrentMetadata(state_slots=jnp.asarray(slots, jnp.int32),
                            reset=jnp.asarray(reset, bool), decode=False)
    params = qwen3_5.init_params(cfg, jax.random.key(seed), dtype)
    cache = qwen3_5.init_cache(cfg, 240, 8, n + 3, dtype)
    cache = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), cache)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, md.num_tokens), jnp.int32)
    ck = None
    if ck_seqs is not None:
        pos0 = np.asarray(md.q_positions)[np.asarray(md.cu_q_lens)[:-1].clip(
            0, md.num_tokens - 1)]
        ends = pos0 + np.asarray(counts)
        ck = CheckpointRows(seq=jnp.asarray(list(ck_seqs) + [0], jnp.int32),
                            pos=jnp.asarray([int(ends[s]) for s in ck_seqs] + [-1], jnp.int32))

    def run(p, c):
        return qwen3_5.forward_with_checkpoints(
            p, tokens, md, c, cfg, recurrent=rec, logits_indices=logits_idx, gdn_impl=impl,
            checkpoint_at=ck)
    return run, params, cache, slots
