"""Decode paged attention in Pallas Mosaic GPU (Hopper: TMA page loads, warp-level MMA), RoPE
at read with the keys rotated in registers. The engine's decode kernel on the H200 (RESULTS.md,
Attention: decode).

Per step, `pages_per_step` pages are fetched by TMA into a ring of `stages` buffers, issued
stages - 1 steps ahead (the sequence's block table, block starts and valid counts are copied to
SMEM once per CTA; mosaic_common.Cta): keys as their two rotary halves [BK, R/2] (two TMA boxes
per page, so no register shuffle is needed for rotate-half), values [BK, D], and in
position_free mode the keys' cos | sin rows, one box per half from a table kept in 8 copies
shifted by 0..7 rows (a TMA box into tiled SMEM must start at a multiple of 8;
mosaic_common.shifted_rope_table). QK^T and PV are warp-level MMAs (`plgpu.mma`: mma.sync
m16n8k16) whose operands live in registers: each step's key halves are loaded from the ring
straight into the B-operand layout (K^T, keys along N: each warp owns 8 of every 32 keys),
rotated and fed to the MMA. A wgmma would read its B operand from shared memory, so the keys
would have to go back there and be fenced first: that variant was measured at +54-95% for
RoPE at read and removed. Nothing goes back to shared memory but the 16 x BK probabilities,
which every warp needs as its PV A operand (V's pairs come by ldmatrix.trans). The key range of
a sequence is split over `splits` CTAs (flash-decoding), merged by log-sum-exp afterwards.

One CTA (one warpgroup) per (sequence, group of `kv_group` kv heads, split). The group's
kv_group * G <= 16 query heads are the rows of one 16-row tile (kv head j's at rows j*G..);
per step, each kv head's keys are rotated with the step's cos | sin rows (fetched once for the
group: the table traffic per key byte falls with kv_group) and contracted with a q tile that
holds only that head's rows, all into one score tile: one online softmax per step for the
group. PV then takes, per kv head, the probabilities masked to its rows. The row max is a
cross-warp reduction per step (keys are spread over the warps); the row sum is kept per key
column and reduced once at the end.

Pallas's automatic barriers are off (it would put a warpgroup barrier before every TMA copy);
the kernel places its own: one at the top of each step, after which one thread refills the slot
the previous step used (TMA runs stages - 1 full steps ahead), and one after the probabilities'
store, before any warp reads them (their next store comes after the next step's max, whose
reduction has barriers of its own).

position_free mode needs the cos | sin table (max_position). Per-key SFU trig was measured at
+140% here and is not offered. (Mosaic GPU's broadcasted_iota also numbers the B layout wrongly:
it assumes a layout's vector runs along the last dimension.)

Limits (`limits`): bf16/f16; full rotary (R == D) with R/2 a multiple of 64, or rotated mode with
D a multiple of 128; kv_group * G <= 16; key steps a multiple of 32 keys; SMEM within 227 KiB.
Pad slots must hold finite values (p = 0 times a NaN value is NaN inside the MMA); the engine
guarantees it: every page is zeroed on the device when the block manager hands it out, before
the step that first uses it (serving/cache/page_zeroing.py), so a slot its sequence never wrote holds 0
whatever the block's previous owner left there. On CPU it runs in the Mosaic GPU interpreter
(`mosaic_common.register_interpreter_rules` supplies the MMA rule).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.paged_attention.mosaic_common import (LOG2E, SMEM_LIMIT, Cta, decode_inputs,
                                                          finish_partials, meta_bytes,
                                                          register_interpreter_rules,
                                                          shape_limits, split_steps)
from kernels_pallas.registry import Implementation

QROWS = 16  # mma M: the query rows of a CTA's kv heads
_LHS = plgpu.Layout.MMA_LHS(jnp.bfloat16, m_warps=1)  # the same for any 16-bit dtype
_RHS = plgpu.Layout.MMA_RHS(jnp.bfloat16, m_warps=1)
_ACC = plgpu.Layout.MMA_ACC(jnp.bfloat16, m_warps=1)


@dataclasses.dataclass(frozen=True)
class MosaicDecodeOptions:
    """None = the measured default for the problem (`defaults`). pages_per_step: pages per key
    step; splits: CTAs per (sequence, kv-head group) over its key steps; stages: TMA ring depth;
    max_position: bound on the positions (position_free: the cos | sin table's rows); packed:
    rotate keys with 16-bit FMAs; kv_group: kv heads per CTA."""

    pages_per_step: int | None = None
    splits: int | None = None
    stages: int | None = None
    max_position: int | None = None
    packed: bool | None = None
    kv_group: int | None = None


def defaults(problem, options: MosaicDecodeOptions) -> MosaicDecodeOptions:
    """The options measured best on the H200 (benchmarks/RESULTS.md, Attention: decode):
    key steps of 32 keys (or one page), two stages, two kv heads per CTA where they fit, 16-bit
    rotation, the caller's position bound when a table of that size is worth reading."""
    o = options
    pair = problem.kv_heads % 2 == 0 and 2 * problem.group <= QROWS
    return dataclasses.replace(
        o, pages_per_step=o.pages_per_step or max(1, 32 // problem.block_size),
        stages=o.stages or 2, kv_group=o.kv_group or (2 if pair else 1),
        packed=True if o.packed is None else o.packed,
        max_position=problem.table_bound if o.max_position is None else o.max_position)


def limits(problem, options: MosaicDecodeOptions) -> str:
    """Why this kernel cannot take the problem with these (filled) options ('' when it can)."""
    o, p = options, problem
    if o.stages < 2:
        return f"needs at least 2 stages, got {o.stages}"
    if p.rotate_keys and o.max_position is None:
        return "needs max_position in position_free mode (cos | sin rows from a table)"
    if o.kv_group < 1 or p.kv_heads % o.kv_group:
        return f"needs kv_group dividing the {p.kv_heads} kv heads, got {o.kv_group}"
    if o.kv_group * p.group > QROWS:
        return f"needs kv_group * G <= {QROWS} query rows per CTA"
    problem_ = shape_limits(p, o.pages_per_step, rows=QROWS, block_multiple=32)
    if problem_:
        return problem_
    block_k = o.pages_per_step * p.block_size
    need = mma_smem_bytes(p.head_dim, block_k, p.dtype.itemsize, o.stages, p.rotate_keys,
                          o.kv_group) + meta_bytes(p.table_cols)
    if need > SMEM_LIMIT:
        return (f"needs {need} bytes of shared memory for head_dim {p.head_dim}, block "
                f"{block_k}, {o.stages} stages, kv_group {o.kv_group}; the H200 has "
                f"{SMEM_LIMIT} per block")
    return ""


def mma_smem_bytes(head_dim, block_k, itemsize, stages, table, kv_group):
    """q halves per kv head, the ring (K halves and V per kv head, cos | sin rows with a
    table), the probability and output tiles, log-sum-exps, barriers, reduction scratch."""
    half = head_dim // 2
    stage = kv_group * 2 * block_k * head_dim + (2 * block_k * half if table else 0)
    return ((kv_group * QROWS * head_dim + stages * stage + QROWS * block_k + QROWS * head_dim)
            * itemsize + QROWS * 4 + 512 + 2048)


def _kernel(q_ref, k_ref, v_ref, meta_ref, info_ref, rope_ref, o_ref, lse_ref,
            qa_smem, qb_smem, ka_smem, kb_smem, v_smem, ca_smem, cb_smem, p_smem, o_smem,
            lse_smem, meta_smem, q_bar, kv_bar, *, max_blocks, page_size, pages_per_step, half,
            rotate_keys, dtype, splits, stages, out_rows, packed, kv_group, group):
    s, g, split = lax.axis_index("s"), lax.axis_index("h"), lax.axis_index("sp")
    n_blocks = info_ref[0, s]
    lo, hi = split_steps(n_blocks, pages_per_step, splits, split)
    block_k = pages_per_step * page_size
    # kv head j of the group; the first also fetches the cos | sin rows (position_free)
    ctas = [Cta(s, g * kv_group + j, meta_smem, n_blocks, k_ref, v_ref, rope_ref, page_size,
                pages_per_step, half, max_blocks, rotate_keys and j == 0)
            for j in range(kv_group)]

    for j in range(kv_group):
        plgpu.copy_gmem_to_smem(q_ref.at[s, g, j, :, pl.ds(0, half)], qa_smem.at[j], q_bar)
        plgpu.copy_gmem_to_smem(q_ref.at[s, g, j, :, pl.ds(half, half)], qb_smem.at[j], q_bar)
    plgpu.copy_gmem_to_smem(meta_ref.at[s], meta_smem, q_bar)
    plgpu.barrier_wait(q_bar)
    q_pos, q_win = info_ref[1, s], info_ref[2, s]

    def q_tiles(j):  # kv head j's q halves (rows of the other heads are zero)
        return plgpu.load(qa_smem.at[j], layout=_LHS), plgpu.load(qb_smem.at[j], layout=_LHS)

    q_kept = q_tiles(0) if kv_group == 1 else None  # in registers throughout when one head

    def keys_t(ref):  # a [BK, R/2] tile -> its transpose in the B-operand layout
        return plgpu.load(ref.transpose((1, 0)), layout=_RHS)

    def issue(step, slot):
        for j, cta in enumerate(ctas):
            cta.issue(step, ka_smem.at[slot, j], kb_smem.at[slot, j], v_smem.at[slot, j],
                      ca_smem.at[slot], cb_smem.at[slot], kv_bar.at[slot])

    for ahead in range(stages - 1):
        pl.when(lo + ahead < hi)(functools.partial(issue, lo + ahead, ahead))

    def step_fn(step, carry):
        acc, m_i, l_cols = carry
        slot = lax.rem(step - lo, stages)
        plgpu.commit_smem()  # every warp is done with step - 1's slot: refill it

        @pl.when(step + stages - 1 < hi)
        def _():
            issue(step + stages - 1, lax.rem(step - lo + stages - 1, stages))

        plgpu.barrier_wait(kv_bar.at[slot])
        math = dtype if packed else jnp.float32
        if rotate_keys:
            cos = keys_t(ca_smem.at[slot]).astype(math)
            sin = keys_t(cb_smem.at[slot]).astype(math)
        qk = plgpu.layout_cast(jnp.zeros((QROWS, block_k), jnp.float32), _ACC)
        for j in range(kv_group):
            k_lo, k_hi = keys_t(ka_smem.at[slot, j]), keys_t(kb_smem.at[slot, j])  # [R/2, BK]
            if rotate_keys:
                lo_m, hi_m = k_lo.astype(math), k_hi.astype(math)
                k_lo = (lo_m * cos - hi_m * sin).astype(dtype)
                k_hi = (hi_m * cos + lo_m * sin).astype(dtype)
            q_lo, q_hi = q_kept or q_tiles(j)
            qk = plgpu.mma(plgpu.mma(qk, q_lo, k_lo), q_hi, k_hi)
        col = plgpu.broadcasted_iota(jnp.int32, (QROWS, block_k), 1, layout=_ACC)
        k_pos, k_ok = ctas[0].key_info(step, col)
        qk = jnp.where(k_ok & (k_pos <= q_pos) & (k_pos >= q_win), qk * LOG2E, -jnp.inf)
        m_new = jnp.maximum(m_i, qk.max(axis=1))  # a cross-warp reduction (keys span warps)
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_i - m_safe)
        p = jnp.exp2(qk - lax.broadcast_in_dim(m_safe, qk.shape, [0]))
        p_smem[...] = p.astype(dtype)  # every warp's PV needs all of the step's columns
        plgpu.commit_smem()  # (a warpgroup barrier: auto barriers are off)
        p_all = plgpu.load(p_smem, layout=_LHS)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        row_head = lax.div(plgpu.broadcasted_iota(jnp.int32, p_all.shape, 0, layout=_LHS), group)
        for j in range(kv_group):
            p_j = p_all if kv_group == 1 else jnp.where(row_head == j, p_all, 0).astype(dtype)
            acc = plgpu.mma(acc, p_j, plgpu.load(v_smem.at[slot, j], layout=_RHS))
        return acc, m_new, l_cols * lax.broadcast_in_dim(alpha, qk.shape, [0]) + p

    init = (plgpu.layout_cast(jnp.zeros((QROWS, v_smem.shape[-1]), jnp.float32), _ACC),
            plgpu.layout_cast(jnp.full((QROWS,), -jnp.inf, jnp.float32), _ACC.reduce(1)),
            plgpu.layout_cast(jnp.zeros((QROWS, block_k), jnp.float32), _ACC))
    acc, m_i, l_cols = lax.fori_loop(lo, hi, step_fn, init)
    l_i = l_cols.sum(axis=1)
    empty = l_i == 0.0  # no visible key: output 0 and log-sum-exp -inf (weight 0 in the merge)
    l_i = jnp.where(empty, 1.0, l_i)
    lse_smem[...] = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_i)) * (1.0 / LOG2E))
    o_smem[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, out_rows)], o_ref.at[split, s, g])
    plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, out_rows)], lse_ref.at[split, s, g])
    plgpu.wait_smem_to_gmem(0)


def decode_attention_mosaic(q_rot, k_pages, v_pages, md, inv_freq, *, rotate_keys: bool,
                            attention_scaling: float, sm_scale: float, pages_per_step: int = 2,
                            splits: int | None = None, stages: int = 2,
                            max_position: int | None = None, packed: bool = True,
                            kv_group: int = 1, interpret=False):
    """Decode-only batches (sequence s's query is row cu_q_lens[s]); q_rot [T, H, D] rotated.

    position_free needs max_position (cos | sin rows from a table); splits: CTAs per (sequence,
    kv-head group) over its key steps (default: enough for ~2048 CTAs, at most 16); stages: TMA
    ring depth; packed: rotate with 16-bit FMAs (bf16x2/f16x2) instead of float32; kv_group: kv
    heads per CTA (they share the step's cos | sin rows and one online softmax). interpret:
    False (compile for the GPU), True (Mosaic GPU interpreter on CPU) or a
    plgpu.InterpretGPUParams. Returns [T, H, D]; rows that are no sequence's query are zero.
    """
    if interpret:
        register_interpreter_rules()
    heads, head_dim = q_rot.shape[1:]
    page_size, kv_heads = k_pages.shape[1:3]
    seqs = md.block_tables.shape[0]
    dtype = q_rot.dtype
    group = heads // kv_heads
    groups = kv_heads // kv_group
    if splits is None:
        splits = max(1, min(16, -(-2048 // (seqs * groups))))
    ins, half, _ = decode_inputs(q_rot, md, inv_freq, rotate_keys, attention_scaling, sm_scale,
                                 pages_per_step, page_size, kv_heads, max_position,
                                 q_rows=QROWS)
    # [S, K, 16, D] (head k's rows first) -> [S, K / kv_group, kv_group, 16, D]: kv head j of a
    # group keeps its rows at j*G.., the other rows of its tile zero
    q_pad = ins[0].reshape(seqs, groups, kv_group, QROWS, head_dim)
    q_pad = jnp.stack([jnp.roll(q_pad[:, :, j], j * group, axis=2) for j in range(kv_group)],
                      axis=2)
    out_rows = min(QROWS, -(-(kv_group * group) // 8) * 8)
    block_k = pages_per_step * page_size
    bf = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    p_tiling = bf if block_k % 64 == 0 else (plgpu.TilingTransform((8, 32)),
                                             plgpu.SwizzleTransform(64))
    unused = plgpu.SMEM((8,), dtype)
    ring = lambda cols: plgpu.SMEM((stages, kv_group, block_k, cols), dtype, transforms=bf)
    table = plgpu.SMEM((stages, block_k, half), dtype, transforms=bf)
    scratch = [
        plgpu.SMEM((kv_group, QROWS, half), dtype, transforms=bf),  # q lo per kv head
        plgpu.SMEM((kv_group, QROWS, half), dtype, transforms=bf),  # q hi per kv head
        ring(half), ring(half), ring(head_dim),  # k lo, k hi, v
        table if rotate_keys else unused, table if rotate_keys else unused,  # cos, sin
        plgpu.SMEM((QROWS, block_k), dtype, transforms=p_tiling),  # probabilities
        plgpu.SMEM((QROWS, head_dim), dtype, transforms=bf),  # output
        plgpu.SMEM((QROWS,), jnp.float32),  # log-sum-exps
        plgpu.SMEM(ins[1].shape[1:], jnp.int32),  # block table, block starts, valid counts
        plgpu.Barrier(num_arrivals=2 * kv_group + 1),  # q tiles, block table
        plgpu.Barrier(num_arrivals=(3 * kv_group + 2 * rotate_keys) * pages_per_step,
                      num_barriers=stages),
    ]
    kernel = functools.partial(
        _kernel, max_blocks=md.block_tables.shape[1], page_size=page_size,
        pages_per_step=pages_per_step, half=half, rotate_keys=rotate_keys, dtype=dtype,
        splits=splits, stages=stages, out_rows=out_rows, packed=packed, kv_group=kv_group,
        group=group)
    call = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((splits, seqs, groups, out_rows, head_dim), dtype),
                  jax.ShapeDtypeStruct((splits, seqs, groups, out_rows), jnp.float32)),
        grid=(seqs, groups, splits), grid_names=("s", "h", "sp"), scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
        interpret=plgpu.InterpretGPUParams() if interpret is True else interpret)
    out, lse = call(q_pad, k_pages, v_pages, *ins[1:])
    return finish_partials(out, lse, md, heads, dtype)


IMPLEMENTATION = Implementation(
    "mosaic_decode", decode_attention_mosaic, MosaicDecodeOptions, defaults, limits,
    backend="mosaic", decode_only=True)
