"""`minipic-bench planner`: checkpoint placement on overlap distributions built from real data.

Prints, per workload (benchmarks/planner_workloads.py), the token-savings factor
E[r | no checkpoints] / E[r | placement] against the budget M for every strategy; how many DP
checkpoints match block caching at its native block sizes; a drifting-traffic replay (static plan
vs histogram estimators with the replan rule vs an oracle); and the DP's run time against N and M.
Checkpoints sit on multiples of the recurrent chunk (64 tokens). Saves PNG plots and optional JSON.

  minipic-bench planner [--budgets 1 2 4 ...] [--timing full|quick|none] [--json out.json]
"""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import platform
import subprocess
import time

import numpy as np

from benchmarks import planner_workloads as wl
from planner import (DecayingHistogram, EmpiricalHistogram, Replanner, expected_recompute,
                     frontier, place, place_lagrangian, place_priced)

BASELINES = ("balanced", "block", "log", "sqrt")
HERE = pathlib.Path(__file__).resolve().parent
DRIFT_WARM = 2000  # requests the drift replay plans on before it scores (static plan, histograms)


def add_parser(p) -> None:
    p.add_argument("--budgets", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                   help="checkpoint budgets M to place for each strategy")
    names = ["longdoc", "sysprompt", "rag", "rag-multihop"]
    p.add_argument("--workloads", nargs="+", default=names, choices=names,
                   help="overlap-depth distributions (benchmarks/planner_workloads.py)")
    p.add_argument("--chunk", type=int, default=wl.CHUNK, help="checkpoint granularity (tokens)")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[64, 256, 1024, 4096],
                   help="block sizes of the 'block' baseline (a checkpoint every B tokens)")
    p.add_argument("--drift-requests", type=int, default=60000,
                   help=f"requests of the drift replay, more than its {DRIFT_WARM:,} warm-up "
                        "requests (0 skips it)")
    p.add_argument("--drift-budgets", type=int, nargs="+", default=[16, 64],
                   help="budgets of the drift replay")
    p.add_argument("--timing", choices=["full", "quick", "none"], default="full",
                   help="DP timing: full sweep of sizes, a quick one, or none")
    p.add_argument("--plot-dir", default="",
                   help="write planner_savings.png / planner_drift.png here (default: no plots; "
                        f"'{HERE.name}' regenerates the committed figures)")
    p.add_argument("--json", default=None, help="write all results here")


def _recompute(depths: np.ndarray, positions: np.ndarray) -> np.ndarray:
    starts = np.concatenate([[0], positions])
    return depths - starts[np.searchsorted(starts, depths, side="right") - 1]


def _factor(none: float, cost: float) -> float:
    return math.inf if cost <= 0 else none / cost


def _chunk_block(n: int, budget: int, chunk: int) -> int:
    """Finest chunk-aligned block size B whose checkpoints fit the budget (n // B <= budget)."""
    return chunk * math.ceil((n // (budget + 1) + 1) / chunk)


def savings_table(work: wl.Workload, budgets, chunk: int) -> dict:
    pmf = work.pmf()
    n = pmf.size - 1
    cand = np.arange(chunk, n + 1, chunk)
    none = expected_recompute(pmf, [])
    fr = frontier(pmf, max(budgets), cand)
    rows = []
    for m in budgets:
        row = {"budget": m}
        for s in BASELINES:
            bs = _chunk_block(n, m, chunk) if s == "block" else None
            pos = place(pmf, m, s, candidates=cand, block_size=bs)
            row[s + "_cost"] = expected_recompute(pmf, pos)
            row[s] = _factor(none, row[s + "_cost"])
            row[s + "_count"] = int(pos.size)
        row["dp_cost"] = float(fr.costs[m])
        row["dp"] = _factor(none, fr.costs[m])
        row["dp_count"] = int(fr.placement(m).size)
        rows.append(row)
    return {"n": n, "candidates": int(cand.size), "none_cost": none, "rows": rows}


def _min_bytes_plan(pmf, held, target: float, cand) -> np.ndarray:
    """Priced placement with price(c) = lam * held[c], lam as large as keeps E[r] <= target."""
    def solve(lam):
        return place_priced(pmf, lam * held, cand)

    ok, hi = solve(0.0), 1.0
    while solve(hi).cost <= target and hi < 1e12:
        hi *= 4.0
    lo = 0.0
    for _ in range(40):
        lam = np.sqrt(lo * hi) if lo > 0 else hi / 4.0
        res = solve(lam)
        if res.cost <= target:
            ok, lo = res, lam
        else:
            hi = lam
        if lo > 0 and hi / lo < 1.0 + 1e-6:
            break
    return ok.positions


def block_match(work: wl.Workload, block_sizes, chunk: int) -> list:
    """For block caching at each native block size, the fewest DP checkpoints that do as well,
    and the fewest states held per cached entry (priced placement) that do as well."""
    pmf = work.pmf()
    n = pmf.size - 1
    cand = np.arange(chunk, n + 1, chunk)
    p = pmf / pmf.sum()
    t = np.arange(n + 1)
    # a cached entry as long as its overlap keeps the states at C & [1, t]: position c is held by
    # the share of entries at least c long
    held = np.cumsum(p[::-1])[::-1]  # [N+1] P(T >= c)

    def stored(c):
        return float(np.dot(p, np.searchsorted(c, t, side="right")))

    out = []
    for b in block_sizes:
        blk = np.arange(b, n + 1, b)
        if blk.size == 0:
            continue
        cost = expected_recompute(pmf, blk)
        target = cost * (1 + 1e-12) + 1e-12
        fr = frontier(pmf, int(blk.size), cand)
        m = int(np.flatnonzero(fr.costs <= target)[0])
        dp_pos = fr.placement(m)
        byte_pos = _min_bytes_plan(pmf, held, target, cand)
        out.append({"block_size": b, "block_count": int(blk.size), "block_cost": cost,
                    "dp_count": m, "dp_cost": float(fr.costs[m]),
                    "block_stored": stored(blk), "dp_stored": stored(dp_pos),
                    "priced_count": int(byte_pos.size), "priced_stored": stored(byte_pos),
                    "priced_cost": expected_recompute(pmf, byte_pos)})
    return out


def drift_replay(a: wl.Workload, b: wl.Workload, budget: int, requests: int, chunk: int,
                 seed: int = 0) -> dict:
    """Traffic drifts from `a` (95%) to `b` (95%): flat for a third, linear for a third, flat.

    Policies see each batch of 100 requests only after serving it. `static` plans once on the
    first 2,000 requests; `cumulative`/`decaying` keep an empirical / exponentially weighted
    (half-life 2,000 requests) histogram and replan every 5,000 requests or when the TV distance
    to the last plan's histogram passes 0.1; `oracle` re-solves on the true mixture every 1,000.
    """
    rng = np.random.default_rng(seed)
    n = max(a.max_depth, b.max_depth)
    cand = np.arange(chunk, n + 1, chunk)
    i = np.arange(requests)
    w = 0.05 + 0.9 * np.clip((i - requests / 3) / (requests / 3), 0.0, 1.0)
    def draw(work, k):
        return rng.choice(work.depths, size=k, p=work.weights / work.weights.sum())

    depths = np.where(rng.random(requests) < w, draw(b, requests), draw(a, requests))
    pa, pb = a.pmf(n) / a.weights.sum(), b.pmf(n) / b.weights.sum()
    warm, batch = DRIFT_WARM, 100

    def replanner(est):
        est.observe(depths[:warm])
        return Replanner(est, budget, candidates=cand, every=5000, tv_threshold=0.1)

    rp = {"cumulative": replanner(EmpiricalHistogram(n, smoothing=1e-3)),
          "decaying": replanner(DecayingHistogram(n, half_life=2000, smoothing=1e-3))}
    warm_pmf = np.bincount(depths[:warm], minlength=n + 1) + 1e-3
    plans = {"static": place(warm_pmf, budget, candidates=cand),
             "balanced": place(warm_pmf, budget, "balanced", candidates=cand),
             "block": place(warm_pmf, budget, "block", candidates=cand,
                            block_size=_chunk_block(n, budget, chunk))}
    names = ["static", "cumulative", "decaying", "oracle", "balanced", "block"]
    cost = {k: np.zeros(requests - warm) for k in names}
    oracle, plan_s = None, 0.0
    for start in range(warm, requests, batch):
        d = depths[start:start + batch]
        if (start - warm) % 1000 == 0:
            oracle = place((1 - w[start]) * pa + w[start] * pb, budget, candidates=cand)
        for k in names:
            pos = rp[k].positions if k in rp else oracle if k == "oracle" else plans[k]
            cost[k][start - warm:start - warm + d.size] = _recompute(d, pos)
        t0 = time.perf_counter()
        for r in rp.values():
            r.observe(d)
        plan_s += time.perf_counter() - t0
    served = depths[warm:].astype(float)
    windows = np.array_split(np.arange(served.size), 29)
    return {
        "budget": budget, "requests": requests, "n": n,
        "savings": {k: _factor(served.sum(), cost[k].sum()) for k in names},
        "replans": {k: rp[k].replans for k in rp},
        "estimator_seconds": plan_s,
        "window_savings": {k: [_factor(served[ix].sum(), cost[k][ix].sum()) for ix in windows]
                           for k in names},
        "window_mix": [float(w[warm + ix].mean()) for ix in windows],
    }


def _timing_pmf(kind: str, n: int, rng) -> np.ndarray:
    if kind == "random":
        return rng.random(n + 1)
    t = np.arange(n + 1) / n  # smooth: a bump near 0.6 N plus a decaying head (big hulls)
    return np.exp(-((t - 0.6) / 0.14) ** 2) + 0.1 * np.exp(-t * 32)


def dp_timing(mode: str) -> list:
    rng = np.random.default_rng(0)
    sizes = [(65536, 256)] if mode == "quick" else [
        (4096, 256), (16384, 256), (65536, 16), (65536, 64), (65536, 256), (65536, 1024)]
    out = []
    for n, m in sizes:
        for kind in ("random", "smooth"):
            pmf = _timing_pmf(kind, n, rng)
            best = (math.inf, math.inf)
            for _ in range(3 if m <= 256 else 1):
                w0, c0 = time.perf_counter(), time.process_time()
                place(pmf, m)
                best = min(best, (time.perf_counter() - w0, time.process_time() - c0))
            out.append({"solver": "dp", "pmf": kind, "n": n, "budget": m, "wall_s": best[0],
                        "cpu_s": best[1]})
    if mode == "full":
        pmf = _timing_pmf("random", 65536, rng)
        for m in (256, 4096):
            w0, c0 = time.perf_counter(), time.process_time()
            res = place_lagrangian(pmf, m)
            out.append({"solver": "lagrangian", "pmf": "random", "n": 65536, "budget": m,
                        "wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0,
                        "iterations": res.iterations, "attained": res.attained})
    return out


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.2f}" if x < 100 else f"{x:.0f}"


def _save(plt, fig, axes, ylabel: str, path: str) -> str:
    """Label the first panel, lay out, write `path`, close the figure."""
    axes[0][0].set_ylabel(ylabel)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot(results: dict, plot_dir: str) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    sav = results["savings"]
    fig, axes = plt.subplots(1, len(sav), figsize=(4.2 * len(sav), 3.6), squeeze=False)
    for ax, (name, tab) in zip(axes[0], sav.items()):
        ms = [r["budget"] for r in tab["rows"]]
        for s in (*BASELINES, "dp"):
            ys = [min(r[s], 1e4) for r in tab["rows"]]
            ax.plot(ms, ys, marker="o", ms=3, lw=2.2 if s == "dp" else 1.2, label=s)
        ax.set(xscale="log", yscale="log", xlabel="budget M (checkpoints)", title=name)
        ax.grid(alpha=0.3)
    paths.append(_save(plt, fig, axes, "token-savings factor (capped 1e4)",
                       os.path.join(plot_dir, "planner_savings.png")))
    if results.get("drift"):
        cols = len(results["drift"])
        fig, axes = plt.subplots(1, cols, figsize=(5.5 * cols, 3.6), squeeze=False)
        for ax, dr in zip(axes[0], results["drift"]):
            x = np.arange(len(dr["window_mix"]))
            for name, ys in dr["window_savings"].items():
                ax.plot(x, np.minimum(ys, 1e4), label=name,
                        lw=2 if name in ("decaying", "oracle") else 1)
            ax.set(yscale="log", xlabel="stream window (drifts sysprompt -> longdoc)",
                   title=f"drift replay, M = {dr['budget']}")
            ax.grid(alpha=0.3)
        paths.append(_save(plt, fig, axes, "savings factor per window",
                           os.path.join(plot_dir, "planner_drift.png")))
    return paths


def run(args) -> int:
    if 0 < args.drift_requests <= DRIFT_WARM:
        raise ValueError(f"--drift-requests {args.drift_requests}: the drift replay plans on its "
                         f"first {DRIFT_WARM} requests and scores the rest; give more than "
                         f"{DRIFT_WARM}, or 0 to skip it")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip() or "unknown"
    head = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "machine": f"{platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs", "tokenizer": wl.tokenizer_name(),
            "loadavg_start": os.getloadavg()[0]}
    print(f"# planner benchmark  {head}")
    builders = {"longdoc": wl.longdoc, "sysprompt": wl.sysprompt, "rag": wl.rag,
                "rag-multihop": lambda: wl.rag(multihop=True)}
    works = {name: builders[name]() for name in args.workloads}
    results = {"meta": head, "savings": {}, "block_match": {}, "drift": [], "timing": []}

    for name, work in works.items():
        tab = savings_table(work, args.budgets, args.chunk)
        results["savings"][name] = tab
        print(f"\n## {name}: {work.description}; N = {tab['n']}, {tab['candidates']} chunk "
              f"candidates, E[r | none] = {tab['none_cost']:.0f} tokens")
        print("savings factor E[r|none]/E[r]   " + "".join(f"{s:>10}" for s in (*BASELINES, "dp"))
              + "   dp/best  tokens saved vs best")
        for r in tab["rows"]:
            best = max(r[s] for s in BASELINES)
            gap = r["dp"] / best if math.isfinite(best) else math.nan
            saved = min(r[s + "_cost"] for s in BASELINES) - r["dp_cost"]
            saved = saved if abs(saved) > 1e-9 else 0.0
            print(f"  M = {r['budget']:>5}                    " +
                  "".join(f"{_fmt(r[s]):>10}" for s in (*BASELINES, "dp")) +
                  f"   {gap:7.2f}  {saved:10.1f}")
        bm = block_match(work, args.block_sizes, args.chunk)
        results["block_match"][name] = bm
        print("block caching vs plans with E[r] no worse: positions | mean states held per entry"
              " (dp: fewest positions; priced: fewest states held)")
        for r in bm:
            print(f"  B = {r['block_size']:>5}: block {r['block_count']:>5} | "
                  f"{r['block_stored']:8.1f}   dp {r['dp_count']:>5} | {r['dp_stored']:8.1f}   "
                  f"priced {r['priced_count']:>5} | {r['priced_stored']:8.1f}   "
                  f"(E[r] {r['block_cost']:.1f} / {r['dp_cost']:.1f} / {r['priced_cost']:.1f})")

    if args.drift_requests:
        a, b = wl.sysprompt(), wl.longdoc()
        for m in args.drift_budgets:
            dr = drift_replay(a, b, m, args.drift_requests, args.chunk)
            results["drift"].append(dr)
            print(f"\n## drift sysprompt -> longdoc, M = {m}, {args.drift_requests} requests: "
                  "savings factor over the stream")
            print("  " + "  ".join(f"{k} {_fmt(v)}" for k, v in dr["savings"].items()) +
                  f"   replans {dr['replans']}, "
                  f"estimator+replan time {dr['estimator_seconds']:.1f} s")

    if args.timing != "none":
        results["timing"] = dp_timing(args.timing)
        print(f"\n## DP timing (this machine, load average {os.getloadavg()[0]:.1f}; best of 3)")
        print("  solver      pmf        N      M    wall s    cpu s")
        for r in results["timing"]:
            print(f"  {r['solver']:<10} {r['pmf']:<7} {r['n']:>6} {r['budget']:>6} "
                  f"{r['wall_s']:9.3f} {r['cpu_s']:8.3f}")
    results["meta"]["loadavg_end"] = os.getloadavg()[0]

    if args.plot_dir:
        for path in _plot(results, args.plot_dir):
            print(f"wrote {path}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=float)
        print(f"wrote {args.json}")
    return 0
