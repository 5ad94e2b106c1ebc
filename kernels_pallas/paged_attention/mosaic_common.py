"""Pieces of the Mosaic GPU decode kernel (mosaic_decode.py) that are not its kernel body: one
CTA's view of its sequence's pages (which page a step reads, where its keys sit, the TMA loads of
a step), a split's key steps, the shape limits and SMEM of the metadata copy, the kernel's inputs
(q tiles, block-table copy, shifted cos | sin table) and the merge of its partial results; and
`register_interpreter_rules`, which teaches the Mosaic GPU interpreter (CPU) `plgpu.mma`."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.paged_attention.decode_common import merge_splits, rope_table_in_graph

META_COLS = 64  # block table, block starts, valid counts: [S, 3, rows, 64] (TMA box dims <= 256)
SMEM_LIMIT = 232448  # bytes per block on the H200, as Mosaic GPU reported it
LOG2E = math.log2(math.e)


@functools.cache
def register_interpreter_rules() -> None:
    """Lower `plgpu.mma` on CPU as acc + a @ b (float32 accumulation): the Mosaic GPU interpreter
    has no rule for it. Called by the decode wrapper before an interpreted call (and by tests);
    registering once per process is enough."""
    from jax.interpreters import mlir

    from kernels_pallas.jax_internals import mosaic_gpu_mma_primitive

    def interpreted_mma(acc, a, b):
        return acc + jnp.dot(a, b, preferred_element_type=acc.dtype)

    mlir.register_lowering(mosaic_gpu_mma_primitive(),
                           mlir.lower_fun(interpreted_mma, multiple_results=False),
                           platform="cpu")


def shape_limits(problem, pages_per_step: int, rows: int, block_multiple: int) -> str:
    """Why the Mosaic decode kernel cannot take these shapes ('' when it can): rows, the query
    rows of a CTA; block_multiple, what a key step's size must be a multiple of."""
    p = problem
    if p.dtype not in (jnp.bfloat16, jnp.float16):
        return f"needs bf16/f16 q and pages, got {p.dtype}"
    if (pages_per_step * p.block_size) % block_multiple:
        return f"needs pages_per_step * page_size a multiple of {block_multiple}"
    if p.group > rows:
        return f"needs at most {rows} query heads per CTA"
    if p.rotate_keys and (2 * p.rotary_half != p.head_dim or p.rotary_half % 64):
        return (f"needs full rotary with R/2 a multiple of 64, got R={2 * p.rotary_half}, "
                f"D={p.head_dim}")
    if p.head_dim % 128 and not p.rotate_keys:
        return f"needs head_dim a multiple of 128 in rotated mode, got {p.head_dim}"
    if p.table_cols > 256 * META_COLS:
        return f"needs block tables of at most {256 * META_COLS} entries, got {p.table_cols}"
    return ""


def meta_bytes(table_cols: int) -> int:
    """SMEM for one sequence's block table, block starts and valid counts."""
    return 3 * -(-table_cols // META_COLS) * META_COLS * 4


@dataclasses.dataclass(frozen=True)
class Cta:
    """One CTA's sequence s and kv head h: its pages, their keys' positions, their TMA loads.
    meta_smem holds the sequence's block table (0), block starts (1) and valid counts (2): a
    scalar read from global memory would be a round trip to L2 on the TMA issue path."""
    s: jax.Array
    h: jax.Array
    meta_smem: object
    n_blocks: jax.Array
    k_ref: object
    v_ref: object
    rope_ref: object
    page_size: int
    pages_per_step: int
    half: int
    max_blocks: int
    table: bool  # position_free with cos | sin rows by TMA

    def meta(self, which, b):
        return self.meta_smem[which, b // META_COLS, b % META_COLS]

    def entry(self, step, p):
        """(table entry, page) of page p of a key step."""
        b = jnp.minimum(step * self.pages_per_step + p, self.max_blocks - 1)
        return b, jnp.clip(self.meta(0, b), 0, self.k_ref.shape[0] - 1)

    def key_info(self, step, idx):
        """idx: key index within the step (an iota) -> (logical position, valid). The page's
        start and valid count are picked per key by a chain of selects on its page index."""
        page = lax.div(idx, self.page_size)
        local = idx - page * self.page_size
        start = count = None
        for p in range(self.pages_per_step):
            b, _ = self.entry(step, p)
            live = step * self.pages_per_step + p < self.n_blocks
            p_start, p_count = self.meta(1, b), jnp.where(live, self.meta(2, b), 0)
            if p == 0:
                start, count = p_start, p_count
            else:
                here = page == p
                start, count = jnp.where(here, p_start, start), jnp.where(here, p_count, count)
        return start + local, local < count

    def issue(self, step, ka, kb, v, ca, cb, bar):
        """TMA loads of a key step into one ring slot (refs ka, kb, v, ca, cb; barrier bar):
        per page its keys' two rotary halves, its values and, with a table, its cos | sin rows
        (a page's slots sit at consecutive positions from its block start; the table's 8
        shifted copies let the box start at a multiple of 8, as TMA into tiled SMEM needs)."""
        half, size = self.half, self.page_size
        for p in range(self.pages_per_step):
            b, page = self.entry(step, p)
            rows = pl.ds(p * size, size)
            plgpu.copy_gmem_to_smem(self.k_ref.at[page, :, self.h, pl.ds(0, half)], ka.at[rows],
                                    bar)
            plgpu.copy_gmem_to_smem(self.k_ref.at[page, :, self.h, pl.ds(half, half)],
                                    kb.at[rows], bar)
            plgpu.copy_gmem_to_smem(self.v_ref.at[page, :, self.h], v.at[rows], bar)
            if self.table:
                start = jnp.clip(self.meta(1, b), 0, self.rope_ref.shape[1] - size)
                shift = lax.rem(start, 8)
                src = self.rope_ref.at[shift, pl.ds(pl.multiple_of(start - shift, 8), size)]
                plgpu.copy_gmem_to_smem(src.at[:, pl.ds(0, half)], ca.at[rows], bar)
                plgpu.copy_gmem_to_smem(src.at[:, pl.ds(half, half)], cb.at[rows], bar)


def split_steps(n_blocks, pages_per_step, splits, split):
    """[lo, hi): the key steps of split `split` of a sequence with n_blocks pages."""
    n_steps = (n_blocks + pages_per_step - 1) // pages_per_step
    per_split = (n_steps + splits - 1) // splits
    lo = split * per_split
    return lo, jnp.minimum(lo + per_split, n_steps)


def decode_inputs(q_rot, md, inv_freq, rotate_keys, attention_scaling, sm_scale, pages_per_step,
                  page_size, kv_heads, max_position, q_rows):
    """The Mosaic decode kernels' inputs other than the pages: (q tiles [S, K, q_rows, D] with the G
    query rows of each kv head scaled by sm_scale, block tables, block starts and valid counts
    as [S, 3, rows, 64] (one TMA box per sequence), block counts, query positions and window
    starts as [3, S], then the shifted cos | sin table (position_free with max_position) or the
    inv_freq tile [BK, R/2]), R/2, and the rows each CTA stores (the 8-row tiles holding G)."""
    tokens, heads, head_dim = q_rot.shape
    group = heads // kv_heads
    seqs = md.block_tables.shape[0]
    dtype = q_rot.dtype
    half = inv_freq.shape[0] if rotate_keys else head_dim // 2
    q_idx = jnp.clip(md.cu_q_lens[:-1], 0, tokens - 1)  # [S]
    q_seq = (q_rot[q_idx].astype(jnp.float32) * sm_scale).astype(dtype)  # [S, H, D]
    q_pad = jnp.zeros((seqs, kv_heads, q_rows, head_dim), dtype)
    q_pad = q_pad.at[:, :, :group].set(q_seq.reshape(seqs, kv_heads, group, head_dim))
    if rotate_keys and max_position is not None:  # rows past max_position: masked pad slots
        rope_in = shifted_rope_table(inv_freq, max_position + page_size, attention_scaling,
                                     dtype)
    else:
        inv = inv_freq.astype(jnp.float32) if rotate_keys else jnp.zeros((half,), jnp.float32)
        rope_in = jnp.broadcast_to(inv[None, :], (pages_per_step * page_size, half))
    nb = md.block_tables.shape[1]
    rows = -(-nb // META_COLS)
    meta = jnp.stack([md.block_tables, md.block_pos_start, md.block_num_valid], axis=1)
    meta = jnp.pad(meta.astype(jnp.int32), ((0, 0), (0, 0), (0, rows * META_COLS - nb)))
    # block counts, query positions and window starts as one [3, S] array made here: Mosaic GPU
    # wants 256-byte aligned operands, and in the engine md.num_blocks is a view into the
    # step's packed metadata that is not
    info = jnp.stack([md.num_blocks, md.q_positions[q_idx], md.q_window_start[q_idx]])
    ins = (q_pad, meta.reshape(seqs, 3, rows, META_COLS), info.astype(jnp.int32), rope_in)
    return ins, half, min(q_rows, -(-group // 8) * 8)


def finish_partials(out, lse, md, heads, dtype):
    """[P, S, K, rows, D] partials and [P, S, K, rows] log-sum-exps -> [T, H, D] (merged by
    log-sum-exp; rows that are no sequence's query are zero)."""
    parts, seqs, kv_heads, _, head_dim = out.shape
    group = heads // kv_heads
    out = out[:, :, :, :group].reshape(parts, seqs, heads, head_dim).astype(jnp.float32)
    lse = lse[:, :, :, :group].reshape(parts, seqs, heads)
    seq = jnp.clip(md.q_seq, 0, seqs - 1)  # partials by token (gathered into the merge)
    return merge_splits(out[:, seq], lse[:, seq], md).astype(dtype)


def shifted_rope_table(inv_freq, max_position: int, attention_scaling: float, dtype):
    """[8, P, R] with copy r, row j = rope_table row j + r (P >= max_position, a multiple of 8):
    any 8 consecutive-or-more rows from an arbitrary start are rows from a multiple of 8 of one
    copy, which is what a TMA box into a tiled SMEM buffer needs. Built in the graph, not as a
    host constant: a model calls the kernel once per layer, and each call would embed its own
    copy of the constant in the program (32 x 4 MB for Llama-3-8B at 2048 positions, which
    stalled the engine's compile); XLA computes the identical graphs once."""
    rows = -(-max_position // 8) * 8
    base = rope_table_in_graph(inv_freq, rows + 8, attention_scaling, dtype)
    return jnp.stack([base[r:r + rows] for r in range(8)])
