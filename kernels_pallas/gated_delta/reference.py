"""Token-by-token gated delta rule, the oracle for the chunked forms (numpy, float64 by default).

For each value head h (key head h // (Hv // Hk), GQA), state S [Dk, Dv], token t:
    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T        (the delta rule)
    o_t = S^T (scale * q_t)
This is HF transformers' `torch_recurrent_gated_delta_rule` with q/k already L2-normalised.
"""

import numpy as np


def gated_delta_reference(q, k, v, g, beta, state0=None, *, scale=None, dtype=np.float64):
    """Run the recurrence one token at a time.

    Args:
      q, k: [N, T, Hk, Dk] (L2-normalised by the caller if the model wants it).
      v: [N, T, Hv, Dv] with Hv % Hk == 0.
      g: [N, T, Hv] log decay (<= 0); beta: [N, T, Hv] write strength.
      state0: [N, Hv, Dk, Dv] or None (zeros).
      scale: query scale, default Dk ** -0.5.
    Returns:
      out [N, T, Hv, Dv], states [N, T, Hv, Dk, Dv] (the state after each token), both `dtype`.
    """
    q, k, v, g, beta = (np.asarray(x, dtype) for x in (q, k, v, g, beta))
    n, t_len, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    rep = hv // hk
    q = np.repeat(q, rep, axis=2) * (dk ** -0.5 if scale is None else scale)
    k = np.repeat(k, rep, axis=2)
    s = np.zeros((n, hv, dk, dv), dtype) if state0 is None else np.array(state0, dtype)
    out = np.zeros((n, t_len, hv, dv), dtype)
    states = np.zeros((n, t_len, hv, dk, dv), dtype)
    for t in range(t_len):
        s = s * np.exp(g[:, t])[:, :, None, None]
        kv_mem = np.einsum("nhk,nhkv->nhv", k[:, t], s)
        delta = (v[:, t] - kv_mem) * beta[:, t][:, :, None]
        s = s + k[:, t][:, :, :, None] * delta[:, :, None, :]
        out[:, t] = np.einsum("nhk,nhkv->nhv", q[:, t], s)
        states[:, t] = s
    return out, states
