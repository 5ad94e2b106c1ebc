"""Gated DeltaNet chunked prefill: our JAX/Pallas layer vs flash-linear-attention's Triton kernel.

One sequence, Qwen3.5-0.8B GDN layer shape (16 heads, Dk = Dv = 128, bf16 inputs), T tokens.
Times the recurrent core only (q/k already L2-normalised, gates given), median of repeats, and
checks each variant's output against fla's (relative error) in the same run.

  minipic-bench gdn --tokens 8192 32768 [--no-fla] [--json out.json]
  python -m benchmarks.gdn_bench ...   (same)
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
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
    import jax
    jax.block_until_ready(fn(*args))  # compile + warm-up
    jax.block_until_ready(fn(*args))
    inner = 10
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner * 1e3)
    return statistics.median(times)


def run_fla(inputs, reps):
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    import triton
    q, k, v, g, beta = (torch.from_numpy(x).cuda() for x in inputs)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    beta = beta.to(torch.bfloat16)

    def call():
        return chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)

    out, final = call()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(call, warmup=100, rep=max(200, reps * 20), return_mode="median")
    return ms, out.float().cpu().numpy(), final.float().cpu().numpy()


def jax_variants():
    import jax.numpy as jnp
    from kernels_pallas.gated_delta import api
    bf16 = jnp.bfloat16

    def mk(**kw):
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

    def fused(q, k, v, g, beta, ck=None, block_v=32, prefetch=False):
        from kernels_pallas.gated_delta import fused_triton
        n, t_len, _, dk = k.shape
        state0 = jnp.zeros((n, v.shape[2], dk, v.shape[3]), jnp.float32)
        idx = None if ck is None else jnp.broadcast_to(jnp.asarray(ck, jnp.int32) // 64,
                                                       (n, len(ck)))
        return fused_triton.fused_gated_delta(q, k, v, g, beta, state0, idx, scale=dk ** -0.5,
                                              block_v=block_v, prefetch=prefetch)

    def fused_intra(q, k, v, g, beta, ck=None):
        from kernels_pallas.gated_delta import fused_triton
        return fused_triton.intra_chunk_fused(k, v, g, beta)

    return {
        "intra_only_fused": fused_intra,
        "fused_bv16": functools.partial(fused, block_v=16),
        "fused_bv32": fused,
        "fused_bv64": functools.partial(fused, block_v=64),
        "fused_bv16_pf": functools.partial(fused, block_v=16, prefetch=True),
        "fused_bv32_pf": functools.partial(fused, block_v=32, prefetch=True),
        "intra_only_blocked_bf16": intra_only,
        "intra_only_trsm_bf16": functools.partial(intra_only, solve="trsm"),
        "xla_scan_trsm_f32": mk(implementation="xla", solve="trsm"),
        "xla_scan_blocked_bf16": mk(implementation="xla", solve="blocked", inter_dtype=bf16),
        "pallas_trsm_bf16": mk(implementation="pallas_triton", solve="trsm", inter_dtype=bf16),
        "pallas_blocked_f32": mk(implementation="pallas_triton", solve="blocked"),
        "pallas_blocked_bf16": mk(implementation="pallas_triton", solve="blocked", inter_dtype=bf16),
    }


def add_parser(parser):
    """Arguments of `minipic-bench gdn`."""
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--checkpoints", type=int, default=16, help="M for the checkpoint run")
    parser.add_argument("--variants", nargs="*", default=None)
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--json", default=None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_parser(parser)
    return run(parser.parse_args(argv))


def run(args):
    """Run the benchmark; prints one line per variant and a table (ms, x fla, rel err)."""
    import jax
    import jax.numpy as jnp
    rows = []
    variants = jax_variants()
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants}
    for tokens in args.tokens:
        inputs = make_inputs(tokens)
        ref_out = ref_final = None
        if not args.no_fla:
            try:
                ms, ref_out, ref_final = run_fla(inputs, args.reps)
                rows.append(dict(tokens=tokens, variant="fla_chunk_gated_delta_rule", ms=ms,
                                 rel_err=0.0))
                print(f"T={tokens} fla: {ms:.3f} ms", flush=True)
            except Exception as e:  # report and go on with our variants
                print(f"T={tokens} fla failed: {type(e).__name__}: {e}", flush=True)
        q, k, v, g, beta = (jnp.asarray(x) for x in inputs)
        jin = (q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), g,
               beta.astype(jnp.bfloat16))
        n_chunks = tokens // 64
        ck = tuple(int(c) * 64 for c in np.linspace(1, n_chunks, args.checkpoints).round())
        for name, fn in variants.items():
            for with_ck in (False, True):
                if with_ck and name not in ("pallas_blocked_bf16", "fused_bv32"):
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
                except Exception as e:
                    print(f"T={tokens} {name} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
    print(f"\n{'tokens':>7} {'variant':<34} {'ms':>8} {'x fla':>6} {'rel_err':>9}")
    fla = {r["tokens"]: r["ms"] for r in rows if r["variant"].startswith("fla")}
    for r in rows:
        ratio = r["ms"] / fla[r["tokens"]] if r["tokens"] in fla else float("nan")
        err = "-" if r["rel_err"] is None else f"{r['rel_err']:.2e}"
        print(f"{r['tokens']:>7} {r['variant']:<34} {r['ms']:>8.3f} {ratio:>6.2f} {err:>9}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=str(jax.devices()[0]), rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
