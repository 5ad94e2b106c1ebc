"""benchmarks/compile_counter.py, the compile counter the benchmarks share: JAX fires its
backend-compile event for a program loaded from the persistent compilation cache too (the suite's
cache is on, every compile written: tests/conftest.py), and a load is not a compile. Each
benchmark that reports compiles (engine, rl; hybrid-spans in test_hybrid_span_request_bench.py)
counts the load apart."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _program(x):
    """A new function each call: it misses jit's own cache, its program is the same."""
    jax.jit(lambda v: v * 5.0 - 2.0)(x).block_until_ready()


def _in_the_cache(shape):
    """An input of `shape` whose program (_program) is in the persistent cache: compiled (or
    loaded, on a rerun of the suite), then loaded once."""
    x = jnp.ones(shape, jnp.float32)
    _program(x)
    _program(x)
    return x


def test_engine_bench_counts_a_cache_load_as_a_load_not_a_compile():
    from benchmarks import engine_bench
    x = _in_the_cache((5, 11))
    counter = engine_bench.CompileCounter()  # as engine_bench.run counts its warm-up and run
    _program(x)
    assert counter.read() == {"xla_compiles": 0, "xla_cache_loads": 1}


def test_rl_measure_counts_no_compile_for_a_cache_load():
    from benchmarks import rl_measure
    x = _in_the_cache((6, 11))
    with rl_measure.count_compiles() as compiles:
        _program(x)
    assert compiles == [0]


def test_each_counter_counts_from_its_own_start():
    from benchmarks.compile_counter import CompileCounter
    first = CompileCounter()
    x = _in_the_cache((4, 11))
    second = CompileCounter()
    _program(x)
    assert second.read() == {"xla_compiles": 0, "xla_cache_loads": 1}
    a = first.read()  # jnp.ones may add programs of its own: at least _program's three
    assert a["xla_compiles"] + a["xla_cache_loads"] >= 3 and a["xla_cache_loads"] >= 2
