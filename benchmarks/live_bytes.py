"""What an engine holds in device memory beyond its weights and KV pool, stage by stage of the
engine benchmark (`minipic-bench engine`: copy-rate anchor, load, warm-up, primed decode batch,
random K/V fill, decode steps), and an A/B of the K/V fill.

    python -m benchmarks.live_bytes --model tiny_llama3 --batch 8 --ctx 256   # CPU, seconds
    python -m benchmarks.live_bytes --batch 128 --max-num-batched-tokens 512  # the H100 case
    python -m benchmarks.live_bytes --fill-ab --leaves 8 --leaf-mib 530       # the fill alone

Per stage: every live jax.Array by owner (weights, KV pool, resident block tables, previous
tokens, recurrent pools; anything else listed by shape: the unexplained bytes), and the device
allocator's own figures (`memory_stats()`: bytes in use, peak, reserved, largest free block;
none on CPU). After the warm-up: XLA's memory analysis of every step variant (temporaries).
The fill A/B runs the fill as it was before 585ecae (jit pruned the leaf it reads for its shape
only, so nothing was donated and the old leaf stayed alive) and as it is, over `--leaves` zero
leaves, reading the bytes in use after each leaf. Writes live_bytes.json to --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

MIB = 1 << 20
STATS = ("bytes_in_use", "peak_bytes_in_use", "bytes_reserved", "largest_free_block_bytes",
         "pool_bytes", "bytes_limit")


def device_stats() -> dict:
    """The first device's allocator figures in MiB ({} where the backend reports none)."""
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    return {k: round(stats[k] / MIB, 1) for k in STATS if k in stats}


def live_bytes() -> int:
    """Bytes of every live (not deleted) jax.Array in the process."""
    import jax
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def owners(engine) -> dict:
    """id(array) -> what holds it, for every device array an LLMEngine keeps by design: its
    runner's state and the outputs of steps launched and not read back yet (async)."""
    import jax
    r = engine.runner
    named = {"weights": r.params, "kv pool": r.cache, "block tables": r.dev_tables.array,
             "prev tokens": r.prev_tokens, "checkpoint pool": r.ck_pool,
             "span maps": r.span_pool, "outputs in flight": [h for _, h in engine._in_flight]}
    return {id(x): name for name, tree in named.items() for x in jax.tree.leaves(tree)}


def account(stage: str, engine=None, before: dict | None = None) -> dict:
    """One stage's row: MiB per owner, the other arrays by shape, the allocator's figures.
    `before` (id -> array, kept alive so no id is reused) holds the arrays live before the
    bench started (another caller's, e.g. earlier tests in one pytest process): their own owner."""
    import gc

    import jax
    gc.collect()  # garbage not collected yet is nobody's: not counted as an unexplained array
    who = owners(engine) if engine is not None else {}
    who.update(dict.fromkeys(before or {}, "before the bench"))
    by_owner: dict = {}
    other = []
    for x in jax.live_arrays():
        if x.is_deleted():
            continue
        name = who.get(id(x))
        if name is None:
            other.append((x.nbytes, f"{tuple(x.shape)} {x.dtype}"))
        else:
            by_owner[name] = by_owner.get(name, 0) + x.nbytes
    other.sort(reverse=True)
    row = {"stage": stage, "live_MiB": round(live_bytes() / MIB, 3),
           "by_owner_MiB": {k: round(v / MIB, 3) for k, v in by_owner.items()},
           "other_bytes": sum(n for n, _ in other), "other_arrays": len(other),
           "other_largest": [f"{what} {n / MIB:.3f} MiB" for n, what in other[:8]],
           "device_MiB": device_stats()}
    if "bytes_in_use" in row["device_MiB"]:  # what the allocator holds that no array explains
        row["device_beyond_live_MiB"] = round(row["device_MiB"]["bytes_in_use"]
                                              - row["live_MiB"], 1)
    print(f"[{stage}] live {row['live_MiB']:.1f} MiB = "
          + ", ".join(f"{k} {v:.1f}" for k, v in row["by_owner_MiB"].items())
          + f", other {row['other_bytes']} bytes ({len(other)} arrays: "
          + "; ".join(row["other_largest"][:3]) + f"); device {row['device_MiB']}, beyond live "
          f"{row.get('device_beyond_live_MiB')}", flush=True)
    return row


def add_parser(p) -> None:
    from benchmarks import engine_bench
    engine_bench.add_parser(p)
    p.add_argument("--fill-ab", action="store_true",
                   help="only the K/V fill, before 585ecae and now, over --leaves zero leaves")
    p.add_argument("--leaves", type=int, default=8, help="leaves of the fill A/B")
    p.add_argument("--leaf-mib", type=float, default=530.0,
                   help="MiB per leaf of the fill A/B (530: one Llama-3-8B layer's K at batch "
                        "128, ctx 2048)")


def _old_fill():
    """The fill program before 585ecae: x read for its shape only, so jit prunes it, and the
    donation with it."""
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, donate_argnums=(0,))
    def fill(x, key):
        return (0.5 * jax.random.normal(key, x.shape, jnp.float32)).astype(x.dtype)
    return fill


def fill_ab(args) -> dict:
    """Live and in-use bytes after each leaf of the fill, before 585ecae and now."""
    import jax
    import jax.numpy as jnp

    from benchmarks.engine_bench import _fill_program
    n = int(args.leaf_mib * MIB) // 2
    out = {}
    for name in ("before_585ecae", "now"):
        # the arrays already live (another caller's) held, so none is freed mid-count
        held = [x for x in jax.live_arrays() if not x.is_deleted()]
        leaves = [jnp.zeros((n,), jnp.bfloat16) for _ in range(args.leaves)]
        jax.block_until_ready(leaves)
        fill = _old_fill() if name == "before_585ecae" else _fill_program(leaves[0].sharding)
        keys = jax.random.split(jax.random.key(0), args.leaves)
        start = live_bytes()
        rows = []
        new = []
        for i in range(args.leaves):  # as the old bench did: the old leaves stay referenced
            new.append(jax.block_until_ready(fill(leaves[i], keys[i])))
            rows.append({"leaf": i, "live_extra_MiB": round((live_bytes() - start) / MIB, 1),
                         **device_stats()})
        out[name] = rows
        print(f"fill {name}: live bytes beyond the leaves after each leaf (MiB): "
              f"{[r['live_extra_MiB'] for r in rows]}; device after the last: "
              f"{ {k: v for k, v in rows[-1].items() if k in STATS} }", flush=True)
        del leaves, new, rows, held
    return out


def stages(args) -> list:
    """The engine bench's stages, one `account` row each."""
    import jax
    import numpy as np

    from benchmarks import engine_bench
    from benchmarks.compile_counter import CompileCounter
    from benchmarks.engine_workload import prime_decode
    from benchmarks.pool_reserve_probe import variant_memory
    before = {id(x): x for x in jax.live_arrays() if not x.is_deleted()}
    rows = [account("start", before=before)]

    def account_(stage, engine=None):
        return account(stage, engine, before)
    res = {"copy_rate_GBps": engine_bench.copy_rate(args.copy_gb) / 1e9}
    rows.append(account_(f"copy-rate anchor ({args.copy_gb} GiB) done"))
    args.no_warmup, warm = True, not args.no_warmup
    llm, _ = engine_bench._load(args, res, CompileCounter(), time.perf_counter())
    engine = llm.llm_engine
    r = engine.runner
    rows.append(account_(f"engine loaded ({r.num_blocks} blocks)", engine))
    if warm:
        engine.warmup()
        rows.append(account_(f"warmed up ({r.num_compiles} variants)", engine))
    limit = int(device_stats().get("bytes_limit", 0) * MIB)
    rows[-1]["step_variants"] = variant_memory(r, limit)
    temps = [v.get("temp_gib", 0) for v in rows[-1]["step_variants"]]
    print(f"step variants' temporaries (GiB, XLA): {temps}", flush=True)
    prime_decode(engine, args.batch, args.ctx, args.decode_steps, np.random.default_rng(0))
    rows.append(account_(f"primed ({args.batch} x {args.ctx})", engine))
    per_leaf = []
    engine_bench._randomize_cache(r, after_leaf=lambda i: per_leaf.append(device_stats()))
    rows.append(account_("random K/V filled", engine))
    rows[-1]["per_leaf_device_MiB"] = per_leaf
    engine.step()
    rows.append(account_("first decode step", engine))
    for _ in range(args.decode_steps):
        engine.step()
    rows.append(account_(f"{args.decode_steps} more decode steps", engine))
    for i in range(args.batch):
        engine.abort_request(f"decode-{i}")
    rows.append(account_("decode batch aborted", engine))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_parser(p)
    args = p.parse_args(argv)
    import jax
    if args.model is None:
        args.model = "llama3_8b"
    data = {"device": str(jax.devices()[0].device_kind), "model": args.model,
            "batch": args.batch, "ctx": args.ctx,
            "env": {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE",
                                                   "XLA_PYTHON_CLIENT_MEM_FRACTION")}}
    if args.fill_ab:
        data["fill_ab"] = fill_ab(args)
    else:
        data["stages"] = stages(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "live_bytes.json"), "w") as f:
        json.dump(data, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
