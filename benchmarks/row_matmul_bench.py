"""kernels_pallas/row_matmul's kernels against the XLA form they replace, timed as a decode step
runs them: a chain of one call a layer over every layer's own weights (more bytes than the L2
holds, as a step streams them), so a call's time is device time and launch gaps, not dispatch
(session 37's per-call A/B measured the ~31 us dispatch of one call, whatever the kernel did).

Modes (bf16, rows 8-64 as a decode bucket; the models' widths in PARTS):
  default   the MLP (x = mlp(x) a layer) in the two kernels at api.OPTIONS vs the XLA form,
            A/B interleaved (timing.ab_time), us a layer and the ratio (below 1: kernels faster)
  --sweep   each kernel part alone (a chain of independent calls a layer) at every launch option
            (block_n, block_k, warps, stages; split-K for the residual product) vs its XLA part;
            the best three of each part profiled (kernel busy us a layer, kernels a layer)

    PYTHONPATH=. python -m benchmarks.row_matmul_bench [--rows 8 16] [--sweep] [--models ..]
"""

from __future__ import annotations

import argparse
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import ab_time, profile_kernels, time_calls
from kernels_pallas.row_matmul import api, reference, triton_rows

# (kernel, contraction width, output width (gate | up for norm_swiglu), the model's layers of it)
PARTS = {
    "qwen3_5_0_8b": [("norm_matmul", 1024, 8224, 18), ("norm_swiglu", 1024, 7168, 24),
                     ("matmul_residual", 2048, 1024, 24), ("matmul_residual", 3584, 1024, 24)],
    "llama3_8b": [("norm_matmul", 4096, 6144, 32), ("norm_swiglu", 4096, 28672, 32),
                  ("matmul_residual", 4096, 4096, 32), ("matmul_residual", 14336, 4096, 32)],
    "tiny": [("norm_matmul", 128, 256, 2), ("norm_swiglu", 128, 512, 2),
             ("matmul_residual", 256, 128, 2)],  # (a CPU run checks the bench)
}
MLP = {"qwen3_5_0_8b": (1024, 3584, 24), "llama3_8b": (4096, 14336, 32), "tiny": (128, 256, 2)}
STAGES = 3  # the sweep's pipeline stages (a second value doubles its ~1 s an option)
L2_BYTES = 200 << 20  # weights a chain streams at least (the H100's L2 is 50 MB)
_BF = jnp.bfloat16


def chain_layers(weight_bytes: int, layers: int) -> int:
    """Layers a chain runs: the model's, or fewer where they stream >= L2_BYTES (at least 2)."""
    return max(2, min(layers, -(-L2_BYTES // weight_bytes)))


def normal(rng, shape, scale):
    return jnp.asarray(rng.standard_normal(shape) * scale, _BF)


def part_inputs(rows, k, n, layers, seed=0):
    """Each layer's own rows and weights (XLA's dot merger would join dots sharing an operand)
    and the norm's weights."""
    rng = np.random.default_rng(seed)
    return ([normal(rng, (rows, k), 1.0) for _ in range(layers)], normal(rng, (k,), 0.1),
            [normal(rng, (k, n), k ** -0.5) for _ in range(layers)])


def part_fn(kernel, option, interpret):
    """One layer's part at `option` (None: the XLA form) -> fn(x, norm_w, w, residual)."""
    if option is None:
        if kernel == "matmul_residual":
            return lambda x, nw, w, r: r + x @ w
        normed = lambda x, nw: reference.rms_norm(x, nw, 1e-6, True)  # noqa: E731
        if kernel == "norm_swiglu":
            def swiglu(x, nw, w, r):
                gu = normed(x, nw) @ w
                f = w.shape[1] // 2
                return jax.nn.silu(gu[:, :f]) * gu[:, f:]
            return swiglu
        return lambda x, nw, w, r: normed(x, nw) @ w
    if kernel == "matmul_residual":
        return lambda x, nw, w, r: triton_rows.matmul_residual(x, w, r, **option,
                                                               interpret=interpret)
    return lambda x, nw, w, r: triton_rows.norm_matmul(
        x, nw, w, eps=1e-6, unit_offset=True, swiglu=kernel == "norm_swiglu", **option,
        interpret=interpret)


def chain(fn):
    """jit of fn over every layer's rows and weights (independent calls, in stream order)."""
    return jax.jit(lambda xs, nw, ws, r: tuple(fn(x, nw, w, r) for x, w in zip(xs, ws)))


def options(kernel, k, n):
    """Every launch option of `kernel` that fits widths k, n (api.block's rule)."""
    out_n = n // 2 if kernel == "norm_swiglu" else n
    splits = (1, 2, 4, 8) if kernel == "matmul_residual" else (1,)
    for bn, bk, warps, stages, split in itertools.product((16, 32, 64), (128, 256), (4, 8),
                                                          (STAGES,), splits):
        if split > 1 and (api.split_k(k, split) != split or warps != 4 or bn == 64):
            continue
        if api.block(out_n, bn) != bn or api.block(k // split, bk) != bk:
            continue
        o = dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
        yield o | ({"split_k": split} if kernel == "matmul_residual" else {})


def sweep_part(model, kernel, k, n, layers, rows, args, interpret):
    """--sweep: one part's every option, then the best three profiled -> {option (a sorted
    item tuple): seconds a layer}."""
    out_n = n // 2 if kernel == "norm_swiglu" else n
    rows_n = (rows, n if kernel == "matmul_residual" else out_n)
    nl = chain_layers(2 * k * n, layers)
    x, nw, ws = part_inputs(rows, k, n, nl)
    r = jnp.zeros(rows_n, _BF)
    label = f"{model} {kernel} {k}x{n} rows {rows} ({nl} layers a call)"
    xla = chain(part_fn(kernel, None, interpret))
    t_xla = time_calls(xla, x, nw, ws, r, iters=args.iters, reps=args.reps) / nl
    want = np.asarray(xla(x, nw, ws, r)[0], np.float32)
    timed, times = [], {}
    for o in options(kernel, k, n):
        try:
            fn = chain(part_fn(kernel, o, interpret))
            diff = float(np.abs(np.asarray(fn(x, nw, ws, r)[0], np.float32) - want).max())
            t = time_calls(fn, x, nw, ws, r, iters=args.iters, reps=args.reps) / nl
        except Exception as err:  # an option that does not build must not stop the run
            print(f"{label} {o}: FAILED {type(err).__name__}: {str(err)[:160]}")
            continue
        timed.append((t, o, fn, diff))
        times[tuple(sorted(o.items()))] = t
        print(f"{label} {o}: {1e6 * t:7.2f} us a layer (xla {1e6 * t_xla:7.2f}), "
              f"ratio {t / t_xla:.3f}, max diff {diff:.3g}", flush=True)
    print(f"== {label}: xla {1e6 * t_xla:.2f} us a layer; best options:")
    for t, o, fn, diff in sorted(timed, key=lambda item: item[0])[:3] + [(None, None, xla, 0)]:
        prof = profile_kernels(lambda fn=fn: fn(x, nw, ws, r), steps=3, top=4)
        what = "xla" if o is None else f"{1e6 * t:7.2f} us, ratio {t / t_xla:.3f}, {o}"
        print(f"==   {what}: kernels {prof['kernels_per_step'] / nl:.1f} a layer, busy "
              f"{1e3 * prof['kernel_busy_ms_per_step'] / nl:.2f} us a layer", flush=True)
    return times


def best_options(swept):
    """{kernel: the option with the least time over the kernel's parts, each part's time a
    layer times its layers in the model} from [(kernel, layers, {option: seconds})]."""
    best = {}
    for kernel in {k for k, _, _ in swept}:
        parts = [(layers, times) for k, layers, times in swept if k == kernel]
        common = set.intersection(*(set(times) for _, times in parts))
        if common:
            opt = min(common, key=lambda o: sum(n * times[o] for n, times in parts))
            best[kernel] = dict(opt)
    return best


def time_mlp(model, rows, args, interpret):
    """Default mode: the MLP chain (x = mlp(x) a layer), the kernels at api.OPTIONS vs XLA."""
    e, f, layers = MLP[model]
    nl = chain_layers(2 * 3 * e * f, layers)
    rng = np.random.default_rng(0)
    x = normal(rng, (rows, e), 1.0)
    ws = [(normal(rng, (e,), 0.1), normal(rng, (e, 2 * f), e ** -0.5),
           normal(rng, (f, e), f ** -0.5)) for _ in range(nl)]

    def run(implementation):
        def layers_of(x, ws):
            for nw, wgu, wd in ws:
                x = api.mlp(x, nw, wgu, wd, eps=1e-6, unit_offset=True,
                            implementation=implementation, interpret=interpret)
            return x
        return jax.jit(layers_of)

    xla, kern = run("xla"), run("triton")
    diff = float(np.abs(np.asarray(kern(x, ws), np.float32)
                        - np.asarray(xla(x, ws), np.float32)).max())
    ta, tb, med, lo, hi = ab_time(xla, kern, x, ws, iters=args.iters, reps=args.reps)
    print(f"{model} mlp rows {rows:>2} ({nl} layers a call): xla {1e3 * ta / nl:7.2f} us a "
          f"layer, kernels {1e3 * tb / nl:7.2f}, ratio {med:.3f} [{lo:.3f}, {hi:.3f}], "
          f"max diff {diff:.3g}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--models", nargs="+", default=["qwen3_5_0_8b", "llama3_8b"],
                    choices=list(MLP))
    ap.add_argument("--sweep", action="store_true", help="each part at every launch option")
    ap.add_argument("--kernels", nargs="+", default=list(api.OPTIONS),
                    help="--sweep: the kernels swept")
    ap.add_argument("--best-out", metavar="FILE",
                    help="--sweep: write the first model's best options (JSON, api.OPTIONS' form)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    interpret = jax.default_backend() != "gpu"  # (a CPU run checks the bench, not the time)
    print(f"device {jax.devices()[0].device_kind}; bf16; api.OPTIONS {api.OPTIONS}")
    for model in args.models:
        for rows in args.rows:
            if not args.sweep:
                time_mlp(model, rows, args, interpret)
                continue
            swept = []
            for kernel, k, n, layers in PARTS[model]:
                if kernel in args.kernels:
                    swept.append((kernel, layers, sweep_part(model, kernel, k, n, layers, rows,
                                                             args, interpret)))
                    if args.best_out:  # after each part: a run cut short keeps what it found
                        with open(args.best_out, "w") as fh:
                            json.dump(best_options(swept), fh)
            print(f"== best {model} rows {rows}: {json.dumps(best_options(swept))}", flush=True)
            args.best_out = None  # (the first model and rows asked for: fixed_step_work reads it)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
