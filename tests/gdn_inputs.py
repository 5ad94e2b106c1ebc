"""Random gated-delta-rule inputs shaped like Qwen3.5's, shared by the GDN kernel tests."""

import numpy as np


def gdn_inputs(rng, n, t, hk, hv, dk, dv, decay=1.0):
    """(q, k, v, g, beta) float32 for n sequences of t tokens: L2-normalised q, k [n, t, hk, dk],
    v [n, t, hv, dv], Qwen3.5-like gates g = -decay exp(A_log) softplus(a + dt_bias) and
    beta = sigmoid(b) [n, t, hv] (decay < 1 keeps long spans' products away from zero)."""
    def l2(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
    q = l2(rng.standard_normal((n, t, hk, dk))).astype(np.float32)
    k = l2(rng.standard_normal((n, t, hk, dk))).astype(np.float32)
    v = rng.standard_normal((n, t, hv, dv)).astype(np.float32)
    a_log = np.log(rng.uniform(0.01, 4, hv))
    softplus = np.log1p(np.exp(rng.standard_normal((n, t, hv)) - 1))
    g = (-decay * np.exp(a_log) * softplus).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((n, t, hv))))).astype(np.float32)
    return q, k, v, g, beta
