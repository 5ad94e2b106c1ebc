"""`minipic-bench hybrid-spans --steps` (benchmarks/hybrid_span_steps.py): the per-step trace of a
call on tiny_qwen3_5 at tests/test_hybrid_span_request_bench.py's shape (its compiles shared).
A reordered span request shows its steps (a prefill with its composition, the decodes), the
trace waits for nothing unless asked, and detaching leaves the engine as it was."""

from __future__ import annotations

import pytest

from benchmarks import hybrid_span_steps as steps
from tests.test_hybrid_span_request_bench import SHAPE, SIZES, _args


@pytest.fixture(scope="module")
def llm():
    from benchmarks import hybrid_span_request as bench
    engine, _ = bench.make_llm(_args(SHAPE + SIZES), bench.CompileCounter())
    return engine


def _requests(seed: int = 3):
    import numpy as np

    from minipic_jax.prompts import Prompt, Span
    rng = np.random.default_rng(seed)

    def ids(n):
        return rng.integers(10, 200, n).tolist()
    system, spans = Prompt(ids(20)), [Span(ids(40)) for _ in range(3)]
    return [system, *spans, Prompt(ids(12))], [system, *spans[::-1], Prompt(ids(12))]


def _call(llm, trace, request, max_tokens=4):
    from benchmarks import hybrid_span_request as bench
    from minipic_jax import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return bench.timed_generate(llm, request, sp, bench.CompileCounter(), trace)


def test_a_reordered_call_shows_its_composed_prefill_and_decodes(llm, monkeypatch):
    def no_sync(x):
        raise AssertionError("a trace without sync waited for the device")
    monkeypatch.setattr(steps.jax, "block_until_ready", no_sync)
    trace = steps.StepTrace(llm).attach()
    try:
        cold, reordered = _requests()
        _call(llm, trace, cold)
        row = _call(llm, trace, reordered)
    finally:
        trace.detach()
    assert row["cached_tokens"] >= 3 * 32
    rows = row["trace"]["steps"]
    launched = [r for r in rows if r["kind"] != "read-back"]
    kinds = [r["kind"] for r in launched]
    assert kinds.count("decode") == 3 and kinds[-1] == "decode"  # max_tokens 4: 1 + 3 decodes
    composed = [r for r in launched if "+compose(" in r["variant"]]
    assert len(composed) == 1 and composed[0]["kind"] == "prefill"
    # only entering with cached maps (no span starts, no capture): a plain step after them
    assert composed[0]["variant"].startswith("plain") and composed[0]["compose_ms"] > 0
    for r in launched:  # every launched step was read back, after its dispatch
        assert r["ready_ms"] >= r["wait_ms"] >= 0 and r["busy_ms"] >= 0, r
        assert r["tokens"] >= r["rows"] >= 1
    for r in rows:
        assert r["step_ms"] >= r["host_ms"] + r["dispatch_ms"] - 1e-6
    wall = row["wall_ms"]
    inside = sum(r["step_ms"] for r in rows)
    outside = row["trace"]["outside"]
    assert inside + outside["before_ms"] + outside["between_ms"] + outside["after_ms"] \
        == pytest.approx(wall, rel=0.05, abs=1.0)
    by_kind = row["trace"]["by_kind"]
    assert sum(s["n"] for s in by_kind.values()) == len(rows)
    table = "\n".join(steps.table_lines(row["trace"]))
    assert "+compose(" in table and "outside steps" in table
    assert " read " in table.splitlines()[0]  # each row's step() adds up: host + disp + read + post


def test_sync_times_the_composition_and_the_step_on_device(llm):
    trace = steps.StepTrace(llm, sync=True).attach()
    try:
        _, reordered = _requests(seed=4)
        _call(llm, trace, _requests(seed=4)[0])
        row = _call(llm, trace, reordered, max_tokens=2)
    finally:
        trace.detach()
    launched = [r for r in row["trace"]["steps"] if r["kind"] != "read-back"]
    assert all(r["step_dev_ms"] > 0 for r in launched)
    composed = [r for r in launched if "compose_rows" in r]
    assert len(composed) == 1 and composed[0]["compose_dev_ms"] > 0
    assert "cmp_dev" in steps.table_lines(row["trace"], sync=True)[0]


def test_detach_puts_every_method_back(llm):
    eng = llm.llm_engine
    before = {name: dict(vars(obj)) for name, obj in (
        ("engine", eng), ("runner", eng.runner), ("cache", eng.cache),
        ("zeroer", eng.runner.zeroer), ("composer", eng.runner.composer))}
    import gc
    callbacks = list(gc.callbacks)
    steps.StepTrace(llm).attach().detach()
    after = {name: dict(vars(obj)) for name, obj in (
        ("engine", eng), ("runner", eng.runner), ("cache", eng.cache),
        ("zeroer", eng.runner.zeroer), ("composer", eng.runner.composer))}
    assert after.keys() == before.keys()
    for name in before:
        assert set(after[name]) == set(before[name]), name
        assert all(after[name][k] is before[name][k] for k in before[name]), name
    assert gc.callbacks == callbacks


def test_busy_is_the_ready_less_the_later_of_dispatch_and_the_previous_ready():
    rows = [{"_first": 0.0, "_ready": 0.010}, {"kind": "read-back"},
            {"_first": 0.004, "_ready": 0.016}, {"_first": 0.020, "_ready": 0.023}]
    steps.busy_ms(rows)
    assert rows[0]["busy_ms"] == pytest.approx(10.0)
    assert "busy_ms" not in rows[1]
    assert rows[2]["busy_ms"] == pytest.approx(6.0)  # waited for the first step's device time
    assert rows[3]["busy_ms"] == pytest.approx(3.0)  # the device was idle when it came
