"""The engine bench fills the KV pool with random K/V in place (benchmarks/engine_bench.py,
`_randomize_cache`): each leaf is donated to the program that writes its replacement, so the fill
never holds a second pool. It did: jit dropped the argument the program reads for its shape only,
donation and all, and on the H100 (weights 16 GB + a 35.6 GB pool at batch 128) the last leaves
found no memory (2026-12-05)."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import engine_bench

SHAPE = (24, 16, 2, 8)  # [pages, block_size, kv heads, head_dim]


def _runner(num_layers: int = 3):
    """What `_randomize_cache` reads of a ModelRunner: its cache, K and V pages per layer."""
    pages = lambda: jnp.zeros(SHAPE, jnp.bfloat16)  # noqa: E731
    return SimpleNamespace(cache={"k": [pages() for _ in range(num_layers)],
                                  "v": [pages() for _ in range(num_layers)]})


def _leave_cyclic_garbage() -> None:
    """An unreachable cycle holding a device array (freed by a gc run, not when dropped)."""
    cycle = SimpleNamespace(array=jnp.ones(1000, jnp.float32))
    cycle.me = cycle


def _live_since(held) -> list:
    """Arrays live now that were not in `held` (a jax.live_arrays() list the caller keeps, so
    no array of an earlier test is freed meanwhile, nor its id reused: the count reads this
    test's arrays only, whatever ran before it)."""
    ids = {id(x) for x in held}
    return [x for x in jax.live_arrays() if id(x) not in ids and not x.is_deleted()]


def test_fill_replaces_every_leaf_in_its_own_buffer():
    runner = _runner()
    old = jax.tree.leaves(runner.cache)
    _leave_cyclic_garbage()  # as an earlier test may: the next gc run (in the fill) frees it
    held = jax.live_arrays()
    engine_bench._randomize_cache(runner)
    # each old leaf was donated: its buffer is the new leaf's, so no second pool was ever live
    assert [x.is_deleted() for x in old] == [True] * len(old)
    new = jax.tree.leaves(runner.cache)
    assert sorted(map(id, _live_since(held))) == sorted(map(id, new)), "the new leaves only"
    assert [(x.shape, x.dtype) for x in new] == [(SHAPE, jnp.bfloat16)] * len(old)
    values = [np.asarray(x, np.float32) for x in new]
    assert all(v.std() > 0.3 for v in values), "random K/V, never zeros"
    assert not np.array_equal(values[0], values[1]), "each leaf its own key"


def test_fill_program_aliases_the_leaf_to_its_output():
    """The lowered program (what a GPU runs too) takes the leaf and gives its buffer to the
    output: `tf.aliasing_output` on the first argument, not the leaf pruned away."""
    x = jnp.zeros(SHAPE, jnp.bfloat16)
    text = engine_bench._fill_program(x.sharding).lower(x, jax.random.key(0)).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert "%arg0: tensor<24x16x2x8xbf16> {tf.aliasing_output = 0" in main, main
