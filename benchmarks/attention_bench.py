"""`minipic-bench attention`: paged attention speed on the GPU next to its anchors, one run.

Decode: S sequences x 1 token over ctx cached keys (block tables randomly permuted) -> effective
K+V bandwidth (bytes of K and V read once / time). Prefill: causal chunks -> TFLOP/s counted on the
causal (unmasked) pairs only, 4 * H * D FLOPs per (query, key) pair. Anchors measured in the same
process: device copy rate, XLA gather + dense (decode), JAX's Pallas `paged_attention` (decode),
cuDNN via `jax.nn.dot_product_attention` (prefill), JAX's Mosaic GPU `attention_mgpu` (prefill).
Timing: warm-up, then `iters` calls dispatched back to back and one block_until_ready, repeated
`reps` times; the median per-call time is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import numpy as np

from benchmarks.attention_decode import (attention_fn, decode_kernel_rows, mosaic_rows,
                                         print_device_table, print_rope_table)
from benchmarks.attention_inputs import decode_inputs
from benchmarks.attention_prefill import prefill_rows
from benchmarks.timing import row, safe

# (kv_group, block_k, num_warps, num_stages) of the ragged Triton kernel on decode rows
DECODE_SWEEP = ((1, 64, 4, 2), (1, 64, 8, 2), (1, 32, 4, 3), (1, 16, 4, 2))
# (kv_group, splits, block_k, num_warps, num_stages) for implementation="triton_decode"; each is
# timed rotated and position_free with every `rope` variant (splits 0 = the kernel's default).
DECODE_KERNEL_SWEEP = ((2, 4, 64, 4, 2), (1, 0, 64, 4, 2), (4, 4, 32, 4, 2))
DECODE_ROPE = ("trig", "table", "table_bf16")


def add_parser(p: argparse.ArgumentParser):
    p.add_argument("--seqs", type=int, default=None,
                   help="decode batch (default 64; 2 with --interpret)")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--contexts", type=int, nargs="+", default=None,
                   help="decode context lengths (default 4096 8192; 64 with --interpret)")
    p.add_argument("--prefill", type=str, nargs="*", default=None,
                   help="SEQSxNEW+CACHED prefill shapes (default 4x8192+0 4x1024+7168; "
                        "1x64+0 with --interpret)")
    p.add_argument("--sweep", nargs="?", const="all", default="", choices=["", "decode", "all"],
                   help="also sweep kernel tile options (decode only, or all)")
    p.add_argument("--mosaic", action="store_true", help="also time the Mosaic GPU decode kernel")
    p.add_argument("--mosaic-configs", nargs="+", default=["2,0,2,2,1"],
                   metavar="PPS,SPLITS,STAGES[,KV_GROUP[,PACKED]]",
                   help="Mosaic decode kernel (mosaic_decode.py) configs: pages per step, splits "
                        "(0 = auto), ring stages, kv heads per CTA, 1 = bf16x2 key rotation "
                        "(a leading 'mma:' is accepted, as in earlier commands)")
    p.add_argument("--decode-kernel", action="store_true",
                   help="also time the decode-only Triton kernel (triton_decode) configs")
    p.add_argument("--decode-rope", nargs="+", default=list(DECODE_ROPE), choices=DECODE_ROPE,
                   help="triton_decode RoPE-at-read variants (kernel option rope) to time")
    p.add_argument("--decode-variants", nargs="+", default=None, metavar="MODE[+OPT]",
                   help="triton_decode variants instead of rotated + --decode-rope: 'rotated' or a "
                        "rope variant, each optionally +OPTION / +noOPTION (boolean kernel "
                        "options, e.g. table_bf16+nopacked)")
    p.add_argument("--decode-configs", nargs="+", default=None, metavar="KVG,SPLITS,BK,W,S",
                   help="triton_decode configs (default: DECODE_KERNEL_SWEEP; splits 0 = auto)")
    p.add_argument("--decode-kernel-only", action="store_true",
                   help="decode: time only the copy anchor and the triton_decode sweep")
    p.add_argument("--prefill-impl", default="triton", choices=["triton", "mosaic_prefill", "both"],
                   help="prefill kernels of ours to time (mosaic_prefill: with its pre-pass alone)")
    p.add_argument("--iters", type=int, default=None,
                   help="calls per timing (default 10; 1 with --interpret)")
    p.add_argument("--reps", type=int, default=None,
                   help="timings per row, median reported (default 7; 1 with --interpret)")
    p.add_argument("--ab-reps", type=int, default=0,
                   help="also time rotated vs position_free interleaved (ABBA order) for this many "
                        "rep pairs and report the median ratio: the RoPE-at-read overhead without "
                        "the drift between separately timed rows (decode kernel and prefill)")
    p.add_argument("--profile", action="store_true",
                   help="decode kernel configs: also print each call's kernels and their device "
                        "time (jax.profiler), to separate the kernel from the glue around it")
    p.add_argument("--ab-variants", nargs="+", default=["table_bf16"], metavar="ROPE[+OPT]",
                   help="position_free variants timed against rotated by --ab-reps (default: the "
                        "engine's, table_bf16)")
    p.add_argument("--json", type=str, default=None, help="write all rows to this file")
    p.add_argument("--interpret", action="store_true",
                   help="CPU smoke run through the Pallas interpreter, on small default shapes; "
                        "its times and TB/s measure the interpreter, not a device")


def apply_size_defaults(args) -> None:
    """GPU-sized defaults, or small shapes with --interpret (the interpreter would take hours on
    the GPU ones); explicit values are kept."""
    small = args.interpret
    for name, gpu, cpu in (("seqs", 64, 2), ("contexts", [4096, 8192], [64]),
                           ("prefill", ["4x8192+0", "4x1024+7168"], ["1x64+0"]),
                           ("iters", 10, 1), ("reps", 7, 1)):
        if getattr(args, name) is None:
            setattr(args, name, cpu if small else gpu)
    if small:
        print("--interpret: Pallas interpreter on the CPU, shapes "
              f"seqs={args.seqs} contexts={args.contexts} prefill={args.prefill}; times and "
              "TB/s / TFLOP/s below measure the interpreter, not a device", flush=True)


def _copy_rows(rows, args, it):
    """The device copy rate anchors: XLA's elementwise pass and torch's copy_ (where present)."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((1 << (16 if args.interpret else 30),), jnp.float32)  # 4 GiB
    safe(rows, "copy", "xla x + 1 f32 (read + write)", jax.jit(lambda a: a + 1), x,
         work=2 * x.nbytes, unit="tbps", **it)
    del x
    if args.interpret:
        return
    try:
        import torch
        a = torch.empty(1 << 30, dtype=torch.float32, device="cuda")
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        ts = []
        for _ in range(args.reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(args.iters):
                b.copy_(a)
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) / 1e3 / args.iters)
        t = statistics.median(ts)
        row(rows, case="copy", impl="torch copy_ f32 4 GiB (read + write)", ms=t * 1e3,
            tbps=2 * a.numel() * 4 / t / 1e12)
        del a, b
        torch.cuda.empty_cache()
    except Exception as e:
        print(f"  copy torch FAILED {type(e).__name__}: {e}"[:200])


def _decode_rows(rows, ctx, rng, inv, args, rope_table, device_time):
    """Every decode row at one context length: our kernels (and their sweeps), the XLA and JAX
    Pallas anchors, and the separate K/V write."""
    import jax
    import jax.numpy as jnp
    from kernels_pallas.paged_attention.xla import xla_paged_attention
    it = dict(iters=args.iters, reps=args.reps)
    H, K, D, B = args.heads, args.kv_heads, args.head_dim, args.page_size
    case = f"decode ctx{ctx}"
    q, k, v, md = decode_inputs(rng, args.seqs, ctx, H, K, D, B, jnp.bfloat16)
    kv_bytes = 2 * args.seqs * ctx * K * D * q.dtype.itemsize
    tb = dict(work=kv_bytes, unit="tbps", **it)
    if args.decode_kernel:  # decode-only Triton kernel, rotated vs each RoPE-at-read variant
        configs = DECODE_KERNEL_SWEEP if args.decode_configs is None else [
            tuple(int(x) for x in c.split(",")) for c in args.decode_configs]
        decode_kernel_rows(rows, case, ctx, (q, k, v, md), inv, kv_bytes, configs, args,
                           rope_table, device_time)
    if args.decode_kernel_only:
        return

    def ours(mode, **opts):
        return attention_fn(inv, "triton", mode, opts, args.interpret)
    t_rot = safe(rows, case, "ours triton rotated", ours("rotated"), q, k, v, md, **tb)
    t_free = safe(rows, case, "ours triton position_free", ours("position_free"), q, k, v, md,
                  **tb)
    if t_rot and t_free:
        print(f"  {case:<16} RoPE-at-read overhead {100 * (t_free / t_rot - 1):+.1f}%")
        rows.append(dict(case=case, overhead_pct=100 * (t_free / t_rot - 1)))
    if args.sweep in ("decode", "all"):
        for kvg, bk, nw, ns in DECODE_SWEEP:
            for mode in ("rotated", "position_free"):
                safe(rows, case, f"ours {mode} kvg{kvg} bk{bk} w{nw} s{ns}",
                     ours(mode, kv_group=kvg, block_k=bk, num_warps=nw, num_stages=ns),
                     q, k, v, md, **tb)
    if args.mosaic:  # the Mosaic GPU decode kernel (TMA, warp-level MMA)
        mosaic_rows(rows, case, ctx, (q, k, v, md), inv, kv_bytes, args, device_time)
    xla = jax.jit(lambda q, k, v, md: xla_paged_attention(
        q, k, v, md, inv, kv_mode="position_free", attention_scaling=1.0, sm_scale=D ** -0.5))
    safe(rows, case, "xla gather+dense position_free", xla, q, k, v, md, **tb)
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa
    k_t, v_t = jnp.moveaxis(k, 2, 0), jnp.moveaxis(v, 2, 0)  # [K, P, B, D] (its layout)
    lengths = jnp.full((args.seqs,), ctx, jnp.int32)
    for ppcb, splits in ((8, 16), (16, 8)):
        fn = jax.jit(lambda q, k, v, bt, ln, ppcb=ppcb, splits=splits: jax_pa.paged_attention(
            q, k, v, bt, ln, pages_per_compute_block=ppcb, k_splits=splits))
        safe(rows, case, f"jax pallas paged_attention p{ppcb} s{splits}", fn, q, k_t, v_t,
             md.block_tables, lengths, **tb)
    del k_t, v_t, q
    _write_kv_row(rows, case, k, v, md, args.seqs)


def _write_kv_row(rows, case, k, v, md, seqs):
    """This step's new K/V rows written as a separate step (what fusing the write would save),
    into donated copies of the pages."""
    import jax
    import jax.numpy as jnp
    from kernels_pallas.paged_attention.api import write_kv
    B, K, D = k.shape[1:]
    new = jnp.ones((seqs, K, D), k.dtype)
    slots = jnp.asarray(np.asarray(md.block_tables)[:, -1] * B + B - 1, jnp.int32)
    wk = jax.jit(write_kv, donate_argnums=(0, 1))
    kk, vv = jnp.copy(k), jnp.copy(v)
    del k, v
    try:
        for _ in range(3):
            kk, vv = wk(kk, vv, new, new, slots)
        jax.block_until_ready(kk)
        t0 = time.perf_counter()
        for _ in range(20):
            kk, vv = wk(kk, vv, new, new, slots)
        jax.block_until_ready(kk)
        t_w = (time.perf_counter() - t0) / 20
        print(f"  {case:<16} write_kv separate step {t_w * 1e3:8.3f} ms")
        rows.append(dict(case=case, impl="write_kv separate", ms=t_w * 1e3))
    except Exception as e:
        print(f"  {case:<16} write_kv FAILED {type(e).__name__}")


def _print_best(rows):
    """The best row of ours per case and mode, and the overhead best vs best."""
    print("\nbest per case and mode:")
    best = {}
    for r in rows:
        if "impl" in r and "error" not in r and "ours" in r["impl"]:
            mode = "position_free" if "position_free" in r["impl"] else "rotated"
            if "mosaic" in r["impl"]:
                mode = "mosaic " + mode
            if "ours decode" in r["impl"]:
                mode = "decode-kernel " + mode
            key = (r["case"], mode)
            val = r.get("tbps", r.get("tflops"))
            if val is not None and (key not in best or val > best[key][0]):
                best[key] = (val, r["impl"])
    for (case, mode), (val, impl) in sorted(best.items()):
        print(f"  {case:<20} {mode:<14} {val:8.2f}  ({impl})")
    for case in sorted({c for c, _ in best}):
        for prefix in ("", "decode-kernel ", "mosaic "):
            rot, free = (case, prefix + "rotated"), (case, prefix + "position_free")
            if rot in best and free in best:
                ratio = best[rot][0] / best[free][0]
                print(f"  {case:<20} {prefix}RoPE-at-read overhead (best vs best) "
                      f"{100 * (ratio - 1):+.1f}%")


def run(args) -> int:
    import jax
    import jax.numpy as jnp
    from kernels_pallas.paged_attention.random_inputs import inv_freq_for

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    apply_size_defaults(args)
    rng = np.random.default_rng(0)
    inv = jnp.asarray(inv_freq_for(args.head_dim, theta=500000.0))
    rows = []
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}", flush=True)
    _copy_rows(rows, args, dict(iters=args.iters, reps=args.reps))
    rope_table = {}  # (config tag, "rotated" or rope variant, ctx) -> bytes / s
    device_time = {}  # (config tag, ctx, kv mode) -> (busy us, kernel us) per call, profiled
    for ctx in args.contexts:
        _decode_rows(rows, ctx, rng, inv, args, rope_table, device_time)
    for spec in args.prefill:
        prefill_rows(rows, spec, rng, inv, args, jnp.bfloat16)
    _print_best(rows)
    print_rope_table(rope_table, args.contexts)
    print_device_table(device_time, args.seqs, args.kv_heads, args.head_dim, 2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="attention_bench")
    add_parser(parser)
    raise SystemExit(run(parser.parse_args()))
