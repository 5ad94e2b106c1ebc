"""XLA ops of a hybrid decode step's Gated DeltaNet layer outside its in-place kernel, per form
(issue 29's reordered request: its decodes are ~400 small kernels a step on a GPU, 15-17 a
layer). CPU only: the decode-only step (8 sequences, one token each, qwen3_5_0_8b widths) is
traced with 1 and 2 GDN layers and the difference is one layer's work, in each form of
qwen3_5_gdn's switches:

  general    DECODE_SEQ_ROWS=0, DECODE_CONV_DIRECT=0: the conv through the step's history index,
             the kernel's inputs gathered at their sequences' rows
  direct     DECODE_CONV_DIRECT=1: the conv read straight from the conv state
  per_seq    DECODE_SEQ_ROWS=1 (the default): the layer per sequence, static slices

  jaxpr: gathers / scatters / transposes / concatenates of the layer's equations (outside
         kernel bodies); hlo: ops of the CPU-compiled program with the decode kernel replaced by
         an opaque host callback (what XLA runs around it; a GPU fuses differently).

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.decode_step_ops [--hlo]
"""

from __future__ import annotations

import argparse
import collections
import json
import re

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.span_step_ops import HLO_OPS, _entry_and_called, model_cfg, outer_eqns

FORMS = {"general": (False, False), "direct": (False, True), "per_seq": (True, True)}
JAXPR_OPS = ("gather", "scatter", "transpose", "concatenate")


def _step(gdn_layers: int, seqs: int = 8):
    from minipic_jax.models import qwen3_5
    from minipic_jax.models.testing import SimplePager
    from serving.model_contract import RecurrentMetadata
    cfg = model_cfg(gdn_layers)
    pager = SimplePager(seqs, 64, 16, seed=0)
    pager.step([9] * seqs)
    md, _, _ = pager.step([1] * seqs)
    rec = RecurrentMetadata(state_slots=jnp.arange(seqs, dtype=jnp.int32),
                            reset=jnp.zeros(seqs, bool), decode=True)
    params = jax.eval_shape(lambda: qwen3_5.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    cache = jax.eval_shape(lambda: qwen3_5.init_cache(cfg, 64, 16, seqs, jnp.bfloat16))

    def step(p, c, impl):
        return qwen3_5.forward(p, jnp.zeros(md.num_tokens, jnp.int32), md, c, cfg,
                               recurrent=rec, gdn_impl=impl)
    return step, params, cache


def jaxpr_ops(gdn_layers: int) -> dict:
    """Counts of JAXPR_OPS in the traced step (the decode kernel interpreted: its body is not
    walked), by primitive name."""
    step, params, cache = _step(gdn_layers)
    jaxpr = jax.make_jaxpr(lambda p, c: step(p, c, "pallas_fused_interpret"))(params, cache)
    out = collections.Counter(e.primitive.name for e in outer_eqns(jaxpr.jaxpr))
    return {op: out.get(op, 0) for op in JAXPR_OPS}


def _stub_decode_kernel():
    """The in-place decode kernel as an opaque host callback of its shapes (HLO counts)."""
    from minipic_jax.models import qwen3_5_gdn

    def fake(q, k, v, a, b, a_log, dt_bias, z, norm, cu, cache, slots, keep, **kw):
        s = cu.shape[0] - 1
        shapes = (jax.ShapeDtypeStruct((s,) + z.shape[1:], z.dtype),
                  jax.ShapeDtypeStruct(cache.shape, cache.dtype))
        return jax.pure_callback(
            lambda *_: tuple(np.zeros(x.shape, x.dtype) for x in shapes), shapes,
            q, k, v, a, b, z, cu, cache, slots, keep)
    qwen3_5_gdn.ragged_decode_layer_in_place = fake


def hlo_ops(gdn_layers: int) -> dict:
    step, params, cache = _step(gdn_layers)
    text = jax.jit(lambda p, c: step(p, c, "pallas_fused")).lower(params, cache).compile() \
        .as_text()
    out = {op: len(re.findall(rf" {op}\(", text)) for op in HLO_OPS}
    out["hlo"] = sum(len(re.findall(r"^\s+\S+ = \S+ [a-z-]+\(", line))
                     for line in _entry_and_called(text))
    return out


def per_layer(form: str, count) -> dict:
    """One GDN layer's counts (2 GDN layers minus 1) in `form` (FORMS)."""
    from minipic_jax.models import qwen3_5_gdn as gdn
    saved = gdn.DECODE_SEQ_ROWS, gdn.DECODE_CONV_DIRECT
    gdn.DECODE_SEQ_ROWS, gdn.DECODE_CONV_DIRECT = FORMS[form]
    try:
        one, two = count(1), count(2)
    finally:
        gdn.DECODE_SEQ_ROWS, gdn.DECODE_CONV_DIRECT = saved
    return {k: two[k] - one[k] for k in one}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hlo", action="store_true", help="also compiled CPU HLO counts")
    args = ap.parse_args(argv)
    rows = {form: {"jaxpr": per_layer(form, jaxpr_ops)} for form in FORMS}
    if args.hlo:
        _stub_decode_kernel()
        for form in FORMS:
            rows[form]["hlo"] = per_layer(form, hlo_ops)
    for form, r in rows.items():
        print(f"{form:8s} per GDN layer: " + "  ".join(
            f"{kind} " + ", ".join(f"{k} {v}" for k, v in c.items() if v) for kind, c in r.items()))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
