"""serving/cache/xla_limit.py: XLA's memory limit for a GPU step program (the base JAX passes,
the arguments and outputs it subtracts, the donated pool rematerialisation counts again), and the
most KV blocks that keep a program under it."""

import jax
import jax.numpy as jnp

from serving.cache.step_temps import program_bytes
from serving.cache.xla_limit import ProgramBytes, blocks_within_limit, fits, remat_peak, xla_limit

GIB = 1 << 30


def test_blocks_within_limit_is_the_largest_pool_that_fits():
    """Each block adds its bytes to arguments, outputs and aliased outputs alike; the answer
    fits, one block more does not (also when the traced pool was too large: a smaller count)."""
    block = 2 << 20
    for temp, traced in ((3 * GIB, 1000), (1 * GIB, 30000), (9 * GIB, 5)):
        prog = ProgramBytes(temp=temp, argument=15 * GIB + traced * block,
                            output=traced * block + 4096, alias=traced * block)
        n = blocks_within_limit(59 * GIB, prog, traced, block)

        def at(blocks):
            d = (blocks - traced) * block
            return ProgramBytes(prog.temp, prog.argument + d, prog.output + d, prog.alias + d)
        assert fits(59 * GIB, at(n)) and not fits(59 * GIB, at(n + 1))
    # no pool fits: a negative count (the caller clamps to its minimum)
    assert blocks_within_limit(GIB, ProgramBytes(GIB, GIB, 0, 0), 10, block) < 0


def test_program_bytes_counts_what_xla_counts():
    """The traced figures of a program with a donated page array written in place: arguments and
    aliased outputs equal XLA's memory analysis, outputs within its tuple's pointer table."""
    def f(w, pages, x, i):
        return pages.at[i].set(x[0, :64]), jnp.tanh(x @ w).sum(0)
    args = (jax.ShapeDtypeStruct((256, 512), jnp.float32),
            jax.ShapeDtypeStruct((1000, 64), jnp.float32),
            jax.ShapeDtypeStruct((128, 256), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
    got = program_bytes(jax.make_jaxpr(f)(*args), [False, True, False, False])
    mem = jax.jit(f, donate_argnums=(1,)).lower(*args).compile().memory_analysis()
    assert got.argument == mem.argument_size_in_bytes
    assert got.alias == mem.alias_size_in_bytes == 1000 * 64 * 4
    assert 0 <= mem.output_size_in_bytes - got.output <= 64
    assert remat_peak(got) == got.temp + got.output
    assert xla_limit(GIB, got) == (GIB - got.argument - got.output + got.alias) * 95 // 100
