"""The engine's prefill and mixed prefill + decode steps on the Mosaic GPU kernels.

`paged_attention(implementation="mixed")`, registered in api.py and its "auto" choice for
steps that may hold prefill chunks on a GPU. An engine step holds decode rows (one query of a
sequence) and prefill chunks (several queries of a sequence) in one ragged batch whose metadata
is sized for the whole step: S sequence rows, each with a block table as wide as max_model_len.
The Mosaic prefill kernel's pre-pass gathers every sequence row's keys into a contiguous buffer
[S, N, K, D], which at engine sizes (S = 128, N = 8192) is gigabytes per layer. So:

  * decode rows go to the decode kernel (the registry's "auto" choice for decode-only steps:
    mosaic_decode where it takes the shapes, else triton_decode), with the prefill sequences'
    block counts zeroed;
  * the sequences with two or more query rows are compacted into `prefill_seqs` slots (a static
    bound chosen from the step's token count, `prefill_slots`) and run through the Mosaic prefill
    kernel, whose pre-pass then gathers only those slots; with `splits` > 1 the key axis of each
    query tile is split (mosaic_prefill_split.py: few query rows over a long cached context);
  * a step with more prefill sequences than slots runs the `overflow` implementation (Triton
    ragged) instead. The engine knows each step's sequences before it launches the step, so it
    decides this on the host (`plan_step`: a static `prefill_fits`, one compiled variant per
    outcome). It also knows when a small step holds no decode row (the cached-span request: one
    sequence of 72 query rows), and then the decode kernel and its gathers are left out
    (`decode_rows` False: per layer the decode kernel, the merge of its partials, two row
    gathers and the select are gone). Only a caller that cannot know (prefill_fits None under
    jit) gets a lax.cond, which XLA's GPU runtime executes by copying the predicate to the host
    and blocking the stream: one host sync per call, i.e. per layer.

Each query row takes exactly one of the two results. The compaction keeps the rows where they
are: each slot carries its sequence's (first row, end row), so no query is moved.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.paged_attention.mosaic_prefill import (mosaic_prefill_limits,
                                                           prefill_attention_mosaic)
from kernels_pallas.paged_attention.mosaic_prefill_prep import direct_v_limits
from kernels_pallas.paged_attention.mosaic_prefill_paged import PagedOptions, paged_limits
from kernels_pallas.paged_attention.mosaic_prefill_split import prefill_attention_split

SPLIT_MAX_TOKENS = 512  # steps of at most this many query tokens split the key axis


def prefill_slots(tokens: int, seqs: int) -> int:
    """Static bound on the prefill sequences of a `tokens`-row step that the Mosaic path takes:
    one per 512 query rows, at least 2. Compiled, the pre-pass writes only the live slots' live
    key steps (triton_gather.py), so a slot costs its share of the [slots, max_model_len, K, D]
    buffers' memory (not their traffic) and a few dead tiles; the split merge's partials grow
    with the slots too, so small steps keep 2. More prefill sequences than slots: `overflow`."""
    return max(1, min(seqs, max(2, tokens // 512)))


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


@dataclasses.dataclass(frozen=True)
class MixedOptions:
    """prefill_seqs: prefill slots (None: `prefill_slots` of the step); splits: key-axis splits
    of the prefill part (None: 16 for steps of <= SPLIT_MAX_TOKENS query rows, else 1);
    max_position: the decode rows' position bound (None: the problem's table bound); overflow:
    the implementation of steps with more prefill sequences than slots; prefill_fits: whether
    this step's prefill sequences fit the slots, decided by the caller on the host (`plan_step`;
    True: the Mosaic path, False: `overflow`, None: checked on device, see module doc);
    decode_rows: whether the step may hold sequences of one query row (False, the caller's
    promise: the decode part is not traced; rows of no prefill sequence are then left as the
    prefill kernel leaves them, i.e. garbage or zero); direct_v: the prefill kernel reads values
    from the pages (the pre-pass gathers keys only: half its traffic; needs finite values in
    every page slot, as mosaic_decode does; mosaic_prefill.prepare); skip_idle: prefill
    warpgroups that own no row skip their work (mosaic_prefill._kernel). direct_v and skip_idle
    None: on (mixed_defaults; direct_v where direct_v_limits allows), measured on the H200 at
    the cached-span step's attention call: 0.87x the call's time with both off
    (benchmarks/RESULTS.md, Attention: prefill). paged_k: no pre-pass at all, keys read from
    the pages and rotated in the kernel (mosaic_prefill_paged.py; off until the H200 measures
    it; the table bound is max_position when set, else max_model_len)."""

    prefill_seqs: int | None = None
    splits: int | None = None
    max_position: int | None = None
    overflow: str = "triton"
    prefill_fits: bool | None = None
    decode_rows: bool = True
    direct_v: bool | None = None
    skip_idle: bool | None = None
    paged_k: bool = False


def plan_step(options: MixedOptions, tokens: int, seqs: int, prefill_count: int,
              decode_count: int | None = None) -> MixedOptions:
    """The options of one step of `tokens` query rows and `seqs` sequence rows, `prefill_count`
    of which have two or more query rows and `decode_count` (None: unknown) one (known on the
    host before launch): the slot count fixed and whether the step fits it, so the compiled step
    holds no conditional; a step of at most SPLIT_MAX_TOKENS rows that fits and holds no decode
    row leaves the decode part out (one more compiled variant per small bucket only: larger
    steps amortise the empty decode part's ~10 us per layer)."""
    slots = options.prefill_seqs or prefill_slots(tokens, seqs)
    fits = prefill_count <= slots
    no_decode = fits and decode_count == 0 and 0 < prefill_count and tokens <= SPLIT_MAX_TOKENS
    return dataclasses.replace(options, prefill_seqs=slots, prefill_fits=fits,
                               decode_rows=not no_decode)


def mixed_defaults(problem, options: MixedOptions) -> MixedOptions:
    fill = {}
    if options.max_position is None:
        fill["max_position"] = problem.table_bound
    if options.direct_v is None:
        fill["direct_v"] = not direct_v_limits(problem.block_size, problem.table_cols)
    if options.skip_idle is None:
        fill["skip_idle"] = True
    return dataclasses.replace(options, **fill) if fill else options


def mixed_limits(problem, options: MixedOptions) -> str:
    """Why this path cannot take the problem ('' when it can): the Mosaic prefill kernel's."""
    why = mosaic_prefill_limits(*problem.stand_ins())
    if not why and options.direct_v:
        why = direct_v_limits(problem.block_size, problem.table_cols)
    if not why and options.paged_k:
        why = paged_limits(problem.head_dim, problem.rotary_half, problem.rotate_keys,
                           problem.dtype, problem.block_size, problem.table_cols)
    return why


def mixed_attention(q_rot, k_pages, v_pages, md, inv_freq, *, decode, overflow, rotate_keys,
                    attention_scaling, sm_scale, prefill_seqs: int | None = None,
                    splits: int | None = None, prefill_fits: bool | None = None,
                    decode_rows: bool = True, direct_v: bool = False, skip_idle: bool = False,
                    paged_k: bool = False, max_position: int | None = None, interpret=False):
    """One engine step (see module doc). q_rot: [T, H, D] rotated queries; decode(q_rot, md) and
    overflow(q_rot, md) run a decode-only batch and the whole step on other implementations
    (api.py binds them from the registry). prefill_fits: the caller's static decision (True /
    False), or None to check on device; decode_rows False: the caller's promise that no
    sequence has exactly one query row (MixedOptions). Returns [T, H, D] in q's dtype."""
    tokens = q_rot.shape[0]
    if prefill_fits is False:
        return overflow(q_rot, md)
    if prefill_seqs is None:
        prefill_seqs = prefill_slots(tokens, md.block_tables.shape[0])
    if splits is None:
        splits = 16 if tokens <= SPLIT_MAX_TOKENS else 1
    compact, count, prefill_row = compact_prefill(md, prefill_seqs)
    q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]

    def prefill_part():
        kw = dict(rotate_keys=rotate_keys, attention_scaling=attention_scaling,
                  sm_scale=sm_scale, direct_v=direct_v, skip_idle=skip_idle,
                  paged=PagedOptions(max_position=max_position) if paged_k else None,
                  interpret=interpret)
        if splits > 1:
            return prefill_attention_split(q_rot, k_pages, v_pages, compact, inv_freq,
                                           splits=splits, **kw)
        return prefill_attention_mosaic(q_rot, k_pages, v_pages, compact, inv_freq, **kw)

    def mosaic_path():
        out = prefill_part()
        if not decode_rows:
            return out
        q_d, md_d = decode_batch(q_rot, md)
        out_d = decode(q_d, md_d)[jnp.clip(md.q_seq, 0, q_lens.shape[0] - 1)]  # [T, H, D]
        return jnp.where(prefill_row[:, None, None], out, out_d.astype(out.dtype))

    if prefill_fits:  # the caller's promise: the step holds at most prefill_seqs of them
        return mosaic_path()
    if _concrete(count):  # eager calls (interpret-mode tests): take the branch in Python
        return mosaic_path() if int(count) <= prefill_seqs else overflow(q_rot, md)
    return lax.cond(count <= prefill_seqs, mosaic_path, lambda: overflow(q_rot, md))


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)
