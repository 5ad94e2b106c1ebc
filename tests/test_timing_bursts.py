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


def test_kernel_lines_take_the_stream_lines_of_gpu_planes():
    """timing._kernel_lines (profile_kernels, device_bursts): every GPU line counted, kernels
    from the Stream lines, from the non-XLA lines of a plane that has none; host planes out."""
    from types import SimpleNamespace as NS

    from benchmarks.timing import _kernel_lines

    def ev(name, start, dur):
        return NS(name=name, start_ns=start, end_ns=start + dur, duration_ns=dur)
    planes = [NS(name="/host:CPU", lines=[NS(name="Stream #1", events=[ev("h", 0, 5)])]),
              NS(name="/device:GPU:0", lines=[
                  NS(name="Stream #7(compute)", events=[ev("k1", 0, 2_000_000),
                                                        ev("k2", 3, 1_000_000)]),
                  NS(name="XLA Ops", events=[ev("op", 0, 9)])]),
              NS(name="/device:GPU:1", lines=[NS(name="XLA Modules", events=[ev("m", 0, 9)]),
                                              NS(name="Kernels", events=[ev("k3", 1, 4)])])]
    lines, kernels = _kernel_lines(NS(planes=planes))
    assert [e.name for e in kernels] == ["k1", "k2", "k3"]
    assert lines["/device:GPU:0/Stream #7(compute)"] == (2, 3.0)
    assert set(lines) == {"/device:GPU:0/Stream #7(compute)", "/device:GPU:0/XLA Ops",
                          "/device:GPU:1/XLA Modules", "/device:GPU:1/Kernels"}


def test_idle_activity_names_what_the_host_did_while_the_device_waited():
    """timing.idle_activity: per burst, the runtime events and the short Python frames that
    overlap the idle gap before it (by the time inside the gap), and the burst's first kernel;
    a frame as long as the whole loop is left out."""
    from types import SimpleNamespace as NS

    from benchmarks.timing import idle_activity

    us = 1000

    def ev(name, start, end):
        return NS(name=name, start_ns=start, end_ns=end, duration_ns=end - start)
    kernels = [ev("step_a", 0, 10 * us), ev("tiny", 110 * us, 111 * us),
               ev("step_b", 300 * us, 310 * us)]
    host = [ev("$engine.py:1 step", 0, 2000 * us),  # the loop: longer than 4x any gap
            ev("$runner.py:9 fetch", 20 * us, 100 * us),  # 80 us inside gap 1
            ev("$runner.py:5 launch", 150 * us, 290 * us),  # 140 us inside gap 2
            ev("PjRtExecute", 160 * us, 400 * us),  # 140 us inside gap 2 (clipped at 300)
            ev("cuMemcpyDtoH", 95 * us, 130 * us)]  # 15 us in gap 1 (to 110), 19 in gap 2
    data = NS(planes=[NS(name="/host:CPU", lines=[NS(name="python", events=host)]),
                      NS(name="/device:GPU:0", lines=[NS(name="Stream #1", events=kernels)])])
    found = bursts([(k.start_ns, k.end_ns) for k in kernels], gap_ns=50 * us)
    idle_activity(data, kernels, found)
    assert [b["first_kernel"] for b in found] == ["step_a", "tiny", "step_b"]
    assert found[0]["host_in_idle"] == [] and found[0]["python_in_idle"] == []
    assert found[1]["python_in_idle"] == [("$runner.py:9 fetch", pytest.approx(0.080))]
    assert found[1]["host_in_idle"] == [("cuMemcpyDtoH", pytest.approx(0.015))]
    assert found[2]["python_in_idle"] == [("$runner.py:5 launch", pytest.approx(0.140))]
    assert found[2]["host_in_idle"] == [("PjRtExecute", pytest.approx(0.140)),
                                        ("cuMemcpyDtoH", pytest.approx(0.019))]
