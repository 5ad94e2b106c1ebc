"""The memory warpgroup of the paged-keys prefill kernel (mosaic_prefill_paged.py): its order.

mosaic_prefill._kernel hands its memory warpgroup to `stream_pages` when the keys come from the
pages. Per key step the warpgroup issues the keys' TMA boxes (raw_bar), waits for them to land,
rotates them in SMEM and arrives on k_bar (PagedKeys.issue / finish); the values are page boxes
on v_bar, as direct_v's. One warpgroup does all of it in program order, so each wait delays
every later issue: its serial chain per key step, not bandwidth, set the first version's speed.

The arithmetic (H100 call of 2026-12-05, 72 rows x 4 heads packed = 3 tiles of 128 per kv head,
16 splits: 384 CTAs of ~17 key steps, one CTA per SM for SMEM, ~2.9 waves, ~51 step slots per
SM). Gathered keys (dv+idle): 0.101 ms, ~2 us a step, tensor and exp2 bound (the kernel runs
3 x 128 x 33K x 128 x 4 flop x 8 heads = 52 GFLOP). Bytes in flight are no limit: 16 boxes of
4 KB a step x 2 slots = 128 KB a CTA, 17 MB over 132 SMs, against ~3-4 MB that 3 TB/s x ~1 us
of latency needs. The first version's kernel took 0.204 ms, ~4 us a step: its chain was
17 key-side TMA issues (each after its own SMEM read of the table) + the keys' load latency L
(~1-1.5 us) + the rotation R (~0.6-0.8 us, f32 with spills at 72 registers) + 8 value issues.
Each order's chain per step, with Dv the values' release after the keys' (~0.9 us):

  * v_first False (keys first): wait k_free, issue K, wait for K, rotate, arrive k_bar, wait
    v_free, issue V: issue + L + R + issue V (v_free has passed by then).
  * v_first True: wait k_free, issue K, wait v_free, issue V, wait for K, rotate: issue +
    max(L, Dv + issue V) + R; the values leave earlier, but the rotation waits for Dv too.

With PagedOptions.prefetch = d the warpgroup also asks L2 for the pages (and cos | sin rows) of
the step d after the one it issues (plgpu.async_prefetch: no SMEM, no barrier): that step's
own load is then an L2 hit, L ~0.6 us. Keys first with a prefetch is then the shortest chain
(~2 us: the compute's step), v_first the better one without (its max hides part of L).

With PagedOptions.rotator a fourth warpgroup (rotate_steps) waits for each slot's keys, loads
the cos | sin rows and rotates; the memory warpgroup only issues and waits for free slots. The
chains split: issues alone (~1 us a step) and cos | sin latency + R (~1.3 us with the prefetch),
both under the compute's ~2 us, at the price of registers: 64K / 512 threads, e.g. 208 for
each compute warpgroup (232 with three warpgroups), 24 for the memory one, 72 for the rotator.

Both cos_sin modes keep one cos | sin buffer (a second would not fit next to the ring), so a
slot's keys are rotated before the next slot's cos | sin rows are requested. The prologue (both
orders) issues both slots' keys and values first and the second slot's cos | sin rows after the
first slot's rotation: one load latency before the second step, where the first version, which
issued and rotated each slot in turn, had two.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.paged_attention.mosaic_common import META_COLS
from kernels_pallas.paged_attention.mosaic_prefill_prep import (BLOCK_KV, STAGES, TILE_HI,
                                                                TILE_LO, TILE_SEQ)


def step_pages(tbl_smem, step, pages: int, first_row: int = 0):
    """The table entries of key step `step` (`pages` a step; first_row: the starts' rows),
    all read before any is used: a TMA issue writes SMEM, so a read written after one cannot
    move before it, and reads interleaved with the issues would each wait out the SMEM
    latency on the memory warpgroup's serial path."""
    return [tbl_smem[first_row + lax.div(b, META_COLS), lax.rem(b, META_COLS)]
            for b in (step * pages + j for j in range(pages))]


def stream_pages(keys, *, lo, n_steps, seq, kv_head, tbl_ref, tbl_smem, tbl_bar, v_ref, v_smem,
                 v_bar, k_free, v_free):
    """The memory warpgroup's loop over key steps [lo, lo + n_steps) of one CTA (module doc):
    keys is mosaic_prefill_paged.PagedKeys; v_ref the value pages [P, B, K, D]; tbl_ref the
    sequences' page tables, copied to tbl_smem once."""
    page_size = keys.spec.page_size
    pages = BLOCK_KV // page_size
    v_first = keys.spec.options.v_first
    rotates = not keys.spec.rotator  # else a fourth warpgroup finishes the keys (rotate_steps)

    def finish(slot):
        if rotates:
            keys.finish(slot)

    def issue_v(step, slot):
        for j, page in enumerate(step_pages(tbl_smem, step, pages)):
            plgpu.copy_gmem_to_smem(v_ref.at[page, :, kv_head],
                                    v_smem.at[slot, pl.ds(j * page_size, page_size)],
                                    v_bar.at[slot])

    def issue_k(step, slot):
        keys.issue(step, slot, seq, kv_head, tbl_smem, cos_sin=rotates)

    ahead = keys.spec.options.prefetch

    def prefetch(step):  # L2 prefetch of a later step's keys (PagedOptions.prefetch)
        @pl.when(step < lo + n_steps)
        def _():
            keys.prefetch(step, seq, kv_head, tbl_smem)

    plgpu.copy_gmem_to_smem(tbl_ref.at[seq], tbl_smem, tbl_bar)  # an SMEM read per page after
    plgpu.barrier_wait(tbl_bar)

    for j in range(STAGES):  # every slot's keys and values in flight before the first wait
        @pl.when(j < n_steps)
        def _():
            keys.issue(lo + j, j, seq, kv_head, tbl_smem, cos_sin=rotates and j == 0)
            issue_v(lo + j, j)
    for j in range(ahead):  # the steps the first refills load
        prefetch(lo + STAGES + j)
    for j in range(STAGES if rotates else 0):
        @pl.when(j < n_steps)
        def _():
            if j > 0:  # the one cos | sin buffer: the previous slot's keys are rotated
                keys.issue_cos_sin(lo + j, j, seq, tbl_smem)
            keys.finish(j)

    def refill(i, _):
        slot = lax.rem(i, STAGES)
        step = lo + i + STAGES
        plgpu.barrier_wait(k_free.at[slot])
        issue_k(step, slot)
        if ahead:
            prefetch(step + ahead)
        if v_first:
            plgpu.barrier_wait(v_free.at[slot])
            issue_v(step, slot)
            finish(slot)
        else:
            finish(slot)
            plgpu.barrier_wait(v_free.at[slot])
            issue_v(step, slot)
        return _

    lax.fori_loop(0, jnp.maximum(n_steps - STAGES, 0), refill, None)
    drain_releases(k_free, v_free, n_steps)


def drain_releases(k_free, v_free, n_steps):
    """The memory warpgroup's last act: wait on the K and V slots' releases of the last STAGES
    key steps too (every barrier arrival observed; the interpreter checks it)."""
    def drain(i, _):
        slot = lax.rem(i, STAGES)
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.barrier_wait(v_free.at[slot])
        return _

    lax.fori_loop(jnp.maximum(n_steps - STAGES, 0), n_steps, drain, None)


def rotate_steps(keys, sched_ref, cs_bar, registers: int):
    """The fourth warpgroup (PagedOptions.rotator): per key step of its tile, load the step's
    cos | sin rows (its own barrier, cs_bar: the one buffer is free once its previous rotation
    is done, which only this warpgroup knows), wait for the slot's keys, rotate them, fence
    and arrive on k_bar (PagedKeys.finish). Its chain per step is the cos | sin rows' latency
    (an L2 hit with the memory warpgroup's prefetch) plus the rotation; the memory warpgroup,
    which then never waits for a landing, only issues."""
    t, wg = lax.axis_index("t"), lax.axis_index("wg")
    seq = sched_ref[t, TILE_SEQ]
    lo, hi = sched_ref[t, TILE_LO], sched_ref[t, TILE_HI]

    @pl.when((seq >= 0) & (wg == 3))
    def _():
        plgpu.set_max_registers(registers, action="decrease")

        def step(i, _):
            slot = lax.rem(i, STAGES)
            keys.issue_cos_sin(lo + i, slot, seq, None, bar=cs_bar)
            plgpu.barrier_wait(cs_bar)
            keys.finish(slot)
            return _

        lax.fori_loop(0, hi - lo, step, None)
