"""`minipic-bench write-kv`: the K/V cache write of one layer (a row scatter into [P, B, K, D]).

Times `write_kv` (distinct indices, `unique_indices=True`) against the same scatter without the
hint (the previous implementation), in place (pages donated), for decode- and prefill-sized T.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def add_parser(p: argparse.ArgumentParser):
    p.add_argument("--pages", type=int, default=16512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--iters", type=int, default=50)


def _plain_write(k_pages, v_pages, k, v, slot_mapping):
    import jax.numpy as jnp
    flat = k_pages.shape[0] * k_pages.shape[1]
    slots = jnp.where(slot_mapping < 0, flat, slot_mapping)
    kf = k_pages.reshape(flat, *k_pages.shape[2:]).at[slots].set(k, mode="drop")
    vf = v_pages.reshape(flat, *v_pages.shape[2:]).at[slots].set(v, mode="drop")
    return kf.reshape(k_pages.shape), vf.reshape(v_pages.shape)


def run(args) -> int:
    import jax
    import jax.numpy as jnp
    from kernels_pallas.paged_attention.api import write_kv

    shape = (args.pages, args.page_size, args.kv_heads, args.head_dim)
    rng = np.random.default_rng(0)
    rows = []
    for name, fn in (("write_kv (unique)", write_kv), ("plain scatter", _plain_write)):
        step = jax.jit(fn, donate_argnums=(0, 1))
        k_pages = jnp.zeros(shape, jnp.bfloat16)
        v_pages = jnp.zeros(shape, jnp.bfloat16)
        for t in args.tokens:
            k = jnp.asarray(rng.normal(size=(t, args.kv_heads, args.head_dim)), jnp.bfloat16)
            slots = rng.choice(args.pages * args.page_size, size=t, replace=False).astype(np.int32)
            slots[-(t // 8):] = -1  # some bucket-padding rows
            slots = jnp.asarray(slots)
            k_pages, v_pages = step(k_pages, v_pages, k, k, slots)
            jax.block_until_ready(k_pages)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    k_pages, v_pages = step(k_pages, v_pages, k, k, slots)
                jax.block_until_ready(k_pages)
                times.append((time.perf_counter() - t0) / args.iters)
            rows.append((name, t, statistics.median(times) * 1e6))
    print(f"{'variant':<20} {'T':>6} {'us/call (K+V)':>14}")
    for name, t, us in rows:
        print(f"{name:<20} {t:>6} {us:>14.1f}")
    return 0
