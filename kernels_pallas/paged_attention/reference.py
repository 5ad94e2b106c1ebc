"""Plain numpy reference for paged attention: per-sequence loops, float64 math.

Written independently of `api._xla_paged_attention` (no gather over the whole table, no shared
mask code): for every sequence it walks the block table entry by entry, collects the valid slots
with their logical positions, rotates keys (position_free) and queries in float64 from float32
angles (`pos * inv_freq` formed in float32, as HF does), and runs a dense masked softmax.
Rows that belong to no sequence (bucket padding past cu_q_lens[-1]) come back as NaN.
"""

from __future__ import annotations

import numpy as np


def _rotate(x, positions, inv_freq, attention_scaling):
    """x [N, Hx, D] float64, positions [N] -> rotated copy (rotate-half, partial rotary)."""
    half = inv_freq.shape[0]
    rot = 2 * half
    angle = positions.astype(np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]  # [N, R/2]
    angle = angle.astype(np.float64)
    cos = (np.cos(angle) * attention_scaling)[:, None, :]  # [N, 1, R/2]
    sin = (np.sin(angle) * attention_scaling)[:, None, :]
    out = x.copy()
    x1, x2 = x[..., :half], x[..., half:rot]
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rot] = x2 * cos + x1 * sin
    return out


def paged_attention_reference(q, k_pages, v_pages, md, inv_freq, *, kv_mode="position_free",
                              attention_scaling=1.0, sm_scale=None):
    """Reference for `api.paged_attention` (same arguments); returns float64 numpy [T, H, D]."""
    q = np.asarray(q, np.float64)
    k_pages = np.asarray(k_pages, np.float64)
    v_pages = np.asarray(v_pages, np.float64)
    inv_freq = np.asarray(inv_freq, np.float32)
    tokens, heads, head_dim = q.shape
    kv_heads = k_pages.shape[2]
    group = heads // kv_heads
    if sm_scale is None:
        sm_scale = head_dim ** -0.5
    cu = np.asarray(md.cu_q_lens)
    q_pos = np.asarray(md.q_positions)
    q_win = np.asarray(md.q_window_start)
    tables = np.asarray(md.block_tables)
    starts = np.asarray(md.block_pos_start)
    n_valid = np.asarray(md.block_num_valid)
    n_blocks = np.asarray(md.num_blocks)

    out = np.full((tokens, heads, head_dim), np.nan)
    for s in range(tables.shape[0]):
        rows = np.arange(cu[s], cu[s + 1])
        if rows.size == 0:
            continue
        keys, values, key_pos = [], [], []
        for b in range(n_blocks[s]):
            page = tables[s, b]
            for j in range(n_valid[s, b]):
                keys.append(k_pages[page, j])
                values.append(v_pages[page, j])
                key_pos.append(starts[s, b] + j)
        qs = _rotate(q[rows], q_pos[rows], inv_freq, attention_scaling)  # [Q, H, D]
        if not keys:
            out[rows] = 0.0
            continue
        keys = np.stack(keys)  # [N, K, D]
        values = np.stack(values)
        key_pos = np.asarray(key_pos)
        if kv_mode == "position_free":
            keys = _rotate(keys, key_pos, inv_freq, attention_scaling)
        for h in range(heads):
            kh = h // group
            scores = qs[:, h, :] @ keys[:, kh, :].T * sm_scale  # [Q, N]
            mask = ((key_pos[None, :] <= q_pos[rows][:, None])
                    & (key_pos[None, :] >= q_win[rows][:, None]))
            scores = np.where(mask, scores, -np.inf)
            row_max = scores.max(axis=1, keepdims=True)
            row_max = np.where(np.isfinite(row_max), row_max, 0.0)
            probs = np.where(mask, np.exp(scores - row_max), 0.0)
            denom = probs.sum(axis=1, keepdims=True)
            out[rows, h, :] = probs @ values[:, kh, :] / np.where(denom == 0, 1.0, denom)
    return out


def rotate_keys_reference(keys, positions, inv_freq, attention_scaling=1.0):
    """keys [N, K, D], positions [N] -> float64 keys rotated by position (for the classic path)."""
    return _rotate(np.asarray(keys, np.float64), np.asarray(positions), inv_freq, attention_scaling)
