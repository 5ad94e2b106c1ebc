"""XLA ops of a hybrid span step's Gated DeltaNet layer outside the kernels, against a plain step's
(issue 19: on a GPU every small op is a kernel launch, and a span step repeats its index and packing
work in each GDN layer). CPU only: the step is traced at the bench's shapes (qwen3_5_0_8b widths,
T = 1024 rows, S = 16 sequences) with 1 and 2 GDN layers, and the difference is one layer's work.

  jaxpr: equations outside Pallas kernel bodies (tests/jaxpr_walk.py's walk).
  hlo:   ops of the CPU-compiled program with the GDN kernels replaced by opaque host callbacks
         (one custom-call each; what is left is what XLA runs around them): fusions, gathers,
         scatters, loops... as `_replay` of benchmarks/rag_ttft.py counts them.

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.span_step_ops [--hlo] [--form ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernel_stubs import stub_pack
from configs.presets import PRESETS
from minipic_jax.models import qwen3_5, qwen3_5_spans
from minipic_jax.models.testing import SimplePager
from serving.model_contract import RecurrentMetadata
from serving.hybrid.span_step import MAX_CAPTURES, piece_bound

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from jaxpr_walk import outer_eqns  # noqa: E402  (the tests' walk: kernel bodies not entered)

HLO_OPS = ("fusion", "custom-call", "gather", "scatter", "while", "conditional", "copy",
           "dynamic-slice", "dynamic-update-slice", "concatenate", "broadcast", "iota")


def model_cfg(gdn_layers: int):
    base = PRESETS["qwen3_5_0_8b"]
    types = ("linear_attention",) * gdn_layers + ("full_attention",)
    return dataclasses.replace(base, vocab_size=1024, num_layers=len(types), layer_types=types)


def step_inputs(t: int, s: int, capture: bool, rng):
    """Metadata of s sequences filling t rows, with span pieces as the rag bench has them (a few
    spans per sequence, some carried, some captured)."""
    lens = rng.multinomial(t - s, np.ones(s) / s) + 1
    pager = SimplePager(s, int(lens.max()) + 8, 16, seed=0)
    md, logits_idx, total = pager.step(lens.tolist())
    seg, span, base = [], [], 0
    for n in lens:
        cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, 6), replace=False))
        ids = np.searchsorted(cuts, np.arange(n), side="right")
        seg += (ids + base).tolist()
        span += (ids % 2 == 1).tolist()
        base += ids.max() + 1
    g = piece_bound(t, s)
    pieces = qwen3_5_spans.pieces_from_segments(seg, md.num_tokens, g, span,
                                                rng.integers(0, 2, s).astype(bool))
    if capture:
        pieces = dataclasses.replace(pieces, capture=jnp.asarray(
            np.r_[1, 3, 5, 7, -np.ones(MAX_CAPTURES - 4)].astype(np.int32)))
    rec = RecurrentMetadata(state_slots=jnp.arange(s, dtype=jnp.int32),
                            reset=jnp.zeros(s, bool), decode=False)
    return md, logits_idx, pieces, rec


def traced(gdn_layers: int, kind: str, t: int = 1024, s: int = 16, hlo: bool = False):
    cfg = model_cfg(gdn_layers)
    rng = np.random.default_rng(0)
    md, logits_idx, pieces, rec = step_inputs(t, s, kind == "capture", rng)
    params = jax.eval_shape(lambda: qwen3_5.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    cache = jax.eval_shape(lambda: qwen3_5.init_cache(cfg, 16 * 80, 16, s, jnp.bfloat16))
    span = None if kind == "plain" else pieces

    def step(params, tokens, md, cache, rec, logits_idx, span):
        return qwen3_5.forward_with_checkpoints(
            params, tokens, md, cache, cfg, recurrent=rec, logits_indices=logits_idx,
            gdn_impl="pallas_fused_interpret", span_pieces=span)

    args = (params, jnp.zeros(md.num_tokens, jnp.int32), md, cache, rec, logits_idx, span)
    if not hlo:
        jaxpr = jax.make_jaxpr(step)(*args).jaxpr
        return {"jaxpr": sum(1 for _ in outer_eqns(jaxpr))}
    text = jax.jit(step).lower(*args).compile().as_text()
    out = {op: len(re.findall(rf" {op}\(", text)) for op in HLO_OPS}
    out["hlo"] = sum(len(re.findall(r"^\s+\S+ = \S+ [a-z-]+\(", line))
                     for line in _entry_and_called(text))
    return out


def _entry_and_called(text):
    """Instruction lines of the compiled module outside fusion bodies (what runs as ops)."""
    keep, lines = True, []
    for line in text.splitlines():
        if line and not line.startswith(" "):
            keep = not line.startswith("%fused") and "fused_computation" not in line.split("(")[0]
        elif keep:
            lines.append(line)
    return lines


def stub_kernels():
    """The GDN Pallas kernel calls as opaque host callbacks of the same shapes (HLO counting on
    CPU: interpret mode would inline the kernel bodies)."""
    from kernels_pallas.gated_delta import ragged_triton

    def packed(q, k, v, g, beta, restart, seq_of_chunk, state0, bounds, **kw):
        src = kw.get("src")  # the kernels read source rows (stream_rows.py): v is [R, Hv, Dv]
        out = v.shape if src is None else (1, src[0].shape[0]) + v.shape[1:]
        shapes = (jax.ShapeDtypeStruct(out, v.dtype),
                  jax.ShapeDtypeStruct((bounds.shape[0],) + state0.shape[1:], jnp.float32))
        trans = kw.get("transitions")  # the captures' products (a second scan kernel)
        if trans is not None:
            dk = k.shape[-1]
            shapes += (jax.ShapeDtypeStruct((trans[0].shape[0], v.shape[-2], dk, dk),
                                            jnp.float32),)
        if getattr(state0, "write_final", False):  # the state cache, finals written in place
            shapes += (jax.ShapeDtypeStruct(state0.sources[0].shape, state0.sources[0].dtype),)
        host = lambda *a: tuple(np.zeros(x.shape, x.dtype) for x in shapes)  # noqa: E731
        return jax.pure_callback(host, shapes, q, k, v, g, beta, restart, seq_of_chunk, state0,
                                 bounds, kw.get("n_used", jnp.int32(0)), src, trans)
    ragged_triton.packed_gated_delta = packed
    stub_pack()  # the stream's gather too (benchmarks/kernel_stubs.py)


def per_layer(kind: str, t: int = 1024, s: int = 16, hlo: bool = False) -> dict:
    """Counts of one GDN layer (2 GDN layers minus 1) and of the step with 1 GDN layer."""
    one, two = traced(1, kind, t, s, hlo), traced(2, kind, t, s, hlo)
    return {"step_1gdn": one, "per_gdn_layer": {k: two[k] - one[k] for k in one}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hlo", action="store_true", help="also compiled CPU HLO counts")
    ap.add_argument("--form", default="", metavar="NAME=0|1,...",
                    help="program switches the steps are traced under (benchmarks/"
                         "program_forms.py), e.g. TRANSITIONS_IN_STREAM=0")
    args = ap.parse_args(argv)
    if args.hlo:
        stub_kernels()
    from benchmarks.program_forms import program_form
    rows = {}
    with program_form(args.form, flag="--form"):
        for kind in ("plain", "span", "capture"):
            rows[kind] = per_layer(kind, hlo=args.hlo)
    key = "hlo" if args.hlo else "jaxpr"
    for kind, r in rows.items():
        per = r["per_gdn_layer"][key]
        ratio = per / rows["plain"]["per_gdn_layer"][key]
        print(f"{kind:8s} per GDN layer {key} ops {per:5d}  ({ratio:.2f}x plain)  "
              f"step with 1 GDN layer {r['step_1gdn'][key]:5d}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
