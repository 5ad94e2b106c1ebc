"""Ragged prefill attention in Pallas Mosaic GPU (Hopper: TMA, wgmma, warp specialisation).

Two steps behind `api.paged_attention(implementation="mosaic_prefill")`:

1. Pre-pass (mosaic_prefill_prep.py: XLA; compiled, its K/V part is triton_gather.gather_live,
   which writes only the key steps the kernel reads): each sequence's keys and values are
   gathered through its block table into contiguous buffers [S, N, K, D] (N = table entries x
   page size, padded to
   BLOCK_KV; the pages' own row layout, so the gather moves whole pages and needs no transpose),
   keys rotated by their logical position in position_free mode (float32 math), pad slots zeroed,
   and a key-position row [S, N] written next to them (pads and unused entries get a sentinel
   position that no query can see). Both kv modes share the kernel; RoPE-at-read costs only the
   rotation here.
   Queries come rotated, are scaled by sm_scale * log2(e) (the kernel's softmax runs in base 2) and
   padded by one tile of rows.
2. Kernel: one CTA per (query head, tile of 128 query tokens of one sequence), three warpgroups.
   Two compute warpgroups own 64 query rows each; the third streams K, V and key positions of the
   tile's live key steps by TMA into a 2-stage ring (full / free barriers), FA3 style. The two
   compute warpgroups take turns on the tensor cores (a schedule barrier): QK^T and PV by wgmma,
   online softmax in float32 registers. The key steps [lo, hi) of a tile are those with a key that
   some query of the tile may see (causal end, window start); steps in [mlo, mhi) need no mask
   (every key valid and visible to every row), the others mask with the key positions (loaded as a
   column vector) against each row's position and window start. All ranges are computed on device
   from the metadata, so the whole op is jittable.

Rows: a sequence's tiles start at its first row rounded down to a multiple of 8 (Mosaic GPU needs
TMA row offsets it can prove 8-aligned), so a tile may compute a few rows of its neighbours. A
warpgroup whose 64 rows all belong to its sequence stores them by TMA straight into [T, H, D]; the
others (at most the first and the last tile of a sequence) go to a side buffer [S, 2, H, 128, D]
and are scattered into place after the kernel (a TMA box cannot stop at a sequence boundary).

Speed on the H200, whole call and kernel alone, against cuDNN's dense attention:
benchmarks/RESULTS.md, Attention: prefill.

Limits (mosaic_prefill_limits): bf16/f16, head_dim 64 or 128 (SMEM), H a multiple of K.
Interpret mode (CPU, Mosaic GPU interpreter) routes P through SMEM for the PV wgmma (the
interpreter supports only SMEM operands); compiled, P stays in registers (wgmma's A operand).
Interpreted, the three warpgroups are threads whose barrier waits block XLA CPU pool threads:
with fewer than 4 pool threads the interpreter can hang (interpret_threads.py: the hang under
an outer jax.jit on the 2-core CI machine, 2026-11-30, was that; with 4 it runs). The eager call
takes ~15 s for the test batches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.paged_attention.mosaic_prefill_prep import (  # noqa: F401 (gather_kv: re-exported)
    _ALIGN, BLOCK_KV, BLOCK_Q, META_COLS, TILE_HI, TILE_LO, TILE_MHI, TILE_MLO, TILE_Q, TILE_Q0,
    TILE_Q1, TILE_SEQ, TILE_START, STAGES, gather_kv, mosaic_prefill_limits, prepare, scatter_tails,
    smem_bytes)
from kernels_pallas.paged_attention.interpret_threads import warn_if_pool_too_small
from kernels_pallas.paged_attention.mosaic_prefill_paged import paged_prepare
from kernels_pallas.paged_attention.mosaic_prefill_paged_stream import drain_releases

def _idle_walk(*, lo, hi, wg, k_bar, v_bar, k_free, v_free, schedule_barrier, sched_bar):
    """An idle compute warpgroup's part of the protocol (_kernel's skip_idle): every barrier
    wait and arrival of a computing warpgroup's step, in the same order, so the memory
    warpgroup's ring and the other warpgroup's schedule barrier see both warpgroups; its
    tensor-core turns cost the other warpgroup nothing."""
    n_steps = hi - lo

    @pl.when(n_steps > 0)
    def _():
        plgpu.barrier_wait(k_bar.at[0])

    pl.when(wg == 1)(schedule_barrier)

    def step(i, _):
        slot = lax.rem(i, STAGES)
        schedule_barrier()  # the QK turn
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_arrive(sched_bar)  # softmax done
        plgpu.barrier_wait(v_bar.at[slot])
        plgpu.barrier_wait(sched_bar)

        @pl.when(i + 1 < n_steps)
        def _():
            plgpu.barrier_wait(k_bar.at[lax.rem(i + 1, STAGES)])

        plgpu.barrier_arrive(v_free.at[slot])
        return _

    lax.fori_loop(0, n_steps, step, None)
    pl.when(wg == 0)(schedule_barrier)


def _kernel(sched_ref, q_ref, k_ref, v_ref, kpos_ref, qpos_ref, qwin_ref, tbl_ref, o_ref,
            side_ref, q_smem, k_smem, v_smem, kpos_smem, qpos_smem, qwin_smem, p_smem, lse_smem,
            tbl_smem, q_bar, k_bar, v_bar, k_free, v_free, sched_bar, tbl_bar, *, group, dtype,
            interpret, split, v_pages_per_step, skip_idle, keys=None, registers=(232, 40)):
    """split: each grid entry is one key range of a tile (mosaic_prefill_split.py); o_ref and
    side_ref are then the partial outputs [E, H, TILE_Q, D] and their base-2 log-sum-exps
    [E, H, TILE_Q], merged after the kernel. v_pages_per_step > 0 (direct V): v_ref is the page
    pool [P, B, K, D] and tbl_ref the page of each table entry [S, R, META_COLS] (clipped,
    prepare()); a key step's values come as that many page boxes, not from a gathered buffer.
    skip_idle: a compute warpgroup that owns no row of its tile's sequence (the second half of
    a sequence's last tile when its rows end in the first) walks the key steps through the
    barriers only (_idle_walk): no wgmma, no softmax, no store; its rows are never read.
    keys: None (k_ref is the gathered buffer) or the paged keys (mosaic_prefill_paged.PagedKeys:
    its stream() is the whole memory warpgroup, K and V from the pages). registers: per-thread
    registers of (each compute, the memory) warpgroup."""
    h = lax.axis_index("h")
    t = lax.axis_index("t")
    wg = lax.axis_index("wg")
    seq = sched_ref[t, TILE_SEQ]
    start = sched_ref[t, TILE_START]
    lo, mlo, mhi, hi = (sched_ref[t, c] for c in (TILE_LO, TILE_MLO, TILE_MHI, TILE_HI))
    n_steps = hi - lo
    head_dim = q_smem.shape[-1]

    def schedule_barrier():
        plgpu.barrier_arrive(sched_bar)
        plgpu.barrier_wait(sched_bar)

    computes = (seq >= 0) & (wg < 2)
    if skip_idle:  # a compute warpgroup none of whose rows belong to the tile's sequence
        wg_row0 = start + wg * BLOCK_Q
        idle = (wg_row0 + BLOCK_Q <= sched_ref[t, TILE_Q0]) | (wg_row0 >= sched_ref[t, TILE_Q1])
        pl.when(computes & idle)(functools.partial(
            _idle_walk, lo=lo, hi=hi, wg=wg, k_bar=k_bar, v_bar=v_bar, k_free=k_free,
            v_free=v_free, schedule_barrier=schedule_barrier, sched_bar=sched_bar))
        computes = computes & jnp.logical_not(idle)

    @pl.when(computes)
    def _compute():
        plgpu.set_max_registers(registers[0], action="increase")
        row0 = pl.multiple_of(start + wg * BLOCK_Q, _ALIGN)
        qo = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0, BLOCK_Q), h], qo, q_bar.at[wg])
        plgpu.copy_gmem_to_smem(qpos_ref.at[pl.ds(row0, BLOCK_Q)], qpos_smem.at[wg], q_bar.at[wg])
        plgpu.copy_gmem_to_smem(qwin_ref.at[pl.ds(row0, BLOCK_Q)], qwin_smem.at[wg], q_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        q_pos = plgpu.load(qpos_smem.at[wg], layout=row_layout)  # [BQ]
        q_win = plgpu.load(qwin_smem.at[wg], layout=row_layout)

        m_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), row_layout)
        l_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), 0.0, jnp.float32), row_layout)
        acc = plgpu.layout_cast(jnp.full((BLOCK_Q, head_dim), 0.0, jnp.float32),
                                plgpu.Layout.WGMMA)

        @pl.when(n_steps > 0)
        def _():
            plgpu.barrier_wait(k_bar.at[0])

        pl.when(wg == 1)(schedule_barrier)  # the two warpgroups alternate from here on

        def step_fn(step, carry, masked):
            acc, m_i, l_i = carry
            i = step - lo
            slot = lax.rem(i, STAGES)

            def compute_qk(acc_ref):
                plgpu.wgmma(acc_ref, qo, k_smem.at[slot].transpose((1, 0)))
                schedule_barrier()
                return acc_ref[...]

            s = pl.run_scoped(compute_qk, plgpu.ACC((BLOCK_Q, BLOCK_KV), jnp.float32))
            shape = s.shape
            if masked:
                k_pos = plgpu.load(kpos_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                # A generic-proxy read of a slot that TMA (async proxy) refills once k_free
                # releases it: fence it (fence.proxy.async) before the arrive (PTX proxy model)
                plgpu.commit_smem()
                k_pos = lax.broadcast_in_dim(k_pos, shape, [1])
                mask = ((k_pos <= lax.broadcast_in_dim(q_pos, shape, [0]))
                        & (k_pos >= lax.broadcast_in_dim(q_win, shape, [0])))
                s = jnp.where(mask, s, -jnp.inf)
            plgpu.barrier_arrive(k_free.at[slot])
            m_new = jnp.maximum(m_i, s.max(axis=1))
            if masked:  # a row may have seen no key yet
                m_new = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l_i = l_i * alpha + p.sum(axis=1)
            p16 = p.astype(dtype)
            if not interpret:
                acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
            plgpu.barrier_arrive(sched_bar)  # softmax done
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_wait(sched_bar)  # tensor cores free

            def wait_next_k():
                @pl.when(i + 1 < n_steps)
                def _():
                    plgpu.barrier_wait(k_bar.at[lax.rem(i + 1, STAGES)])

            if interpret:  # the interpreter's wgmma takes SMEM operands only
                p_smem.at[wg][...] = p16
                plgpu.commit_smem()

                def compute_pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem.at[wg], v_smem.at[slot])
                    wait_next_k()
                    return acc_ref[...]

                acc = acc + pl.run_scoped(compute_pv, plgpu.ACC(acc.shape, jnp.float32))
            else:
                def compute_pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    wait_next_k()

                acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l_i

        carry = (acc, m_i, l_i)
        carry = lax.fori_loop(lo, mlo, functools.partial(step_fn, masked=True), carry)
        carry = lax.fori_loop(mlo, mhi, functools.partial(step_fn, masked=False), carry)
        acc, m_i, l_i = lax.fori_loop(mhi, hi, functools.partial(step_fn, masked=True), carry)
        pl.when(wg == 0)(schedule_barrier)

        empty = l_i == 0.0
        l_i = jnp.where(empty, 1.0, l_i)
        qo[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype)
        if split:
            lse_smem.at[wg][...] = jnp.where(empty, -jnp.inf, m_i + jnp.log2(l_i))
            plgpu.commit_smem()
            rows = pl.ds(wg * BLOCK_Q, BLOCK_Q)
            plgpu.copy_smem_to_gmem(qo, o_ref.at[t, h, rows])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], side_ref.at[t, h, rows])
            plgpu.wait_smem_to_gmem(0)
            return
        plgpu.commit_smem()
        # Whole: all 64 rows belong to this sequence. Else the rows go to the side buffer: slot 0
        # for the sequence's first tile, 1 for its last (a tile never starts past its seq's start
        # unless it is not the first).
        whole = (row0 >= sched_ref[t, TILE_Q0]) & (row0 + BLOCK_Q <= sched_ref[t, TILE_Q1])
        side_slot = (start > sched_ref[t, TILE_Q0]).astype(jnp.int32)

        @pl.when(whole)
        def _():
            plgpu.copy_smem_to_gmem(qo, o_ref.at[pl.ds(row0, BLOCK_Q), h])

        @pl.when(jnp.logical_not(whole))
        def _():
            plgpu.copy_smem_to_gmem(
                qo, side_ref.at[seq, side_slot, h, pl.ds(wg * BLOCK_Q, BLOCK_Q)])

        plgpu.wait_smem_to_gmem(0)

    @pl.when((seq >= 0) & (wg == 2))
    def _memory():
        plgpu.set_max_registers(registers[1], action="decrease")
        kv_head = lax.div(h, jnp.int32(group))
        if keys is not None:  # paged keys: mosaic_prefill_paged_stream orders the loads
            return keys.stream(lo=lo, n_steps=n_steps, seq=seq, kv_head=kv_head, tbl_ref=tbl_ref,
                               tbl_smem=tbl_smem, tbl_bar=tbl_bar, v_ref=v_ref, v_smem=v_smem,
                               v_bar=v_bar, k_free=k_free, v_free=v_free)

        def issue_k(step, slot):
            rows = pl.ds(step * BLOCK_KV, BLOCK_KV)
            plgpu.copy_gmem_to_smem(k_ref.at[seq, rows, kv_head], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(kpos_ref.at[seq, rows], kpos_smem.at[slot], k_bar.at[slot])

        def issue_v(step, slot):
            if not v_pages_per_step:
                keys = pl.ds(step * BLOCK_KV, BLOCK_KV)
                plgpu.copy_gmem_to_smem(v_ref.at[seq, keys, kv_head], v_smem.at[slot],
                                        v_bar.at[slot])
                return
            size = BLOCK_KV // v_pages_per_step
            for j in range(v_pages_per_step):
                b = step * v_pages_per_step + j
                page = tbl_smem[lax.div(b, META_COLS), lax.rem(b, META_COLS)]
                plgpu.copy_gmem_to_smem(v_ref.at[page, :, kv_head],
                                        v_smem.at[slot, pl.ds(j * size, size)], v_bar.at[slot])

        if v_pages_per_step:  # the sequence's page table, once (an SMEM read per page after)
            plgpu.copy_gmem_to_smem(tbl_ref.at[seq], tbl_smem, tbl_bar)
            plgpu.barrier_wait(tbl_bar)

        for j in range(STAGES):
            @pl.when(j < n_steps)
            def _():
                issue_k(lo + j, j)
                issue_v(lo + j, j)

        def refill(i, _):
            slot = lax.rem(i, STAGES)
            plgpu.barrier_wait(k_free.at[slot])
            issue_k(lo + i + STAGES, slot)
            plgpu.barrier_wait(v_free.at[slot])
            issue_v(lo + i + STAGES, slot)
            return _

        lax.fori_loop(0, jnp.maximum(n_steps - STAGES, 0), refill, None)
        drain_releases(k_free, v_free, n_steps)


def prefill_attention_mosaic(q_rot, k_pages, v_pages, md, inv_freq, *, rotate_keys: bool,
                             attention_scaling: float, sm_scale: float, direct_v: bool = False,
                             skip_idle: bool = False, paged=None, interpret=False):
    """Ragged causal, window-limited attention for prefill-shaped batches (see module doc).

    q_rot: [T, H, D] queries already rotated by their positions; k_pages, v_pages [P, B, K, D].
    rotate_keys: keys stored unrotated (position_free), rotated in the pre-pass.
    interpret: False (compile for the GPU), True (Mosaic GPU interpreter on CPU) or a
    plgpu.InterpretGPUParams. Returns [T, H, D] in q's dtype; rows of no sequence are garbage.
    direct_v: values read from the pages by the kernel, not gathered (prepare; needs finite
    values in every page slot). skip_idle: warpgroups that own no row skip their work (_kernel).
    paged: None, or mosaic_prefill_paged.PagedOptions: no pre-pass at all, K and V read from
    the pages through the table and keys rotated in the kernel (implies direct_v's contract).
    """
    if paged is not None:
        inputs, keys = paged_prepare(q_rot, k_pages, v_pages, md, inv_freq, paged,
                                     rotate_keys=rotate_keys, attention_scaling=attention_scaling, sm_scale=sm_scale)
    else:
        keys = None
        inputs = prepare(q_rot, k_pages, v_pages, md, inv_freq, rotate_keys=rotate_keys,
                         attention_scaling=attention_scaling, sm_scale=sm_scale,
                         live_gather=not interpret, direct_v=direct_v)
    out, side = run_kernel(inputs, kv_heads=k_pages.shape[2], interpret=interpret,
                           skip_idle=skip_idle, keys=keys)
    return scatter_tails(out, side, md, q_rot.shape[0])


def run_kernel(inputs, *, kv_heads: int, interpret=False, split: bool = False,
               skip_idle: bool = False, keys=None):
    """The Mosaic GPU kernel on prepare()'s outputs -> (out [T8, H, D], side [S, 2, H, 128, D]);
    with split (one grid entry per key range of a tile, sched [E, 8]): (partial outputs
    [E, H, 128, D], base-2 log-sum-exps [E, H, 128] float32). skip_idle: see _kernel (the rows
    of an idle warpgroup, which no sequence owns, are left unwritten). keys: paged_prepare's
    PagedKeysSpec (inputs from paged_prepare: k and v are the page pools), or None."""
    sched, q_in, k_buf, v_buf, key_pos, q_pos, q_win, v_table = inputs
    direct = v_table is not None
    v_pages_per_step = BLOCK_KV // v_buf.shape[1] if direct else 0
    if not direct:
        v_table = jnp.zeros((1, 1, META_COLS), jnp.int32)  # unread
    rows_out = q_in.shape[0] - TILE_Q
    _, heads, head_dim = q_in.shape
    seqs = key_pos.shape[0]
    dtype = q_in.dtype
    num_tiles = sched.shape[0]
    interp = bool(interpret)
    sw = plgpu.SwizzleTransform(128)
    tiled = (plgpu.TilingTransform((8, 128 // dtype.itemsize)), sw)
    scratch = [
        plgpu.SMEM((2, BLOCK_Q, head_dim), dtype, transforms=tiled),  # Q, then O
        plgpu.SMEM((STAGES, BLOCK_KV, head_dim), dtype, transforms=tiled),  # K ring
        plgpu.SMEM((STAGES, BLOCK_KV, head_dim), dtype, transforms=tiled),  # V ring
        plgpu.SMEM((STAGES, BLOCK_KV), jnp.int32),  # key positions
        plgpu.SMEM((2, BLOCK_Q), jnp.int32),  # query positions
        plgpu.SMEM((2, BLOCK_Q), jnp.int32),  # query window starts
        plgpu.SMEM((2, BLOCK_Q, BLOCK_KV), dtype, transforms=tiled) if interp else None,  # P
        plgpu.SMEM((2, BLOCK_Q), jnp.float32) if split else None,  # log-sum-exps (split)
        plgpu.SMEM(v_table.shape[1:], jnp.int32) if direct else None,  # page table (direct V)
        plgpu.Barrier(num_arrivals=3, num_barriers=2),  # q_bar: Q + positions + windows
        plgpu.Barrier(num_arrivals=1 if keys else 2, num_barriers=STAGES),  # k_bar: K + positions
        plgpu.Barrier(num_arrivals=max(v_pages_per_step, 1), num_barriers=STAGES),  # v_bar
        plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),  # k_free (both compute wgs)
        plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),  # v_free
        plgpu.Barrier(num_arrivals=2),  # schedule barrier
        plgpu.Barrier() if direct else None,  # tbl_bar: the page table is in SMEM
    ]
    kernel = functools.partial(_kernel, group=heads // kv_heads, dtype=dtype, interpret=interp,
                               split=split, v_pages_per_step=v_pages_per_step,
                               skip_idle=skip_idle)
    extra_inputs = ()
    if keys is not None:  # the rope table as a last input, the key scratch last
        kernel, extra_inputs = keys.bind(kernel, len(scratch)), (keys.rope,)
        scratch += keys.scratch(tiled, dtype, STAGES)
    if interp:
        warn_if_pool_too_small()
    if split:
        out_type = (jax.ShapeDtypeStruct((num_tiles, heads, TILE_Q, head_dim), dtype),
                    jax.ShapeDtypeStruct((num_tiles, heads, TILE_Q), jnp.float32))
    else:
        out_type = (jax.ShapeDtypeStruct((rows_out, heads, head_dim), dtype),
                    jax.ShapeDtypeStruct((seqs, 2, heads, TILE_Q, head_dim), dtype))
    call = plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(heads, num_tiles), grid_names=("h", "t"), thread_name="wg",
        num_threads=keys.warpgroups if keys is not None else 3,  # paged keys: a rotator?
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret is True else (interpret or None))
    return call(sched, q_in, k_buf, v_buf, key_pos, q_pos, q_win, v_table, *extra_inputs)
