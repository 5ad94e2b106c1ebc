"""One GDN layer's decode step at a model's shapes, median ms over reps (each waited for, one
process), with the largest state difference:
  state: the XLA form (gather the step's states out of the cache, the one-step recurrence,
         scatter them back) against the in-place kernel (decode_triton.decode_in_place);
  layer: the XLA layer core (conv state gather, causal conv, l2 norms, gates, the step, the gated
         RMS norm, both scatters: qwen3_5_gdn's functions) against the kernel with the glue and
         the conv (decode_conv_layer_in_place).

    PYTHONPATH=. python -m benchmarks.gdn_decode_bench [--rows 8] [--slots 65] [--reps 200]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import blocked_ms
from kernels_pallas.gated_delta.chunked import recurrent_step
from kernels_pallas.gated_delta.decode_triton import decode_conv_layer_in_place, decode_in_place


def xla_form(q, k, v, g, beta, state, slots, keep, has):
    s0 = jnp.where(keep[:, None, None, None], state[slots], 0.0)
    out, new = recurrent_step(q, k, v, g, beta, s0, scale=q.shape[-1] ** -0.5)
    new = jnp.where(has[:, None, None, None], new, s0)
    return jnp.where(has[:, None, None], out, 0.0), state.at[slots].set(new)


def xla_layer(x, conv_w, conv_cache, a, b, a_log, dt_bias, z, norm, state, slots, keep, has,
              eps=1e-6):
    """The XLA decode layer core the conv kernel replaces (one token per row)."""
    from minipic_jax.models.qwen3_5_gdn import conv_silu, gated_rms_norm, l2norm
    rows, dtype = x.shape[0], z.dtype
    _, hv, dk, dv = state.shape
    hk = (x.shape[1] - hv * dv) // (2 * dk)
    past = jnp.where(keep[:, None, None], conv_cache[slots], 0).astype(dtype)
    window = jnp.concatenate([past, x[:, :, None]], axis=-1)
    qkv = conv_silu(window, conv_w).astype(dtype)
    q = l2norm(qkv[:, :hk * dk].reshape(rows, hk, dk))
    k = l2norm(qkv[:, hk * dk:2 * hk * dk].reshape(rows, hk, dk))
    v = qkv[:, 2 * hk * dk:].reshape(rows, hv, dv)
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    out, new = xla_form(q, k, v, g, jax.nn.sigmoid(b), state, slots, keep, has)
    conv = jnp.where(has[:, None, None], window[:, :, 1:], past)
    return (gated_rms_norm(out.astype(dtype), z, norm, eps), conv_cache.at[slots].set(conv), new)


def time_form(fn, args, reps, donate):
    """Median ms of fn over reps (timing.blocked_ms: each call waited for, after two warm
    ones), the caches `donate` (argument indices) fed back each call; returns (ms, the last
    outputs)."""
    f = jax.jit(fn, donate_argnums=donate)
    args, last = list(args), []

    def call():
        outs = f(*args)
        for j, arg in enumerate(donate):
            args[arg] = outs[1 + j]
        last[:] = [outs]
        return outs
    return blocked_ms(call, reps)["ms"], last[0]


def rel_diff(x, ref) -> float:
    return float(jnp.max(jnp.abs(x - ref)) / (jnp.max(jnp.abs(ref)) + 1e-30))


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
    base = jnp.asarray(rng.standard_normal((a.slots, h, d, d)), jnp.float32)
    ms_x, (_, st_x) = time_form(xla_form, (q, k, v, g, beta, base.copy(), slots, keep, has),
                                a.reps, (5,))
    print(f"gdn decode rows={n} slots={a.slots} heads={h} dim={d}: state xla {ms_x:.4f} ms",
          flush=True)
    for bv in a.block_v:  # each form runs reps + 2 steps from the same state
        fn = functools.partial(decode_in_place, block_v=bv)
        ms_k, (_, st_k) = time_form(fn, (q, k, v, g, beta, base.copy(), slots, keep, has),
                                    a.reps, (5,))
        print(f"  in place block_v={bv}: {ms_k:.4f} ms = {ms_k / ms_x:.3f}x xla; "
              f"state rel. max diff {rel_diff(st_k, st_x):.2e}", flush=True)
    c = 3 * h * d
    x = jnp.asarray(rng.standard_normal((n, c)), jnp.bfloat16)
    conv_w = jnp.asarray(rng.standard_normal((c, 4)) * 0.5, jnp.bfloat16)
    conv0 = jnp.asarray(rng.standard_normal((a.slots, c, 3)), jnp.bfloat16)
    ab = jnp.asarray(rng.standard_normal((2, n, h)), jnp.bfloat16)
    glue = (jnp.asarray(rng.standard_normal(h) * 0.5, jnp.bfloat16),
            jnp.asarray(rng.standard_normal(h) * 0.5, jnp.bfloat16),
            jnp.asarray(rng.standard_normal((n, h, d)), jnp.bfloat16),
            jnp.ones(d, jnp.bfloat16))
    def layer_args():  # fresh caches: each form donates its own
        return (x, conv_w, conv0.copy(), ab[0], ab[1], *glue, base.copy(), slots, keep, has)
    ms_lx, (_, _, st_lx) = time_form(xla_layer, layer_args(), a.reps, (2, 9))
    fn = functools.partial(decode_conv_layer_in_place, eps=1e-6)
    ms_lk, (_, _, st_lk) = time_form(fn, layer_args(), a.reps, (2, 9))
    print(f"  layer: xla {ms_lx:.4f} ms, conv kernel {ms_lk:.4f} ms = {ms_lk / ms_lx:.3f}x; "
          f"state rel. max diff {rel_diff(st_lk, st_lx):.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
