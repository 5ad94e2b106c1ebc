"""A decode step's MLP (norm, gate/up, SwiGLU, down, residual) in kernels_pallas/row_matmul's two
kernels against the XLA form (row_matmul.reference.mlp, what the blocks run without
layers.MLP_ROW_KERNEL), interleaved A/B (timing.ab_time: back-to-back calls, ABBA), bf16, at the
MLP widths of Qwen3.5-0.8B (1,024 x 3,584) and Llama-3-8B (4,096 x 14,336) and 8-64 rows. Prints
each form's us per call, the ratio kernel / XLA (below 1: the kernels are faster), the weight
stream's GB/s in the kernels, and the largest difference of their outputs. `--sweep` times the
kernels' block and warp options too (the api's defaults: BLOCK_N 32, BLOCK_K 128, 4 warps);
`--parts` each kernel alone at every option against its XLA part (their best options may
differ: the down product has E / BN programs only).

    PYTHONPATH=. python -m benchmarks.row_matmul_bench [--rows 8 16 64] [--sweep | --parts]
"""

from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import ab_time
from kernels_pallas.row_matmul import api, reference, triton_rows

SHAPES = {"qwen3_5_0_8b": (1024, 3584), "llama3_8b": (4096, 14336)}


def inputs(rows, e, f, seed=0):
    rng = np.random.default_rng(seed)
    bf = jnp.bfloat16
    return (jnp.asarray(rng.standard_normal((rows, e)), bf),
            jnp.asarray(rng.standard_normal(e) * 0.1, bf),
            jnp.asarray(rng.standard_normal((e, 2 * f)) / np.sqrt(e), bf),
            jnp.asarray(rng.standard_normal((f, e)) / np.sqrt(f), bf))


def kernel_form(block_n, block_k, warps, interpret):
    """The two kernels at one block / warp option (both kernels the same options)."""
    def run(x, nw, wgu, wd):
        act = triton_rows.norm_matmul(x, nw, wgu, eps=1e-6, unit_offset=True, swiglu=True,
                                      block_n=block_n, block_k=block_k, num_warps=warps,
                                      interpret=interpret)
        return triton_rows.matmul_residual(act, wd, x, block_n=block_n, block_k=block_k,
                                           num_warps=warps, interpret=interpret)
    return jax.jit(run)


def xla_first(x, nw, wgu):
    """The MLP's first half as XLA runs it: norm, gate / up product, SwiGLU."""
    f = wgu.shape[1] // 2
    gu = jnp.einsum("te,ef->tf", reference.rms_norm(x, nw, 1e-6, True), wgu)
    return jax.nn.silu(gu[:, :f]) * gu[:, f:]


def xla_second(act, wd, x):
    """... and its second: the down product and the residual add."""
    return x + jnp.einsum("tf,fe->te", act, wd)


def part_forms(interpret):
    """Each kernel alone against its XLA part at every option: (label, xla fn, kernel fn, which
    half's operands)."""
    out = []
    for bn, bk, warps in itertools.product((16, 32, 64), (64, 128, 256), (4, 8)):
        first = functools.partial(triton_rows.norm_matmul, eps=1e-6, unit_offset=True,
                                  swiglu=True, block_n=bn, block_k=bk, num_warps=warps,
                                  interpret=interpret)
        second = functools.partial(triton_rows.matmul_residual, block_n=bn, block_k=bk,
                                   num_warps=warps, interpret=interpret)
        out += [(f"norm_swiglu bn {bn:>2} bk {bk:>3} w {warps}", xla_first, first, "first"),
                (f"matmul_residual bn {bn:>2} bk {bk:>3} w {warps}", xla_second, second,
                 "second")]
    return out


def time_parts(name, rows, args, interpret):
    """--parts: each kernel alone at every option against its XLA part."""
    x, nw, wgu, wd = inputs(rows, *SHAPES[name])
    operands = {"first": (x, nw, wgu), "second": (jax.jit(xla_first)(x, nw, wgu), wd, x)}
    for label, xla_fn, kern_fn, which in part_forms(interpret):
        a = operands[which]
        try:
            ta, tb, med, lo, hi = ab_time(jax.jit(xla_fn), jax.jit(kern_fn), *a,
                                          iters=args.iters, reps=args.reps)
        except Exception as err:  # an option that does not build must not stop the run
            print(f"{name} rows {rows:>2} {label}: FAILED {type(err).__name__}: {err}"[:240])
            continue
        print(f"{name} rows {rows:>2} {label}: xla {1e3 * ta:8.1f} us, kernel {1e3 * tb:8.1f} "
              f"us, ratio {med:.3f} [{lo:.3f}, {hi:.3f}]")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="the kernels' options too")
    ap.add_argument("--parts", action="store_true",
                    help="each kernel alone at every option against its XLA part")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    interpret = jax.default_backend() != "gpu"  # (a CPU run checks the bench, not the time)
    xla = jax.jit(functools.partial(reference.mlp, eps=1e-6, unit_offset=True))
    options = [(api.BLOCK_N, api.BLOCK_K, 4)]
    if args.sweep:
        options += [o for o in itertools.product((16, 32, 64), (64, 128, 256), (4, 8))
                    if o != options[0]]
    print(f"device {jax.devices()[0].device_kind}; bf16; us per call (A/B interleaved); "
          f"ratio = kernels / XLA")
    if args.parts:
        for name in args.shapes:
            for rows in args.rows:
                time_parts(name, rows, args, interpret)
        return 0
    for name in args.shapes:
        e, f = SHAPES[name]
        wbytes = 2 * (3 * e * f)  # gate, up and down weights, bf16
        for rows in args.rows:
            x = inputs(rows, e, f)
            want = np.asarray(xla(*x), np.float32)
            for bn, bk, warps in options:
                label = f"{name} rows {rows:>2} bn {bn:>2} bk {bk:>3} w {warps}"
                try:
                    kern = kernel_form(bn, bk, warps, interpret)
                    diff = float(np.abs(np.asarray(kern(*x), np.float32) - want).max())
                    ta, tb, med, lo, hi = ab_time(xla, kern, *x, iters=args.iters,
                                                  reps=args.reps)
                except Exception as err:  # an option that does not build must not stop the run
                    print(f"{label}: FAILED {type(err).__name__}: {err}"[:240])
                    continue
                print(f"{label}: xla {1e3 * ta:8.1f} us, kernels {1e3 * tb:8.1f} us, ratio "
                      f"{med:.3f} [{lo:.3f}, {hi:.3f}], kernels {wbytes / tb / 1e6:7.0f} GB/s, "
                      f"max diff {diff:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
