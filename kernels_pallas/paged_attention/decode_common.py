"""Pieces the split-K decode kernels (triton_decode.py, mosaic_decode.py) share, in plain jnp:
the log-sum-exp merge of the splits' partial results and the cos | sin tables of key positions."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def merge_splits(out, lse, md):
    """Log-sum-exp merge of the splits' partial results, one elementwise pass (splits unrolled).

    out [splits, T, H, D], lse [splits, T, H]; a split that saw no visible key has lse = -inf and
    weight 0. Rows that are no sequence's query (never written by the kernel) come back zero.
    """
    seq = jnp.clip(md.q_seq, 0, md.num_blocks.shape[0] - 1)
    t = jnp.arange(md.q_seq.shape[0], dtype=jnp.int32)
    is_query = (md.cu_q_lens[seq] == t) & (md.cu_q_lens[seq + 1] > t)  # [T]
    m = functools.reduce(jnp.maximum, list(lse))  # [T, H]
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    num = den = 0.0
    for o_i, lse_i in zip(out, lse):
        w = jnp.exp(lse_i - m)[..., None]  # [T, H, 1]
        num = num + jnp.where(w > 0, o_i, 0.0) * w
        den = den + w
    merged = num / jnp.where(den == 0, 1.0, den)
    return jnp.where(is_query[:, None, None], merged, 0.0)


def rope_table_in_graph(inv_freq, max_position: int, attention_scaling: float, dtype):
    """rope_table's values computed by jnp ops (staged into the jitted graph)."""
    ang = jnp.arange(max_position, dtype=jnp.float32)[:, None] * jnp.asarray(inv_freq,
                                                                             jnp.float32)
    table = jnp.concatenate([jnp.cos(ang), jnp.sin(ang)], axis=1) * attention_scaling
    return table.astype(dtype)


def rope_table(inv_freq, max_position: int, attention_scaling: float, dtype):
    """[max_position, R] cos | sin of pos * inv_freq (angle formed in float32, as HF does).

    A concrete inv_freq (numpy, or an array closed over by the jitted function) gets a table
    built once on the host and reused by every call and layer; a traced one (e.g. jnp.asarray
    inside the jitted function) builds it in the graph on every call. The models pass numpy."""
    if isinstance(inv_freq, jax.core.Tracer):
        return rope_table_in_graph(inv_freq, max_position, attention_scaling, dtype)
    inv = np.asarray(inv_freq, np.float32)
    return jnp.asarray(_host_rope_table(inv.tobytes(), max_position, float(attention_scaling),
                                        jnp.dtype(dtype).name))  # a jit constant


@functools.lru_cache(maxsize=16)
def _host_rope_table(inv_bytes: bytes, max_position: int, scaling: float, dtype: str):
    """The traced branch of rope_table in numpy (float32 angle, cos/sin rounded once)."""
    inv = np.frombuffer(inv_bytes, np.float32)
    ang = np.arange(max_position, dtype=np.float32)[:, None] * inv  # float32, as HF forms it
    ang = ang.astype(np.float64)
    table = np.concatenate([np.cos(ang), np.sin(ang)], axis=1) * scaling
    table = table.astype(np.float32).astype(jnp.dtype(dtype))
    table.flags.writeable = False  # shared by every caller
    return table


def check_max_position(md, max_position, kernel: str):
    """The table covers positions [0, max_position): every query (hence every key it sees)."""
    if not isinstance(max_position, int) or max_position <= 0:
        raise ValueError(f"{kernel}: rope='table' needs kernel_options max_position (a "
                         f"positive int bounding the positions), got {max_position!r}")
    if isinstance(md.q_positions, jax.core.Tracer) or isinstance(md.cu_q_lens, jax.core.Tracer):
        return
    n = int(md.cu_q_lens[-1])
    pos, win = md.q_positions[:n], md.q_window_start[:n]
    if n and (int(jnp.max(pos)) >= max_position or int(jnp.min(win)) < 0):
        raise ValueError(f"{kernel}: rope='table' covers positions [0, {max_position}) "
                         f"(max_position) but queries span [{int(jnp.min(win))}, "
                         f"{int(jnp.max(pos))}]")
