"""Timing helpers shared by the kernel benchmarks: back-to-back calls with one wait per rep,
interleaved A/B ratios, and rows that survive a variant that fails to build."""

from __future__ import annotations

import bisect
import math
import statistics
import time

import numpy as np


def blocked_ms(call, reps: int) -> dict:
    """Median / min ms of `reps` calls of call() (-> arrays to wait on), each waited for (after
    two warm calls): a lone call's latency, launches included."""
    import jax
    for _ in range(2):
        jax.block_until_ready(call())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return {"ms": 1e3 * float(np.median(times)), "min_ms": 1e3 * float(np.min(times))}


def time_calls(fn, *args, iters, reps):
    """Median seconds per call: after two warm-up calls, `iters` calls dispatched back to back and
    one wait, repeated `reps` times."""
    import jax
    out = fn(*args)
    jax.block_until_ready(out)
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def ab_time(fa, fb, *args, iters, reps):
    """Times fa and fb interleaved (ABBA per rep pair, so drift cancels) -> (median ms of a,
    median ms of b, median of the per-pair ratios b / a, their 25th and 75th percentiles)."""
    import jax

    def once(fn):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / iters

    for fn in (fa, fb, fa, fb):
        jax.block_until_ready(fn(*args))
    ta, tb, ratios = [], [], []
    for r in range(reps):
        if r % 2:
            b, a = once(fb), once(fa)
        else:
            a, b = once(fa), once(fb)
        ta.append(a)
        tb.append(b)
        ratios.append(b / a)
    q = np.percentile(ratios, [25, 50, 75])
    return statistics.median(ta) * 1e3, statistics.median(tb) * 1e3, q[1], q[0], q[2]


def ab_row(rows, case, label, fa, fb, *args, reps, iters):
    """`ab_time` of rotated (fa) vs position_free (fb) into a printed row."""
    try:
        ma, mb, med, lo, hi = ab_time(fa, fb, *args, iters=iters, reps=reps)
    except Exception as e:  # a config that does not compile must not stop the run
        print(f"  {case:<16} A/B {label} FAILED {type(e).__name__}: {e}"[:300])
        return
    print(f"  {case:<16} A/B {label}: rotated {ma:.4f} ms, position_free {mb:.4f} ms, "
          f"overhead median {100 * (med - 1):+.2f}% [IQR {100 * (lo - 1):+.2f}, "
          f"{100 * (hi - 1):+.2f}] over {reps} interleaved pairs", flush=True)
    rows.append(dict(case=case, impl=f"A/B {label}", rotated_ms=ma, position_free_ms=mb,
                     overhead_median_pct=100 * (med - 1), overhead_p25_pct=100 * (lo - 1),
                     overhead_p75_pct=100 * (hi - 1), pairs=reps))


def row(rows, **kw):
    """Append one result row (case, impl, ms, and tbps or tflops) and print it."""
    rows.append(kw)
    unit = "TB/s" if "tbps" in kw else "TFLOP/s"
    val = kw.get("tbps", kw.get("tflops"))
    rate = f"{val:7.2f} {unit}"
    if val is None or not math.isfinite(val):  # a zero or failed time: no rate to report
        rate = f"    n/a {unit} (time {kw['ms']} ms is below the timer's resolution or invalid)"
    print(f"  {kw['case']:<16} {kw['impl']:<40} {kw['ms']:8.3f} ms  {rate}", flush=True)


def safe(rows, case, impl, fn, *args, iters, reps, work, unit):
    """`time_calls` into a row (work / time in TB/s or TFLOP/s); a variant that fails to build
    becomes an error row instead of ending the run. Returns seconds per call or None."""
    try:
        t = time_calls(fn, *args, iters=iters, reps=reps)
    except Exception as e:  # an anchor that does not build here must not sink the whole run
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        print(f"  {case:<16} {impl:<40} FAILED {msg}", flush=True)
        rows.append(dict(case=case, impl=impl, error=msg))
        return None
    row(rows, case=case, impl=impl, ms=t * 1e3, **{unit: work / t / 1e12 if t > 0 else math.inf})
    return t


def _traced(call, runs: int = 1):
    """(the last result, ProfileData) of `runs` calls under one jax.profiler trace, each waited
    for."""
    import glob
    import os
    import tempfile

    import jax
    from jax.profiler import ProfileData
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        for _ in range(runs):
            out = call()
            jax.block_until_ready(out)
    path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
    return out, ProfileData.from_file(path)


def _kernel_lines(data) -> tuple[dict, list]:
    """A trace's GPU planes: {plane/line: (events, ms)} of every line, and the kernel events
    (the Stream lines; where a plane has none, its lines other than XLA's own)."""
    lines, kernels = {}, []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        by_line = [(line.name, list(line.events)) for line in plane.lines]
        for name, evs in by_line:
            lines[f"{plane.name}/{name}"] = (len(evs), sum(e.duration_ns for e in evs) / 1e6)
        streams = [evs for name, evs in by_line if name.startswith("Stream")]
        for evs in streams or [evs for name, evs in by_line if not name.startswith("XLA")]:
            kernels += evs
    return lines, kernels


def profile_kernels(call, steps: int = 3, top: int = 25) -> dict:
    """jax.profiler trace of `steps` calls; device kernels aggregated by name (per call)."""
    import jax
    jax.block_until_ready(call())
    _, data = _traced(call, steps)
    lines, kernels = _kernel_lines(data)
    by_name = {}
    for e in kernels:
        n, t = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (n + 1, t + e.duration_ns / 1e6)
    whole = bursts([(e.start_ns, e.end_ns) for e in kernels], gap_ns=math.inf)  # one burst
    busy = sum(b["busy_ms"] for b in whole)
    span = sum(b["span_ms"] for b in whole)
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return {"kernels_per_step": sum(n for n, _ in by_name.values()) / steps,
            "kernel_busy_ms_per_step": busy / steps,
            "first_to_last_kernel_ms_per_step": span / steps,
            "lines": {k: {"events": n, "ms": t} for k, (n, t) in lines.items()},
            "top": [{"name": k[:90], "calls_per_step": n / steps, "ms_per_step": t / steps}
                    for k, (n, t) in rows[:top]]}


def host_events(call, top: int = 15) -> tuple:
    """call() under a jax.profiler trace: (its result, the host-side events of the trace (every
    plane but the GPUs' kernel lines and Python frames: PjRt and XLA TraceMe scopes, CUDA
    driver calls) summed by
    name, [(name, count, ms)] costliest first, `top` of them). What a call's host time went to
    that another call's did not (benchmarks/hybrid_span_request.py --host-trace)."""
    out, data = _traced(call)
    by_name = {}
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            for e in line.events:
                if e.name.startswith("$"):  # Python frames (the tracer's): not the runtime's
                    continue
                n, t = by_name.get(e.name, (0, 0.0))
                by_name[e.name] = (n + 1, t + e.duration_ns / 1e6)
    rows = sorted(((k[:80], n, t) for k, (n, t) in by_name.items()), key=lambda r: -r[2])
    return out, rows[:top]


def bursts(intervals, gap_ns: float) -> list[dict]:
    """Device kernel intervals [(start_ns, end_ns)] grouped into bursts: a new burst starts where
    the device has been idle (no kernel running) for more than gap_ns. Per burst: kernels, busy
    ms (the union of its kernels), span ms (first start to last end), idle ms before it."""
    out, end = [], None
    for s, e in sorted(intervals):
        if end is None or s - end > gap_ns:
            out.append({"kernels": 0, "busy_ms": 0.0, "start": s, "end": s,
                        "idle_before_ms": 0.0 if end is None else (s - end) / 1e6})
        b = out[-1]
        b["kernels"] += 1
        b["busy_ms"] += max(0, e - max(s, b["end"])) / 1e6  # the part no earlier kernel covered
        b["end"] = end = max(b["end"], e)
    for b in out:
        b["span_ms"] = (b["end"] - b["start"]) / 1e6
        b["start_ns"], b["end_ns"] = b.pop("start"), b.pop("end")
    return out


def idle_activity(data, kernels, found: list[dict], top: int = 3) -> None:
    """Adds to each burst of `found` (the `bursts` of `kernels`, the kernel events of a trace
    `data`) what the host did in the device idle before it: `host_in_idle`, the runtime events
    (PjRt / XLA scopes, driver calls) and `python_in_idle`, the Python frames (only those
    shorter than 4x the gap: not the loop around it), each [(name, ms of it inside the gap)]
    most first; `first_kernel` names the burst's first kernel."""
    events = [(e.start_ns, e.end_ns, e.name) for plane in data.planes
              if not plane.name.startswith("/device:GPU") for line in plane.lines
              for e in line.events]
    starts = sorted((e.start_ns, e.name) for e in kernels)
    prev_end = None
    for b in found:
        i = bisect.bisect_left(starts, (b["start_ns"], ""))
        b["first_kernel"] = starts[i][1][:60] if i < len(starts) else ""
        lo, hi = prev_end, b["start_ns"]
        prev_end = b["end_ns"]
        runtime, frames = {}, {}
        if lo is not None and hi > lo:
            for s, e, name in events:
                inside = min(e, hi) - max(s, lo)
                if inside <= 0:
                    continue
                if name.startswith("$"):
                    if e - s < 4 * (hi - lo):
                        frames[name] = frames.get(name, 0) + inside
                else:
                    runtime[name] = runtime.get(name, 0) + inside
        for key, got in (("host_in_idle", runtime), ("python_in_idle", frames)):
            ranked = sorted(got.items(), key=lambda kv: -kv[1])[:top]
            b[key] = [(k[:70], v / 1e6) for k, v in ranked]


def device_bursts(call, gap_us: float = 50.0) -> tuple:
    """call() under a jax.profiler trace: (its result, `bursts` of the GPU kernels it ran, idle
    gaps over gap_us splitting them): how long each engine step kept the device busy and how long
    the device waited between steps, and what the host did meanwhile (`idle_activity`;
    benchmarks/hybrid_span_request.py --device-trace)."""
    out, data = _traced(call)
    _, kernels = _kernel_lines(data)
    found = bursts([(e.start_ns, e.end_ns) for e in kernels], gap_us * 1e3)
    idle_activity(data, kernels, found)
    return out, found
