"""serving/cache/xla_limit.py: XLA's memory limit for a GPU step program (the base JAX passes,
the arguments and outputs it subtracts, the aliased outputs it adds back) and the peak it holds
to it (the weights counted again), checked against the device's figures; and the most KV blocks
that keep a program under it."""

import dataclasses

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
    assert remat_peak(got) == got.temp + got.argument - got.alias + got.output
    assert xla_limit(GIB, got) == \
        (GIB - got.argument - got.output + got.alias) * 95 // 100 + got.alias


def test_the_device_figures_follow_from_the_formula():
    """H100 (jaxlib 0.11.2, bytes_limit 63,763,906,560 = 75% of the card), the probe's top
    step at max_model_len 40,960: XLA's VLOG said limit 43.26 GiB, adjusted for the 21.13 GiB
    of outputs 22.13 GiB, peak 47.85 GiB (entry 26.73 = 14.96 GiB of weights + 11.77 of
    temporaries). The two warnings on record (the ttft engine at max_model_len 33,792, pool by
    the share rule: 0.8 of bytes_limit less the weights less the ~9 GiB reserve): 43.35 GiB on
    the H100, 88.83 GiB on the H200 (143,771 MiB card)."""
    weights = int(14.9575 * GIB)
    pool = int(21.129 * GIB)
    top = ProgramBytes(temp=int(11.77 * GIB), argument=weights + pool, output=pool, alias=pool)
    assert abs(xla_limit(63763906560, top) / GIB - 43.26) < 0.01
    assert abs((xla_limit(63763906560, top) - top.output) / GIB - 22.13) < 0.01
    assert abs(remat_peak(top) / GIB - 47.85) < 0.01 and not fits(63763906560, top)
    for bytes_limit, warned in ((63763906560, 43.35), (int(0.75 * 143771 * 2**20), 88.83)):
        pool = int(0.8 * bytes_limit) - weights - int(8.95 * GIB)
        prog = ProgramBytes(temp=0, argument=weights + pool, output=pool, alias=pool)
        assert abs(xla_limit(bytes_limit, prog) / GIB - warned) < 0.05


def test_exact_slop_holds_temporaries_to_the_margin_of_the_room_left():
    """Config.compilation.xla_memory_limit "exact": with exact_slop's factor XLA's check reads
    "temporaries within 95% of bytes_limit less the program's buffers" (the weights counted once):
    every program that passes it keeps that margin, and every one within 94% passes. Brute force
    over random programs (seeded)."""
    import numpy as np
    from serving.cache.xla_limit import exact_slop
    rng = np.random.default_rng(28)
    for _ in range(2000):
        limit = int(rng.integers(1, 200)) * GIB // 4
        weights, pool, out = (int(rng.integers(0, limit // 2)) for _ in range(3))
        io = weights + pool + out
        if io >= limit:
            assert exact_slop(limit, ProgramBytes(0, weights + pool, pool + out, pool)) is None
            continue
        room = limit - io
        temp = int(rng.integers(0, room + 1))
        prog = ProgramBytes(temp, weights + pool, pool + out, pool)
        s = exact_slop(limit, prog)
        if fits(limit, prog, s):
            assert temp * 100 <= 95 * room
        if temp * 100 <= 94 * room:
            assert fits(limit, prog, s)


def test_exact_slop_keeps_the_h100_step_that_xla_rematerialised():
    """The H100 step of test_the_device_figures_follow_from_the_formula: 11.77 GiB of temporaries
    beside 14.96 GiB of weights and a 21.13 GiB pool, under a 59.38 GiB bytes_limit: 23.29 GiB
    are free, yet XLA's own rule rematerialised it; under the exact factor (159) it fits, and a
    program whose temporaries need more than 95% of the free memory still does not."""
    from serving.cache.xla_limit import exact_limit_options, exact_slop, with_pool_bytes
    weights, pool, bytes_limit = int(14.9575 * GIB), int(21.129 * GIB), 63763906560
    top = ProgramBytes(temp=int(11.77 * GIB), argument=weights + pool, output=pool, alias=pool)
    assert not fits(bytes_limit, top)
    s = exact_slop(bytes_limit, top)
    assert s == 159 and fits(bytes_limit, top, s)
    room = bytes_limit - weights - pool
    assert not fits(bytes_limit, dataclasses.replace(top, temp=int(0.96 * room)), s)
    # the options: one factor for all programs, the smallest; the pool moved to its final size
    small = with_pool_bytes(top, -GIB)
    opts = exact_limit_options(bytes_limit, [small, dataclasses.replace(small, temp=GIB)], GIB)
    assert opts == {"xla_gpu_memory_limit_slop_factor": s}
    assert exact_limit_options(GIB, [top]) == {}


def test_exact_slop_fits_xla_int32_flag_when_the_room_is_a_byte():
    from serving.cache.xla_limit import INT32_MAX, exact_slop
    prog = ProgramBytes(temp=0, argument=60 * GIB, output=0, alias=0)
    assert exact_slop(60 * GIB + 1, prog) == INT32_MAX
