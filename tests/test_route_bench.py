"""`minipic-bench route` end to end on a small MuSiQue slice (host-only engines): span-aware
routing and ordering give the replicas more prefix-cache hits than random routing."""

from __future__ import annotations

import json

from benchmarks import cli


def test_route_bench_routed_beats_random(tmp_path):
    argv = ["route", "--samples", "3", "--questions", "3", "--replicas", "2",
            "--passage-tokens", "24", "--num-kv-blocks", "96", "--max-tokens", "2",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    res = json.loads((tmp_path / "route_bench.json").read_text())["results"]
    for name, r in res.items():
        assert sum(r["requests_per_replica"]) == 9, name
        assert r["prompt_tokens"] == res["random"]["prompt_tokens"], name  # same requests
    assert res["routed+order"]["hit_rate"] > res["random"]["hit_rate"]
    assert res["routed+order"]["computed_tokens"] < res["random"]["computed_tokens"]
