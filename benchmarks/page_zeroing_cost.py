"""What zeroing fresh KV pages costs a step (serving/cache/page_zeroing.py), alone on the device.

    python -m benchmarks.page_zeroing_cost [--layers 32 --kv-heads 8 --head-dim 128 --pages 16384]

Builds a KV pool of the engine's layout (per attention layer a K and a V leaf of [pages, block,
kv heads, head dim], bf16; default: the Llama-3-8B shape of the decode benchmark) and times the
jitted `zero_pages` (the pool donated, as in the step) with a step input of
`page_zeroing.STEP_PAGES` ids of which 0 / 8 / 32 are real pages (8: a batch of 128 sequences
crosses about 8 block boundaries a decode step), and a separate call of CALL_PAGES real pages.
Prints ms per call and, against a decode step time given by --step-ms (benchmarks/RESULTS.md,
Engine: the decode step's wall time), its share. Anchor in the same run: an elementwise pass over one leaf (its bytes /
time = the copy rate).
"""

from __future__ import annotations

import argparse
import functools
import json

import numpy as np


def main(argv=None) -> int:
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import time_calls
    from serving.cache.page_zeroing import CALL_PAGES, STEP_PAGES, zero_pages
    p = argparse.ArgumentParser(prog="python -m benchmarks.page_zeroing_cost")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pages", type=int, default=16384)
    p.add_argument("--step-ms", type=float, default=13.97)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON file for the rows")
    a = p.parse_args(argv)
    shape = (a.pages, a.block_size, a.kv_heads, a.head_dim)
    cache = [{"k": jnp.ones(shape, jnp.bfloat16), "v": jnp.ones(shape, jnp.bfloat16)}
             for _ in range(a.layers)]
    zero = jax.jit(functools.partial(zero_pages, num_pages=a.pages, block_size=a.block_size),
                   donate_argnums=(0,))
    rng = np.random.default_rng(0)
    state = {"cache": cache}

    def ids(n_real, n_ids):
        out = np.full(n_ids, a.pages, np.int32)
        out[:n_real] = rng.choice(a.pages, n_real, replace=False)
        return jnp.asarray(out)

    def run(i):
        state["cache"] = zero(state["cache"], i)
        return state["cache"]

    rows = []
    for name, n_real, n_ids in [("step input, 0 fresh", 0, STEP_PAGES),
                                ("step input, 8 fresh", 8, STEP_PAGES),
                                ("step input, 32 fresh", STEP_PAGES, STEP_PAGES),
                                ("separate call", CALL_PAGES, CALL_PAGES)]:
        i = ids(n_real, n_ids)
        ms = 1e3 * time_calls(run, i, iters=a.iters, reps=a.reps)
        rows.append({"case": name, "ms": ms, "share_of_step": ms / a.step_ms})
    leaf = state["cache"][0]["k"]
    double = jax.jit(lambda x: x * 2)
    copy_s = time_calls(double, leaf, iters=a.iters, reps=a.reps)
    copy_tbs = 2 * leaf.size * leaf.dtype.itemsize / copy_s / 1e12
    for r in rows:
        print(f"{r['case']:<22} {r['ms']:8.3f} ms  {100 * r['share_of_step']:6.2f}% of a "
              f"{a.step_ms} ms step")
    print(f"anchor: elementwise pass over one leaf at {copy_tbs:.2f} TB/s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"options": vars(a), "rows": rows, "copy_tb_s": copy_tbs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
