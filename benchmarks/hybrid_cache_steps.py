"""Per-step log of a hybrid-cache run: how many engine steps of each token bucket ran.

Wall time of a run is about sum over steps of cost(bucket, kind), so the step mix explains what
the token counts do not (benchmarks/RESULTS.md, hybrid prefix caching). `StepLog` wraps the
runner's `launch` (the one entry of real and stubbed steps) and counts, per step: the bucket, the
real query tokens, and whether the step only decodes.
"""

from __future__ import annotations

import collections


class StepLog:
    def __init__(self, runner):
        self.runner, self.inner = runner, runner.launch
        self.reset()
        runner.launch = self._launch

    def reset(self) -> None:
        self.buckets = collections.Counter()  # (bucket, "decode" | "prefill") -> steps
        self.real = 0  # query tokens of all steps
        self.padded = 0  # bucket tokens of all steps

    def _launch(self, batch, **kw):
        cfg = self.runner.config
        real = sum(e.token_idx.size for e in batch)
        t = cfg.token_bucket(max(real, 1))
        decode = all(e.token_idx.size == 1 and e.token_idx[0] >= e.seq.num_prompt_tokens
                     for e in batch)
        self.buckets[(t, "decode" if decode else "prefill")] += 1
        self.real += real
        self.padded += t
        return self.inner(batch, **kw)

    def summary(self) -> dict:
        """{"step_buckets": {"512 prefill": n, ...}, "query_tokens", "padded_tokens"}."""
        keys = sorted(self.buckets, key=lambda k: (k[1], k[0]))
        return {"step_buckets": {f"{t} {kind}": self.buckets[(t, kind)] for t, kind in keys},
                "query_tokens": self.real, "padded_tokens": self.padded}

    def close(self) -> None:
        self.runner.launch = self.inner


def fit_wall(results) -> dict | None:
    """Least squares over the runs: wall = sum over step kinds (bucket, decode | prefill) of
    cost x steps of that kind + rest. Per run, `prefill_wall_s`: the wall less the fitted cost
    of its decode-only steps (the part caching can shorten). None with too few runs."""
    import numpy as np
    rows = [r for r in results if r.get("step_buckets")]
    kinds = sorted({k for r in rows for k in r["step_buckets"]},
                   key=lambda k: (k.split()[1], int(k.split()[0])))
    if len(rows) < len(kinds) + 3:
        return None
    x = np.array([[r["step_buckets"].get(k, 0) for k in kinds] + [1.0] for r in rows], float)
    y = np.array([r["wall_s"] for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    res = y - x @ coef
    cov = float(res @ res) / max(len(rows) - x.shape[1], 1) * np.linalg.pinv(x.T @ x)
    r2 = 1 - float(res @ res) / max(float(((y - y.mean()) ** 2).sum()), 1e-30)
    cost = dict(zip(kinds, (float(v) for v in coef[:-1])))
    for r in rows:
        r["prefill_wall_s"] = r["wall_s"] - sum(cost[k] * v for k, v in r["step_buckets"].items()
                                                if k.endswith("decode"))
    return {"step_ms": {k: 1e3 * cost[k] for k in kinds},
            "step_ms_se": {k: 1e3 * float(np.sqrt(cov[i, i])) for i, k in enumerate(kinds)},
            "rest_s": float(coef[-1]), "r2": r2, "residual_std_s": float(res.std()),
            "runs": len(rows)}


def main(argv=None) -> int:
    """Refit a saved run: python -m benchmarks.hybrid_cache_steps runs/hybrid_cache_runN.json"""
    import json
    import sys
    path = (argv or sys.argv[1:])[0]
    results = json.load(open(path))["results"]
    print(json.dumps(fit_wall(results), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
