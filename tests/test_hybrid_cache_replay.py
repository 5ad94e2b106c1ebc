"""The hybrid-cache bench's host replay (`--stub-device`: the jitted step replaced by a stub; token
counts depend only on the scheduler and the checkpoint store): at the same checkpoint budget,
dp recomputes fewer prompt tokens than every fixed rule on a system-prompt workload."""

import argparse
import json

import pytest

from benchmarks import hybrid_cache_bench


def _replay(tmp_path, workload, budgets, scale, strategies):
    p = argparse.ArgumentParser()
    hybrid_cache_bench.add_parser(p)
    out = tmp_path / "replay.json"
    args = p.parse_args(["--model", "tiny_qwen3_5", "--dtype", "float32", "--stub-device",
                         "--num-kv-blocks", "20000", "--max-num-seqs", "4", "--scale", str(scale),
                         "--workloads", workload, "--budgets", *map(str, budgets),
                         "--strategies", *strategies, "--json", str(out)])
    hybrid_cache_bench.run(args)
    rows = json.loads(out.read_text())["results"]
    return {(r["budget"], r["strategy"]): r["tokens_recomputed"] for r in rows}


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
