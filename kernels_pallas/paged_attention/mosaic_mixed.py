"""The engine's prefill and mixed prefill + decode steps on the Mosaic GPU kernels.

`paged_attention(implementation="mixed")`. An engine step holds decode rows (one query of a
sequence) and prefill chunks (several queries of a sequence) in one ragged batch whose metadata
is sized for the whole step: S sequence rows, each with a block table as wide as max_model_len.
The Mosaic prefill kernel's pre-pass gathers every sequence row's keys into a contiguous buffer
[S, N, K, D], which at engine sizes (S = 128, N = 8192) is gigabytes per layer. So:

  * decode rows go to the decode kernel (`implementation="decode"`: the Mosaic MMA kernel where it
    takes the shapes, else triton_decode), with the prefill sequences' block counts zeroed;
  * the sequences with two or more query rows are compacted into `prefill_seqs` slots (a static
    bound chosen from the step's token count, `prefill_slots`) and run through the Mosaic prefill
    kernel, whose pre-pass then gathers only those slots; with `splits` > 1 the key axis of each
    query tile is split (mosaic_prefill_split.py: few query rows over a long cached context);
  * a step with more prefill sequences than slots runs the Triton ragged kernel instead
    (lax.cond: both are compiled, one runs).

Each query row takes exactly one of the two results. The compaction keeps the rows where they
are: each slot carries its sequence's (first row, end row), so no query is moved.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.paged_attention.mosaic_prefill import (mosaic_prefill_limits,
                                                           prefill_attention_mosaic)
from kernels_pallas.paged_attention.mosaic_prefill_split import prefill_attention_split
from kernels_pallas.rope import apply_rope

SPLIT_MAX_TOKENS = 512  # steps of at most this many query tokens split the key axis


def prefill_slots(tokens: int, seqs: int) -> int:
    """Static bound on the prefill sequences of a `tokens`-row step that the Mosaic path takes:
    one per 2048 query rows, at least 2. The pre-pass gathers this many whole block tables
    (slots x max_model_len keys), so the bound trades gather traffic against overflow steps."""
    return max(1, min(seqs, max(2, tokens // 2048)))


def mixed_limits(q, k_pages) -> str:
    """Why this path cannot take these shapes ('' when it can): the Mosaic prefill kernel's."""
    return mosaic_prefill_limits(q, k_pages)


@dataclasses.dataclass(frozen=True)
class _Compact:
    """The prefill slots' metadata (the fields the Mosaic prefill pre-pass and schedule read)."""
    q_positions: jax.Array  # [T] as in the step
    q_window_start: jax.Array  # [T]
    cu_q_lens: jax.Array  # [P + 1] unused placeholder (q_bounds gives the rows)
    q_bounds: tuple  # ([P] first row, [P] end row); empty for unused slots
    num_blocks: jax.Array  # [P]
    block_tables: jax.Array  # [P, NB]
    block_pos_start: jax.Array  # [P, NB]
    block_num_valid: jax.Array  # [P, NB]


def compact_prefill(md, slots: int):
    """(_Compact of the first `slots` sequences with >= 2 query rows, their count, [T] bool of
    the rows that belong to such a sequence)."""
    cu = md.cu_q_lens
    q_lens = cu[1:] - cu[:-1]
    prefill = q_lens > 1  # [S]
    count = jnp.sum(prefill.astype(jnp.int32))
    (idx,) = jnp.nonzero(prefill, size=slots, fill_value=0)
    live = jnp.arange(slots) < count
    first = jnp.where(live, cu[idx], 0)
    end = jnp.where(live, cu[idx + 1], 0)
    seq = jnp.clip(md.q_seq, 0, prefill.shape[0] - 1)
    rows = jnp.arange(md.q_seq.shape[0])
    in_seq = (rows >= cu[seq]) & (rows < cu[seq + 1])
    prefill_row = prefill[seq] & in_seq
    compact = _Compact(
        q_positions=md.q_positions, q_window_start=md.q_window_start,
        cu_q_lens=jnp.zeros((slots + 1,), jnp.int32), q_bounds=(first, end),
        num_blocks=jnp.where(live, md.num_blocks[idx], 0), block_tables=md.block_tables[idx],
        block_pos_start=md.block_pos_start[idx], block_num_valid=md.block_num_valid[idx])
    return compact, count, prefill_row


def decode_batch(q, md):
    """The step's decode rows as a decode-only batch: row s = sequence s's first query row, the
    prefill sequences (and empty ones) with no blocks. -> (q [S, H, D], metadata)."""
    cu = md.cu_q_lens
    seqs = cu.shape[0] - 1
    q_lens = cu[1:] - cu[:-1]
    row = jnp.clip(cu[:-1], 0, q.shape[0] - 1)
    ar = jnp.arange(seqs, dtype=jnp.int32)
    md_d = dataclasses.replace(
        md, q_positions=md.q_positions[row], q_window_start=md.q_window_start[row], q_seq=ar,
        cu_q_lens=jnp.concatenate([ar, jnp.full((1,), seqs, jnp.int32)]),
        num_blocks=jnp.where(q_lens == 1, md.num_blocks, 0),
        slot_mapping=jnp.full((seqs,), -1, jnp.int32))
    return q[row], md_d


def mixed_attention(q_rot, q, k_pages, v_pages, md, inv_freq, *, decode, ragged, rotate_keys,
                    attention_scaling, sm_scale, prefill_seqs: int, splits: int = 1,
                    interpret=False):
    """One engine step (see module doc). q_rot: [T, H, D] rotated queries (the Mosaic prefill
    kernel's input); q: unrotated (decode(q, md) and ragged(q, md) are paged_attention with the
    decode and the Triton ragged implementations bound). Returns [T, H, D] in q's dtype."""
    compact, count, prefill_row = compact_prefill(md, prefill_seqs)
    q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]

    def prefill_part():
        kw = dict(rotate_keys=rotate_keys, attention_scaling=attention_scaling,
                  sm_scale=sm_scale, interpret=interpret)
        if splits > 1:
            return prefill_attention_split(q_rot, k_pages, v_pages, compact, inv_freq,
                                           splits=splits, **kw)
        return prefill_attention_mosaic(q_rot, k_pages, v_pages, compact, inv_freq, **kw)

    def mosaic_path():
        out = prefill_part()
        q_d, md_d = decode_batch(q, md)
        out_d = decode(q_d, md_d)[jnp.clip(md.q_seq, 0, q_lens.shape[0] - 1)]  # [T, H, D]
        return jnp.where(prefill_row[:, None, None], out, out_d.astype(out.dtype))

    if _concrete(count):  # eager calls (interpret-mode tests): take the branch in Python
        return mosaic_path() if int(count) <= prefill_seqs else ragged(q, md)
    return lax.cond(count <= prefill_seqs, mosaic_path, lambda: ragged(q, md))


def prefill_choice(q, k_pages, inv_freq, options, interpret):
    """implementation="prefill" (a step that may hold prefill chunks) -> (implementation,
    kernel_options): "mixed" (Mosaic prefill for the prefill sequences, the decode kernel for
    decode rows; mosaic_mixed.py) on a GPU where the Mosaic prefill kernel takes the shapes
    (bf16/f16, head_dim 64 or 128), else the Triton ragged kernel where it takes them, else
    XLA. options may hold max_position (passed to the decode part)."""
    from kernels_pallas.paged_attention.api import _triton_limits
    on_gpu = jax.default_backend() == "gpu" and not interpret
    if on_gpu and not mixed_limits(q, k_pages):
        return "mixed", options
    if (on_gpu or interpret) and not _triton_limits(q, k_pages, inv_freq, None):
        return "triton", {}
    return "xla", {}


def mixed_call(q, k_pages, v_pages, md, inv_freq, *, kv_mode, attention_scaling, sm_scale,
           interpret, options):
    """implementation="mixed": options prefill_seqs (default prefill_slots), splits (default 16
    for steps of <= SPLIT_MAX_TOKENS query rows, else 1), max_position (decode part)."""
    from kernels_pallas.paged_attention.api import paged_attention
    tokens, seqs = q.shape[0], md.block_tables.shape[0]
    prefill_seqs = options.pop("prefill_seqs", prefill_slots(tokens, seqs))
    splits = options.pop("splits", 16 if tokens <= SPLIT_MAX_TOKENS else 1)
    common = dict(kv_mode=kv_mode, attention_scaling=attention_scaling, sm_scale=sm_scale,
                  interpret=interpret)
    decode = functools.partial(paged_attention, k_pages=k_pages, v_pages=v_pages,
                               inv_freq=inv_freq, implementation="decode",
                               kernel_options=options, **common)
    ragged = functools.partial(paged_attention, k_pages=k_pages, v_pages=v_pages,
                               inv_freq=inv_freq, implementation="triton", **common)
    q_rot = apply_rope(q, md.q_positions, inv_freq, attention_scaling)
    return mixed_attention(
        q_rot, q, k_pages, v_pages, md, inv_freq,
        decode=lambda x, m: decode(x, metadata=m), ragged=lambda x, m: ragged(x, metadata=m),
        rotate_keys=kv_mode == "position_free", attention_scaling=attention_scaling,
        sm_scale=sm_scale, prefill_seqs=prefill_seqs, splits=splits, interpret=interpret)


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)
