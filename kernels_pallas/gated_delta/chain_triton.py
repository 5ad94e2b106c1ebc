"""Pallas (Triton) kernel applying chains of cached span maps to recurrent states, one pass per
chain (issue 29, "Composition cost").

A row's chain is maps m_0, m_1, ... (pool slots) applied in order, S <- A_m S + B_m, per GDN layer
and value head ("group", G = layers x heads, each [Dk, Dk] / [Dk, Dv] float32). The XLA loop
(serving/hybrid/chain_compose.compose_sorted) runs one while-loop trip per chain position:
gather the position's maps out of the pool (a copy of A and B), one batched dot, the add and
the ended-chain select, each a pass over HBM (~12 map-sized passes an application, ~97 us on
an H100 for one Qwen3.5-0.8B map on one row). Here one program per (row, group, Dv block) keeps
its state block in registers for the whole chain: each position reads A and B straight from the
pool by slot (no copy), so an application moves A and B once (37.7 MB at 0.8B: ~13 us at
3 TB/s) and a chain's state is read and written once. Ended chains and padding rows cost no
trip (the loop stops at the row's own length), and a chain whose map i has A exactly zero in
this program's layer and head (`start`: its decay underflowed over the span) starts there from
that map's B: A S + B is B for any finite S, bit for bit, so the maps before it are not read.

Precision (the names of affine.COMPOSE_PRECISIONS as jax precisions): HIGHEST / None are IEEE
float32 dots; TF32_TF32_F32_X3 is Triton's tf32x3 (on CPU, interpreted: IEEE, as XLA's CPU has
no TF32); BF16_BF16_F32_X3 / _X6 split each operand into bf16 parts here (Triton's dot would
cast to one bf16 pass) and sum 3 / 6 bf16 products in float32, the same on every platform.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_F32, _BF16 = jnp.float32, jnp.bfloat16
_BF16_TERMS = {jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3: ((0, 0), (0, 1), (1, 0)),
               jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6:
                   ((0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (2, 0))}


def _bf16_parts(x, n):
    """x (float32) as n bf16 parts whose float32 sum approximates it (8 more bits each).
    Each part is x's top 16 bits, cut by a bit mask (so exactly a bf16): a round trip
    `x.astype(bf16).astype(float32)` was folded to x by the GPU compiler (the low parts came
    out 0 and X3 / X6 were one bf16 pass: rel. error 3.5e-3 on an H100, 2026-12-05)."""
    parts = []
    for _ in range(n):
        hi = jax.lax.bitcast_convert_type(
            jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000), _F32)
        parts.append(hi.astype(_BF16))  # exact: hi's low 16 bits are 0
        x = x - hi
    return parts


def _dot(a, s, precision, interpret):
    """a @ s in float32 at `precision` (see the module doc)."""
    if precision in _BF16_TERMS:
        terms = _BF16_TERMS[precision]
        n = 1 + max(max(t) for t in terms)
        pa, ps = _bf16_parts(a, n), _bf16_parts(s, n)
        out = None  # smallest products first, so the large one is added last
        for i, j in reversed(terms):
            d = jnp.dot(pa[i], ps[j], preferred_element_type=_F32)
            out = d if out is None else out + d
        return out
    if precision is None or interpret or precision == jax.lax.Precision.HIGHEST:
        precision = jax.lax.Precision.HIGHEST
    return jnp.dot(a, s, precision=precision, preferred_element_type=_F32)


def run_chain(s0, r, first, layer, head, cols, chain_ref, n_ref, a_ref, b_ref, precision,
              interpret):
    """Row r's chain on its state block s0 [Dk, BV] (float32) in one program: from position
    first + 1 on, from that map's B where first >= 0 (a reset start), else from s0; each map's
    A and B read from the pool by slot. Both chain kernels run this (chain_in_place.py)."""
    def step(i, s):
        slot = chain_ref[r, i]
        return _dot(a_ref[slot, layer, head], s, precision, interpret) + \
            b_ref[slot, layer, head, :, cols]

    reset = b_ref[chain_ref[r, jnp.maximum(first, 0)], layer, head, :, cols]
    return jax.lax.fori_loop(first + 1, n_ref[r], step, jnp.where(first >= 0, reset, s0))


def launch_options(a, b, state_shape, block_v, num_stages, precision, name: str):
    """(block_v, num_stages) of a chain kernel over states [..., Hv, Dk, Dv] of Lg layers
    (state_shape: (Lg, Hv, Dk, Dv)), defaults filled (chain_apply's doc), the pool's shapes and
    block_v checked (ValueError naming `name`)."""
    layers, heads, dk, dv = state_shape
    block_v = min(128, dv) if block_v is None else block_v
    if num_stages is None:
        num_stages = 2 if precision in _BF16_TERMS else 1
    if a.shape[1:] != (layers, heads, dk, dk) or b.shape[1:] != (layers, heads, dk, dv):
        raise ValueError(f"{name}: pool a {a.shape} / b {b.shape} do not fit {layers} layers of "
                         f"[{heads}, {dk}, {dv}] states")
    if dv % block_v:
        raise ValueError(f"{name}: block_v {block_v} does not divide Dv {dv}")
    return block_v, num_stages


def _chain_kernel(chain_ref, n_ref, start_ref, a_ref, b_ref, s_ref, o_ref, *, heads, block_v,
                  precision, interpret):
    # chain [S, L] int32 (whole); n [S] int32; start [S, G] int32 (-1: none); a [P, Lg, Hv, Dk,
    # Dk], b [P, Lg, Hv, Dk, Dv] (the whole pool); s / o [Dk, BV]: this program's state block
    # (row r, layer g // Hv, head g % Hv, value columns v*BV ...)
    r, g, v = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(pl.multiple_of(v * block_v, block_v), block_v)
    o_ref[...] = run_chain(s_ref[...].astype(_F32), r, start_ref[r, g], g // heads, g % heads,
                           cols, chain_ref, n_ref, a_ref, b_ref, precision, interpret)


def chain_apply(a, b, chains, n_maps, state, *, start=None, precision=None,
                block_v: int | None = None, num_warps: int = 8, num_stages: int | None = None,
                interpret: bool = False):
    """Each row's state after its chain of maps, in the cache's layout.

    Args:
      a: [P, Lg, Hv, Dk, Dk], b: [P, Lg, Hv, Dk, Dv] the map pool (float32).
      chains: [S, L] int32 pool slots in order (entries at or past a row's length are not read);
      n_maps: [S] int32 maps to apply per row (0: the state is copied).
      state: [Lg, S, Hv, Dk, Dv] float32 (serving's read_states layout).
      start: None, or [S, Lg, Hv] int32: per row, layer and head the last chain position < n
        whose map's A is exactly zero there (the row continues from its B), -1 for none
        (chain_compose.reset_starts). Positions not below n_maps are the caller's error.
      precision: of the dots (module doc); block_v: value columns per program (divides Dv;
        None: min(128, Dv)); num_warps, num_stages: per program (None: 2 for the bf16 presets,
        else 1). The defaults are the fastest of benchmarks/compose_forms.py's sweeps on an H100
        (session 20, Qwen3.5-0.8B maps, 30 on 3 rows): block_v 128 / 8 warps at every
        tensor-core precision (one stage: tf32_x3 1.25 ms, bf16_x6 1.42, bf16_x3 1.09; 64 / 8:
        1.54, 1.52, 1.27); two stages (the next map loaded while this one's dots run) bf16_x6
        1.21, bf16_x3 0.98 (three: no better); tf32_x3 at 128 / 8 with two stages asks 256 KB of
        shared memory (232 KB on an H100; 64 / 8 / 2: 1.34). At "highest" (IEEE float32 FMA, no
        tensor cores) every setting ran at ~0.5 TFLOP/s (62-89 ms): chain_compose.use_kernel
        keeps that precision on the XLA loop (3.1 ms).
    Returns:
      [Lg, S, Hv, Dk, Dv] float32.
    """
    layers, rows, heads, dk, dv = state.shape
    block_v, num_stages = launch_options(a, b, (layers, heads, dk, dv), block_v, num_stages,
                                         precision, "chain_apply")
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    block = pl.BlockSpec((None, None, None, dk, block_v),
                         lambda r, g, v: (g // heads, r, g % heads, 0, v))
    kernel = functools.partial(_chain_kernel, heads=heads, block_v=block_v,
                               precision=precision, interpret=interpret)
    chains = jnp.clip(jnp.asarray(chains, jnp.int32), 0, a.shape[0] - 1)  # never read outside
    n_maps = jnp.minimum(jnp.asarray(n_maps, jnp.int32), chains.shape[1])
    if start is None:
        start = jnp.full((rows, layers * heads), -1, jnp.int32)
    else:
        start = jnp.asarray(start, jnp.int32).reshape(rows, layers * heads)
    return pl.pallas_call(
        kernel, grid=(rows, layers * heads, dv // block_v),
        in_specs=[whole(chains), whole(n_maps), whole(start), whole(a), whole(b), block],
        out_specs=block, out_shape=jax.ShapeDtypeStruct(state.shape, _F32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="span_chain_apply",
    )(chains, n_maps, start, a, b, state.astype(_F32))
