"""paged_attention's input checks: shapes and dtypes (always), and the values of the metadata
(when concrete: under jit they are tracers and the checks are skipped)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

KV_MODES = ("position_free", "rotated")
_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)
_INT_FIELDS = ("q_positions", "q_window_start", "q_seq", "cu_q_lens", "num_blocks", "block_tables",
               "block_pos_start", "block_num_valid", "slot_mapping")


def validate(q, k_pages, v_pages, md, inv_freq, kv_mode):
    """Shape and dtype checks of a paged_attention call (ValueError naming the field)."""
    if kv_mode not in KV_MODES:
        raise ValueError(f"paged_attention: kv_mode must be one of {KV_MODES}, got {kv_mode!r}")
    if q.ndim != 3 or k_pages.ndim != 4:
        raise ValueError(f"paged_attention: q must be [T, H, D] and pages [P, B, K, D], "
                         f"got q{q.shape} k_pages{k_pages.shape}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"paged_attention: k_pages {k_pages.shape} != v_pages {v_pages.shape}")
    tokens, heads, head_dim = q.shape
    kv_heads = k_pages.shape[2]
    if k_pages.shape[3] != head_dim:
        raise ValueError(f"paged_attention: head_dim of q ({head_dim}) != pages "
                         f"({k_pages.shape[3]})")
    if heads % kv_heads:
        raise ValueError(f"paged_attention: {heads} query heads not a multiple of {kv_heads} "
                         f"kv heads")
    if 2 * inv_freq.shape[-1] > head_dim:
        raise ValueError(f"paged_attention: rotary dim {2 * inv_freq.shape[-1]} > head_dim "
                         f"{head_dim}")
    for name in ("q_positions", "q_window_start", "q_seq", "slot_mapping"):
        if getattr(md, name).shape != (tokens,):
            raise ValueError(f"paged_attention: metadata.{name} must be [{tokens}], "
                             f"got {getattr(md, name).shape}")
    seqs = md.block_tables.shape[0]
    for name in ("block_pos_start", "block_num_valid"):
        if getattr(md, name).shape != md.block_tables.shape:
            raise ValueError(f"paged_attention: metadata.{name} must match block_tables "
                             f"{md.block_tables.shape}, got {getattr(md, name).shape}")
    if md.cu_q_lens.shape != (seqs + 1,) or md.num_blocks.shape != (seqs,):
        raise ValueError(f"paged_attention: cu_q_lens must be [{seqs + 1}] and num_blocks [{seqs}]")
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if x.dtype not in _FLOATS:
            raise ValueError(f"paged_attention: {name} dtype must be float32/bfloat16/float16, "
                             f"got {x.dtype}")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"paged_attention: k_pages {k_pages.dtype} != v_pages {v_pages.dtype}")
    if not jnp.issubdtype(inv_freq.dtype, jnp.floating):
        raise ValueError(f"paged_attention: inv_freq must be floating, got {inv_freq.dtype}")
    for name in _INT_FIELDS:
        if getattr(md, name).dtype != jnp.int32:
            raise ValueError(f"paged_attention: metadata.{name} must be int32, "
                             f"got {getattr(md, name).dtype}")


def validate_values(q, k_pages, md):
    """Data-dependent checks; they need concrete arrays, so they are skipped under jit (tracers)."""
    fields = (md.cu_q_lens, md.num_blocks, md.block_tables, md.block_num_valid)
    if any(isinstance(x, jax.core.Tracer) for x in fields):
        return
    cu, nb, tables, n_valid = (np.asarray(x) for x in fields)
    num_pages, page_size = k_pages.shape[:2]
    max_blocks = tables.shape[1]
    if cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > q.shape[0]:
        raise ValueError(f"paged_attention: cu_q_lens must rise from 0 to at most {q.shape[0]} "
                         f"tokens, got {cu.tolist()}")
    bad = np.flatnonzero((nb < 0) | (nb > max_blocks))
    if bad.size:
        s = int(bad[0])
        raise ValueError(f"paged_attention: sequence {s} uses {int(nb[s])} blocks, table holds "
                         f"{max_blocks}")
    in_use = np.arange(max_blocks)[None, :] < nb[:, None]
    bad = np.argwhere(in_use & ((tables < 0) | (tables >= num_pages)))
    if bad.size:
        s, b = (int(i) for i in bad[0])
        raise ValueError(f"paged_attention: block_tables[{s}, {b}] = {int(tables[s, b])} is "
                         f"outside the pool [0, {num_pages})")
    bad = np.argwhere(in_use & ((n_valid < 0) | (n_valid > page_size)))
    if bad.size:
        s, b = (int(i) for i in bad[0])
        raise ValueError(f"paged_attention: block_num_valid[{s}, {b}] = {int(n_valid[s, b])} "
                         f"not in [0, {page_size}]")


def check_decode_only(md, implementation):
    """Decode kernels take at most one query per sequence (checked when not tracing)."""
    if isinstance(md.cu_q_lens, jax.core.Tracer):
        return
    lens = np.diff(np.asarray(md.cu_q_lens))
    if np.any(lens > 1):
        s = int(np.argmax(lens > 1))
        raise ValueError(f"paged_attention: implementation={implementation!r} is decode-only; "
                         f"sequence {s} has {int(lens[s])} query tokens")
