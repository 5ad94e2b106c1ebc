"""One GDN layer's decode step, the XLA form (gather the step's states out of the cache, the
one-step recurrence, scatter them back) against the in-place kernel (decode_triton), at a model's
shapes: median ms over reps, each waited for, in one process, and the largest difference.

    PYTHONPATH=. python -m benchmarks.gdn_decode_bench [--rows 8] [--slots 65] [--reps 200]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.gated_delta.chunked import recurrent_step
from kernels_pallas.gated_delta.decode_triton import decode_in_place


def xla_form(q, k, v, g, beta, state, slots, keep, has):
    s0 = jnp.where(keep[:, None, None, None], state[slots], 0.0)
    out, new = recurrent_step(q, k, v, g, beta, s0, scale=q.shape[-1] ** -0.5)
    new = jnp.where(has[:, None, None, None], new, s0)
    return jnp.where(has[:, None, None], out, 0.0), state.at[slots].set(new)


def time_form(fn, args, reps):
    f = jax.jit(fn, donate_argnums=(5,))
    args = list(args)
    out = None
    times = []
    for i in range(reps + 5):
        t0 = time.perf_counter()
        out, args[5] = f(*args)
        jax.block_until_ready(args[5])
        if i >= 5:
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times), out, args[5]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--slots", type=int, default=65)
    ap.add_argument("--heads", type=int, default=16, help="Hk = Hv (Qwen3.5-0.8B: 16)")
    ap.add_argument("--dim", type=int, default=128, help="Dk = Dv (Qwen3.5-0.8B: 128)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--block-v", type=int, nargs="+", default=[32])
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    n, h, d = a.rows, a.heads, a.dim
    qk = rng.standard_normal((2, n, h, d)).astype(np.float32)
    qk /= np.linalg.norm(qk, axis=-1, keepdims=True)
    q, k = (jnp.asarray(x, jnp.bfloat16) for x in qk)
    v = jnp.asarray(rng.standard_normal((n, h, d)), jnp.bfloat16)
    g = jnp.asarray(-rng.uniform(0.01, 2.0, (n, h)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (n, h)), jnp.float32)
    slots = jnp.asarray(rng.permutation(a.slots)[:n], jnp.int32)
    keep, has = jnp.ones(n, bool), jnp.ones(n, bool)
    state = lambda: jnp.asarray(rng.standard_normal((a.slots, h, d, d)), jnp.float32)  # noqa
    base = state()
    ms_x, out_x, st_x = time_form(xla_form, (q, k, v, g, beta, base.copy(), slots, keep, has),
                                  a.reps)
    print(f"gdn decode rows={n} slots={a.slots} heads={h} dim={d}: xla {ms_x:.4f} ms", flush=True)
    for bv in a.block_v:
        fn = functools.partial(decode_in_place, block_v=bv)
        ms_k, out_k, st_k = time_form(fn, (q, k, v, g, beta, base.copy(), slots, keep, has),
                                      a.reps)
        # after the same number of steps from the same state (time_form runs reps + 5 each)
        err = float(jnp.max(jnp.abs(st_k - st_x)) / (jnp.max(jnp.abs(st_x)) + 1e-30))
        print(f"  in place block_v={bv}: {ms_k:.4f} ms = {ms_k / ms_x:.3f}x xla; "
              f"state rel. max diff {err:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
