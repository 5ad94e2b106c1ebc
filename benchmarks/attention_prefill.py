"""Prefill parts of `minipic-bench attention` (benchmarks/attention_bench.py): our kernels on a
SEQSxNEW+CACHED prefill shape, rotated and position_free (alone and interleaved A/B), the Mosaic
prefill's parts alone, the tile sweep, and the dense anchors (cuDNN, JAX's attention_mgpu)."""

from __future__ import annotations

from benchmarks.attention_decode import attention_fn
from benchmarks.attention_inputs import prefill_inputs
from benchmarks.timing import ab_row, safe

# (block_q, block_k, num_warps, num_stages) of the ragged Triton kernel
PREFILL_SWEEP = ((32, 64, 8, 2), (32, 64, 4, 3), (32, 128, 8, 2), (64, 64, 8, 2))


def prefill_rows(rows, spec: str, rng, inv, args, dtype):
    """Every prefill row of one shape `spec` = SEQSxNEW+CACHED."""
    seqs, rest = spec.split("x")
    new, cached = (int(a) for a in rest.split("+"))
    seqs = int(seqs)
    case = f"prefill {spec}"
    H, K, D, B = args.heads, args.kv_heads, args.head_dim, args.page_size
    q, k, v, md = prefill_inputs(rng, seqs, new, cached, H, K, D, B, dtype)
    flops = 4.0 * H * D * seqs * sum(cached + i + 1 for i in range(new))
    it = dict(iters=args.iters, reps=args.reps, work=flops, unit="tflops")
    impls = ["triton", "mosaic_prefill"] if args.prefill_impl == "both" else [args.prefill_impl]
    for impl in impls:
        if impl == "mosaic_prefill" and args.interpret:
            print(f"  {case:<16} mosaic_prefill skipped: its interpreter hangs under jit")
            continue
        fns = {mode: attention_fn(inv, impl, mode, {} if impl == "triton" else None,
                                  args.interpret) for mode in ("rotated", "position_free")}
        t = {mode: safe(rows, case, f"ours {impl} {mode}", fn, q, k, v, md, **it)
             for mode, fn in fns.items()}
        if t["rotated"] and t["position_free"]:
            over = 100 * (t["position_free"] / t["rotated"] - 1)
            print(f"  {case:<16} {impl} RoPE-at-read overhead {over:+.1f}%")
            rows.append(dict(case=case, impl=impl, overhead_pct=over))
            if args.ab_reps:
                ab_row(rows, case, f"prefill {impl}", fns["rotated"], fns["position_free"],
                       q, k, v, md, reps=args.ab_reps, iters=args.iters)
        if impl == "mosaic_prefill":
            _mosaic_parts(rows, case, (q, k, v, md), inv, K, D, it)
    if args.sweep == "all":
        for bq, bk, nw, ns in PREFILL_SWEEP:
            for mode in ("rotated", "position_free"):
                opts = dict(block_q=bq, block_k=bk, num_warps=nw, num_stages=ns)
                safe(rows, case, f"ours {mode} bq{bq} bk{bk} w{nw} s{ns}",
                     attention_fn(inv, "triton", mode, opts, args.interpret), q, k, v, md, **it)
    if cached == 0:
        _dense_anchors(rows, case, q.reshape(seqs, new, H, D), K, dtype, it)


def _mosaic_parts(rows, case, inputs, inv, kv_heads, head_dim, it):
    """The Mosaic prefill's gather(+rotate) pre-pass, its preparation and its kernel alone (all
    inside the whole call's time)."""
    import jax
    from kernels_pallas.paged_attention import mosaic_prefill as mp
    q, k, v, md = inputs
    for mode in ("rotated", "position_free"):
        pre = jax.jit(lambda k, v, md, mode=mode: mp.gather_kv(
            k, v, md, inv, rotate_keys=mode == "position_free", attention_scaling=1.0))
        safe(rows, case, f"part: gather(+rotate) {mode} (ms)", pre, k, v, md, **it)
    prep = jax.jit(lambda q, k, v, md: mp.prepare(
        q, k, v, md, inv, rotate_keys=False, attention_scaling=1.0, sm_scale=head_dim ** -0.5))
    safe(rows, case, "part: prepare rotated (ms)", prep, q, k, v, md, **it)
    prepared = jax.block_until_ready(prep(q, k, v, md))
    kern = jax.jit(lambda x: mp.run_kernel(x, kv_heads=kv_heads))
    safe(rows, case, "part: kernel alone (TFLOP/s)", kern, prepared, **it)


def _dense_anchors(rows, case, qd, kv_heads, dtype, it):
    """Dense causal attention on the same queries (no cache): cuDNN and JAX's attention_mgpu."""
    import jax
    import jax.numpy as jnp
    seqs, new, _, head_dim = qd.shape
    kd = jax.random.normal(jax.random.key(1), (seqs, new, kv_heads, head_dim), dtype)
    vd = jax.random.normal(jax.random.key(2), (seqs, new, kv_heads, head_dim), dtype)
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn"))
    safe(rows, case, "cudnn dot_product_attention (dense)", cudnn, qd, kd, vd, **it)
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu as amg
        cfg = amg.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
        mg = jax.jit(lambda q, k, v: amg.attention(q, k, v, cfg))
        f16 = [a.astype(jnp.float16) for a in (qd, kd, vd)]  # its scratch is fp16
        safe(rows, case, "jax attention_mgpu fp16 (dense)", mg, *f16, **it)
    except Exception as e:
        print(f"  {case:<16} attention_mgpu FAILED {type(e).__name__}: {e}"[:300])
