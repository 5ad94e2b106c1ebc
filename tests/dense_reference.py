"""An independent dense reference for the engine: full-matrix attention with the Block-Attention
mask, in numpy float64. It reuses only the model's params (and re-derives the segment structure,
positions and RoPE itself), never engine or attention code.

Block-Attention semantics (DESIGN §3): pads are dropped (no position, never attended); logical
positions run 0..n-1 over the remaining tokens; a token in an SSEP span attends to keys of its span
at or before it, any other token to every key at or before it. Markers count only at block starts
of the raw token list. Default RoPE only (theta from the config), rotate-half.
"""

from __future__ import annotations

import numpy as np


def segment_windows(tokens, block_size, pad, ssep, pdep, markers=True):
    """raw tokens -> (kept token ids, window start per kept token)."""
    kept, win = [], []
    span_start = None  # logical start of the current SSEP span, None inside a PDEP segment
    for i, t in enumerate(tokens):
        if markers and i % block_size == 0 and t in (ssep, pdep):
            span_start = len(kept) if t == ssep else None
        if markers and t == pad:
            continue
        kept.append(int(t))
        win.append(0 if span_start is None else span_start)
    return kept, win


def embedding_input(ids, cfg) -> np.ndarray:
    """The rows of the embedding that `ids` read. A marker beyond the vocabulary (vocab_size,
    +1, +2: pad, ssep, pdep) reads the embedding of the three highest ids that are not the
    config's BOS/EOS, in that order (the engine's documented rule, re-derived here)."""
    ids = np.asarray(ids, np.int64)
    reserved = set(cfg.eos_token_ids) | ({cfg.bos_token_id} - {None})
    borrowed = [i for i in range(cfg.vocab_size - 1, -1, -1) if i not in reserved][:3]
    beyond = ids >= cfg.vocab_size
    assert (ids[beyond] < cfg.vocab_size + 3).all(), "ids beyond the vocabulary but no marker"
    return np.where(beyond, np.asarray(borrowed)[np.clip(ids - cfg.vocab_size, 0, 2)], ids)


def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos[:, None] * inv[None, :]
    cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :]
    sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def reference_logprobs(params, cfg, kept, win):
    """log-softmax over the vocab for every kept token position: [n, V] float64."""
    f = lambda a: np.asarray(a, np.float64)
    if any("wqkv" in lp for lp in params["layers"]):  # the engine runs fused weights
        from minipic_jax.models.llama import unfuse_params
        params = unfuse_params(params)
    n = len(kept)
    pos = np.arange(n, dtype=np.float64)
    x = f(params["embed"])[embedding_input(kept, cfg)]
    q_i, k_i = np.arange(n)[:, None], np.arange(n)[None, :]
    mask = (k_i <= q_i) & (k_i >= np.asarray(win)[:, None])
    group = cfg.num_heads // cfg.num_kv_heads
    for lp in params["layers"]:
        h = _rms(x, f(lp["attn_norm"]), cfg.rms_norm_eps)
        q = _rope(np.einsum("te,ehd->thd", h, f(lp["wq"])), pos, cfg.rope.theta)
        k = _rope(np.einsum("te,ekd->tkd", h, f(lp["wk"])), pos, cfg.rope.theta)
        v = np.einsum("te,ekd->tkd", h, f(lp["wv"]))
        k = np.repeat(k, group, axis=1)
        v = np.repeat(v, group, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(cfg.head_dim)
        s = np.where(mask[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        a = np.einsum("hqk,khd->qhd", p, v)
        x = x + np.einsum("thd,hde->te", a, f(lp["wo"]))
        h = _rms(x, f(lp["mlp_norm"]), cfg.rms_norm_eps)
        g = h @ f(lp["w_gate"])
        x = x + ((g / (1 + np.exp(-g))) * (h @ f(lp["w_up"]))) @ f(lp["w_down"])
    x = _rms(x, f(params["final_norm"]), cfg.rms_norm_eps)
    head = f(params["embed"]).T if "lm_head" not in params else f(params["lm_head"])
    logits = x @ head
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def check_against_reference(params, cfg, prompt, output_ids, output_logprobs, *, block_size,
                            pad, ssep, pdep, markers=True, atol=2e-4):
    """Teacher-forced check of one request: every generated token is the reference's argmax (up
    to `atol` ties) and its logprob matches. Returns the max abs logprob error."""
    kept, win = segment_windows(prompt, block_size, pad, ssep, pdep, markers)
    n_prompt = len(kept)
    full = kept + list(output_ids[:-1])
    win = win + [win[-1]] * (len(full) - n_prompt)
    ref = reference_logprobs(params, cfg, full, win)[n_prompt - 1:]  # rows predicting outputs
    err = 0.0
    for j, tok in enumerate(output_ids):
        row = ref[j]
        assert row[tok] >= row.max() - atol, (
            f"token {j}: engine chose {tok} (ref logprob {row[tok]:.6f}) but reference argmax is "
            f"{int(row.argmax())} ({row.max():.6f})")
        if output_logprobs is not None:
            got = output_logprobs[j][tok].logprob
            err = max(err, abs(got - row[tok]))
            assert abs(got - row[tok]) < atol, f"token {j}: logprob {got} vs reference {row[tok]}"
    return err
