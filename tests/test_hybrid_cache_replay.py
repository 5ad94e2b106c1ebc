"""The hybrid-cache bench's host replay (`--stub-device`: the jitted step replaced by a stub; token
counts depend only on the scheduler and the checkpoint store): at the same checkpoint budget,
dp recomputes fewer prompt tokens than every fixed rule on a system-prompt workload."""

import argparse
import json

import pytest

from benchmarks import hybrid_cache_bench


def _replay(tmp_path, workload, budgets, scale, strategies, more=()):
    p = argparse.ArgumentParser()
    hybrid_cache_bench.add_parser(p)
    out = tmp_path / "replay.json"
    args = p.parse_args(["--model", "tiny_qwen3_5", "--dtype", "float32", "--stub-device",
                         "--num-kv-blocks", "20000", "--max-num-seqs", "4", "--scale", str(scale),
                         "--workloads", workload, "--budgets", *map(str, budgets),
                         "--strategies", *strategies, "--json", str(out), *more])
    hybrid_cache_bench.run(args)
    rows = json.loads(out.read_text())["results"]
    return {(r["budget"], r["strategy"]): r["tokens_recomputed"] for r in rows}


@pytest.mark.parametrize("flag", ["off", "on"])
def test_free_room_flag_reaches_the_engine_and_the_json(tmp_path, monkeypatch, flag):
    """--free-room sets Config.hybrid_cache.free_room of the bench's engine (on by default, as the
    engine's own default; off: comparable with RESULTS' hybrid-cache runs 4-5), kept through the
    per-strategy resets, and the JSON records it."""
    engines, make = [], hybrid_cache_bench._engine
    monkeypatch.setattr(hybrid_cache_bench, "_engine",
                        lambda *a: engines.append(make(*a)) or engines[-1])
    more = ["--max-tokens", "2"] + (["--free-room", flag] if flag == "off" else [])
    _replay(tmp_path, "sysprompt", [8], 0.01, ["last", "dp"], more)
    engine = engines[0].llm_engine
    assert engine.config.hybrid_cache.free_room is (flag == "on")
    assert engine.hybrid_cache.free_room is (flag == "on")  # the store of the last reset
    assert json.loads((tmp_path / "replay.json").read_text())["free_room"] is (flag == "on")


def test_dp_recomputes_least_on_system_prompts(tmp_path):
    got = _replay(tmp_path, "sysprompt", [8], 0.2, ["last", "balanced", "dp"])
    assert got[8, "dp"] < min(got[8, "last"], got[8, "balanced"]), got


@pytest.mark.slow
@pytest.mark.parametrize("workload", hybrid_cache_bench.WORKLOADS)
def test_dp_recomputes_least_on_every_workload_and_budget(tmp_path, workload):
    strategies = list(hybrid_cache_bench.STRATEGIES)
    got = _replay(tmp_path, workload, [8, 32], 0.5, strategies)
    for b in (8, 32):
        others = min(got[b, s] for s in strategies if s not in ("dp", "none"))
        assert got[b, "dp"] < others, (b, got)


def _stub_llm(**kw):
    """tiny_qwen3_5 with the jitted step stubbed (host only, nothing compiles)."""
    from benchmarks.engine_host import StubStep
    from minipic_jax import LLM
    llm = LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=4,
              max_num_batched_tokens=256, min_token_bucket=64, max_model_len=1280,
              num_kv_blocks=400, checkpoint_gb=16 * 16896 / 2**30, **kw)
    llm.llm_engine.runner._step = StubStep(llm.llm_engine.vocab_size)
    return llm


def test_a_request_waits_for_the_checkpoint_its_prefix_is_computing():
    """Three requests with one 908-token system prompt, sent together. The first plans
    checkpoints at 448 and 832. The second is admitted while the first is at 768 and waits a
    step for the checkpoint at 832 rather than recompute from 448 (the 384 tokens saved exceed
    Config.hybrid_cache.step_tokens = 256; at 0 it never waits). The third is admitted in the step
    in which the second takes its checkpoint at 896: that state is not written before the step
    runs, so it resumes at 832 (it used to restore the unwritten slot). Free room off: the wait
    is the DP placement's path; with it (the default) the first's chunk ending at 768 stores a
    free checkpoint there, which the second resumes from without waiting."""
    import numpy as np

    from minipic_jax import SamplingParams
    rng = np.random.default_rng(909)
    system = rng.integers(0, 256, 908).tolist()
    prompts = [system + rng.integers(0, 256, int(n)).tolist() for n in (9, 30, 17)]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    cached = {}
    for wait in (0.0, 256.0):
        llm = _stub_llm(checkpoint_step_tokens=wait, checkpoint_free_room=False)
        cached[wait] = [o.num_cached_tokens for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert llm.llm_engine.hybrid_cache.planner.strategy == "dp"
    assert cached[256.0] == [0, 832, 832] and cached[0.0] == [0, 448, 832], cached
    free = _stub_llm(checkpoint_step_tokens=256.0).generate(prompts, sp, use_tqdm=False)
    assert [o.num_cached_tokens for o in free] == [0, 768, 832]


def test_bucket_fit_cuts_chunks_at_buckets():
    """Config.hybrid_cache.bucket_fit (serving/hybrid/bucket_fit.py): the same requests run in fewer
    padded step tokens, and no step's tokens overflow a bucket by 1..spill (60) tokens."""
    import numpy as np

    from benchmarks.hybrid_cache_steps import StepLog
    from minipic_jax import SamplingParams
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in (150, 170, 300, 90, 140)]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    padded, sizes = {}, {}
    for fit in (False, True):
        llm = _stub_llm(checkpoint_bucket_fit=fit)
        log, seen = StepLog(llm.llm_engine.runner), []
        inner = log.inner
        log.inner = lambda batch, **kw: seen.append(sum(e.token_idx.size for e in batch)) or \
            inner(batch, **kw)
        llm.generate(prompts, sp, use_tqdm=False)
        padded[fit], sizes[fit] = log.padded, seen
    assert padded[True] < padded[False], padded
    over = lambda n: any(b < n <= b + 60 for b in (64, 128))  # noqa: E731
    assert any(map(over, sizes[False])) and not any(map(over, sizes[True])), sizes
