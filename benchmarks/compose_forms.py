"""The two forms of span-map composition side by side, without a model (issue 29, "Composition
cost"): `python -m benchmarks.compose_forms`. Qwen3.5-0.8B's map shapes (18 GDN layers x 16
heads, Dk = Dv = 128, float32), the captured step's chains (12, 10 and 8 maps on 3 of 4 rows,
chain length 256), random maps of norm ~1: for each form of chain_compose (the Triton chain
kernel, the per-position XLA loop) and each composition precision, the median ms of
span_maps.entry_states, its TFLOP/s and its relative difference from the XLA loop at "highest".
A form that fails to compile prints its error and the others still run. Then the kernel's
(block_v, num_warps) at every precision (`sweep`), to pick chain_triton's defaults;
`python -m benchmarks.compose_forms stages`: its num_stages at the tensor-core precisions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import time_calls
from kernels_pallas.gated_delta import affine
from kernels_pallas.gated_delta.chain_triton import chain_apply
from serving.hybrid import chain_compose, span_maps

SWEEP = ((64, 8), (64, 4), (32, 4), (128, 8), (128, 16), (32, 8), (16, 4))
SWEEP_PRECISIONS = ("highest", "tf32_x3", "bf16_x3", "bf16_x6")
# session 20 (H100): at "highest" every setting ran at ~0.5 TFLOP/s and 128 / 8 led at every
# tensor-core precision; `stages` times Triton's software pipelining (the next map's A and B
# loaded while this one's dot runs) at the tensor-core precisions
STAGES = ((128, 8, 2), (128, 8, 3), (64, 8, 2), (64, 4, 2), (64, 4, 3), (32, 4, 2))

LAYERS, HEADS, DK, CONV, K1 = 18, 16, 128, 6144, 3
LENGTHS, ROWS, LENGTH = (12, 10, 8), 4, 256


def inputs(seed: int = 0):
    """(pool, chains, conv0, delta0) of the module doc's shapes."""
    keys = jax.random.split(jax.random.key(seed), 3)
    slots = sum(LENGTHS)
    maps = (slots, LAYERS, HEADS, DK, DK)
    pool = span_maps.pool_of(
        a=jax.random.normal(keys[0], maps, jnp.float32) / np.sqrt(DK),
        b=jax.random.normal(keys[1], maps, jnp.float32),
        tail=jnp.ones((slots, LAYERS, CONV, K1), jnp.bfloat16),
        count=jnp.full((slots,), 128, jnp.int32))
    chains = np.full((ROWS, LENGTH), -1, np.int32)
    starts = np.cumsum((0,) + LENGTHS)
    for r, n in enumerate(LENGTHS):
        chains[r, :n] = np.arange(starts[r], starts[r] + n)
    delta0 = jax.random.normal(keys[2], (LAYERS, ROWS, HEADS, DK, DK), jnp.float32)
    return pool, jnp.asarray(chains), jnp.zeros((LAYERS, ROWS, CONV, K1), jnp.bfloat16), delta0


def main(reps: int = 10) -> None:
    pool, chains, conv0, delta0 = inputs()
    run = jax.jit(span_maps.entry_states, static_argnames=("precision", "impl"))
    gflop = sum(LENGTHS) * chain_compose.flops_per_application(LAYERS, HEADS, DK, DK) / 1e9
    ref = None
    for impl in ("xla", "triton"):
        for name in affine.COMPOSE_PRECISIONS:
            call = functools.partial(run, pool, chains, conv0, delta0, impl=impl,
                                     precision=affine.compose_precision(name))
            try:
                got = np.asarray(call()[1], np.float64)
                ms = 1e3 * time_calls(call, iters=1, reps=reps)
            except Exception as e:  # noqa: BLE001 - report and go on with the other forms
                print(f"compose form {impl} {name}: {type(e).__name__}: {str(e)[:300]}")
                continue
            ref = got if ref is None else ref
            rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            print(f"compose form {impl:6s} {name:8s} | {ms:.3f} ms | {gflop / ms:.2f} TFLOP/s "
                  f"| rel. diff. from xla highest {rel:.2e}", flush=True)


def sweep(reps: int = 10, settings=None, label: str = "compose kernel") -> None:
    """chain_apply alone (delta states only) at each (precision, block_v, num_warps, num_stages)
    of `settings` (default: every SWEEP_PRECISIONS x SWEEP at one stage), with its relative
    difference from the first that ran."""
    pool, chains, _, delta0 = inputs()
    n = span_maps.chain_lengths(chains)
    gflop = sum(LENGTHS) * chain_compose.flops_per_application(LAYERS, HEADS, DK, DK) / 1e9
    if settings is None:
        settings = [(p, bv, w, 1) for p in SWEEP_PRECISIONS for bv, w in SWEEP]
    ref = None
    for name, block_v, warps, n_stages in settings:
        what = f"{label} {name:8s} block_v {block_v:3d} warps {warps:2d} stages {n_stages}"
        call = jax.jit(functools.partial(chain_apply, block_v=block_v, num_warps=warps,
                                         num_stages=n_stages,
                                         precision=affine.compose_precision(name)))
        try:
            got = np.asarray(call(pool.a, pool.b, chains, n, delta0), np.float64)
            ms = 1e3 * time_calls(call, pool.a, pool.b, chains, n, delta0, iters=1, reps=reps)
        except Exception as e:  # noqa: BLE001 - report and go on with the other settings
            print(f"{what}: {type(e).__name__}: {str(e)[:200]}")
            continue
        ref = got if ref is None else ref
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        print(f"{what} | {ms:.3f} ms | {gflop / ms:.2f} TFLOP/s | rel. diff. {rel:.2e}",
              flush=True)


def stages(reps: int = 10) -> None:
    """chain_apply at each (block_v, num_warps, num_stages) of STAGES, tensor-core precisions."""
    sweep(reps, [(p, bv, w, st) for p in SWEEP_PRECISIONS[1:] for bv, w, st in STAGES],
          label="compose stages")


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["stages"]:
        stages()
    else:
        main()
        sweep()
