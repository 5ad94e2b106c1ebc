"""Span-step forms through the engine against the float64 hybrid span reference
(tests/test_engine_hybrid_spans.py's engine and checks): the captures' products by a scan and a
span step's finals written in place (session 33), the stream gathered by the pack kernel
(session 34; the kernels' paths only: compiled on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from minipic_jax.prompts import Prompt
from test_engine_hybrid_spans import _fresh, _long_doc, _run, _span_stats, llm  # noqa: F401


@pytest.mark.slow  # CI time (~20 s: the step variants recompiled); the forms' own tests are
# tests/test_transition_scan.py and tests/test_span_finals_in_place.py (layer and step)
def test_span_step_forms_of_session_33_match_the_reference(llm):
    """The engine with the captures' products by a scan and a span step's finals written in
    place (qwen3_5_joint.TRANSITIONS_IN_STREAM = False, the default since session 33;
    FINALS_IN_PLACE = True and stream_pack.PACK_KERNEL, since session 34): cold spans captured
    (long ones in pieces, carried final spans), then skipped at other offsets, every token the
    float64 reference's."""
    from benchmarks.program_forms import program_form
    eng = _fresh(llm, span_map_gb=None, span_map_host_gb=0.0)
    rng = np.random.default_rng(43)
    sys_a, q1, q2 = Prompt("system prompt"), Prompt("what is it?"), Prompt("and now?")
    d1, d2, d3 = (_long_doc(rng, n) for n in (149, 20, 35))
    with program_form("TRANSITIONS_IN_STREAM=0,FINALS_IN_PLACE=1,PACK_KERNEL=1", eng.runner):
        err = _run(llm, [[[sys_a, d1, d2, q1], [d3, q2], [q1, d2, d3]],
                         [[d3, d1, q1], [d2, sys_a, d3, q2]]])
    st = _span_stats(eng)
    print(f"max abs logprob error vs the float64 reference: {err:.2e}; {st}")
    assert err < 1e-5 and st["span_maps_captured"] >= 3 and st["spans_skipped"] >= 4, st
