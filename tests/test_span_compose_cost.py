"""benchmarks/span_compose_cost.py: the capture keeps the compose call with the most cached maps
as it was, though the composer refills the same buffer every step (span_compose.ComposeInputs),
and its plan counts what chain_compose runs."""

from types import SimpleNamespace

import numpy as np

from benchmarks import span_compose_cost
from serving.hybrid import span_compose


class _Runner:
    ck_pool = None

    def _dispatch(self, ints, floats, use_prev, kw):
        return None


def test_capture_keeps_the_chains_of_its_compose_call():
    runner = _Runner()
    capture = span_compose_cost.WarmStepCapture(runner)
    spec, size = span_compose.layout(4, 16, False)
    ints = np.zeros(size, np.int32)
    off, shape = spec["chain"]
    chain = ints[off:off + 64].reshape(shape)
    kw = {"compose": (4, 16)}
    chain[:] = -1
    chain[0, :12], chain[1, :10], chain[2, :8] = 1, 2, 3  # 30 maps
    runner._dispatch(ints, None, False, kw)
    runner._dispatch(np.zeros(8, np.int32), np.zeros(2, np.float32), False, {"t": 64})  # its step
    chain[:] = -1
    chain[0, :1] = 5  # the next step's compose call, one map, same buffer
    runner._dispatch(ints, None, False, kw)
    capture.close()
    f = capture.best[4]
    assert capture.maps == 30 and int((f["chain"] >= 0).sum()) == 30
    shape = SimpleNamespace(shape=(6, 18, 16, 128, 128))  # _plan reads the pool's shapes only
    pool = SimpleNamespace(a=shape, b=shape)
    plan = span_compose_cost._plan(pool, f["chain"])  # Qwen3.5-0.8B: 1.208 GFLOP a map
    assert (plan["maps"], plan["applications"], plan["applications_before"]) == (30, 30, 48)
    assert round(plan["gflop"], 1) == 36.2
