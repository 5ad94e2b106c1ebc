"""Decode-kernel parts of `minipic-bench attention` (benchmarks/attention_bench.py): the
triton_decode config sweep with its RoPE-at-read variants, interleaved A/B and profiled device
time; the Mosaic GPU decode configs; their summary tables."""

from __future__ import annotations

import numpy as np

from benchmarks.timing import ab_row, profile_kernels, safe


def attention_fn(inv, implementation, kv_mode, options, interpret):
    """A jitted paged_attention call over (q, k_pages, v_pages, metadata)."""
    import jax
    from kernels_pallas.paged_attention.api import paged_attention
    return jax.jit(lambda q, k, v, md: paged_attention(
        q, k, v, md, inv, kv_mode=kv_mode, implementation=implementation,
        kernel_options=options, interpret=interpret))


def decode_kernel_rows(rows, case, ctx, inputs, inv, kv_bytes, configs, args, rope_table,
                       device_time):
    """triton_decode configs: rotated and each RoPE-at-read variant timed alone (into
    rope_table), rotated vs position_free interleaved (--ab-reps), profiled (--profile)."""
    it = dict(iters=args.iters, reps=args.reps)
    for kvg, splits, bk, nw, ns in configs:
        opts = dict(kv_group=kvg, block_k=bk, num_warps=nw, num_stages=ns,
                    **({"splits": splits} if splits else {}))
        tag = f"kvg{kvg} sp{splits or 'auto'} bk{bk} w{nw} s{ns}"

        def dec(mode, o):
            return attention_fn(inv, "triton_decode", mode, o, args.interpret)
        for variant in args.decode_variants or ["rotated"] + args.decode_rope:
            mode = "rotated" if variant.startswith("rotated") else "position_free"
            # positions here are < ctx; rotated mode takes the same flags with rope "trig"
            o = variant_options(opts, "trig" + variant.removeprefix("rotated")
                                if mode == "rotated" else variant, ctx)
            label = variant if mode == "rotated" else f"{mode} {variant}"
            t = safe(rows, case, f"ours decode {label} {tag}", dec(mode, o), *inputs,
                     work=kv_bytes, unit="tbps", **it)
            if t:
                rope_table[(tag, variant, ctx)] = kv_bytes / t
        for ab in args.ab_variants if args.ab_reps else ():  # rotated vs position_free
            ab_row(rows, case, f"decode {tag} (position_free {ab})", dec("rotated", opts),
                   dec("position_free", variant_options(opts, ab, ctx)), *inputs,
                   reps=args.ab_reps, iters=args.iters)
        if args.profile:  # device time of each kernel of the call (kernel vs glue)
            variants = [("rotated", "rotated", opts)] + [
                ("position_free", ab, variant_options(opts, ab, ctx)) for ab in args.ab_variants]
            for mode, label, o in variants:
                busy = profile_row(rows, case, f"decode {tag} {label}", dec(mode, o), *inputs)
                if busy:
                    device_time[(tag, ctx, label)] = busy


def mosaic_rows(rows, case, ctx, inputs, inv, kv_bytes, args, device_time):
    """Mosaic GPU decode configs PPS,SPLITS,STAGES[,KV_GROUP[,PACKED]] (a leading "mma:" is
    accepted, as in earlier commands): rotated, and position_free with cos | sin table rows,
    the table variant against rotated interleaved, profiled."""
    it = dict(iters=args.iters, reps=args.reps)
    for cfg in args.mosaic_configs:
        pps, splits, stages, kvg, packed = (
            [int(x) for x in cfg.removeprefix("mma:").split(",")] + [1, 0])[:5]
        opts = dict(pages_per_step=pps, stages=stages, kv_group=kvg, packed=bool(packed),
                    **({"splits": splits} if splits else {}))
        tag = (f"mma pps{pps} sp{splits or 'auto'} st{stages} kvg{kvg}"
               + (" packed" if packed else ""))
        variants = [("rotated", "rotated", opts),
                    ("position_free", "table", dict(opts, max_position=ctx))]
        fns = [attention_fn(inv, "mosaic_decode", mode, o, args.interpret)
               for mode, _, o in variants]
        for (_, label, _), fn in zip(variants, fns):
            safe(rows, case, f"ours mosaic {label} {tag}", fn, *inputs, work=kv_bytes,
                 unit="tbps", **it)
        if args.ab_reps:
            ab_row(rows, case, f"mosaic {tag} (position_free table)", fns[0], fns[-1], *inputs,
                   reps=args.ab_reps, iters=args.iters)
        if args.profile:
            for (_, label, _), fn in zip(variants, fns):
                busy = profile_row(rows, case, f"mosaic {tag} {label}", fn, *inputs)
                if busy:
                    device_time[(f"mosaic {tag}", ctx, label)] = busy


def variant_options(opts, variant, ctx):
    """kernel_options of a position_free variant 'ROPE[+OPT|+noOPT...]' (positions < ctx)."""
    rope, *flags = variant.split("+")
    return dict(opts, rope=rope, max_position=ctx,
                **{f.removeprefix("no"): not f.startswith("no") for f in flags})


def profile_row(rows, case, label, fn, *args, calls: int = 10):
    """Kernels of `calls` traced calls, device ms per call, into a printed row -> (busy us,
    attention kernel us) per call, or None."""
    try:
        prof = profile_kernels(lambda: fn(*args), steps=calls, top=8)
    except Exception as e:  # noqa: BLE001 - the timed rows stand without the trace
        print(f"  {case:<16} profile {label} FAILED {type(e).__name__}: {e}"[:300])
        return None
    parts = ", ".join(f"{r['name'][:40]} {1e3 * r['ms_per_step']:.1f} us"
                      for r in prof["top"])
    print(f"  {case:<16} profile {label}: {prof['kernels_per_step']:.0f} kernels, busy "
          f"{1e3 * prof['kernel_busy_ms_per_step']:.1f} us of "
          f"{1e3 * prof['first_to_last_kernel_ms_per_step']:.1f} us: {parts}", flush=True)
    rows.append(dict(case=case, impl=f"profile {label}", profile=prof))
    kernel = prof["top"][0]["ms_per_step"] if prof["top"] else 0.0  # the attention kernel
    return 1e3 * prof["kernel_busy_ms_per_step"], 1e3 * kernel


def print_device_table(device_time, seqs, kv_heads, head_dim, itemsize):
    """Profiled device time per call (every kernel of the call / the attention kernel alone):
    bandwidth without the host's dispatch gaps between calls, and the RoPE-at-read overhead."""
    if not device_time:
        return
    print("\ntriton_decode device time per call (profiler; busy = all kernels of the call):")
    for tag, ctx, label in device_time:
        rot, free = device_time.get((tag, ctx, "rotated")), device_time[(tag, ctx, label)]
        if label != "rotated" and rot and rot[0] > 0 and rot[1] > 0:
            kv_bytes = 2 * seqs * ctx * kv_heads * head_dim * itemsize
            print(f"  {tag:<24} ctx{ctx:<6} busy rotated {rot[0]:6.1f} us "
                  f"({kv_bytes / rot[0] / 1e6:.2f} TB/s), {label} {free[0]:6.1f} us "
                  f"({kv_bytes / free[0] / 1e6:.2f} TB/s), overhead "
                  f"{100 * (free[0] / rot[0] - 1):+.1f}%; kernel alone {rot[1]:.1f} / "
                  f"{free[1]:.1f} us ({100 * (free[1] / rot[1] - 1):+.1f}%)")


def print_rope_table(table, contexts):
    """triton_decode: TB/s rotated vs each RoPE-at-read variant; overhead in time vs rotated
    mode of the same config, and vs the best rotated config of the run ("best")."""
    if not table:
        return
    print("\ntriton_decode RoPE-at-read variants (TB/s; overhead = time vs rotated, same config "
          "/ vs best rotated):")
    best = {c: max([v for (t, r, cc), v in table.items() if cc == c and r.startswith("rotated")],
                   default=None) for c in contexts}
    head = "".join(f" | ctx{c} TB/s  same  best" for c in contexts)
    print(f"  {'config':<22} {'variant':<28}{head}")
    for tag in dict.fromkeys(t for t, _, _ in table):
        for rope in dict.fromkeys(r for t, r, _ in table if t == tag):
            cells = ""
            for c in contexts:
                val, rot = table.get((tag, rope, c)), table.get((tag, "rotated", c))
                if val is None:
                    cells += f" | {'FAILED':>9} {'':>13}"
                    continue
                over = " " * 14
                if rot and rope != "rotated":
                    over = f"{100 * (rot / val - 1):+6.1f}%{100 * (best[c] / val - 1):+6.1f}%"
                cells += f" | {val / 1e12:9.2f} {over}"
            print(f"  {tag:<22} {rope:<28}{cells}")
