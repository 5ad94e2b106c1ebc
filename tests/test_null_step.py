"""benchmarks/null_step.py: the compiled step that computes nothing is called with the runner's
arguments and gives what the runner reads back (the cache, an [S, C] output), and its
Llama-3.1-8B-like pytree has that model's leaves (32 layers x 6 fused weights, embedding, final
norm, LM head; K and V per layer)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import null_step


def test_null_step_takes_the_runners_call_and_the_8b_leaves():
    runner = types.SimpleNamespace(params=None, cache=None, _step=None)
    step = null_step.install(runner, "llama8b")
    assert runner._step is step and null_step.num_leaves(runner) == 32 * 6 + 3 + 2 * 32
    ints, floats = np.zeros(64, np.int32), np.ones(8, np.float32)
    prev, tables = jnp.zeros(5, jnp.int32), jnp.ones((3, 5, 7), jnp.int32)  # resident tables
    cache, packed, prev_out, pool, maps, tables_out = step(
        runner.params, runner.cache, ints, floats, prev, None, None, tables, t=8, s=4,
        all_greedy=True, use_filter=False, num_logprobs=2)
    assert packed.shape == (4, 2 + 1 + 2 * 2) and pool is None and maps is None
    assert tables_out.shape == (3, 5, 7)  # given back, as the runner keeps it for the next step
    assert jax.tree.structure(cache) == jax.tree.structure(runner.cache)
    assert step.counts["compiled"] == 1
