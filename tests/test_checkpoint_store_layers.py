"""A prefill step's checkpoint rows stored layer by layer (checkpoint_pool.CHECKPOINTS_STACKED
off): each GDN layer's K rows are scattered straight into its layer of the pool, with no
[Lg, K, ...] stack of them (288 MiB of float32 states a step at Qwen3.5-0.8B, K = 16, written
whole however few checkpoints the step takes). The pool, logits and caches equal the stacked
store's bit for bit on tiny_qwen3_5, with unused rows and a restore in the step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minipic_jax.models import qwen3_5
from serving.hybrid import checkpoint_pool
from serving.hybrid.checkpoint_plan import step_rows
from tests.jaxpr_walk import outer_eqns
from tests.test_hybrid_checkpoint_rows import traced_prefill_step, value_shapes

POOL_SLOTS = 8  # the traced step's checkpoint pool


def _pool_step(seed: int):
    """(run(params, cache, pool), params, cache, pool): one checkpointed prefill of three
    sequences of tiny_qwen3_5 (XLA GDN), with checkpoint rows at two sequences' ends and at a
    chunk boundary, two unused rows, and one sequence restored from a pool slot first."""
    from configs.presets import PRESETS
    from minipic_jax.models.testing import SimplePager
    from serving.model_contract import RecurrentMetadata
    cfg = PRESETS["tiny_qwen3_5"]
    counts = [70, 9, 33]
    n = len(counts)
    rng = np.random.default_rng(seed)
    pager = SimplePager(n, 160, 8, seed=seed)
    pager.step([64, 5, 8])
    md, logits_idx, _ = pager.step(counts)
    pos0 = np.asarray([64, 5, 8])
    rec = RecurrentMetadata(state_slots=jnp.asarray([2, 0, 4], jnp.int32),
                            reset=jnp.zeros(n, bool), decode=False)
    params = qwen3_5.init_params(cfg, jax.random.key(seed), jnp.float32)
    cache = qwen3_5.init_cache(cfg, 240, 8, n + 2, jnp.float32)
    cache = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), cache)
    lay = checkpoint_pool.state_layout(qwen3_5, cfg, 8, jnp.float32)
    pool = checkpoint_pool.allocate(lay, 6)
    pool = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), pool)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, md.num_tokens), jnp.int32)
    f = {"state_slots": rec.state_slots,
         "restore_seq": jnp.asarray([1, -1], jnp.int32), "restore_slot": jnp.asarray([3, -1],
                                                                                    jnp.int32),
         "ck_seq": jnp.asarray([0, 1, -1, 2, 0], jnp.int32),
         "ck_pos": jnp.asarray([128, pos0[1] + 9, -1, pos0[2] + 33, -1], jnp.int32),
         "ck_slot": jnp.asarray([5, 1, -1, 0, -1], jnp.int32)}
    kw = dict(recurrent=rec, logits_indices=logits_idx, gdn_impl="xla")

    def run(p, c, pl):
        return checkpoint_pool.checkpointed_forward(qwen3_5, p, tokens, md, c, cfg, pl, f,
                                                    False, kw)
    return run, params, cache, pool


def test_layer_by_layer_store_is_the_stacked_store_bit_for_bit(monkeypatch):
    run, params, cache, pool = _pool_step(seed=3)
    outs = {}
    for stacked in (True, False):
        monkeypatch.setattr(checkpoint_pool, "CHECKPOINTS_STACKED", stacked)
        jax.clear_caches()  # JAX keys traces by function: `run` must be traced in each form
        outs[stacked] = jax.jit(run)(params, cache, pool)
    for got, ref in zip(jax.tree.leaves(outs[False]), jax.tree.leaves(outs[True])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    new_pool = outs[False][2]
    written = [5, 1, 0]
    assert not np.array_equal(np.asarray(new_pool.delta[:, written]),
                              np.asarray(pool.delta[:, written]))  # the rows did land
    kept = [2, 3, 4]  # no checkpoint row names them: untouched (unused rows are dropped)
    np.testing.assert_array_equal(np.asarray(new_pool.delta[:, kept]),
                                  np.asarray(pool.delta[:, kept]))


def test_store_rows_takes_per_layer_sequences():
    rng = np.random.default_rng(0)
    pool = checkpoint_pool.CheckpointPool(conv=jnp.asarray(rng.standard_normal((3, 5, 4, 2))),
                                          delta=jnp.asarray(rng.standard_normal((3, 5, 2, 2, 2)),
                                                            jnp.float32))
    conv = jnp.asarray(rng.standard_normal((3, 4, 4, 2)), pool.conv.dtype)
    delta = jnp.asarray(rng.standard_normal((3, 4, 2, 2, 2)), jnp.float32)
    idx = jnp.asarray([4, -1, 0, 2], jnp.int32)
    stacked = checkpoint_pool.store_rows(pool, idx, conv, delta)
    layered = checkpoint_pool.store_rows(pool, idx, tuple(conv), list(delta))
    for got, ref in zip(jax.tree.leaves(layered), jax.tree.leaves(stacked)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


@pytest.mark.parametrize("stacked", [True, False])
def test_the_traced_step_holds_no_stack_of_checkpoint_rows(stacked, monkeypatch):
    """The engine's plain prefill step (16 seats, traced with abstract weights): with the
    stacked store a [Lg, K, Hv, Dk, Dv] value exists and one scatter writes the pool's delta;
    layer by layer, no such value and one scatter a GDN layer."""
    monkeypatch.setattr(checkpoint_pool, "CHECKPOINTS_STACKED", stacked)
    jaxpr, s, tail, layers = traced_prefill_step(16, POOL_SLOTS)
    stack = (layers, step_rows(s)) + tail
    assert (stack in value_shapes(jaxpr)) == stacked
    pool_writes = [e for e in outer_eqns(jaxpr) if e.primitive.name == "scatter"
                   and tuple(e.invars[0].aval.shape) == (layers, POOL_SLOTS) + tail]
    assert len(pool_writes) == (1 if stacked else layers)
