"""Intra-chunk UT solve of the gated delta rule in Pallas Mosaic GPU (Hopper: TMA, wgmma).

Same outputs as `intra_blocked.intra_chunk_blocked` (W, U, KD [N, T, Hv, D] in the 16-bit input
dtype, gc [N, T, Hv] float32), for bf16 / f16 inputs and chunks of 64 rows. One warpgroup per
(sequence, chunk, value head): its 64 rows are the M = 64 of every wgmma, so the chunk is never
sliced into row blocks in registers; where the Triton kernel works on 16-row sub-blocks, this
one masks whole [64, 64] tiles instead:
  - exponents: every decay exponent a direct float32 sum of g over its own segment, never a
    difference of two cumulative sums (tests/test_gated_delta_decay_precision.py says why): the
    [64, 64] segment sums seg = L @ G (L the ones on and below the diagonal, G[m, j] = g_m for
    m > j) on the tensor cores, G split into three bf16 parts that sum to it exactly (L is exact
    in bf16, float32 accumulation); gc and the sums to the chunk end as row reductions of masked
    tiles;
  - A = tril(beta K K^T * exp(seg), -1): one wgmma K @ K^T in the input dtype, float32 accumulate;
  - (I + A)^-1 without row substitution: D (A's 16 x 16 diagonal blocks) is nilpotent of index
    16, so (I + D)^-1 = (I - D)(I + D^2)(I + D^4)(I + D^8) exactly (the Triton kernel's product).
    Its six products are block-diagonal: the right operand goes as its four diagonal blocks
    stacked [64, 16], so each is one wgmma of N = 16 (a quarter of a [64, 64] product; row r of
    the left operand is zero outside its block). With M = (I + D)^-1 O (O = A - D, strictly
    lower by blocks, M^4 = 0) the inverse is (I - M)(I + M^2)(I + D)^-1: four [64, 64]
    products. Every product's operands are split into bf16 hi + lo parts, three passes
    (`_product`, `_block_diagonal_product`; block_passes=1: the four block-level ones in one);
  - W = Tinv @ (beta exp(gc) K), U = Tinv @ (beta V) as the Triton kernel's final dots do: Tinv
    and the right-hand sides rounded to the input dtype, float32 accumulation. KD = K exp(g over
    (r, C - 1]).
The gates travel as one [N, Hv, 2, T] float32 array (g, beta; a TMA box needs a contiguous last
axis) and gc comes back [N, Hv, T], moved to [N, T, Hv] here.

Interpret mode (plgpu.InterpretGPUParams, CPU) runs this same kernel body with one difference
(as mosaic_prefill.py's P): compiled, the left operands of the products stay in registers
(wgmma's A); interpreted, they are stored to SMEM tiles first (the interpreter takes SMEM
operands only). The CUDA lowering test and the compiled tests cover the register path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.gated_delta.mosaic_calls import chunks_below, named, one_kernel_per_shape

CHUNK = 64  # rows of a chunk = M of a warpgroup's wgmma
SUB = 16  # diagonal blocks inverted by the nilpotent product (the Triton kernel's sub-block)
_WG = plgpu.Layout.WGMMA
_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a [64, N] tile
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column
_F32 = jnp.float32
_SW128 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def tile_iota(dim):
    return plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), dim), _WG)


def wgmma_sum(pairs, shape):
    """sum of a @ b over the (a, b) SMEM operand pairs, float32, into registers."""
    def body(acc):
        for a, b in pairs:
            plgpu.wgmma(acc, a, b)
        return acc[...]
    return pl.run_scoped(body, plgpu.ACC(shape, _F32))


def _hi_lo(x):
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(_F32)).astype(jnp.bfloat16)


def _product(a, b, ops, passes):
    """a @ b for float32 [64, 64] register tiles: passes=3 sums a_hi b_hi + a_hi b_lo +
    a_lo b_hi (relative error ~2^-16, the a_lo b_lo term dropped), passes=1 takes a_hi b_hi
    alone. The b parts go through SMEM tiles, the a parts as `_lhs` says."""
    (a_hi, a_lo), (b_hi, b_lo) = _hi_lo(a), _hi_lo(b)
    lhs = _lhs(ops, ops.tiles[:2], (a_hi, a_lo)[:1 if passes == 1 else 2])
    ops.tiles[2][...] = b_hi
    pairs = [(lhs[0], ops.tiles[2])]
    if passes == 3:
        ops.tiles[3][...] = b_lo
        pairs = [(lhs[1], ops.tiles[2]), (lhs[0], ops.tiles[3])] + pairs
    plgpu.commit_smem()  # generic-proxy stores, then the tensor cores read them
    return wgmma_sum(pairs, (CHUNK, CHUNK))


def _lhs(ops, slots, parts):
    """Left wgmma operands: the 16-bit register arrays themselves when compiled (wgmma's A may
    come from registers: no SMEM round trip), else stored to the SMEM tiles `slots` (the
    interpreter takes SMEM operands only)."""
    if ops.regs_a:
        return list(parts)
    for ref, x in zip(slots, parts):
        ref[...] = x
    return list(slots[:len(parts)])


def exponents(gates, tiles):
    """(gc [64] row layout: g over [0, r]; to_end [64]: g over (r, C - 1]; seg [64, 64]: g over
    (j, i]), every one a sum over its own segment (module doc). tiles: four [64, 64] bf16 SMEM
    tiles (one wgmma of three passes) or two (three wgmmas one after the other, for a kernel
    short of SMEM)."""
    rows, cols = tile_iota(0), tile_iota(1)
    g_by_col = lax.broadcast_in_dim(plgpu.load(gates.at[0], layout=_COL), (CHUNK, CHUNK), [1])
    gc = jnp.sum(jnp.where(cols <= rows, g_by_col, 0.0), axis=1)
    to_end = jnp.sum(jnp.where(cols > rows, g_by_col, 0.0), axis=1)
    g_by_row = lax.broadcast_in_dim(plgpu.load(gates.at[0], layout=_ROW), (CHUNK, CHUNK), [0])
    terms = jnp.where(rows > cols, g_by_row, 0.0)  # [m, j]: g_m where m > j
    hi = terms.astype(jnp.bfloat16)
    rest = terms - hi.astype(_F32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(_F32)).astype(jnp.bfloat16)  # hi + mid + lo == terms exactly
    tiles[0][...] = jnp.where(cols <= rows, 1.0, 0.0).astype(jnp.bfloat16)  # L[i, m]: m <= i
    if len(tiles) == 4:
        tiles[1][...], tiles[2][...], tiles[3][...] = lo, mid, hi
        plgpu.commit_smem()
        seg = wgmma_sum([(tiles[0], tiles[1]), (tiles[0], tiles[2]), (tiles[0], tiles[3])],
                        (CHUNK, CHUNK))
        return gc, to_end, seg
    seg = None
    for part in (lo, mid, hi):  # the smallest first, as above
        tiles[1][...] = part
        plgpu.commit_smem()
        term = wgmma_sum([(tiles[0], tiles[1])], (CHUNK, CHUNK))  # waits: tiles[1] free again
        seg = term if seg is None else seg + term
    return gc, to_end, seg


@dataclasses.dataclass(frozen=True)
class Operands:
    """The SMEM operand tiles of the register products: tiles, four [64, 64] bf16 (128-byte
    swizzle: full products, the segment sums); full, two [64, 64] and stacked, two [64, 16]
    bf16 (32-byte swizzle, as a wgmma with N = 16 needs on both sides: block-diagonal
    products, `_block_diagonal_product`)."""
    tiles: list
    full: list
    stacked: list
    regs_a: bool  # left operands from registers (compiled), else SMEM (`_lhs`)

    @staticmethod
    def scratch():
        sw32 = (plgpu.TilingTransform((8, SUB)), plgpu.SwizzleTransform(32))
        return [plgpu.SMEM((4, CHUNK, CHUNK), jnp.bfloat16, transforms=_SW128),
                plgpu.SMEM((2, CHUNK, CHUNK), jnp.bfloat16, transforms=sw32),
                plgpu.SMEM((2, CHUNK, SUB), jnp.bfloat16, transforms=sw32)]

    @classmethod
    def of(cls, tiles, full, stacked, *, regs_a):
        return cls([tiles.at[i] for i in range(4)],
                   [] if full is None else [full.at[i] for i in range(2)],  # compiled: unused
                   [stacked.at[i] for i in range(2)], regs_a)


def _same_block(cols):
    rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (CHUNK, cols), 0), _WG)
    if cols == SUB:
        return lax.shift_right_logical(rows, 4)
    c = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (CHUNK, cols), 1), _WG)
    return lax.shift_right_logical(rows, 4) == lax.shift_right_logical(c, 4)


def _stacked(x):
    """Block-diagonal [64, 64] -> its four 16 x 16 diagonal blocks stacked, [64, 16]."""
    block = _same_block(SUB)
    return sum(jnp.where(block == i, x[:, SUB * i:SUB * (i + 1)], 0.0)
               for i in range(CHUNK // SUB))


def _unstacked(s):
    """[64, 16] stacked diagonal blocks -> the block-diagonal [64, 64] (in registers, the
    columns c and c + 16 of a row sit in one thread: no data moves)."""
    return jnp.where(_same_block(CHUNK), jnp.concatenate([s] * (CHUNK // SUB), axis=1), 0.0)


def _block_diagonal_product(a, b, ops):
    """a @ b for block-diagonal a, b given stacked ([64, 16]), stacked, three passes: one
    wgmma of N = 16 per pass (a quarter of a full [64, 64] product), since row r of a is zero
    outside its block, where b's rows are that block's."""
    (a_hi, a_lo), (b_hi, b_lo) = _hi_lo(_unstacked(a)), _hi_lo(b)
    lhs_hi, lhs_lo = _lhs(ops, ops.full, (a_hi, a_lo))
    ops.stacked[0][...], ops.stacked[1][...] = b_hi, b_lo
    plgpu.commit_smem()
    return wgmma_sum([(lhs_lo, ops.stacked[0]), (lhs_hi, ops.stacked[1]),
                      (lhs_hi, ops.stacked[0])], (CHUNK, SUB))


def unit_lower_inverse(a, ops, block_passes):
    """(I + a)^-1 for a strictly lower [64, 64] (module doc): the diagonal blocks by the
    nilpotent product in three-pass block-diagonal products (the Triton kernel's float32
    diagonal inverse), then the block-level factor (I - M)(I + M^2) in `block_passes` (3, or
    1 as the Triton kernel's bf16 block substitution). ops: `Operands`."""
    rows, cols = tile_iota(0), tile_iota(1)
    eye = jnp.where(rows == cols, 1.0, 0.0)
    d = jnp.where(_same_block(CHUNK), a, 0.0)
    p = _stacked(d)
    x = _stacked(eye) - p
    power = 2
    while power < SUB:
        p = _block_diagonal_product(p, p, ops)  # d^power, stacked
        x = x + _block_diagonal_product(x, p, ops)
        power *= 2
    x = _unstacked(x)  # (I + d)^-1
    m = _product(x, a - d, ops, block_passes)
    y = eye - m
    y = y + _product(y, _product(m, m, ops, block_passes), ops, block_passes)
    return _product(y, x, ops, block_passes)


def _kernel(k_ref, v_ref, gate_ref, w_ref, u_ref, kd_ref, gc_ref, k_smem, v_smem, gates,
            tiles, stacked, gc_smem, bar, *extra, rep, block_passes, interpret, lean):
    # extra (`_scratch`): full, tinv_smem (interpreted only), kd_smem (unless lean)
    full, tinv_smem = extra[:2] if interpret else (None, None)
    n, c, h = lax.axis_index("n"), lax.axis_index("c"), lax.axis_index("h")
    rows = pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)
    plgpu.copy_gmem_to_smem(k_ref.at[n, rows, lax.div(h, rep)], k_smem, bar)
    plgpu.copy_gmem_to_smem(v_ref.at[n, rows, h], v_smem, bar)
    plgpu.copy_gmem_to_smem(gate_ref.at[n, h, :, rows], gates, bar)
    plgpu.barrier_wait(bar)
    dtype = k_smem.dtype
    ops = Operands.of(tiles, full, stacked, regs_a=not interpret)
    gc, to_end, seg = exponents(gates, ops.tiles)
    beta = plgpu.load(gates.at[1], layout=_ROW)
    kk = wgmma_sum([(k_smem, k_smem.transpose((1, 0)))], (CHUNK, CHUNK))
    r, cl = tile_iota(0), tile_iota(1)
    a = jnp.where(r > cl, lax.broadcast_in_dim(beta, kk.shape, [0]) * kk * jnp.exp(seg), 0.0)
    tinv = unit_lower_inverse(a, ops, block_passes)

    # K and V move to registers; their tiles take the right-hand sides, then W and U
    k = plgpu.load(k_smem, layout=_WG).astype(_F32)
    k_smem[...] = (k * lax.broadcast_in_dim(beta * jnp.exp(gc), k.shape, [0])).astype(dtype)
    kd = (k * lax.broadcast_in_dim(jnp.exp(to_end), k.shape, [0])).astype(dtype)
    v = plgpu.load(v_smem, layout=_WG).astype(_F32)
    v_smem[...] = (v * lax.broadcast_in_dim(beta, v.shape, [0])).astype(dtype)
    [tinv_lhs] = _lhs(ops, [tinv_smem], [tinv.astype(dtype)])
    gc_smem[...] = gc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(gc_smem, gc_ref.at[n, h, rows])
    w = wgmma_sum([(tinv_lhs, k_smem)], k.shape)
    k_smem[...] = w.astype(dtype)
    if not lean:
        extra[-1][...] = kd
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, w_ref.at[n, rows, h])
    u = wgmma_sum([(tinv_lhs, v_smem)], v.shape)
    v_smem[...] = u.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(v_smem, u_ref.at[n, rows, h])
    if lean:  # KD (held in registers, 16-bit) takes K's tile once W's store has read it
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        k_smem[...] = kd
        plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem if lean else extra[-1], kd_ref.at[n, rows, h])
    # lean: the CTA leaves once its stores have read SMEM (as CUTLASS epilogues do; the writes
    # land before the next kernel starts), not after they reach HBM: its SMEM frees sooner
    plgpu.wait_smem_to_gmem(0, wait_read_only=lean)


def _scratch(dk, dv, dtype, interpret, lean):
    """SMEM of the solve (`_kernel`'s order): 69 KB at D = 128 compiled and lean (room for
    three CTAs per SM, registers permitting: the solve is a chain of ~14 dependent products,
    so more CTAs in flight hide its latency), 85 KB with KD's own tile (two per SM); when
    interpreted, also the left-operand tiles the interpreter needs (`_lhs`)."""
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    tiles, full, stacked = Operands.scratch()
    out = [plgpu.SMEM((CHUNK, dk), dtype, transforms=tiled),  # K, beta exp(gc) K, W (, KD)
           plgpu.SMEM((CHUNK, dv), dtype, transforms=tiled),  # V, beta V, U
           plgpu.SMEM((2, CHUNK), _F32),  # g, beta
           tiles, stacked,  # product operands
           plgpu.SMEM((CHUNK,), _F32),  # gc
           plgpu.Barrier(num_arrivals=3)]
    if interpret:
        out += [full, plgpu.SMEM((CHUNK, CHUNK), dtype, transforms=tiled)]  # (I + A)^-1
    return out + ([] if lean else [plgpu.SMEM((CHUNK, dk), dtype, transforms=tiled)])  # KD


def shape_limits(dtype, dk: int, dv: int, chunk: int) -> str:
    """Why the Mosaic kernels cannot take a model's gated delta shape ('' when they can):
    dtype (the values'), head dims and chunk, known before any operand exists (the engine
    asks at start: api.Problem's model facts)."""
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"needs bf16/f16 values, got {jnp.dtype(dtype)}"
    if chunk != CHUNK:
        return f"needs chunk_size {CHUNK} (a warpgroup's rows), got {chunk}"
    if dk % 64 or dv % 64 or max(dk, dv) > 128:  # 256 overflows SMEM (227 KB)
        return f"needs Dk, Dv multiples of 64 up to 128, got Dk={dk} Dv={dv}"
    return ""


def limits(k, v, chunk, dot_dtype) -> str:
    """Why the Mosaic intra kernel cannot take these operands ('' when it can)."""
    dtype = jnp.dtype(k.dtype)
    if dtype not in (jnp.bfloat16, jnp.float16) or v.dtype != dtype:
        return f"needs bf16/f16 k and v of one dtype, got {k.dtype} and {v.dtype}"
    if dot_dtype is not None and jnp.dtype(dot_dtype) != dtype:
        return f"needs dot dtype = the inputs' ({dtype}), got {jnp.dtype(dot_dtype)}"
    why = shape_limits(dtype, k.shape[-1], v.shape[-1], chunk)
    if why:
        return why
    if k.shape[1] % chunk:
        return f"needs T a multiple of {chunk}, got T={k.shape[1]}"
    return ""


@one_kernel_per_shape("block_passes", "interpret", "lean")
def _solve(k, v, gates, used, *, block_passes, interpret, lean):
    """The kernel call (gates [N, Hv, 2, T] float32; used: None or an int32 scalar), jitted so
    that every call of one shape lowers one kernel (`one_kernel_per_shape`)."""
    n, t_len, hk, dk = k.shape
    hv, dv = v.shape[2:]
    dtype = k.dtype
    kernel, extra = chunks_below(functools.partial(
        _kernel, rep=hv // hk, block_passes=block_passes, interpret=bool(interpret),
        lean=lean), 3, used, t_len // CHUNK)
    call = plgpu.kernel(
        named(kernel, "gdn_solve_mosaic"),
        out_type=(jax.ShapeDtypeStruct((n, t_len, hv, dk), dtype),
                  jax.ShapeDtypeStruct((n, t_len, hv, dv), dtype),
                  jax.ShapeDtypeStruct((n, t_len, hv, dk), dtype),
                  jax.ShapeDtypeStruct((n, hv, t_len), _F32)),
        grid=(n, t_len // CHUNK, hv), grid_names=("n", "c", "h"),
        scratch_types=_scratch(dk, dv, dtype, bool(interpret), lean),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret is True else (interpret or None))
    return call(k, v, gates, *extra)


def intra_chunk_mosaic(k, v, g, beta, *, chunk=CHUNK, dot_dtype=None, interpret=False,
                       block_passes=3, used=None, lean=False):
    """Kernel 1 of the fused path on Mosaic GPU (module doc).

    Args:
      k: [N, T, Hk, Dk]; v: [N, T, Hv, Dv] (bf16 or f16, one dtype); g, beta: [N, T, Hv].
      dot_dtype: None or the inputs' dtype (the only one taken).
      interpret: False (compile for the GPU), True or a plgpu.InterpretGPUParams (CPU).
      used: None or an int32 scalar: only chunks below it are solved (`chunks_below`).
      block_passes: the passes of the inverse's block-level products: 3 (the inverse to ~1e-4
        of its scale on correlated keys) or 1 (bf16 operands, ~4e-3: the Triton kernel's bf16
        block substitution; tests/test_gated_delta_mosaic.py measures both).
      lean: KD stored through K's tile after W's store (no tile of its own: 69 KB of SMEM, not
        85, `_scratch`), and the CTA ends once its stores have read SMEM; the same values.
    Returns:
      w, kd [N, T, Hv, Dk] and u [N, T, Hv, Dv] in the inputs' dtype, gc [N, T, Hv] float32.
    """
    why = limits(k, v, chunk, dot_dtype)
    if block_passes not in (1, 3):
        why = why or f"block_passes must be 1 or 3, got {block_passes}"
    if why:
        raise ValueError(f"gated_delta intra_chunk_mosaic: {why}")
    gates = jnp.stack([g.astype(_F32), beta.astype(_F32)], axis=-1)  # [N, T, Hv, 2]
    gates = jnp.transpose(gates, (0, 2, 3, 1))  # [N, Hv, 2, T]
    w, u, kd, gc = _solve(k, v, gates, used, block_passes=block_passes, interpret=interpret,
                          lean=lean)
    return w, u, kd, jnp.moveaxis(gc, 1, 2)
