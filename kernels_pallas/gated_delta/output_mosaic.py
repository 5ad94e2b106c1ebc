"""The output kernel of the fused gated delta rule in Pallas Mosaic GPU (Hopper: TMA, wgmma).

Same contract as `fused_triton.output_fused` for bf16 / f16 and chunks of 64 rows: per
(sequence, chunk, value head) one warpgroup computes
    O = (scale Q exp(gc)) S + tril(scale Q K^T * exp(seg)) V'
with S the state entering the chunk (from the scan, [Dk, Dv] or transposed [Dv, Dk]) and V' the
scan's corrected values. The decay exponents are intra_mosaic.exponents' segment sums (each a
float32 sum over its own segment, on the tensor cores); Q K^T, the inter-chunk product and the
intra-chunk product take the input dtype with float32 accumulation, as the Triton kernel's dots
do, and the last two accumulate into one wgmma accumulator. SMEM: ~105 KB at D = 128 (Q, K, V',
S, the scores, two segment-sum tiles), so two CTAs share an SM and one's loads overlap the
other's products.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.gated_delta.intra_mosaic import CHUNK, exponents, tile_iota, wgmma_sum
from kernels_pallas.gated_delta.mosaic_calls import chunks_below, named, one_kernel_per_shape

_F32 = jnp.float32


def _kernel(q_ref, k_ref, vnew_ref, s_ref, gate_ref, o_ref, q_smem, k_smem, v_smem, s_smem,
            attn_smem, gates, tiles, bar, *, rep, scale, states_t, interpret):
    n, c, h = lax.axis_index("n"), lax.axis_index("c"), lax.axis_index("h")
    rows = pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)
    kh = lax.div(h, rep)
    plgpu.copy_gmem_to_smem(q_ref.at[n, rows, kh], q_smem, bar)
    plgpu.copy_gmem_to_smem(k_ref.at[n, rows, kh], k_smem, bar)
    plgpu.copy_gmem_to_smem(vnew_ref.at[n, rows, h], v_smem, bar)
    plgpu.copy_gmem_to_smem(s_ref.at[n, h, c], s_smem, bar)
    plgpu.copy_gmem_to_smem(gate_ref.at[n, h, :, rows], gates, bar)
    plgpu.barrier_wait(bar)
    dtype = q_smem.dtype
    gc, _, seg = exponents(gates, [tiles.at[0], tiles.at[1]])
    qk = wgmma_sum([(q_smem, k_smem.transpose((1, 0)))], (CHUNK, CHUNK))
    rows_i, cols_j = tile_iota(0), tile_iota(1)
    attn = jnp.where(rows_i >= cols_j, qk * (scale * jnp.exp(seg)), 0.0)
    q = plgpu.load(q_smem, layout=plgpu.Layout.WGMMA).astype(_F32)
    qg = (q * lax.broadcast_in_dim(scale * jnp.exp(gc), q.shape, [0])).astype(dtype)
    attn = attn.astype(dtype)
    if interpret:  # the interpreter's wgmma takes SMEM operands only; compiled: A in registers
        q_smem[...], attn_smem[...] = qg, attn
        qg, attn = q_smem, attn_smem
    plgpu.commit_smem()
    state = s_smem.transpose((1, 0)) if states_t else s_smem  # [Dk, Dv]
    o = wgmma_sum([(qg, state), (attn, v_smem)], v_smem.shape)
    v_smem[...] = o.astype(v_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(v_smem, o_ref.at[n, rows, h])
    plgpu.wait_smem_to_gmem(0)


def output_mosaic(q, k, g, v_new, states, *, scale, chunk=CHUNK, states_t=False,
                  interpret=False, used=None):
    """O [N, T, Hv, Dv] in v_new's dtype from q/k [N, T, Hk, Dk], g [N, T, Hv] (float32 log
    decays; the kernel sums them itself), V' [N, T, Hv, Dv] and the states entering each chunk
    [N, Hv, NT, Dk, Dv] ([N, Hv, NT, Dv, Dk] if states_t), all 16-bit of one dtype; interpret:
    False (compile), True or a plgpu.InterpretGPUParams (CPU); used: None or an int32 scalar,
    only chunks below it (mosaic_calls.chunks_below)."""
    n, t_len, hk, dk = k.shape
    hv, dv = v_new.shape[2:]
    dtype = v_new.dtype
    if (chunk != CHUNK or jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16)
            or {q.dtype, k.dtype, states.dtype} != {dtype} or dk % 64 or dv % 64
            or max(dk, dv) > 128 or t_len % chunk):
        raise ValueError(f"gated_delta output_mosaic: needs chunk {CHUNK}, q/k/V'/states of one "
                         f"bf16/f16 dtype, Dk and Dv multiples of 64 up to 128 and T a multiple "
                         f"of the chunk; got chunk={chunk}, dtypes {q.dtype} {k.dtype} {dtype} "
                         f"{states.dtype}, Dk={dk}, Dv={dv}, T={t_len}")
    gates = jnp.moveaxis(g.astype(_F32), 1, 2)[:, :, None, :]  # [N, Hv, 1, T]
    return _output(q, k, v_new, states, gates, used, scale=scale, states_t=states_t,
                   interpret=interpret)


@one_kernel_per_shape("scale", "states_t", "interpret")
def _output(q, k, v_new, states, gates, used, *, scale, states_t, interpret):
    """The kernel call (gates [N, Hv, 1, T] float32; used: None or an int32 scalar), jitted so
    that every call of one shape lowers one kernel (mosaic_calls.one_kernel_per_shape)."""
    n, t_len, hk, dk = k.shape
    hv, dv = v_new.shape[2:]
    dtype = v_new.dtype
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = lambda shape, dt=dtype: plgpu.SMEM(shape, dt, transforms=tiled)
    kernel, extra = chunks_below(functools.partial(
        _kernel, rep=hv // hk, scale=scale, states_t=states_t, interpret=bool(interpret)), 5,
        used, t_len // CHUNK)
    call = plgpu.kernel(
        named(kernel, "gdn_output_mosaic"),
        out_type=jax.ShapeDtypeStruct((n, t_len, hv, dv), dtype),
        grid=(n, t_len // CHUNK, hv), grid_names=("n", "c", "h"),
        scratch_types=[
            smem((CHUNK, dk)),  # Q, then scale Q exp(gc)
            smem((CHUNK, dk)),  # K
            smem((CHUNK, dv)),  # V', then O
            smem((dv, dk) if states_t else (dk, dv)),  # S
            smem((CHUNK, CHUNK)),  # the masked scores (interpreted only)
            plgpu.SMEM((1, CHUNK), _F32),  # g
            smem((2, CHUNK, CHUNK), jnp.bfloat16),  # segment-sum operands (two: SMEM)
            plgpu.Barrier(num_arrivals=5),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret is True else (interpret or None))
    return call(q, k, v_new, states, gates, *extra)
