"""The one step loop (LLMEngine.step) after a failed read-back: a launched step stays in flight
until its outputs are read, so recovery waits for it again. If the device finished it (the
fault was on the host), the prefix cache is kept, in the sync loop as in the async one; if the
read fails again (the device step failed), every cached page is dropped."""

from __future__ import annotations

import pytest

from conftest import make_tiny_llm
from minipic_jax import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


class Fault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def llm():
    # one 64-token bucket (min_token_bucket): recovery does not depend on the padded step
    # size; one compile instead of two (CI time)
    return make_tiny_llm(async_scheduling=False, min_token_bucket=64)


def fail_reads(engine, times: int):
    """runner.fetch raises on its next `times` calls; returns the call count and a disarm."""
    real, calls = engine.runner.fetch, [0]

    def fetch(handle):
        calls[0] += 1
        if calls[0] <= times:
            raise Fault(f"read-back {calls[0]}")
        return real(handle)

    engine.runner.fetch = fetch
    return calls, lambda: setattr(engine.runner, "fetch", real)


@pytest.mark.parametrize("times,kept", [(1, True), (99, False)], ids=["host", "device"])
def test_sync_step_read_back_fault(llm, times, kept, fresh_rng):
    eng = llm.llm_engine
    eng.reset_prefix_cache()
    prompt = [int(t) for t in fresh_rng.integers(0, 256, 40)]
    want = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    cached = dict(eng.bm.table)
    assert len(cached) == 2  # the prompt's two full blocks
    calls, disarm = fail_reads(eng, times)
    try:
        with pytest.raises(Fault):
            llm.generate([prompt[:35] + [1, 2, 3]], GREEDY, use_tqdm=False)
    finally:
        disarm()
    assert calls[0] == 2  # the step's read-back, then recovery's
    assert eng.num_in_flight == 0 and not eng.has_unfinished()
    assert eng.bm.num_free == eng.num_blocks
    assert (eng.bm.table == cached) is kept
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want
    assert again.num_cached_tokens == (32 if kept else 0)
