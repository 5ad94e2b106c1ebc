"""`minipic-bench rag` on CPU with a tiny model: workloads from the shipped MuSiQue data, every
configuration kind, vLLM's lines and JSON keys, the cached-span TTFT pair.

Oracles: position-free keys on plain prompts (pic_off) must give rotated's greedy tokens
token for token (float32); the multi-question workload must hit the span cache in
position_free mode far more than the classic prefix cache does; cached spans must be counted as
hits in the TTFT pair.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import cli
from benchmarks import rag_workloads as W

TINY = ["--model", "tiny_llama3", "--dtype", "float32", "--num-requests", "4",
        "--passage-tokens", "24", "--max-num-batched-tokens", "256", "--min-token-bucket", "256",
        "--max-model-len", "512", "--max-num-seqs", "8", "--max-tokens", "2",
        "--ttft-spans", "3", "--ttft-span-tokens", "40", "--ttft-repeats", "1",
        "--questions-per-set", "4", "--in-process"]


def test_workloads_follow_the_layout():
    from minipic_jax.loading.tokenizer import load_tokenizer
    from configs.presets import get_preset
    enc = W.Encoder(load_tokenizer(None, get_preset("tiny_llama3")), cap=16)
    samples = W.load_musique()
    multi = W.make_workload("multi", samples, enc, num_requests=8, questions_per_set=4)
    assert {frozenset(r.passages) for r in multi[:4]} == {frozenset(multi[0].passages)}
    assert multi[0].passages != multi[1].passages  # retriever order varies per question
    assert multi[0].question != multi[1].question
    zipf = W.make_workload("zipf", samples, enc, num_requests=20, zipf_s=1.2)
    assert all(len(set(r.passages)) == 10 for r in zipf)
    cold, cached = W.ttft_spans(samples, enc, num_spans=3, span_tokens=40)
    assert sorted(cold.passages) == sorted(cached.passages) and cold.passages != cached.passages
    assert W.plain(multi[0])[:len(multi[0].system)] == list(multi[0].system)


def test_rag_bench_tiny(tmp_path, capsys, monkeypatch):
    import jax
    from minipic_jax import compile_cache
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "xla"))
    before = jax.config.jax_compilation_cache_dir  # the suite's own cache (tests/conftest.py)
    compile_cache.disable()  # so the engine's default rule (the env folder) decides
    try:
        _run_tiny(tmp_path, capsys)
    finally:
        compile_cache.configure(before) if before else compile_cache.disable()
    assert any((tmp_path / "xla").iterdir())  # the step executables were written


def _run_tiny(tmp_path, capsys):
    argv = ["rag", *TINY, "--configs", "rotated", "pic_off", "fcfs", "ttft",
            "--workloads", "multi", "--modes", "offline", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "[fcfs] multi offline: Throughput: " in text and "load " in text
    data = json.loads((tmp_path / "rag_bench.json").read_text())
    res = {r["config"]: r for r in data["results"]}
    assert all(res[c]["load_s"] > 0 and res[c]["warmup_s"] > 0 for c in res)
    assert res["fcfs"]["compilation_cache_dir"] == str(tmp_path / "xla")
    rot, off, pic = (res[c]["runs"][0] for c in ("rotated", "pic_off", "fcfs"))
    for r in (rot, off, pic):
        assert r["num_requests"] == 4 and r["output_tokens"] == 4 * 2
        assert r["compiles_during_run"] == 0
        for key in ("requests_per_second", "tokens_per_second", "output_throughput",
                    "median_ttft_ms", "p99_tpot_ms", "samples_per_second"):
            assert r[key] > 0, key
    assert off["same_outputs"] == 1.0  # RoPE at read = RoPE at write
    assert rot["speedup"] == 1.0 and pic["speedup"] > 0 and pic["baseline"] == "rotated"
    assert pic["prefix_cache_hit_rate"] > rot["prefix_cache_hit_rate"] + 0.3
    t = res["ttft"]
    assert t["rows"][0]["cached_prompt_tokens"] == 0
    assert t["rows"][1]["cached_prompt_tokens"] >= 3 * 32  # every span's full blocks
    assert t["cold_over_cached"] > 0
    g = t["generate"]  # the same request through LLM.generate, as a user calls it
    assert [r["cold"] for r in g["rows"]] == [True, False]
    assert g["rows"][0]["cached_prompt_tokens"] == 0 and g["rows"][1]["cached_prompt_tokens"] >= 3 * 32
    assert all(r["host_ms"] > 0 and r["steps"] >= 1 for r in g["rows"])
    assert "[ttft] through LLM.generate: cold " in text
    assert (tmp_path / "rag_bench.png").exists()


def test_a_program_form_is_set_for_the_run_and_a_bad_one_refused(tmp_path, monkeypatch):
    """--program-form: the named switches hold while the configuration runs (put back after);
    a name that is no program switch is refused before an engine starts, naming the flag."""
    from benchmarks import rag_runs
    from minipic_jax.models import qwen3_5_joint
    seen = []
    monkeypatch.setattr(rag_runs, "run_config", lambda name, opts: seen.append(
        (name, qwen3_5_joint.FINALS_IN_PLACE, qwen3_5_joint.TRANSITIONS_IN_STREAM))
                        or {"config": name, "error": "not run (a test)"})
    argv = ["rag", "--configs", "fcfs", "--in-process", "--out", str(tmp_path)]
    before = (qwen3_5_joint.FINALS_IN_PLACE, qwen3_5_joint.TRANSITIONS_IN_STREAM)
    form = f"FINALS_IN_PLACE={int(not before[0])},TRANSITIONS_IN_STREAM={int(not before[1])}"
    cli.main(argv + ["--program-form", form])
    assert seen == [("fcfs", not before[0], not before[1])]
    assert (qwen3_5_joint.FINALS_IN_PLACE, qwen3_5_joint.TRANSITIONS_IN_STREAM) == before
    with pytest.raises(ValueError, match="--program-form 'NO_SUCH=1'"):
        cli.main(argv + ["--program-form", "NO_SUCH=1"])


def test_runs_without_rotated_compare_with_the_first_configuration():
    """Rag's hybrid runs (`--configs pic_off fcfs`) have no rotated run: their speed-ups are
    over the first configuration, named in each run (session 37's device calls printed none)."""
    from benchmarks.rag_bench import speedups

    def run(rps, outputs):
        return {"workload": "zipf", "mode": "offline", "requests_per_second": rps,
                "outputs": outputs}
    results = [{"config": "pic_off", "runs": [run(80.0, {"a": [1, 2], "b": [3]})]},
               {"config": "fcfs", "runs": [run(76.0, {"a": [1, 2], "b": [4]})]}]
    speedups(results)
    fcfs = results[1]["runs"][0]
    assert (fcfs["baseline"], fcfs["speedup"], fcfs["same_outputs"]) == ("pic_off", 0.95, 0.5)
