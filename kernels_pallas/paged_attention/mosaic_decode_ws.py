"""Decode paged attention in Pallas Mosaic GPU, warp-specialised: RoPE at read off the MMA path.

EXPERIMENTAL, like mosaic_decode.py (the one-warpgroup kernel it shares its inputs, table and
limits with); runs under the Mosaic GPU interpreter in CI (tests/test_paged_attention_mgpu.py).

One CTA per (sequence, kv head, split) with `consumers` + 1 warpgroups (FA3 style):
- the producer warpgroup fetches each key step's pages by TMA into a ring of `stages` slots (K
  as its two rotary halves, V, and in position_free mode with a table the pages' cos | sin rows),
  and in position_free mode rotates the step's keys in place in shared memory (float32 math,
  or 16-bit with `packed`), then marks the slot ready;
- the consumer warpgroups take the CTA's key steps in turn (consumer c: steps lo + c, lo + c +
  consumers, ...), each with its own online softmax, and hand a slot back once its wgmmas are
  done. Each consumer's result is one split-K partial, merged with the others by log-sum-exp.
A slot belongs to one consumer (stages is a multiple of consumers), so every barrier has a
single waiter per phase. After rotating step i the producer refills the slot of step
i - consumers (that consumer has just been handed step i, so it is done with it): TMA runs
stages - consumers steps ahead of the rotation, and the rotation one step ahead of the consumers.

Measured on the H200 (benchmarks/RESULTS.md, decode runs 19-21): rotated, 2 consumers, 4 stages,
the kernel takes 274 us at 64 x 4096 (triton_decode 263); RoPE at read costs +49-65%. With the
rotation arithmetic skipped (rotate_math=False) the same pipeline costs +3.4%: the producer's
rotation throughput is the limit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.paged_attention.mosaic_decode import (decode_inputs, finish_partials,
                                                          shape_limits, smem_limit)
from kernels_pallas.paged_attention.mosaic_decode_parts import (ROWS, Cta, attend_step,
                                                               initial_carry, rotate_in_place,
                                                               scratch_buffers, split_steps,
                                                               store_partial)


def ws_limits(q, k_pages, inv_freq, rotate_keys, pages_per_step, table_cols, stages, consumers,
              table):
    """Why the warp-specialised kernel cannot take these shapes and options ('' when it can).
    Compiled, P stays in registers: no probability tiles in SMEM."""
    if consumers < 1 or stages <= consumers or stages % consumers:
        return (f"needs stages a multiple of consumers and larger, got stages={stages}, "
                f"consumers={consumers}")
    return (shape_limits(q, k_pages, inv_freq, rotate_keys, pages_per_step, table_cols)
            or smem_limit(q, k_pages, rotate_keys, pages_per_step, table_cols, stages, table, 0,
                          consumers))


def _kernel(q_ref, k_ref, v_ref, meta_ref, info_ref, rope_ref,
            o_ref, lse_ref, qa_smem, qb_smem, ka_smem, kb_smem, v_smem, ca_smem, cb_smem,
            inv_smem, p_smem, lse_smem, meta_smem, q_bar, kv_bar, ready_bar, free_bar, *,
            max_blocks, page_size, pages_per_step, half, rotate_keys, table, scaling, dtype,
            splits, stages, consumers, out_rows, interpret, rotate_math, packed):
    s, h, split = lax.axis_index("s"), lax.axis_index("h"), lax.axis_index("sp")
    wg = lax.axis_index("wg")
    n_blocks = info_ref[0, s]
    lo, hi = split_steps(n_blocks, pages_per_step, splits, split)
    trig = rotate_keys and not table
    cta = Cta(s, h, meta_smem, n_blocks, k_ref, v_ref, rope_ref, page_size, pages_per_step, half,
              max_blocks, rotate_keys and table)

    @pl.when(wg == 0)
    def _():  # q, the block table etc. (and the inv_freq tile) for every warpgroup
        plgpu.copy_gmem_to_smem(q_ref.at[s, h, :, pl.ds(0, half)], qa_smem, q_bar)
        plgpu.copy_gmem_to_smem(q_ref.at[s, h, :, pl.ds(half, half)], qb_smem, q_bar)
        plgpu.copy_gmem_to_smem(meta_ref.at[s], meta_smem, q_bar)
        if trig:
            plgpu.copy_gmem_to_smem(rope_ref, inv_smem, q_bar)

    @pl.when(wg == consumers)
    def _producer():
        def issue(step):
            slot = lax.rem(step - lo, stages)
            cta.issue(step, ka_smem.at[slot], kb_smem.at[slot], v_smem.at[slot],
                      ca_smem.at[slot], cb_smem.at[slot], kv_bar.at[slot])

        plgpu.barrier_wait(q_bar)
        for ahead in range(stages):
            pl.when(lo + ahead < hi)(functools.partial(issue, lo + ahead))

        @pl.loop(lo, hi)
        def _(step):
            slot = lax.rem(step - lo, stages)
            if rotate_keys:  # the consumers wait for the rotated keys, not for the TMA
                plgpu.barrier_wait(kv_bar.at[slot])
                if rotate_math:
                    cos, sin = ((ca_smem[slot], cb_smem[slot]) if table else
                                cta.trig_cos_sin(step, inv_smem, scaling))
                    rotate_in_place(ka_smem.at[slot], kb_smem.at[slot], cos, sin, dtype,
                                    dtype if packed else jnp.float32)
                plgpu.barrier_arrive(ready_bar.at[slot])
            back = step - consumers  # its consumer now holds `step`: done with `back`

            @pl.when((back >= lo) & (back + stages < hi))
            def _():
                plgpu.barrier_wait(free_bar.at[lax.rem(back - lo, stages)])
                issue(back + stages)

        @pl.loop(jnp.maximum(lo, hi - stages), hi)
        def _(step):  # observe the last uses too (Pallas: a waiter waits on every phase)
            plgpu.barrier_wait(free_bar.at[lax.rem(step - lo, stages)])

    @pl.when(wg < consumers)
    def _consumer():
        q_pos, q_win = info_ref[1, s], info_ref[2, s]
        plgpu.barrier_wait(q_bar)

        def step_fn(t, carry):
            step = lo + wg + t * consumers
            slot = lax.rem(step - lo, stages)
            plgpu.barrier_wait((ready_bar if rotate_keys else kv_bar).at[slot])
            carry = attend_step(carry, cta, step, q_pos, q_win, qa_smem, qb_smem,
                                ka_smem.at[slot], kb_smem.at[slot], v_smem.at[slot], dtype,
                                p_smem.at[wg] if interpret else None)
            plgpu.barrier_arrive(free_bar.at[slot])
            return carry

        count = jnp.maximum(hi - lo - wg + consumers - 1, 0) // consumers
        carry = lax.fori_loop(0, count, step_fn, initial_carry(v_smem.shape[-1]))
        # This consumer's last TMA landed and its wgmmas are done: its V slot `wg` is free.
        part = split * consumers + wg
        store_partial(carry, v_smem.at[wg, pl.ds(0, ROWS)], lse_smem.at[wg],
                      o_ref.at[part, s, h], lse_ref.at[part, s, h], out_rows, dtype)


def decode_attention_mosaic_ws(q_rot, k_pages, v_pages, md, inv_freq, *, rotate_keys: bool,
                               attention_scaling: float, sm_scale: float, pages_per_step: int = 4,
                               splits: int | None = None, stages: int = 4, consumers: int = 2,
                               max_position: int | None = None, packed: bool = False,
                               rotate_math: bool = True, interpret=False):
    """As mosaic_decode.decode_attention_mosaic (same inputs and result), warp-specialised:
    `consumers` compute warpgroups and one producer warpgroup (TMA, and the key rotation in
    position_free mode); stages: ring slots, a multiple of consumers and larger; packed: rotate
    the keys with 16-bit FMAs (bf16x2) instead of float32 (as triton_decode's packed option);
    rotate_math=False is a benchmark diagnostic: the same pipeline with the rotation arithmetic
    skipped (wrong results), to tell the pipeline's cost from the rotation's."""
    heads, head_dim = q_rot.shape[1:]
    page_size, kv_heads = k_pages.shape[1:3]
    seqs = md.block_tables.shape[0]
    dtype = q_rot.dtype
    table = rotate_keys and max_position is not None
    trig = rotate_keys and not table
    if splits is None:
        splits = max(1, min(16, -(-1024 // (seqs * kv_heads))))
    ins, half, out_rows = decode_inputs(q_rot, md, inv_freq, rotate_keys, attention_scaling,
                                        sm_scale, pages_per_step, page_size, kv_heads,
                                        max_position)
    scratch = scratch_buffers(dtype, half, head_dim, pages_per_step, page_size, stages, table,
                              trig, probs=(consumers,) if interpret else None, lse=(consumers,),
                              meta_shape=ins[1].shape[1:]) + [
        plgpu.Barrier(num_barriers=stages),  # ready (rotated keys)
        plgpu.Barrier(num_barriers=stages),  # free (the slot's consumer is done)
    ]
    kernel = functools.partial(
        _kernel, max_blocks=md.block_tables.shape[1], page_size=page_size,
        pages_per_step=pages_per_step, half=half,
        rotate_keys=rotate_keys, table=table, scaling=float(attention_scaling), dtype=dtype,
        splits=splits, stages=stages, consumers=consumers, out_rows=out_rows,
        interpret=bool(interpret), rotate_math=rotate_math, packed=packed)
    parts = splits * consumers
    call = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((parts, seqs, kv_heads, out_rows, head_dim), dtype),
                  jax.ShapeDtypeStruct((parts, seqs, kv_heads, out_rows), jnp.float32)),
        grid=(seqs, kv_heads, splits), grid_names=("s", "h", "sp"), num_threads=consumers + 1,
        thread_name="wg", scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret is True else interpret)
    out, lse = call(*ins[:1], k_pages, v_pages, *ins[1:])
    return finish_partials(out, lse, md, heads, dtype)
