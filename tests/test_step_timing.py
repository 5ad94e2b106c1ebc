"""Where a step's host time goes (get_stats: step_time_s, host_time_share, host_ms_per_step).

The clock is the real one plus fixed amounts the step's parts add (schedule 10 s, launch 30 s,
advancing frontiers 100 s, each read-back 1000 s), so every field's share is known up to the real
time (well under a second per step): scheduling is charged to `schedule` but a read-back forced
before a preemption inside it is not (its wait is device_wait, the rest post), read-backs are
device_wait, frontiers are overlap, the launch is build + dispatch, and the fields add up to
step_time. Both loops: sync and async (a pool so small that preemptions force read-backs).
"""

from __future__ import annotations

import dataclasses
import sys
import time
import weakref

import pytest

from conftest import make_tiny_llm
from minipic_jax import SamplingParams
from serving.step_timer import StepTimer

# no prefix cache: the timed run repeats the first one exactly (no new shape compiles in it);
# one 32-token bucket (min_token_bucket = max_num_batched_tokens): the fields' meaning does not
# depend on the step's padded size, and one compile replaces three (CI time)
TINY_POOL = dict(num_kv_blocks=14, max_num_seqs=3, max_num_batched_tokens=32,
                 min_token_bucket=32, enable_prefix_caching=False)
COST = {"schedule": 10.0, "launch": 30.0, "advance": 100.0, "fetch": 1000.0}
FIELDS = ("schedule", "build", "dispatch", "post", "overlap", "device_wait")
STATS_KEYS = {
    "steps", "finished_requests", "prompt_tokens", "cached_prompt_tokens",
    "prefix_cache_hit_rate", "computed_query_tokens", "generated_tokens", "blocks_total",
    "blocks_used", "blocks_evicted", "blocks_offloaded", "blocks_restored", "host_blocks",
    "preemptions", "step_time_s", "host_time_share", "host_work_share", "host_ms_per_step",
    "num_compiles", "async_scheduling", "sync_fallbacks", "discarded_rows"}


def test_step_timer_charges_the_innermost_phase():
    now = [0.0]
    timer = StepTimer(clock=lambda: now[0])
    timer.start()
    now[0] += 1  # base phase: post
    with timer.phase("schedule"):
        now[0] += 2
        with timer.phase("device_wait"):
            now[0] += 4
        now[0] += 8
    timer.move(0.5, "schedule", "dispatch")
    got = timer.stop()
    assert got == {"schedule": 9.5, "build": 0.0, "dispatch": 0.5, "device_wait": 4.0,
                   "overlap": 0.0, "post": 1.0}
    assert sum(got.values()) == 15
    with pytest.raises(ValueError, match="unknown phase 'scheduling'"):
        with timer.phase("scheduling"):
            pass


def test_a_step_timer_phase_is_a_reused_object():
    """The engine opens 4-5 phases per step on the host's critical path: a phase is an object
    made once and reused, its entry and exit plain method calls (0.65 us on the CPU VM), not a
    generator context manager (a generator and a manager object per use, 1.6 us)."""
    timer = StepTimer()
    timer.start()
    calls = []

    def count(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(count)
    try:
        with timer.phase("build"):
            pass
    finally:
        sys.setprofile(None)
    assert calls == ["phase", "__enter__", "enter", "_charge", "__exit__", "leave", "_charge"], calls
    assert timer.phase("build") is timer.phase("build")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_step_read_back_is_freed_after_the_timer_stops(async_scheduling):
    """A step's rows and output arrays, once read back, are freed when step() returns, after its
    timer stopped (as before the one-loop redesign, 8e11161): the async decode loop is
    device-bound, so its timed wall is the device step minus the host work left outside the
    timer, and freeing them inside had moved it into the decode step wall (issue 27)."""
    from benchmarks.engine_host import StubStep
    eng = make_tiny_llm(async_scheduling=async_scheduling).llm_engine
    stub, outputs, reads, at_stop = StubStep(eng.vocab_size), [], [0], []

    def step(*args, **kwargs):  # the stubbed jitted step, its packed outputs watched
        result = stub(*args, **kwargs)
        outputs.append(weakref.ref(result[1]))
        return result

    def alive():
        return sum(o() is not None for o in outputs)

    real_fetch, real_start, real_stop = eng.runner.fetch, eng._timer.start, eng._timer.stop
    eng.runner._step = step
    eng.runner.fetch = lambda handle: (reads.__setitem__(0, reads[0] + 1), real_fetch(handle))[1]
    eng._timer.start = lambda: (reads.__setitem__(0, 0), real_start())[1]
    eng._timer.stop = lambda: (at_stop.append((alive(), reads[0])), real_stop())[1]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for i in range(3):
        eng.add_request(str(i), [(5 * i + j) % 250 + 1 for j in range(20 + 7 * i)], sp)
    while eng.has_unfinished():
        eng.step()
        assert alive() == eng.num_in_flight  # step() returned: what it read back is gone
    assert sum(r for _, r in at_stop) == len(outputs) > 5
    in_flight_at_stop = [n - r for n, r in at_stop]  # the steps read back are all still held
    assert in_flight_at_stop == [int(async_scheduling)] * (len(at_stop) - 1) + [0], at_stop


def charge(obj, attr, seconds, extra, counts):
    real = getattr(obj, attr)

    def costly(*args, **kwargs):
        extra[0] += seconds
        counts[attr] = counts.get(attr, 0) + 1
        return real(*args, **kwargs)

    setattr(obj, attr, costly)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_host_time_fields_keep_their_meaning(async_scheduling, monkeypatch):
    llm = make_tiny_llm(async_scheduling=async_scheduling, **TINY_POOL)
    eng = llm.llm_engine
    prompts = [[(7 * i + j) % 250 + 1 for j in range(20 + 9 * i)] for i in range(6)]
    sps = [SamplingParams(temperature=0.0, max_tokens=24 + 3 * i, ignore_eos=True)
           for i in range(6)]
    llm.generate(prompts, sps, use_tqdm=False)  # compiles every shape the timed run takes
    before = dataclasses.asdict(eng.stats)
    fallbacks, preemptions = eng.num_sync_fallbacks, eng.scheduler.num_preemptions
    extra, counts, real_clock = [0.0], {}, time.perf_counter

    def fake():
        return real_clock() + extra[0]

    monkeypatch.setattr(time, "perf_counter", fake)  # the runner's dispatch time
    eng._timer.clock = fake
    charge(eng.scheduler, "schedule", COST["schedule"], extra, counts)
    charge(eng.runner, "launch", COST["launch"], extra, counts)
    charge(eng, "_advance", COST["advance"], extra, counts)
    charge(eng.runner, "fetch", COST["fetch"], extra, counts)
    real_step, reads_only = eng.step, [0]

    def step():  # counts the steps that only read back the step in flight
        steps, wall = eng.stats.steps, eng.stats.step_time
        out = real_step()
        reads_only[0] += eng.stats.steps == steps and eng.stats.step_time != wall
        return out

    eng.step = step
    llm.generate(prompts, sps, use_tqdm=False)
    monkeypatch.undo()
    st = {k: v - before[k] for k, v in dataclasses.asdict(eng.stats).items()}
    n, r = st["steps"], reads_only[0]
    stats = eng.get_stats()
    assert set(stats) == STATS_KEYS and set(stats["host_ms_per_step"]) == {
        "schedule", "build", "dispatch", "post", "overlap"}
    assert counts["launch"] == counts["fetch"] == counts["_advance"] == n > 0
    assert (stats["sync_fallbacks"] > fallbacks) == async_scheduling
    assert stats["preemptions"] > preemptions
    assert r == 0 or async_scheduling
    st["launch"] = st["build"] + st["dispatch"]  # dispatch: the real time inside the launch
    slack = (n + r) * 1.0  # real host time: well under a second per step
    want = {"schedule": COST["schedule"] * n, "launch": COST["launch"] * n,
            "overlap": COST["advance"] * n, "device_wait": COST["fetch"] * n,
            "post": COST["schedule"] * r}  # a read-back-only step's time is post and wait
    for field, value in want.items():
        assert value - slack < st[field] < value + slack, (field, st[field], value)
    assert abs(sum(st[f] for f in FIELDS) - st["step_time"]) < 1e-6 * st["step_time"]
