"""`minipic-bench write-kv`: the K/V cache write of one layer (a row scatter into [P, B, K, D]).

Times, in one run and in place (pages donated), for decode- and prefill-sized T: `write_kv` with
implementation "xla" (a scatter with distinct indices, `unique_indices=True`), "triton" (the
Pallas row copy, pages aliased) and the plain scatter without the hint (the first version).
Before timing, each variant's result is checked against the plain scatter's (exact: a copy).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np


def add_parser(p: argparse.ArgumentParser):
    p.add_argument("--pages", type=int, default=16512, help="KV pool pages (one layer)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension")
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048],
                   help="rows written per call")
    p.add_argument("--iters", type=int, default=50, help="calls per timing")
    names = ["xla", "triton", "triton-r1", "triton-r16", "plain"]
    p.add_argument("--variants", nargs="+", default=names, choices=names,
                   help="triton-rN: N token rows per program (default ~4096 elements)")


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
    from kernels_pallas.paged_attention.triton_write import write_kv_triton

    shape = (args.pages, args.page_size, args.kv_heads, args.head_dim)
    rng = np.random.default_rng(0)
    cpu = jax.default_backend() == "cpu"  # Pallas runs interpreted there (slow; a smoke test)
    fns = {"xla": functools.partial(write_kv, implementation="xla"),
           "triton": functools.partial(write_kv, implementation="triton"),
           "triton-r1": functools.partial(write_kv_triton, rows=1, interpret=cpu),
           "triton-r16": functools.partial(write_kv_triton, rows=16, interpret=cpu),
           "plain": _plain_write}
    cases = []
    for t in args.tokens:
        k = jnp.asarray(rng.normal(size=(t, args.kv_heads, args.head_dim)), jnp.bfloat16)
        v = jnp.asarray(rng.normal(size=(t, args.kv_heads, args.head_dim)), jnp.bfloat16)
        slots = rng.choice(args.pages * args.page_size, size=t, replace=False).astype(np.int32)
        slots[-(t // 8):] = -1  # some bucket-padding rows
        cases.append((t, k, v, jnp.asarray(slots)))
    # correctness on this device: every variant vs the plain scatter, on small random pages
    small = (64, args.page_size, args.kv_heads, args.head_dim)
    for t, k, v, _ in cases[:1]:
        sl = rng.choice(64 * args.page_size, size=min(t, 64 * args.page_size), replace=False)
        sl = jnp.asarray(np.where(rng.random(sl.size) < 0.2, -1, sl).astype(np.int32))
        base = jnp.asarray(rng.normal(size=small), jnp.bfloat16)
        want = jax.jit(_plain_write)(base, base + 1, k[:sl.size], v[:sl.size], sl)
        for name in args.variants:
            got = jax.jit(fns[name])(base, base + 1, k[:sl.size], v[:sl.size], sl)
            ok = all(bool(jnp.array_equal(g, w)) for g, w in zip(got, want))
            print(f"check {name}: {'ok' if ok else 'MISMATCH'}", flush=True)
    rows = []
    for name in args.variants:
        step = jax.jit(fns[name], donate_argnums=(0, 1))
        k_pages = jnp.zeros(shape, jnp.bfloat16)
        v_pages = jnp.zeros(shape, jnp.bfloat16)
        for t, k, v, slots in cases:
            k_pages, v_pages = step(k_pages, v_pages, k, v, slots)
            jax.block_until_ready(k_pages)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    k_pages, v_pages = step(k_pages, v_pages, k, v, slots)
                jax.block_until_ready(k_pages)
                times.append((time.perf_counter() - t0) / args.iters)
            rows.append((name, t, statistics.median(times) * 1e6))
        del k_pages, v_pages
    print(f"{'variant':<20} {'T':>6} {'us/call (K+V)':>14}")
    for name, t, us in rows:
        print(f"{name:<20} {t:>6} {us:>14.1f}")
    return 0
