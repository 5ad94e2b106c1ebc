"""tests/hybrid_span_reference.py in float32: the same token-by-token numpy model with every
float64 array made float32. An independent float32 implementation (it shares no code with the
engine), so its distance to the float64 reference is float32's own floor at a prompt's tokens:
what the engine's float32 logprobs may sit at without any error of theirs
(tests/test_tensor_parallel.py, scripts/tp_precision.py)."""

from __future__ import annotations

import inspect
import types

import numpy as np

from tests import hybrid_span_reference as hsr


def float32_reference() -> types.ModuleType:
    """hybrid_span_reference with every float64 array made float32 (its reference_logprobs
    then returns float32: tests/test_tensor_parallel.py checks)."""
    src = inspect.getsource(hsr).replace("np.float64", "np.float32")
    # float64 defaults (allocations) and float64 scalars (np.sqrt of a Python int: NumPy 2
    # promotes a float32 array divided by one to float64) made float32
    for old, new in [(alloc, alloc[:-1] + ", np.float32)") for alloc in (
            "np.zeros((kc, mixed.shape[1]))", "np.zeros((hv, dk, dv))",
            "np.zeros((h.shape[0], hv, dv))")] + [
            ("np.sqrt(cfg.head_dim)", "np.float32(np.sqrt(cfg.head_dim))")]:
        assert old in src, f"float32_reference: {old} is no longer in hybrid_span_reference"
        src = src.replace(old, new)
    mod = types.ModuleType("hybrid_span_reference_f32")
    exec(src, mod.__dict__)
    return mod


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
