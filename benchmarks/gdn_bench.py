"""Gated DeltaNet chunked prefill: our JAX/Pallas layer vs flash-linear-attention's Triton kernel.

One sequence, Qwen3.5-0.8B GDN layer shape (16 heads, Dk = Dv = 128, bf16 inputs), T tokens.
Times the recurrent core only (q/k already L2-normalised, gates given), median of repeats, and
checks each variant's output against fla's (relative error) in the same run.

  minipic-bench gdn --tokens 8192 32768 [--no-fla] [--profile] [--json out.json]
--profile adds each variant's kernels by part (solve / scan / output / glue) next to their floors
at H100 rates (benchmarks/gdn_profile.py).
  python -m benchmarks.gdn_bench ...   (same)
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import numpy as np


def make_inputs(tokens, heads=16, dim=128, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, tokens, heads, dim)).astype(np.float32)
    k = rng.standard_normal((1, tokens, heads, dim)).astype(np.float32)
    q /= np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
    k /= np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    v = rng.standard_normal((1, tokens, heads, dim)).astype(np.float32)
    # Qwen3.5-like gates: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
    a = rng.standard_normal((1, tokens, heads)).astype(np.float32)
    g = -np.exp(np.log(rng.uniform(1, 16, heads))).astype(np.float32) * np.log1p(np.exp(a - 4.0))
    beta = 1 / (1 + np.exp(-rng.standard_normal((1, tokens, heads)))).astype(np.float32)
    return q, k, v, g.astype(np.float32), beta.astype(np.float32)


def time_jax(fn, args, reps):
    """Median ms per call (10 calls back to back per rep, after warm-up)."""
    from benchmarks.timing import time_calls
    return time_calls(fn, *args, iters=10, reps=reps) * 1e3


def fla_call(inputs):
    """fla's chunk_gated_delta_rule on `inputs` (bf16 q, k, v, beta on the GPU), as a call."""
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    q, k, v, g, beta = (torch.from_numpy(x).cuda() for x in inputs)
    q, k, v, beta = (x.to(torch.bfloat16) for x in (q, k, v, beta))
    return lambda: chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)


def run_fla(inputs, reps):
    import torch
    import triton
    call = fla_call(inputs)
    out, final = call()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(call, warmup=100, rep=max(200, reps * 20), return_mode="median")
    return ms, out.float().cpu().numpy(), final.float().cpu().numpy()


# the earlier fused path (row-substitution solve, [Dk, BV] state, BV = 16;
# benchmarks/history/gated_delta.md)
OLD_DEFAULT = dict(intra="subst", intra_warps=4, layout="kv", block_v=16, scan_warps=4,
                   scan_stages=2, ckpt_store="when", out_warps=4)
CKPT_VARIANTS = ("fused", "fused_old", "fused_best", "fused_best_mask", "fused_when", "tree",
                 "tree_bf16maps", "blocked16", "blocked32")


def fused_mosaic_lean(q, k, v, g, beta, ck=None):
    """fused_mosaic_out with the lean Mosaic solve (intra_mosaic.py lean=True): the fused
    pipeline (fused_triton.fused_gated_delta, its DEFAULTS) from a zero state, composed here."""
    import jax.numpy as jnp
    from kernels_pallas.gated_delta import fused_triton, intra_mosaic, output_mosaic, scan_fused
    del ck
    opt = fused_triton.DEFAULTS
    w, u, kd, gc = intra_mosaic.intra_chunk_mosaic(k, v, g, beta, lean=True)
    dl = jnp.moveaxis(jnp.exp(gc[:, 63::64, :]), 1, 2)  # [N, Hv, NT]
    s0 = jnp.zeros((k.shape[0], v.shape[2], k.shape[3], v.shape[3]), jnp.float32)
    v_new, states, final, _ = scan_fused.state_scan(
        w, u, kd, dl, s0, block_v=opt["block_v"], layout=opt["layout"],
        num_warps=opt["scan_warps"], num_stages=opt["scan_stages"])
    out = output_mosaic.output_mosaic(q, k, g, v_new, states, scale=k.shape[-1] ** -0.5,
                                      states_t=opt["layout"] == "vk")
    return out, final, None


def jax_variants():
    import jax.numpy as jnp
    from kernels_pallas.gated_delta import api
    bf16 = jnp.bfloat16

    def mk(**kw):
        kw.setdefault("scan", "sequential")  # these variants time the sequential scans

        def f(q, k, v, g, beta, ck=None):
            out, final, cs = api.prefill(q, k, v, g, beta, checkpoint_at=ck, **kw)
            return out, final, cs
        return f

    def intra_only(q, k, v, g, beta, ck=None, solve="blocked"):  # the parallel half alone
        from kernels_pallas.gated_delta import chunked
        f32 = jnp.float32
        qc, kc, vc = (chunked.to_chunks(x.astype(f32), 64) for x in (q, k, v))
        gc, bc = (chunked.to_chunks(x.astype(f32), 64) for x in (g, beta))
        parts = chunked.intra_chunk(qc, kc, vc, gc, bc, scale=q.shape[-1] ** -0.5, solve=solve)
        return tuple(x.astype(bf16) for x in (parts["w"], parts["u"], parts["kd"]))

    def from_zero_state(kernel):  # kernel(q, k, v, g, beta, state0, chunk_idx, scale, **opts)
        def f(q, k, v, g, beta, ck=None, **opts):
            n, _, _, dk = k.shape
            state0 = jnp.zeros((n, v.shape[2], dk, v.shape[3]), jnp.float32)
            idx = None if ck is None else jnp.broadcast_to(jnp.asarray(ck, jnp.int32) // 64,
                                                           (n, len(ck)))
            return kernel(q, k, v, g, beta, state0, idx, scale=dk ** -0.5, **opts)[:3]
        return f

    from kernels_pallas.gated_delta import fused_triton, scan_blocked, tree_scan
    fused = from_zero_state(fused_triton.fused_gated_delta)
    # Pallas intra / output around the tree scan; the two-level scan (scan_blocked.py)
    tree = from_zero_state(tree_scan.fused_tree_gated_delta)
    blocked = from_zero_state(scan_blocked.blocked_gated_delta)

    def fused_intra(q, k, v, g, beta, ck=None):
        return fused_triton.intra_chunk_fused(k, v, g, beta)

    def intra_kernel(q, k, v, g, beta, ck=None, kind="blocked", **kw):  # kernel 1 alone
        from kernels_pallas.gated_delta import intra_blocked, intra_mosaic
        if kind == "mosaic":
            return intra_mosaic.intra_chunk_mosaic(k, v, g, beta, **kw)
        return intra_blocked.intra_chunk_blocked(k, v, g, beta, num_warps=2)

    return {
        "intra_only_fused": fused_intra,
        "fused": fused,  # fused_triton.DEFAULTS
        "fused_mosaic": functools.partial(fused, intra="mosaic"),  # intra_mosaic.py's solve
        "fused_mosaic_out": functools.partial(fused, intra="mosaic", output="mosaic"),
        "fused_mosaic_out_lean": fused_mosaic_lean,
        "intra_only_blocked": intra_kernel,  # the Triton solve alone (fused's kernel 1)
        "intra_only_mosaic": functools.partial(intra_kernel, kind="mosaic"),
        "intra_only_mosaic_p1": functools.partial(intra_kernel, kind="mosaic", block_passes=1),
        # KD through K's tile: 69 KB of SMEM, three CTAs per SM (intra_mosaic.py `_scratch`)
        "intra_only_mosaic_lean": functools.partial(intra_kernel, kind="mosaic", lean=True),
        "intra_only_mosaic_lean_p1": functools.partial(intra_kernel, kind="mosaic", lean=True,
                                                       block_passes=1),
        "tree": tree,  # the associative scan over chunk maps (tree_scan.py)
        "tree_bf16maps": functools.partial(tree, map_dtype=bf16),
        # two-level scan: G segments of chunks (blocked{G}), options of both scan passes
        **{f"blocked{gs}": functools.partial(blocked, segments=gs) for gs in (4, 8, 16, 32, 64)},
        "blocked16_bv32": functools.partial(blocked, segments=16, block_v=32),
        "blocked16_w2": functools.partial(blocked, segments=16, num_warps=2),
        "blocked16_xla": functools.partial(blocked, segments=16, compose_impl="xla"),
        "fused_old": functools.partial(fused, **OLD_DEFAULT),
        "fused_bv32_old": functools.partial(fused, **{**OLD_DEFAULT, "block_v": 32}),
        "fused_when": functools.partial(fused, ckpt_store="when"),  # checkpoint runs only
        "fused_s4": functools.partial(fused, scan_stages=4),
        "fused_kv": functools.partial(fused, layout="kv"),
        "intra_only_blocked_bf16": intra_only,
        "intra_only_trsm_bf16": functools.partial(intra_only, solve="trsm"),
        "xla_scan_trsm_f32": mk(implementation="xla", solve="trsm"),
        "xla_scan_blocked_bf16": mk(implementation="xla", solve="blocked", inter_dtype=bf16),
    }


# (layout, block_v, num_warps, num_stages) tried by --sweep for the state scan
SCAN_CONFIGS = ([("kv", 16, 4, 2)]
                + [("vk", bv, nw, ns) for bv in (16, 32, 64) for nw in (1, 2, 4)
                   for ns in (1, 2, 3)]
                + [("vk", 64, 8, 2), ("vk", 128, 4, 2), ("vk", 128, 8, 2)]
                + [("kv", bv, nw, ns) for bv in (16, 32) for nw in (2, 4) for ns in (1, 2, 3)
                   if (bv, nw, ns) != (16, 4, 2)])
INTRA_CONFIGS = [("subst", 4), ("subst", 8), ("blocked", 1), ("blocked", 2), ("blocked", 4),
                 ("blocked", 8)]


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def sweep(inputs, reps, deadline):
    """Time each fused kernel alone (intra solve, state scan, output) over its options at one T.

    Returns (rows, best): rows of dict(part, variant, ms, rel_err) (rel_err against the old
    default's outputs) and the fastest correct options as `fused_gated_delta` keyword args.
    """
    import jax
    import jax.numpy as jnp
    from kernels_pallas.gated_delta import fused_triton, intra_blocked, scan_fused
    bf16 = jnp.bfloat16
    q, k, v, g, beta = (jnp.asarray(x) for x in inputs)
    q, k, v, beta = (x.astype(bf16) for x in (q, k, v, beta))
    rows = []

    def timed(part, label, fn, args, ref=None):  # ref: [(output index, expected)]
        if time.perf_counter() > deadline:
            print(f"sweep {part} {label}: skipped (time budget)", flush=True)
            return None
        try:
            f = jax.jit(fn)
            ms = time_jax(f, args, reps)
            out = f(*args)
            err = None if ref is None else max(_rel(out[i], r) for i, r in ref)
            rows.append(dict(part=part, variant=label, ms=ms, rel_err=err))
            print(f"sweep {part} {label}: {ms:.3f} ms rel_err={err}", flush=True)
            return out
        except Exception as e:
            print(f"sweep {part} {label} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            return None

    ref_intra = jax.jit(fused_triton.intra_chunk_fused)(k, v, g, beta)
    for kind, nw in INTRA_CONFIGS:
        fn = (fused_triton.intra_chunk_fused if kind == "subst"
              else intra_blocked.intra_chunk_blocked)
        timed("intra", f"{kind}_w{nw}", functools.partial(fn, num_warps=nw), (k, v, g, beta),
              [(0, ref_intra[0]), (1, ref_intra[1])])
    w, u, kd, gc = ref_intra
    dl = jnp.moveaxis(jnp.exp(gc[:, 63::64, :]), 1, 2)
    s0 = jnp.zeros((1, v.shape[2], k.shape[3], v.shape[3]), jnp.float32)
    ref_scan = jax.jit(functools.partial(scan_fused.state_scan, layout="kv", block_v=16))(
        w, u, kd, dl, s0)
    states = {}
    for layout, bv, nw, ns in SCAN_CONFIGS:
        out = timed("scan", f"{layout}_bv{bv}_w{nw}_s{ns}", functools.partial(
            scan_fused.state_scan, layout=layout, block_v=bv, num_warps=nw, num_stages=ns),
            (w, u, kd, dl, s0), [(0, ref_scan[0]), (2, ref_scan[2])])
        if out is not None:
            states.setdefault(layout, out)
    for layout, out in states.items():
        for nw in (4, 8):
            timed("output", f"{layout}_w{nw}", functools.partial(
                fused_triton.output_fused, scale=k.shape[-1] ** -0.5, chunk=64, dot_dtype=bf16,
                out_dtype=bf16, num_warps=nw, states_t=layout == "vk"),
                (q, k, g, out[0], out[1]))

    def fastest(part, *prefixes):
        ok = [r for r in rows if r["part"] == part and r["variant"].startswith(prefixes or "")
              and (r["rel_err"] is None or r["rel_err"] < 2e-2)]
        return min(ok, key=lambda r: r["ms"])["variant"] if ok else None

    best = {}
    if (name := fastest("intra")):
        kind, nw = name.split("_w")
        best.update(intra=kind, intra_warps=int(nw))
    if (name := fastest("scan", "kv_", "vk_")):  # the layouts fused_gated_delta has
        layout, bv, nw, ns = name.split("_")
        best.update(layout=layout, block_v=int(bv[2:]), scan_warps=int(nw[1:]),
                    scan_stages=int(ns[1:]))
        if (name := fastest("output", layout)):
            best.update(out_warps=int(name.split("_w")[1]))
    print(f"sweep best: {best}", flush=True)
    return rows, best


def best_variants(best: dict) -> dict:
    """The sweep's best as variants, also with the Mosaic solve and output (the engine's)."""
    fused = jax_variants()["fused"]
    scan = {k: best[k] for k in ("layout", "block_v", "scan_warps", "scan_stages") if k in best}
    return {"fused_best": functools.partial(fused, **best),
            "fused_best_mask": functools.partial(fused, **best, ckpt_store="mask"),
            "fused_mosaic_out_best": functools.partial(fused, intra="mosaic", output="mosaic",
                                                       **scan)}


def _profile(f, jin, label):
    """gdn_profile.profile_jax of one variant, printed against the floors; None if it fails."""
    from benchmarks import gdn_profile
    try:
        prof = gdn_profile.profile_jax(f, jin)
    except Exception as e:  # the timed row stands without its trace
        print(f"{label} profile failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None
    _, tokens, heads, dim = jin[2].shape
    print(gdn_profile.line(label, prof, gdn_profile.floors(tokens, heads, dim)), flush=True)
    return prof


def _profile_fla(tokens):
    """gdn_profile.profile_fla of fla at T tokens, printed against the floors; None if it
    fails."""
    from benchmarks import gdn_profile
    try:
        prof = gdn_profile.profile_fla(fla_call(make_inputs(tokens)))
    except Exception as e:  # the timed row stands without its trace
        print(f"T={tokens} fla profile failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None
    print(gdn_profile.line(f"T={tokens} fla", prof, gdn_profile.floors(tokens, 16, 128)),
          flush=True)
    return prof


def add_parser(parser):
    """Arguments of `minipic-bench gdn`."""
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768],
                        help="prefill lengths T to time")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per variant")
    parser.add_argument("--checkpoints", type=int, default=16, help="M for the checkpoint run")
    parser.add_argument("--variants", nargs="*", default=None,
                        help="variants to time (default: all that run on this backend)")
    parser.add_argument("--no-fla", action="store_true",
                        help="skip the flash-linear-attention reference (needs torch + CUDA)")
    parser.add_argument("--json", default=None, help="write all rows to this file")
    parser.add_argument("--profile", action="store_true",
                        help="also trace each variant (and fla): its kernels by part, next to "
                             "the parts' floors at H100 rates (gdn_profile.py)")
    parser.add_argument("--sweep", action="store_true",
                        help="time the fused kernels alone over their options at the largest T "
                             "and add fused_best (the fastest correct combination)")
    parser.add_argument("--sweep-budget-s", type=float, default=150.0,
                        help="--sweep stops starting new combinations after this many seconds")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_parser(parser)
    return run(parser.parse_args(argv))


def run(args):
    """Run the benchmark; prints one line per variant and a table (ms, x fla, rel err)."""
    import jax
    import jax.numpy as jnp
    rows, sweep_rows = [], []
    variants = jax_variants()
    if args.variants:
        unknown = [k for k in args.variants if k not in variants]
        if unknown:
            raise SystemExit(f"gdn: unknown variants {unknown}; known: {sorted(variants)}")
        variants = {k: variants[k] for k in args.variants}  # in the order asked (a timeout
        # keeps the first ones)
    fla_ref = {}
    for tokens in args.tokens:  # the anchor first, for every T
        if args.no_fla:
            break
        try:
            ms, ref_out, _ = run_fla(make_inputs(tokens), args.reps)
            fla_ref[tokens] = ref_out
            rows.append(dict(tokens=tokens, variant="fla_chunk_gated_delta_rule", ms=ms,
                             rel_err=0.0))
            print(f"T={tokens} fla: {ms:.3f} ms", flush=True)
        except Exception as e:  # report and go on with our variants
            print(f"T={tokens} fla failed: {type(e).__name__}: {e}", flush=True)
    best = None
    if args.sweep:
        t_sweep = max(args.tokens)
        sweep_rows, best = sweep(make_inputs(t_sweep), max(3, args.reps // 3),
                                 time.perf_counter() + args.sweep_budget_s)
        variants.update(best_variants(best))
    for tokens in args.tokens:
        inputs = make_inputs(tokens)
        ref_out = fla_ref.get(tokens)
        q, k, v, g, beta = (jnp.asarray(x) for x in inputs)
        jin = (q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), g,
               beta.astype(jnp.bfloat16))
        n_chunks = tokens // 64
        ck = tuple(int(c) * 64 for c in np.linspace(1, n_chunks, args.checkpoints).round())
        for name, fn in variants.items():
            for with_ck in (False, True):
                if (with_ck and name not in CKPT_VARIANTS) or (
                        not with_ck and name.endswith(("_mask", "_when"))):
                    continue
                try:
                    f = jax.jit(functools.partial(fn, ck=ck if with_ck else None))
                    ms = time_jax(f, jin, args.reps)
                    err = None
                    if ref_out is not None and not name.startswith("intra"):
                        out, final, _ = f(*jin)
                        o = np.asarray(out.astype(jnp.float32))
                        err = float(np.linalg.norm(o - ref_out) / np.linalg.norm(ref_out))
                    label = name + (f"+ckpt{args.checkpoints}" if with_ck else "")
                    rows.append(dict(tokens=tokens, variant=label, ms=ms, rel_err=err))
                    print(f"T={tokens} {label}: {ms:.3f} ms rel_err_vs_fla={err}", flush=True)
                    if args.profile and not with_ck:
                        rows[-1]["profile"] = _profile(f, jin, f"T={tokens} {label}")
                except Exception as e:
                    print(f"T={tokens} {name} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
    if args.profile:  # torch.profiler last: its CUPTI session must not precede jax.profiler's
        for r in rows:
            if r["variant"].startswith("fla") and "profile" not in r:
                r["profile"] = _profile_fla(r["tokens"])
    print(f"\n{'tokens':>7} {'variant':<34} {'ms':>8} {'x fla':>6} {'rel_err':>9}")
    fla = {r["tokens"]: r["ms"] for r in rows if r["variant"].startswith("fla")}
    for r in rows:
        ratio = r["ms"] / fla[r["tokens"]] if r["tokens"] in fla else float("nan")
        err = "-" if r["rel_err"] is None else f"{r['rel_err']:.2e}"
        print(f"{r['tokens']:>7} {r['variant']:<34} {r['ms']:>8.3f} {ratio:>6.2f} {err:>9}")
    if sweep_rows:
        print(f"\nsweep at T={max(args.tokens)} (each kernel alone; rel_err vs the old default)")
        for r in sweep_rows:
            err = "-" if r["rel_err"] is None else f"{r['rel_err']:.2e}"
            print(f"{r['part']:>7} {r['variant']:<26} {r['ms']:>8.3f} {err:>9}")
        print(f"best: {best}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=str(jax.devices()[0]), rows=rows, sweep=sweep_rows,
                           best=best), fh, indent=1)


if __name__ == "__main__":
    main()
