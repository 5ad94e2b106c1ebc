"""Bisect a Qwen3.5 fixture's logit error against HF between the model's XLA glue and the gated
delta kernels (the compiled `test_pallas_gdn_path_matches_hf` failure on the H200).

1. Logits vs the HF fixture for each GDN kernel ("xla", the Pallas kernels) with the model's
   float32 policy (IEEE float32 dots) and without it (default precision: TF32 dots on a GPU).
2. Each GDN layer's kernel on its real inputs (an eager forward at "highest" on the XLA path
   records them): Pallas vs XLA vs a float64 token recurrence, per stage (intra-chunk W / U / KD,
   final and checkpoint states from the scan, outputs), plus the inputs' ranges.

Usage (repository root): python3 scripts/gdn_model_bisect.py [--fixture qwen3_5_gva2]
On CPU the Pallas kernels run in interpret mode.
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.gated_delta import api, chunked, fused_triton, ragged, reference
from minipic_jax.loading import load_model
from minipic_jax.models import qwen3_5, qwen3_5_gdn, testing

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures"
INTERPRET = jax.default_backend() != "gpu"
PALLAS = "pallas_fused_interpret" if INTERPRET else "pallas_fused"


def _fixture(name):
    lm = load_model(str(FIXTURES / name))
    ref = np.load(FIXTURES / name / "reference.npz")
    n = sum(1 for k in ref.files if k.startswith("prompt_"))
    full = [np.concatenate([ref[f"prompt_{i}"], ref[f"greedy_{i}"][:-1]]) for i in range(n)]
    return lm, full, [ref[f"logits_{i}"] for i in range(n)]


def _inputs(lm, full):
    """The test's one ragged call: (params, tokens, metadata, cache, checkpoint_at, total)."""
    pager = testing.SimplePager(len(full), max(map(len, full)), 16)
    cache = lm.family.init_cache(lm.cfg, pager.num_pages, 16, len(full), jnp.float32)
    md, _, total = pager.step([len(t) for t in full])
    tokens = np.zeros(md.num_tokens, np.int32)
    tokens[:total] = np.concatenate(full)
    ck = jnp.asarray([[-1], [64], [64]][:len(full)], jnp.int32)
    return jnp.asarray(tokens), md, cache, ck, total


def logits_table(lm, full, want):
    """Logits vs HF for each GDN kernel, with the model's float32 policy (IEEE float32 dots,
    minipic_jax.models.layers.exact_float32) and without it (the default precision: TF32 dots
    on a GPU, exact on CPU)."""
    bounds = np.cumsum([0] + [len(f) for f in full])
    forwards = (("float32", qwen3_5.forward_with_checkpoints),
                ("default", qwen3_5.forward_with_checkpoints.__wrapped__))
    for prec, forward in forwards:
        fwd = jax.jit(forward, static_argnames=("cfg", "gdn_impl"))
        for impl in ("xla", PALLAS):
            tokens, md, cache, ck, total = _inputs(lm, full)
            logits = np.asarray(fwd(lm.params, tokens, md, cache, cfg=lm.cfg, checkpoint_at=ck,
                                    gdn_impl=impl)[0])[:total]
            errs = [np.abs(logits[bounds[i]:bounds[i + 1]] - w).max() for i, w in enumerate(want)]
            print(f"logits vs HF  dots={prec:8s} gdn={impl:22s} max abs per prompt: "
                  + " ".join(f"{e:.3e}" for e in errs), flush=True)


def _intra_stages(q, k, v, g, beta, cu, pos0, chunk=64):
    """max |Pallas - XLA| of the intra-chunk W, U, KD on the ragged packing of these inputs."""
    n_tokens, hk, _ = k.shape
    hv = v.shape[1]
    pk = ragged.packing(cu, pos0, n_tokens, chunk=chunk)
    pack = lambda x: ragged.take_rows(x, pk["src"])[None]  # noqa: E731
    w, u, kd, _ = fused_triton.intra(pack(k), pack(v), pack(g), pack(beta), chunk=chunk,
                                     dot_dtype=jnp.float32, interpret=INTERPRET,
                                     num_warps=fused_triton.DEFAULTS["intra_warps"])
    rep = lambda x: jnp.repeat(x, hv // hk, axis=1)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        parts = chunked.intra_chunk(*(chunked.to_chunks(pack(x), chunk)
                                      for x in (rep(q), rep(k), v, g, beta)),
                                    scale=k.shape[-1] ** -0.5)
    return {name: float(jnp.abs(chunked.to_chunks(mine, chunk) - parts[name]).max())
            for name, mine in (("w", w), ("u", u), ("kd", kd))}


def _oracle(q, k, v, g, beta, cu, state0):
    """float64 token recurrence per sequence: (out [T, Hv, Dv], finals [S, Hv, Dk, Dv])."""
    out = np.zeros(v.shape, np.float64)
    finals = np.array(state0, np.float64)
    for s in range(len(cu) - 1):
        a, e = int(cu[s]), int(cu[s + 1])
        if a == e:
            continue
        ro, rs = reference.gated_delta_reference(*(np.asarray(x)[None, a:e]
                                                   for x in (q, k, v, g, beta)), state0[s:s + 1])
        out[a:e], finals[s] = ro[0], rs[0, -1]
    return out, finals


def layer_table(lm, full):
    """Eager forward on the XLA path at "highest"; each GDN layer's kernel call is re-run."""
    original = qwen3_5_gdn.ragged_gated_delta
    rows = []
    pallas = jax.jit(lambda *a: api.ragged_gated_delta(
        *a[:-1], checkpoint_at=a[-1], implementation="pallas_fused", interpret=INTERPRET,
        decode=False))

    def recorder(q, k, v, g, beta, cu, pos0, state0, *, checkpoint_at=None, **kw):
        args = (q, k, v, g, beta, cu, pos0, state0)
        mine = pallas(*args, checkpoint_at)
        xla = original(*args, checkpoint_at=checkpoint_at, **kw)
        total = int(cu[-1])
        o_ref, f_ref = _oracle(q, k, v, g, beta, np.asarray(cu), np.asarray(state0))
        d = lambda a, b: float(np.abs(np.asarray(a, np.float64) - b).max())  # noqa: E731
        row = dict(layer=len(rows), out_px=d(mine[0][:total], np.asarray(xla[0][:total])),
                   fin_px=d(mine[1], np.asarray(xla[1])),
                   ck_px=d(mine[2], np.asarray(xla[2])) if xla[2] is not None else 0.0,
                   out_xr=d(xla[0][:total], o_ref[:total]), out_pr=d(mine[0][:total],
                                                                     o_ref[:total]),
                   fin_xr=d(xla[1], f_ref), fin_pr=d(mine[1], f_ref),
                   pad_out=float(jnp.abs(mine[0][total:]).max()) if total < q.shape[0] else 0.0)
        row.update({f"{n}_px": e for n, e in _intra_stages(q, k, v, g, beta, cu, pos0).items()})
        row.update(vmax=float(jnp.abs(v).max()), gmin=float(jnp.min(g[:total])),
                   bmin=float(jnp.min(beta[:total])), bmax=float(jnp.max(beta[:total])),
                   s0max=float(jnp.abs(state0).max()))
        rows.append(row)
        return xla

    qwen3_5_gdn.ragged_gated_delta = recorder
    try:
        tokens, md, cache, ck, _ = _inputs(lm, full)
        with jax.default_matmul_precision("highest"):
            qwen3_5.forward_with_checkpoints(lm.params, tokens, md, cache, lm.cfg,
                                             checkpoint_at=ck, gdn_impl="xla")
    finally:
        qwen3_5_gdn.ragged_gated_delta = original
    keys = list(rows[0])
    print("per GDN layer (px = |pallas - xla|, xr / pr = |xla / pallas - float64 recurrence|; "
          "w/u/kd: intra kernel):")
    print(" ".join(f"{k:>8s}" for k in keys))
    for r in rows:
        print(" ".join(f"{r[k]:8d}" if k == "layer" else f"{r[k]:8.1e}" for k in keys),
              flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fixture", default="qwen3_5_gva2")
    args = parser.parse_args()
    lm, full, want = _fixture(args.fixture)
    print(f"backend {jax.default_backend()}, pallas {PALLAS}, prompt lengths "
          f"{[len(f) for f in full]}, HF logit |max| {max(np.abs(w).max() for w in want):.2f}")
    logits_table(lm, full, want)
    layer_table(lm, full)


if __name__ == "__main__":
    main()
