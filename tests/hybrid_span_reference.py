"""A float64 numpy dense reference of the hybrid span semantics (docs/DESIGN.md, "Spans on hybrid
models"), token by token, for the Qwen3.5 family. Independent of the engine and the kernels: it
reuses only the model's params and re-derives segments, positions, masks, RoPE and the recurrences.

Per kept (non-pad) token, in order, every layer:
- attention: an SSEP span token attends to its span's tokens at or before it; any other token to
  every kept token at or before it (Block-Attention). RoPE by logical position (partial rotary).
- Gated DeltaNet: a span token's conv window and delta state are the span's own (zero at the span
  start); a PDEP token uses the *flow*: the conv window over all earlier kept tokens' layer inputs,
  and the delta state run over every earlier token's own delta inputs (q, k, v, g, beta as that
  token computed them: a span token's from its span-local window), in order. So the state
  entering a PDEP segment is a replay of the recurrence over all earlier segments' span-local
  inputs, never a composition of maps (that is what the engine does and what this checks).
"""

from __future__ import annotations

import types

import numpy as np

from tests.dense_reference import embedding_input


def segments(tokens, block_size, pad, ssep, pdep):
    """raw tokens -> (kept ids, segment id per kept token [n], is-span per segment).

    A marker at a block start opens a segment (markers are ordinary kept tokens); a request that
    starts without a marker starts with a PDEP segment; pads are dropped.
    """
    kept, seg, span = [], [], []
    for i, t in enumerate(tokens):
        if i % block_size == 0 and t in (ssep, pdep):
            span.append(t == ssep)
        elif not span:
            span.append(False)
        if t == pad:
            continue
        kept.append(int(t))
        seg.append(len(span) - 1)
    return kept, np.asarray(seg), span


def _f(a):
    return np.asarray(a, np.float64)


def _rms(x, w, eps, unit_offset=True):
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return normed * ((1.0 + _f(w)) if unit_offset else _f(w))


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _rope_partial(x, pos, cfg):
    """Rotate-half on the first R dims of x [n, H, D] at logical positions pos [n]."""
    r = cfg.rotary_dim
    inv = 1.0 / cfg.rope.theta ** (np.arange(0, r, 2, dtype=np.float64) / r)
    ang = pos[:, None] * inv[None, :]
    cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :]
    sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :]
    xr = x[..., :r]
    rot = np.concatenate([-xr[..., r // 2:], xr[..., :r // 2]], -1)
    return np.concatenate([xr * cos + rot * sin, x[..., r:]], -1)


def _attention(h, p, cfg, mask):
    n = h.shape[0]
    pos = np.arange(n, dtype=np.float64)
    q = _rms(np.einsum("te,ehd->thd", h, _f(p.wq)), p.q_norm, cfg.rms_norm_eps)
    k = _rms(np.einsum("te,ekd->tkd", h, _f(p.wk)), p.k_norm, cfg.rms_norm_eps)
    v = np.einsum("te,ekd->tkd", h, _f(p.wv))
    gate = np.einsum("te,ehd->thd", h, _f(p.wgate))
    q, k = _rope_partial(q, pos, cfg), _rope_partial(k, pos, cfg)
    group = cfg.num_heads // cfg.num_kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(cfg.head_dim)
    s = np.where(mask[None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    a = np.einsum("hqk,khd->qhd", w, v) / (1.0 + np.exp(-gate))
    return np.einsum("thd,hde->te", a, _f(p.wo))


def _delta_step(s, k, v, g, beta):
    """One token of the gated delta rule for all value heads: s [Hv, Dk, Dv]."""
    s = s * np.exp(g)[:, None, None]
    delta = (v - np.einsum("hk,hkv->hv", k, s)) * beta[:, None]
    return s + k[:, :, None] * delta[:, None, :]


def _gdn(h, p, cfg, seg, span, trace=None):
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kc = cfg.linear_conv_kernel_dim
    mixed = h @ _f(p.w_qkv)  # [n, C]
    z = np.einsum("te,ehv->thv", h, _f(p.w_z))
    beta = 1.0 / (1.0 + np.exp(-(h @ _f(p.w_b))))
    a = h @ _f(p.w_a) + _f(p.dt_bias)
    g = -np.exp(_f(p.a_log)) * np.log1p(np.exp(a))
    conv_w = _f(p.conv_w)  # [C, Kc]
    flow_win = np.zeros((kc, mixed.shape[1]))
    flow_s = np.zeros((hv, dk, dv))
    core = np.zeros((h.shape[0], hv, dv))
    if trace is not None:  # per token: delta inputs; per segment: the flow entering it
        trace.update(k=[], v=[], g=g, beta=beta, entering={}, window={})
    for t in range(h.shape[0]):
        if trace is not None and (t == 0 or seg[t - 1] != seg[t]):
            trace["entering"][int(seg[t])] = flow_s.copy()
            trace["window"][int(seg[t])] = flow_win[1:].copy()
        in_span = span[seg[t]]
        if in_span and (t == 0 or seg[t - 1] != seg[t]):  # span start: fresh local state
            loc_win, loc_s = np.zeros_like(flow_win), np.zeros_like(flow_s)
        flow_win = np.concatenate([flow_win[1:], mixed[t][None]])
        if in_span:
            loc_win = np.concatenate([loc_win[1:], mixed[t][None]])
        win = loc_win if in_span else flow_win
        x = _silu(np.einsum("kc,ck->c", win, conv_w))
        q = x[:hk * dk].reshape(hk, dk)
        k = x[hk * dk:2 * hk * dk].reshape(hk, dk)
        v = x[2 * hk * dk:].reshape(hv, dv)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        if trace is not None:
            trace["k"].append(k)
            trace["v"].append(v)
        q, k = np.repeat(q, hv // hk, axis=0), np.repeat(k, hv // hk, axis=0)
        # every token advances the flow with the delta inputs it computed for itself (a span
        # token's from its span-local conv window): what the span's cached map holds
        flow_s = _delta_step(flow_s, k, v, g[t], beta[t])
        if in_span:
            loc_s = _delta_step(loc_s, k, v, g[t], beta[t])
        s = loc_s if in_span else flow_s
        core[t] = np.einsum("hk,hkv->hv", q * dk ** -0.5, s)
    normed = core / np.sqrt(np.mean(core * core, -1, keepdims=True) + cfg.rms_norm_eps)
    out = normed * _f(p.norm) * _silu(z)
    return np.einsum("thv,hve->te", out, _f(p.w_out))


def _attrs(tree):
    """The family's params dict read by attribute (p.wq, lp.mixer, ...)."""
    if isinstance(tree, dict):
        return types.SimpleNamespace(**{k: _attrs(v) for k, v in tree.items()})
    if isinstance(tree, (tuple, list)):
        return tuple(_attrs(v) for v in tree)
    return tree


def reference_logprobs(params, cfg, kept, seg, span, trace=None):
    """log-softmax over the vocab at every kept token: [n, V] float64. trace: None or a list that
    receives one dict per GDN layer (delta inputs k [n, Hk, Dk], v [n, Hv, Dv], g, beta [n, Hv];
    entering / window: segment -> flow delta state [Hv, Dk, Dv] / conv window [Kc-1, C])."""
    from minipic_jax.models.qwen3_5 import unfuse_params
    n = len(kept)
    # an engine's params are fused (qwen3_5.fuse_params): read the HF layout's matrices
    params = _attrs({"lm_head": None, **unfuse_params(params)})  # no lm_head when tied
    x = _f(params.embed)[embedding_input(kept, cfg)]
    q_i, k_i = np.arange(n)[:, None], np.arange(n)[None, :]
    in_span = np.asarray([span[s] for s in seg])
    mask = (k_i <= q_i) & (~in_span[:, None] | (seg[:, None] == seg[None, :]))
    for i, lp in enumerate(params.layers):
        h = _rms(x, lp.attn_norm, cfg.rms_norm_eps)
        if cfg.layer_types[i] == "full_attention":
            x = x + _attention(h, lp.mixer, cfg, mask)
        else:
            layer_trace = None if trace is None else {}
            x = x + _gdn(h, lp.mixer, cfg, seg, span, layer_trace)
            if trace is not None:
                trace.append(layer_trace)
        h = _rms(x, lp.mlp_norm, cfg.rms_norm_eps)
        x = x + (_silu(h @ _f(lp.w_gate)) * (h @ _f(lp.w_up))) @ _f(lp.w_down)
    x = _rms(x, params.final_norm, cfg.rms_norm_eps)
    head = _f(params.embed).T if params.lm_head is None else _f(params.lm_head)
    logits = x @ head
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
