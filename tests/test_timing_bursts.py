"""benchmarks.timing.bursts: device kernel intervals grouped into steps by idle gaps."""

import pytest

from benchmarks.timing import bursts


def test_kernels_group_into_bursts_at_idle_gaps_with_overlaps_counted_once():
    us = 1000  # ns
    ivs = [(0, 10 * us), (5 * us, 12 * us), (15 * us, 20 * us),  # one burst: gap 3 us < 50
           (120 * us, 130 * us), (131 * us, 140 * us),  # idle 100 us before it
           (400 * us, 401 * us)]
    got = bursts(reversed(ivs), gap_ns=50 * us)  # any order
    assert [b["kernels"] for b in got] == [3, 2, 1]
    assert got[0]["busy_ms"] == pytest.approx(0.017)  # 0-12 and 15-20: the overlap once
    assert got[0]["span_ms"] == pytest.approx(0.020)
    assert got[1]["idle_before_ms"] == pytest.approx(0.100)
    assert got[1]["busy_ms"] == pytest.approx(0.019) and got[1]["span_ms"] == pytest.approx(0.020)
    assert got[2]["idle_before_ms"] == pytest.approx(0.260) and got[0]["idle_before_ms"] == 0.0
    assert bursts([], gap_ns=1) == []
