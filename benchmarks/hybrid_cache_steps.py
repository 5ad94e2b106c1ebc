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
    """Least squares over the runs: wall = per_step x steps + per_padded x padded tokens + rest
    (a step costs a fixed part plus its bucket's tokens). Per run, `prefill_wall_s`: the wall
    less the fitted cost of its decode-only steps (what caching can shorten). None with fewer
    runs than 4."""
    import numpy as np
    rows = [r for r in results if "padded_tokens" in r]
    if len(rows) < 4:
        return None
    x = np.array([[r["steps"], r["padded_tokens"], 1.0] for r in rows], float)
    y = np.array([r["wall_s"] for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ coef
    r2 = 1 - float(((y - pred) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-30))
    step_s, tok_s, rest = (float(v) for v in coef)
    for r in rows:
        dec = sum(v for k, v in r["step_buckets"].items() if k.endswith("decode"))
        dec_tokens = sum(int(k.split()[0]) * v for k, v in r["step_buckets"].items()
                         if k.endswith("decode"))
        r["prefill_wall_s"] = r["wall_s"] - dec * step_s - dec_tokens * tok_s
    return {"per_step_ms": 1e3 * step_s, "per_padded_token_us": 1e6 * tok_s, "rest_s": rest,
            "r2": r2, "residual_std_s": float((y - pred).std()), "runs": len(rows)}
