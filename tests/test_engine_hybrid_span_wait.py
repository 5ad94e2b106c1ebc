"""A hybrid span request whose spans another request is computing waits in its place and skips
them once they are ready (serving/hybrid/span_cache.py, Waiting); the requests behind it are
admitted meanwhile (serving/scheduler.py, LOOK_PAST_WAITING: before, the whole queue waited
behind it, and a rag step ran part empty). Outputs equal the float64 hybrid span reference."""

from __future__ import annotations

import numpy as np

from minipic_jax.prompts import Prompt
from test_engine_hybrid_spans import _docs, _fresh, _run, _span_stats, llm  # noqa: F401 (fixture)


def test_a_request_waiting_on_spans_in_flight_lets_later_ones_go_first(llm, monkeypatch):  # noqa: F811
    eng = _fresh(llm, span_map_gb=None, span_map_host_gb=0.0)
    cache, admitted = eng.scheduler.cache, []
    admit = cache.admit

    def noted(seq, seats):
        got = admit(seq, seats)
        if got is True:
            admitted.append(seq.seq_id)
        return got
    monkeypatch.setattr(cache, "admit", noted)
    rng = np.random.default_rng(11)
    sys_a, q1, q2, q3 = (Prompt(bytes(rng.integers(97, 123, n).tolist()).decode())
                         for n in (20, 9, 5, 7))
    d1, d2, d3 = _docs(rng, 40, 30, 20)
    err = _run(llm, [[[sys_a, d1, d2, q1], [d2, d1, q2], [d3, q3]]])  # the second waits
    assert err < 1e-5
    first, waiter, later = sorted(admitted)  # ids in submission order
    assert admitted == [first, later, waiter], admitted
    st = _span_stats(eng)
    assert st["span_admission_waits"] > 0 and st["spans_skipped"] == 2, st
