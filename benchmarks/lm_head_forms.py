"""The LM head of a small-batch step, alone: logits [N, V] of N rows against the tied [V, E]
embedding in the forms XLA might compile differently (issue 29's steps, Qwen3.5-0.8B: V 248,320,
E 1,024, bf16; the table is 508 MB, ~0.17 ms to read at 3 TB/s).

Why: on an H100 a 1,024-token hybrid prefill step of 16 sequences ran its LM head as one cuBLAS
kernel (`nvjet_sm90_tss_144x128_64x6_1x2_h_bz_TNN`) of 0.71 ms, 8% of the step, where the
decode step's 8 rows took a Triton GEMM fusion of 0.17 ms (benchmarks/runs/
span_step_conv_shifted_2026-12-06_h100_s28c.txt, fixed_step_decode_inplace_..._s26a.txt).

Forms (each a jitted function of (x, table)): `tied` today's layers.tied_logits (contract E of
the table as stored); `transposed` the same against a pre-transposed [E, V] copy; `chunks4` the
vocabulary in 4 slices, concatenated; `rows32` / `rows64` / `rows128` the rows padded to that;
`in_step` the step's own path (qwen3_5.forward's lm_head scope): the N rows gathered from a
[--step-rows, E] hidden state by index, the final RMS norm, then `tied` (in a 1,024-token step
the 16-row head was the 0.71 ms cuBLAS kernel, alone `tied` a 0.17 ms Triton fusion: s30);
`in_step_barrier` the same with the normed rows passed through an optimization barrier (both
differ from `tied` by the norm).
Prints per N the median ms, the effective TB/s of the table read and (on a GPU) the kernels per
call, their busy time and the costliest kernel.

    python -m benchmarks.lm_head_forms [--rows 1 8 16 64] [--reps 30]
"""

from __future__ import annotations

import argparse

import numpy as np


def forms(v_chunks: int = 4, pad_rows: int = 64, step_rows: int = 1024) -> dict:
    import jax
    import jax.numpy as jnp

    from minipic_jax.models import layers
    f32 = jnp.float32

    def tied(x, table_ve, table_ev):
        return jnp.einsum("ne,ve->nv", x, table_ve, preferred_element_type=f32)

    def transposed(x, table_ve, table_ev):
        return jnp.einsum("ne,ev->nv", x, table_ev, preferred_element_type=f32)

    def chunks(x, table_ve, table_ev):
        parts = jnp.array_split(table_ve, v_chunks, axis=0)
        return jnp.concatenate([jnp.einsum("ne,ve->nv", x, p, preferred_element_type=f32)
                                for p in parts], axis=1)

    def padded(to):
        def rows_padded(x, table_ve, table_ev):
            n = x.shape[0]
            xp = jnp.pad(x, ((0, max(to - n, 0)), (0, 0)))
            return jnp.einsum("ne,ve->nv", xp, table_ve, preferred_element_type=f32)[:n]
        return rows_padded
    def in_step(barrier):
        def gathered(x, table_ve, table_ev):  # x's rows spread over a step's hidden state
            n = x.shape[0]
            idx = (jnp.arange(n, dtype=jnp.int32) * (step_rows // n)) + step_rows // n - 1
            h = jnp.zeros((step_rows, x.shape[1]), x.dtype).at[idx].set(x)
            hn = layers.rms_norm(h[idx], jnp.ones(x.shape[1], x.dtype), 1e-6, unit_offset=True)
            if barrier:
                hn = jax.lax.optimization_barrier(hn)
            return jnp.einsum("ne,ve->nv", hn, table_ve, preferred_element_type=f32)
        return gathered
    return {"tied": tied, "transposed": transposed, f"chunks{v_chunks}": chunks,
            "rows32": padded(32), f"rows{pad_rows}": padded(pad_rows), "rows128": padded(128),
            "in_step": in_step(False), "in_step_barrier": in_step(True)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64])
    ap.add_argument("--forms", nargs="+", default=None, help="a subset of the forms")
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--embed", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--step-rows", type=int, default=1024, help="the in_step forms' hidden rows")
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import blocked_ms, profile_kernels
    rng = np.random.default_rng(0)
    table_ve = jnp.asarray(rng.standard_normal((a.vocab, a.embed)) * 0.02, jnp.bfloat16)
    table_ev = jnp.asarray(table_ve.T)  # a copy in [E, V] order
    gpu = jax.default_backend() == "gpu"
    mb = table_ve.size * 2 / 1e6
    print(f"lm head forms: V {a.vocab}, E {a.embed}, bf16 table {mb:.0f} MB, "
          f"{jax.devices()[0].device_kind}")
    for n in a.rows:
        x = jnp.asarray(rng.standard_normal((n, a.embed)), jnp.bfloat16)
        ref = None
        for name, fn in forms(step_rows=a.step_rows).items():
            if a.forms and name not in a.forms and name != "tied":
                continue
            f = jax.jit(fn)
            call = lambda: f(x, table_ve, table_ev)  # noqa: E731
            out = np.asarray(call())
            ref = out if ref is None else ref
            diff = float(np.max(np.abs(out - ref)))
            ms = blocked_ms(call, a.reps)["ms"]
            top = ""
            if gpu:
                prof = profile_kernels(call, top=1)
                top = (f" | {prof['kernels_per_step']:.0f} kernels, busy "
                       f"{prof['kernel_busy_ms_per_step']:.3f} ms, top "
                       f"{prof['top'][0]['name'][:40]} {prof['top'][0]['ms_per_step']:.3f}"
                       if prof["top"] else "")
            print(f"rows {n:3d} {name:10s} {ms:7.3f} ms  {mb / 1e3 / ms:5.2f} TB/s  "
                  f"max |diff| vs tied {diff:.2e}{top}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
