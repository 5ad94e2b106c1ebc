"""K/V cache write in Pallas (Triton lowering): a row copy into the aliased page buffers.

`write_kv` stores T new rows ([K, D] each, for K and V) at their flat slots page * B + offset.
XLA lowers that as a general scatter (55-64 us per layer on the H200 for ~0.5 MB of rows, see
benchmarks/history/engine.md). Here each program copies `rows` consecutive token rows: it loads
their slots, loads the [rows, K * D] tiles of k and v, and stores them at the slot rows of the
page buffers, which are aliased in and out (updated in place, nothing else is touched). Rows whose
slot is -1 (bucket padding, pads) are masked off.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.registry import Implementation


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _kernel(slot_ref, k_ref, v_ref, kp_in, vp_in, kp_ref, vp_ref, *, tokens, width, rows, cols,
            interpret):
    del kp_in, vp_in  # aliased to kp_ref / vp_ref
    r = pl.program_id(0) * rows + lax.broadcasted_iota(jnp.int32, (rows,), 0)  # [R] token rows
    in_range = r < tokens
    r_safe = jnp.where(in_range, r, 0)
    slot = pltriton.load(slot_ref.at[r_safe], mask=in_range, other=-1)  # [R]
    ok = in_range & (slot >= 0)
    col = lax.broadcasted_iota(jnp.int32, (1, cols), 1)  # [1, C] (K * D up to a power of 2)
    if interpret:
        # The interpreter stores masked lanes by writing back what they read, which races with
        # a real write to the same row; so dropped rows repeat the program's last kept row
        # (same slot, same values) and only a program with no kept row is masked off.
        last = jnp.max(jnp.where(ok, r_safe, -1))
        lead_slot = jnp.max(jnp.where(r_safe == last, slot, -1))
        r_safe = jnp.where(ok, r_safe, jnp.maximum(last, 0))
        dest = jnp.where(ok, slot, jnp.maximum(lead_slot, 0))
        mask = (last >= 0) & (col < width) & jnp.ones((rows, 1), jnp.bool_)  # [R, C]
    else:  # masked lanes write nothing
        dest = jnp.where(ok, slot, 0)
        mask = ok[:, None] & (col < width)  # [R, C]
    for src, dst in ((k_ref, kp_ref), (v_ref, vp_ref)):
        x = pltriton.load(src.at[r_safe[:, None], col], mask=mask, other=0)
        pltriton.store(dst.at[dest[:, None], col], x.astype(dst.dtype), mask=mask)


def write_kv_triton(k_pages, v_pages, k, v, slot_mapping, *, rows: int | None = None,
                    num_warps: int = 4, interpret: bool = False):
    """Copy rows k[t], v[t] ([K, D]) to slot slot_mapping[t] of k_pages / v_pages ([P, B, K, D]),
    skipping slot -1; pages are updated in place (input_output_aliases). Slots must be distinct
    (the engine guarantees it). `rows`: token rows per program (default ~4096 elements)."""
    num_pages, page_size, kv_heads, head_dim = k_pages.shape
    tokens = k.shape[0]
    width = kv_heads * head_dim
    cols = _next_pow2(width)
    if rows is None:
        rows = max(1, min(_next_pow2(max(tokens, 1)), 4096 // cols))
    if rows & (rows - 1):
        raise ValueError(f"write_kv_triton: rows per program must be a power of 2, got {rows}")
    flat = num_pages * page_size
    if flat * width >= 2 ** 31 or tokens * width >= 2 ** 31:
        raise ValueError(f"write_kv_triton: {flat} x {width} page elements overflow int32 offsets "
                         f"(use the XLA write, or fewer KV blocks)")
    kernel = functools.partial(_kernel, tokens=tokens, width=width, rows=rows, cols=cols,
                               interpret=interpret)
    kp, vp = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((flat, width), k_pages.dtype),
                   jax.ShapeDtypeStruct((flat, width), v_pages.dtype)),
        input_output_aliases={3: 0, 4: 1},
        grid=(max(1, pl.cdiv(tokens, rows)),),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="write_kv",
    )(slot_mapping.astype(jnp.int32), k.reshape(tokens, width), v.reshape(tokens, width),
      k_pages.reshape(flat, width), v_pages.reshape(flat, width))
    return kp.reshape(k_pages.shape), vp.reshape(v_pages.shape)


@dataclasses.dataclass(frozen=True)
class TritonWriteOptions:
    rows: int | None = None  # token rows per program (default ~4096 elements)
    num_warps: int = 4


def limits(problem, options: TritonWriteOptions) -> str:
    """problem: write.WriteProblem. Offsets are int32."""
    del options
    if problem.cache_elements >= 2 ** 31:
        return (f"needs fewer than 2**31 elements per cache array (int32 offsets), got "
                f"{problem.cache_elements}; use the XLA write or fewer KV blocks")
    return ""


IMPLEMENTATION = Implementation("triton", write_kv_triton, TritonWriteOptions, limits=limits,
                                backend="triton")
