"""The ragged GDN prefill's state scan: one program per sequence (ragged_triton.SEQ_PARALLEL, the
sequences of a step side by side) against the serial scan (one program walks every packed chunk),
interleaved A/B in one process, on the step shapes a hybrid engine runs: a Qwen3.5-0.8B GDN layer
(16 heads, Dk = Dv = 128, bf16), a 1,024-token bucket, and the row layouts of its steps:

  one      one sequence of 1,024 tokens (nothing to overlap: the control)
  mixed    2 prefill chunks of 480 tokens + 62 decode rows (a continuous-batching step at 64 seats)
  rag16    2 prefill chunks of 400 + 14 decode rows (rag's 16 seats)
  pieces   16 pieces of 60 tokens from a zero state (a span step's local pass)
  seats64  64 sequences of 16 tokens (a step of many short chunks)

Each row: median ms per layer call (the kernels and their XLA glue, 10 calls back to back per
rep), B/A ratio with its quartiles, and max |diff| between the two (0: the same bits).

  PYTHONPATH=. python -m benchmarks.ragged_scan [--layouts one mixed ...] [--reps 15]
  PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.ragged_scan --interpret --small   (CPU check)
"""

from __future__ import annotations

import argparse
import json

import numpy as np

LAYOUTS = {  # name -> (sequence lengths, each sequence's first position)
    "one": ([1024], [0]),
    "mixed": ([480, 480] + [1] * 62, [64, 0] + [300] * 62),
    "rag16": ([400, 400] + [1] * 14, [0, 448] + [700] * 14),
    "pieces": ([60] * 16, [0] * 16),
    "seats64": ([16] * 64, [128] * 64),
}


def _case(lens, pos0, tokens, heads, dim, seed=0):
    rng = np.random.default_rng(seed)
    t = max(tokens, sum(lens))
    q, k = (rng.standard_normal((t, heads, dim)).astype(np.float32) for _ in range(2))
    q /= np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
    k /= np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    v = rng.standard_normal((t, heads, dim)).astype(np.float32)
    g = -np.log1p(np.exp(rng.standard_normal((t, heads)) - 4.0)).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((t, heads))))).astype(np.float32)
    s0 = 0.1 * rng.standard_normal((len(lens), heads, dim, dim)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return q, k, v, g, beta, cu, np.asarray(pos0, np.int32), s0


def run(layouts, reps, interpret=False, small=False, dtype="bfloat16"):
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import ab_time
    from kernels_pallas.gated_delta import api, ragged_triton
    heads, dim, tokens = (2, 16, 128) if small else (16, 128, 1024)
    rows = []
    for name in layouts:
        lens, pos0 = LAYOUTS[name]
        if small:
            lens = [max(1, n // 8) for n in lens][:8]
            pos0 = pos0[:8]
        q, k, v, g, beta, cu, p0, s0 = _case(lens, pos0, tokens, heads, dim)
        q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
        fns = {}
        for flag in (False, True):  # read at trace time: one jitted function each
            ragged_triton.SEQ_PARALLEL = flag
            fn = jax.jit(lambda *a: api.ragged_gated_delta(
                *a, implementation="pallas_fused", interpret=interpret, decode=False)[:2])
            jax.block_until_ready(fn(q, k, v, g, beta, cu, p0, s0))  # traced with this flag
            fns[flag] = fn
        ragged_triton.SEQ_PARALLEL = True
        args = (q, k, v, g, beta, cu, p0, s0)
        outs = [fns[f](*args) for f in (False, True)]
        diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                   for a, b in zip(*outs))
        a_ms, b_ms, ratio, lo, hi = ab_time(fns[False], fns[True], *args, iters=10, reps=reps)
        row = dict(layout=name, seqs=len(lens), tokens=int(sum(lens)), serial_ms=a_ms,
                   per_seq_ms=b_ms, ratio=ratio, q25=lo, q75=hi, max_abs_diff=diff)
        rows.append(row)
        print(f"ragged scan {name:8s} S={len(lens):3d} T={sum(lens):5d}: serial {a_ms:.4f} ms, "
              f"per-sequence {b_ms:.4f} ms = {ratio:.3f}x [{lo:.3f}-{hi:.3f}], "
              f"max|diff| {diff:.2e}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU check)")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    rows = run(a.layouts, a.reps, a.interpret, a.small)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
