"""Smoke test of `minipic-bench planner` on the shipped MuSiQue data (tiny settings)."""

import json

import numpy as np
import pytest

from benchmarks.cli import main
from benchmarks.planner_workloads import _radix_depths


def test_planner_bench_cli(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["planner", "--workloads", "rag", "--budgets", "1", "3", "--block-sizes", "256",
               "--timing", "none", "--drift-requests", "0", "--plot-dir", "", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    rows = res["savings"]["rag"]["rows"]
    assert [r["budget"] for r in rows] == [1, 3]
    for r in rows:  # the DP is never beaten at the same budget
        for s in ("balanced", "block", "log", "sqrt"):
            assert r["dp_cost"] <= r[s + "_cost"] + 1e-9
    assert "savings factor" in capsys.readouterr().out


def test_planner_bench_rejects_a_drift_replay_shorter_than_its_warm_up():
    with pytest.raises(ValueError, match="--drift-requests 50: .* more than 2000"):
        main(["planner", "--workloads", "rag", "--drift-requests", "50", "--plot-dir", ""])


def test_radix_depths_is_longest_common_prefix_with_earlier_requests(fresh_rng):
    rng = fresh_rng
    # distinct segments of one length (like distinct passages): none is a prefix of another
    pool = sorted({tuple(rng.integers(0, 3, size=3).tolist()) for _ in range(12)})
    segs = [pool[i] for i in rng.permutation(len(pool))[:5]]
    reqs = [[segs[i] for i in rng.integers(0, 5, size=rng.integers(1, 5))] for _ in range(30)]
    flat = [sum(r, ()) for r in reqs]
    want = []
    for i, a in enumerate(flat):  # brute force over token sequences
        best = 0
        for b in flat[:i]:
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            best = max(best, k)
        want.append(best)
    assert _radix_depths(reqs).tolist() == want
