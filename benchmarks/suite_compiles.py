"""Where the test suite's time goes in JAX: compiles, traces and lowerings per test file.

The suite is CPU-bound and most of it is JAX building programs (session 41, the 2-core VM:
8,123 XLA compiles, 883 s, and 367 s of tracing and lowering, of ~1,760 CPU seconds). As a
pytest plugin this module charges JAX's own duration events to the test file that ran them and
writes one JSON per xdist worker; run as a module it merges them into a table.

    MINIPIC_SUITE_COMPILES=/tmp/sc python -m pytest -p benchmarks.suite_compiles -n 2 tests
    python -m benchmarks.suite_compiles /tmp/sc [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib

ENV = "MINIPIC_SUITE_COMPILES"
COMPILE = "/jax/core/compile/backend_compile_duration"
BUILD = ("/jax/core/compile/jaxpr_trace_duration",
         "/jax/core/compile/jaxpr_to_mlir_module_duration")

_current = ["<collection>"]
_sums: dict = collections.defaultdict(lambda: [0, 0.0, 0.0])  # file -> compiles, s, build s


def _on_duration(name: str, seconds: float, **_) -> None:
    row = _sums[_current[0]]
    if name == COMPILE:
        row[0] += 1
        row[1] += seconds
    elif name in BUILD:
        row[2] += seconds


def pytest_configure(config) -> None:
    if os.environ.get(ENV):
        import jax.monitoring
        jax.monitoring.register_event_duration_secs_listener(_on_duration)


def pytest_runtest_setup(item) -> None:
    _current[0] = item.nodeid.split("::")[0]


def pytest_sessionfinish(session) -> None:
    folder = os.environ.get(ENV)
    if folder:
        pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        (pathlib.Path(folder) / f"{worker}.json").write_text(json.dumps(dict(_sums)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help=f"the folder ${ENV} named")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    sums = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for path in sorted(pathlib.Path(args.folder).glob("*.json")):
        for name, row in json.loads(path.read_text()).items():
            for i, x in enumerate(row):
                sums[name][i] += x
    total = [sum(r[i] for r in sums.values()) for i in range(3)]
    print(f"{total[0]} compiles, {total[1]:.0f} s; tracing and lowering {total[2]:.0f} s")
    print(f"{'compiles':>8} {'compile_s':>9} {'build_s':>8}  file")
    for name, (n, comp, build) in sorted(sums.items(), key=lambda kv: -kv[1][1] - kv[1][2])[
            :args.top]:
        print(f"{n:8d} {comp:9.1f} {build:8.1f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
