"""Decode paged attention in Pallas Mosaic GPU with warp-level MMA: keys rotated in registers.

EXPERIMENTAL, like mosaic_decode.py, whose inputs, TMA ring, cos | sin table and split-K merge it
shares. The difference is where the rotated keys go. A wgmma reads its B operand from shared
memory, so mosaic_decode.py must write the rotated keys back to their ring slot and fence them
before the QK^T wgmma. Here QK^T and PV are warp-level MMAs (`plgpu.mma`: mma.sync m16n8k16)
whose operands live in registers, as in triton_decode: each step's key halves are loaded from
the ring straight into the B-operand layout (K^T, keys along N: each warp owns 8 of every 32
keys), rotated in float32 and fed to the MMA. Nothing goes back to shared memory but the 16 x BK
probabilities, which every warp needs as its PV A operand (V^T pairs come by ldmatrix.trans).

One CTA (one warpgroup) per (sequence, kv head, split); the G <= 16 query heads of the kv head
are rows 0..G-1 of a 16-row tile. The online softmax's row max is a cross-warp reduction per
step (keys are spread over the warps); the row sum is kept per key column and reduced once at
the end. Pallas's automatic barriers are off (it would put a warpgroup barrier before each of
the step's 12-20 TMA copies); the kernel places its own: one at the top of each step, after
which one thread refills the slot the previous step used (TMA runs stages - 1 full steps
ahead), and one after the probabilities' store, before any warp reads them (their next store
comes after the next step's max, a cross-warp reduction with barriers of its own).
In trig mode the B-layout key index and inv_freq (as three bf16 parts summed in float32) are
loaded once from a tile: Mosaic GPU's broadcasted_iota assumes a layout's vector runs along
the last dimension, which the B layout's does not (its pairs run along R/2), so an iota there
numbers the keys wrongly (run 22-23).

Limits: those of mosaic_decode.py, with G <= 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.interpreters import mlir
from jax._src.pallas.mosaic_gpu import primitives as _mgpu_primitives
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.paged_attention.mosaic_decode import (_SMEM_LIMIT, decode_inputs,
                                                          finish_partials, meta_bytes,
                                                          shape_limits)
from kernels_pallas.paged_attention.mosaic_decode_parts import _LOG2E, Cta, cody_waite

QROWS = 16  # mma M: the G query rows of a kv head are rows 0..G-1
_LHS = plgpu.Layout.MMA_LHS(jnp.bfloat16, m_warps=1)  # the same for any 16-bit dtype
_RHS = plgpu.Layout.MMA_RHS(jnp.bfloat16, m_warps=1)
_ACC = plgpu.Layout.MMA_ACC(jnp.bfloat16, m_warps=1)


def _interpreted_mma(acc, a, b):
    return acc + jnp.dot(a, b, preferred_element_type=acc.dtype)


# The Mosaic GPU interpreter (CPU) has no rule for plgpu.mma: there it is acc + a @ b in float32.
mlir.register_lowering(_mgpu_primitives.mma_p,
                       mlir.lower_fun(_interpreted_mma, multiple_results=False), platform="cpu")


def mma_limits(q, k_pages, inv_freq, rotate_keys, pages_per_step, table_cols, stages, table):
    """Why this kernel cannot take these shapes and options ('' when it can)."""
    if stages < 2:
        return f"needs at least 2 stages, got {stages}"
    if q.shape[1] // k_pages.shape[2] > QROWS:
        return f"needs at most {QROWS} query heads per kv head"
    problem = shape_limits(q, k_pages, inv_freq, rotate_keys, pages_per_step, table_cols)
    if problem:
        return problem
    head_dim, block_k = q.shape[-1], pages_per_step * k_pages.shape[1]
    need = mma_smem_bytes(head_dim, block_k, q.dtype.itemsize, stages, rotate_keys and table,
                          rotate_keys and not table) + meta_bytes(table_cols)
    if need > _SMEM_LIMIT:
        return (f"needs {need} bytes of shared memory for head_dim {head_dim}, block {block_k}, "
                f"{stages} stages; the H200 has {_SMEM_LIMIT} per block")
    return ""


def mma_smem_bytes(head_dim, block_k, itemsize, stages, table, trig):
    """q halves, the ring (K halves, V, cos | sin rows with a table), the inv_freq tile (trig),
    the probability tile, the output tile, log-sum-exps, barriers and the reduction scratch."""
    half = head_dim // 2
    stage = 2 * block_k * half + block_k * head_dim + (2 * block_k * half if table else 0)
    return ((2 * QROWS * half + stages * stage + QROWS * block_k + QROWS * head_dim) * itemsize
            + (4 * block_k * half * 2 if trig else 0) + QROWS * 4 + 512 + 2048)


def _kernel(q_ref, k_ref, v_ref, meta_ref, nb_ref, qpos_ref, qwin_ref, rope_ref, o_ref, lse_ref,
            qa_smem, qb_smem, ka_smem, kb_smem, v_smem, ca_smem, cb_smem, inv_smem, p_smem,
            o_smem, lse_smem, meta_smem, q_bar, kv_bar, *, max_blocks, page_size,
            pages_per_step, half, rotate_keys, table, scaling, dtype, splits, stages, out_rows,
            packed):
    s, h, split = lax.axis_index("s"), lax.axis_index("h"), lax.axis_index("sp")
    n_blocks = nb_ref[s]
    n_steps = (n_blocks + pages_per_step - 1) // pages_per_step
    per_split = (n_steps + splits - 1) // splits
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, n_steps)
    block_k = pages_per_step * page_size
    cta = Cta(s, h, meta_smem, n_blocks, k_ref, v_ref, rope_ref, page_size, pages_per_step, half,
              max_blocks, rotate_keys and table)

    plgpu.copy_gmem_to_smem(q_ref.at[s, h, :, pl.ds(0, half)], qa_smem, q_bar)
    plgpu.copy_gmem_to_smem(q_ref.at[s, h, :, pl.ds(half, half)], qb_smem, q_bar)
    if rotate_keys and not table:
        plgpu.copy_gmem_to_smem(rope_ref, inv_smem, q_bar)
    plgpu.copy_gmem_to_smem(meta_ref.at[s], meta_smem, q_bar)
    plgpu.barrier_wait(q_bar)
    q_pos, q_win = qpos_ref[s], qwin_ref[s]
    q_lo, q_hi = plgpu.load(qa_smem, layout=_LHS), plgpu.load(qb_smem, layout=_LHS)

    def keys_t(ref):  # a [BK, R/2] tile -> its transpose in the B-operand layout
        return plgpu.load(ref.transpose((1, 0)), layout=_RHS)

    if rotate_keys and not table:  # in the B layout: inv_freq (three bf16 parts), key index
        inv = sum(keys_t(inv_smem.at[i]).astype(jnp.float32) for i in range(3))
        key_idx = keys_t(inv_smem.at[3]).astype(jnp.float32).astype(jnp.int32)

    def issue(step, slot):
        cta.issue(step, ka_smem.at[slot], kb_smem.at[slot], v_smem.at[slot], ca_smem.at[slot],
                  cb_smem.at[slot], kv_bar.at[slot])

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
        k_lo, k_hi = keys_t(ka_smem.at[slot]), keys_t(kb_smem.at[slot])  # [R/2, BK]
        if rotate_keys:
            if table:
                cos, sin = keys_t(ca_smem.at[slot]), keys_t(cb_smem.at[slot])
            else:
                pos, _ = cta.key_info(step, key_idx)
                red = cody_waite(pos.astype(jnp.float32) * inv)
                cos, sin = jnp.cos(red) * scaling, jnp.sin(red) * scaling
            math = dtype if packed else jnp.float32
            cos, sin = cos.astype(math), sin.astype(math)
            lo_m, hi_m = k_lo.astype(math), k_hi.astype(math)
            k_lo = (lo_m * cos - hi_m * sin).astype(dtype)
            k_hi = (hi_m * cos + lo_m * sin).astype(dtype)
        qk = plgpu.layout_cast(jnp.zeros((QROWS, block_k), jnp.float32), _ACC)
        qk = plgpu.mma(plgpu.mma(qk, q_lo, k_lo), q_hi, k_hi)
        col = plgpu.broadcasted_iota(jnp.int32, (QROWS, block_k), 1, layout=_ACC)
        k_pos, k_ok = cta.key_info(step, col)
        qk = jnp.where(k_ok & (k_pos <= q_pos) & (k_pos >= q_win), qk * _LOG2E, -jnp.inf)
        m_new = jnp.maximum(m_i, qk.max(axis=1))  # a cross-warp reduction (keys span warps)
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = lax.broadcast_in_dim(jnp.exp2(m_i - m_safe), qk.shape, [0])
        p = jnp.exp2(qk - lax.broadcast_in_dim(m_safe, qk.shape, [0]))
        p_smem[...] = p.astype(dtype)  # every warp's PV needs all of the step's columns
        plgpu.commit_smem()  # (a warpgroup barrier: auto barriers are off)
        v = plgpu.load(v_smem.at[slot], layout=_RHS)
        acc = acc * lax.broadcast_in_dim(jnp.exp2(m_i - m_safe), acc.shape, [0])
        acc = plgpu.mma(acc, plgpu.load(p_smem, layout=_LHS), v)
        return acc, m_new, l_cols * alpha + p

    init = (plgpu.layout_cast(jnp.zeros((QROWS, v_smem.shape[-1]), jnp.float32), _ACC),
            plgpu.layout_cast(jnp.full((QROWS,), -jnp.inf, jnp.float32), _ACC.reduce(1)),
            plgpu.layout_cast(jnp.zeros((QROWS, block_k), jnp.float32), _ACC))
    acc, m_i, l_cols = lax.fori_loop(lo, hi, step_fn, init)
    l_i = l_cols.sum(axis=1)
    empty = l_i == 0.0  # no visible key: output 0 and log-sum-exp -inf (weight 0 in the merge)
    l_i = jnp.where(empty, 1.0, l_i)
    lse_smem[...] = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_i)) * (1.0 / _LOG2E))
    o_smem[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, out_rows)], o_ref.at[split, s, h])
    plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, out_rows)], lse_ref.at[split, s, h])
    plgpu.wait_smem_to_gmem(0)


def decode_attention_mosaic_mma(q_rot, k_pages, v_pages, md, inv_freq, *, rotate_keys: bool,
                                attention_scaling: float, sm_scale: float,
                                pages_per_step: int = 4, splits: int | None = None,
                                stages: int = 3, max_position: int | None = None,
                                packed: bool = False, interpret=False):
    """As mosaic_decode.decode_attention_mosaic (same inputs, options and result), with QK^T
    and PV as warp-level MMAs on registers: the rotated keys never go back to shared memory.
    packed: rotate with 16-bit FMAs (bf16x2/f16x2) instead of float32."""
    heads, head_dim = q_rot.shape[1:]
    page_size, kv_heads = k_pages.shape[1:3]
    seqs = md.block_tables.shape[0]
    dtype = q_rot.dtype
    table = rotate_keys and max_position is not None
    if splits is None:
        splits = max(1, min(16, -(-2048 // (seqs * kv_heads))))
    ins, half, out_rows = decode_inputs(q_rot, md, inv_freq, rotate_keys, attention_scaling,
                                        sm_scale, pages_per_step, page_size, kv_heads,
                                        max_position, q_rows=QROWS)
    block_k = pages_per_step * page_size
    trig = rotate_keys and not table
    if trig:  # f32 inv_freq as three 16-bit parts: transposed loads of 16-bit tiles are exact
        ins = ins[:-1] + (_trig_tile(ins[-1]),)
    sw = plgpu.SwizzleTransform(128)
    bf = (plgpu.TilingTransform((8, 64)), sw)
    unused = plgpu.SMEM((8,), dtype)
    ring = lambda cols: plgpu.SMEM((stages, block_k, cols), dtype, transforms=bf)
    scratch = [
        plgpu.SMEM((QROWS, half), dtype, transforms=bf),  # q lo
        plgpu.SMEM((QROWS, half), dtype, transforms=bf),  # q hi
        ring(half), ring(half), ring(head_dim),  # k lo, k hi, v
        ring(half) if table else unused, ring(half) if table else unused,  # cos, sin
        plgpu.SMEM((4, block_k, half), jnp.bfloat16, transforms=bf) if trig else unused,  # inv
        plgpu.SMEM((QROWS, block_k), dtype, transforms=bf),  # probabilities
        plgpu.SMEM((QROWS, head_dim), dtype, transforms=bf),  # output
        plgpu.SMEM((QROWS,), jnp.float32),  # log-sum-exps
        plgpu.SMEM(ins[1].shape[1:], jnp.int32),  # block table, block starts, valid counts
        plgpu.Barrier(num_arrivals=3 + (rotate_keys and not table)),
        plgpu.Barrier(num_arrivals=(5 if table else 3) * pages_per_step, num_barriers=stages),
    ]
    kernel = functools.partial(
        _kernel, max_blocks=md.block_tables.shape[1], page_size=page_size,
        pages_per_step=pages_per_step, half=half, rotate_keys=rotate_keys, table=table,
        scaling=float(attention_scaling), dtype=dtype, splits=splits, stages=stages,
        out_rows=out_rows, packed=packed)
    call = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((splits, seqs, kv_heads, out_rows, head_dim), dtype),
                  jax.ShapeDtypeStruct((splits, seqs, kv_heads, out_rows), jnp.float32)),
        grid=(seqs, kv_heads, splits), grid_names=("s", "h", "sp"), scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
        interpret=plgpu.InterpretGPUParams() if interpret is True else interpret)
    out, lse = call(*ins[:1], k_pages, v_pages, *ins[1:])
    return finish_partials(out, lse, md, heads, dtype)


def _trig_tile(inv_tile):
    """[BK, R/2] float32 inv_freq rows -> [4, BK, R/2] bfloat16: three parts whose float32 sum
    is inv_freq (8 + 8 + 8 bits), then each row's key index (exact: BK <= 256)."""
    parts, rest = [], inv_tile
    for _ in range(3):
        parts.append(rest.astype(jnp.bfloat16))
        rest = rest - parts[-1].astype(jnp.float32)
    key_idx = lax.broadcasted_iota(jnp.bfloat16, inv_tile.shape, 0)
    return jnp.stack(parts + [key_idx])
