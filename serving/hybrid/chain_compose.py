"""Composing chains of cached span maps onto their rows' states, only the map applications that
are used (issue 29, "Composition cost").

A compose program (serving/hybrid/span_compose.py) holds `rows` chain rows of up to L maps each.
Applying one map to one row's state costs 2 Dk Dk Dv multiply-adds per GDN layer and value head
(Qwen3.5-0.8B: 1.208 GFLOP); the loop this replaces applied a map to every row at every position
up to the longest chain, so 30 maps on 3 of 4 rows (longest 12) cost 48 applications.

Here the rows are sorted by chain length, longest first, so the rows still composing at
position i are a prefix, k_i of them, and k_i only shrinks with i. The program runs one loop per
static row width w of `widths(rows)` (widest first), each over the positions whose k_i it is the
narrowest width to hold, applying that position's maps to the first w rows only. Positions and
widths both come from the chain lengths (`bounds`): the same function plans on the host
(`plan`, `applications`: what a step costs, what tests count) and bounds the loops on device.
Work done / work needed <= the largest ratio of neighbouring widths (4/3 or 3/2 past 4 rows); up
to 4 rows every width exists, so the work is exact, and a loop whose width is one more than the
next one's runs no mask (every row of it composes at every position it runs).

On a GPU that loop is the slow form: each trip copies its maps out of the pool (a gather), then
the dot, the add and the ended-chain select each pass over HBM, ~12 map-sized passes per
application (~97 us for one Qwen3.5-0.8B map on one row on an H100, against ~13 us to read A and
B once). `compose_kernel` replaces it there at a tensor-core precision (`use_kernel`: asked for,
or by "auto"): one Triton program per (row, layer,
head, value block) runs its row's whole chain with the state block in registers, reading each
map from the pool by slot, and the conv windows come in closed form (`chain_window`). A chain
starts at its last map whose A is exactly zero in the program's layer and head (the pool's
zero_a flags, `reset_starts`): a span long against a head's decay leaves that head in its B
whatever it entered with, so the maps before it need not be read (exact, bit for bit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.gated_delta.api import apply_map, chain_apply, chain_in_place
from kernels_pallas.sharding import tp_mesh

EXACT_WIDTHS = 4  # every width up to this one; then 6, 8, 12, 16, 24, 32, 48, 64, ...


# Which form composes the chains: "auto" (on a GPU without a TP mesh, the kernel at a tensor-core
# precision, else the XLA loop), "triton" (the kernel; interpreted off a GPU) or "xla"
# (compose_sorted's loop). Measured on an H100 (session 20, benchmarks/compose_forms.py, 30
# Qwen3.5-0.8B maps on 3 rows): the kernel 1.25 ms at tf32_x3 against the loop's 3.14; at
# "highest" its IEEE float32 dots run on the CUDA cores at ~0.5 TFLOP/s (67.6 ms), so "auto"
# keeps IEEE float32 on the loop. AUTO_KERNEL = False is the loop everywhere.
IMPLS = ("auto", "triton", "xla")
AUTO_KERNEL = True
_GPU = ("gpu", "cuda")


def use_kernel(impl: str = "auto", precision=None) -> bool:
    """Whether chains are composed by the Triton kernel (`compose_kernel`): asked, or "auto" with
    AUTO_KERNEL on a GPU outside a tensor-parallel trace (there the pool and states split by
    heads, and the XLA loop, which XLA partitions, serves) at a tensor-core `precision` (a
    DotAlgorithmPreset; None / HIGHEST: IEEE float32, faster on the loop). ValueError naming the
    choices for another name."""
    if impl not in IMPLS:
        raise ValueError(f"chain compose impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl == "triton"
    tensor_cores = isinstance(precision, jax.lax.DotAlgorithmPreset)
    return AUTO_KERNEL and tensor_cores and _platform() in _GPU and tp_mesh() is None


def _platform() -> str:
    """The platform the chains compose on (tests trace "gpu" on CPU by replacing this)."""
    return jax.default_backend()


def compose_kernel(pool, chains, n_maps, conv, delta, precision=None):
    """The states after each row's chain (any row order), in the cache's layout: the delta states
    by the Triton kernel (kernels_pallas/gated_delta/chain_triton.py: one pass per chain, maps
    read from the pool by slot), the conv windows in closed form (`chain_window`).

    chains [S, L] int32, n_maps [S] int32 (rows need no sorting); conv [Lg, S, C, K1]; delta
    [Lg, S, Hv, Dk, Dv] float32. Returns (conv, delta) as given, moved on by the chains."""
    delta = chain_apply(pool.a, pool.b, chains, n_maps, delta,
                        start=reset_starts(pool.zero_a, chains, n_maps), precision=precision,
                        interpret=_platform() not in _GPU)
    return chain_window(pool, chains, n_maps, conv), delta


def compose_in_place(pool, chains, n_maps, slots, source, convs, deltas, windows, *,
                     ck_delta=None, ck_slots=None, precision=None):
    """compose_kernel on the cache itself (kernels_pallas/gated_delta/chain_in_place.py): each
    chain row's state slot moves on by its chain, from its `source` (the slot, zero or a
    checkpoint of ck_delta [Lg, Pc, ...] at ck_slots [S]; or untouched), and its conv slot takes
    its window from `windows` [Lg, S, C, K1] (chain_window's). slots, source [S] int32; convs /
    deltas: the GDN layers' state caches. Returns (convs, deltas), the same buffers."""
    deltas, convs = chain_in_place(
        pool.a, pool.b, chains, n_maps, reset_starts(pool.zero_a, chains, n_maps), source, slots,
        deltas, convs, windows, ck_delta=ck_delta, ck_slots=ck_slots, precision=precision,
        interpret=_platform() not in _GPU)
    return convs, deltas


def reset_starts(zero_a, chains, n_maps):
    """[S, Lg, Hv] int32: per chain row, GDN layer and value head, the last position i <
    n_maps whose map has A exactly zero there (the state after it is its B: the chain starts
    there), -1 where none has. zero_a [P, Lg, Hv] bool (the pool's flags); chains [S, L] int32
    pool slots; n_maps [S] int32."""
    length = chains.shape[1]
    pos = jnp.arange(length, dtype=jnp.int32)
    zero = zero_a[jnp.clip(chains, 0, zero_a.shape[0] - 1)]  # [S, L, Lg, Hv]
    live = (pos[None, :] < n_maps[:, None])[:, :, None, None]
    return jnp.max(jnp.where(zero & live, pos[None, :, None, None], -1), axis=1)


def widths(rows: int) -> tuple[int, ...]:
    """The static row widths of the loops of a compose program of `rows` chain rows, widest
    first: `rows`, then each width below it (1..4, then w * 3/2 and 2w from 4 on). One loop each:
    few (12 at 64 rows), since on a GPU every loop costs a host check of its trip count."""
    ladder, w = set(range(1, EXACT_WIDTHS + 1)), EXACT_WIDTHS
    while w < rows:
        ladder |= {w * 3 // 2, w * 2}
        w *= 2
    return tuple(sorted({rows} | {x for x in ladder if x < rows}, reverse=True))


def bounds(n_sorted, rows: int) -> list:
    """[(w, first, end)]: the loop of width w runs positions first <= i < end, those where more
    than the next width's rows but at most w still compose. n_sorted [rows]: the chain lengths,
    longest first (numpy on the host, a traced array on device: only static indexing).

    With n sorted, more than m rows compose at position i exactly when n[m] > i."""
    ws = widths(rows)
    out = []
    for w, narrower in zip(ws, ws[1:] + (0,)):
        first = n_sorted[w] if w < rows else 0
        out.append((w, first, n_sorted[narrower]))
    return out


def plan(lengths, rows: int) -> list[tuple[int, int, int]]:
    """`bounds` on the host for chains of these lengths (any order, at most `rows` of them):
    [(width, first, end)] with first <= end, as the device loops will run."""
    if len(lengths) > rows:
        raise ValueError(f"chain_compose.plan: {len(lengths)} chains exceed {rows} rows")
    n = np.zeros(rows, np.int64)
    n[:len(lengths)] = sorted(lengths, reverse=True)
    return [(w, int(first), int(end)) for w, first, end in bounds(n, rows)]


def applications(lengths, rows: int) -> int:
    """Map applications (one map on one row's state) the compose program runs for these chains:
    sum(lengths) up to 4 rows, at most 3/2 of it above."""
    return sum(w * (end - first) for w, first, end in plan(lengths, rows))


def flops_per_application(gdn_layers: int, hv: int, dk: int, dv: int) -> int:
    """FLOPs of one map applied to one row: A S over every GDN layer and value head (the + B and
    the conv window shift are a rounding error)."""
    return 2 * gdn_layers * hv * dk * dk * dv


def compose_sorted(pool, chains, n_maps, conv, delta, precision=None):
    """The states after each row's chain, rows sorted by chain length, longest first.

    Args:
      pool: the span-map pool (serving/hybrid/span_maps.SpanMapPool).
      chains: [S, L] int32 pool slots in order (-1 past a chain's end); n_maps: [S] int32 the
        chain lengths, non-increasing.
      conv: [S, Lg, C, K1] conv windows; delta: [S, Lg, Hv, Dk, Dv] float32 (row-major, so a
        width's rows are a leading slice and the gathered maps need no transpose).
      precision: of the A S dots (affine.compose_precision; None: IEEE float32).
    Returns:
      conv, delta as given, moved on by each row's chain.
    """
    idx = jnp.clip(chains, 0, pool.a.shape[0] - 1)
    f32 = jnp.float32
    ws = widths(chains.shape[0])
    for (w, first, end), narrower in zip(bounds(n_maps, chains.shape[0]), ws[1:] + (0,)):
        def step(i, carry, w=w, all_run=w - narrower == 1):
            conv_w, delta_w = carry
            ids = idx[:w, i]  # [w]
            nxt = apply_map((pool.a[ids].astype(f32), pool.b[ids].astype(f32)), delta_w,
                            precision=precision)
            shifted = shift_window(conv_w, pool.tail[ids], pool.count[ids][:, None])
            if all_run:  # exactly w chains run at every position of this loop: no mask
                return shifted, nxt
            use = i < n_maps[:w]  # the rows of this width whose chain has ended keep their state
            return (jnp.where(use[:, None, None, None], shifted, conv_w),
                    jnp.where(use[:, None, None, None, None], nxt, delta_w))

        conv_w, delta_w = jax.lax.fori_loop(first, end, step, (conv[:w], delta[:w]))
        conv, delta = conv.at[:w].set(conv_w), delta.at[:w].set(delta_w)
    return conv, delta


def shift_window(window, tail, n):
    """The conv window after n more inputs whose last K1 are `tail` (right-aligned).

    window, tail [..., C, K1]; n [...] int32 >= 0. Position j of the result holds tail[j] when it
    is one of the n new inputs (j >= K1 - n), else window[j + n]."""
    k1 = window.shape[-1]
    j = jnp.arange(k1, dtype=jnp.int32)
    n = jnp.asarray(n, jnp.int32)[..., None, None]
    older = jnp.take_along_axis(window, jnp.broadcast_to(jnp.clip(j + n, 0, k1 - 1),
                                                         window.shape), axis=-1)
    return jnp.where(j >= k1 - n, tail.astype(window.dtype), older)


def chain_window(pool, chains, n_maps, window):
    """The conv windows after each row's chain, in closed form (no loop over positions): the
    window's position j holds the d = K1 - j th most recent input, which comes from the last map
    i whose inputs from i on number at least d (at its tail's K1 - (d - inputs after i)), or,
    where the whole chain has fewer than d inputs, from the old window shifted by that count.
    The same windows as `shift_window` run map by map, for any counts (0 included).

    pool: the span-map pool (tail [P, Lg, C, K1], count [P]); chains [S, L] int32 pool slots;
    n_maps [S] int32 the chains' lengths; window [Lg, S, C, K1]. Returns [Lg, S, C, K1]."""
    k1, length = window.shape[-1], chains.shape[1]
    slot = jnp.clip(chains, 0, pool.count.shape[0] - 1)
    live = jnp.arange(length, dtype=jnp.int32)[None, :] < n_maps[:, None]
    count = jnp.where(live, pool.count[slot], 0)  # [S, L]
    from_i = jnp.flip(jnp.cumsum(jnp.flip(count, 1), 1), 1)  # inputs of maps i.. (non-increasing)
    d = k1 - jnp.arange(k1, dtype=jnp.int32)  # [K1]
    src = jnp.sum(from_i[:, None, :] >= d[None, :, None], axis=-1) - 1  # [S, K1]; -1: old window
    at = jnp.clip(src, 0, length - 1)
    after = (jnp.take_along_axis(from_i, at, 1) - jnp.take_along_axis(count, at, 1))
    tails = pool.tail[jnp.take_along_axis(slot, at, 1)]  # [S, K1 (j), Lg, C, K1]
    t_idx = jnp.clip(k1 - (d[None] - after), 0, k1 - 1)
    new = jnp.take_along_axis(tails, t_idx[:, :, None, None, None], axis=-1)[..., 0]
    old = jnp.moveaxis(window, 1, 0)  # [S, Lg, C, K1]
    w_idx = jnp.clip(jnp.arange(k1, dtype=jnp.int32)[None] + from_i[:, :1], 0, k1 - 1)
    kept = jnp.take_along_axis(old, jnp.broadcast_to(w_idx[:, None, None, :], old.shape), -1)
    out = jnp.where((src >= 0)[:, None, None, :],
                    jnp.moveaxis(new, 1, -1).astype(window.dtype), kept)
    return jnp.moveaxis(out, 0, 1)
