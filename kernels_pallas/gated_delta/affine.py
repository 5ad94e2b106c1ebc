"""The gated delta rule as an affine map of its state, and the composition of such maps.

Layout (as everywhere in this folder): a value head's state S is [Dk, Dv] and a token does
    S <- exp(g) S ;  S <- S + beta k (v - S^T k)^T
i.e. S_t = A_t S_{t-1} + B_t with A_t = exp(g_t) (I - beta_t k_t k_t^T) [Dk, Dk] and
B_t = beta_t k_t v_t^T [Dk, Dv]. A map (A, B) acts from the left: apply((A, B), S) = A S + B.
Running (A1, B1) and then (A2, B2) is the map
    then(first=(A1, B1), second=(A2, B2)) = (A2 A1, A2 B1 + B2)
(the transpose of the issue's right-acting (A1 A2, B1 A2 + B2) for the state S^T).

Over a chunk of C tokens the chunked form (chunked.py) gives, from its WY factors,
    A_chunk = exp(gc_last) I - KD^T W ,   B_chunk = KD^T U
so a span's map is the ordered product of its chunk maps: one Dk x Dk product per chunk, and
B_span is the state the span produces from a zero state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.gated_delta.ragged import packing as ragged_packing
from kernels_pallas.gated_delta.ragged import ragged_prefill

_F32 = jnp.float32


def _by_dtype(precision, *arrays):
    """None -> HIGHEST when every operand is float32 (maps exist for exactness: TF32 would cost
    ~1e-3 relative on a GPU), else the default; an explicit precision is kept."""
    if precision is None and all(jnp.dtype(x.dtype) == _F32 for x in arrays):
        return jax.lax.Precision.HIGHEST
    return precision


# Named precisions of the dots that apply cached span maps (serving's span_map_compose_precision):
# "highest" is IEEE float32 (the exactness every test holds them to); the others emulate float32
# on a GPU's tensor cores (DotAlgorithmPreset: 3 or 6 bf16 passes, 3 TF32 passes), several
# times IEEE float32's throughput, exactness to be measured (benchmarks/runs/compose_next_device.sh).
COMPOSE_PRECISIONS = {"highest": None, "bf16_x6": "BF16_BF16_F32_X6",
                      "bf16_x3": "BF16_BF16_F32_X3", "tf32_x3": "TF32_TF32_F32_X3"}
_PRESET_PLATFORMS = ("gpu", "cuda")


def _backend() -> str:
    return jax.default_backend()


def compose_precision(name: str, platform: str | None = None):
    """The `precision` of composition dots (`apply`, `then`, `apply_chain`) for a name of
    COMPOSE_PRECISIONS on `platform` (None: JAX's default backend): Precision.HIGHEST for
    "highest" and on platforms other than a GPU (XLA on CPU computes the bf16 presets as plain
    float32 and rejects TF32_TF32_F32_X3), else the DotAlgorithmPreset. ValueError naming the
    choices for an unknown name."""
    if name not in COMPOSE_PRECISIONS:
        raise ValueError(f"compose precision must be one of {tuple(COMPOSE_PRECISIONS)}, "
                         f"got {name!r}")
    platform = _backend() if platform is None else platform
    preset = COMPOSE_PRECISIONS[name]
    if preset is None or platform not in _PRESET_PLATFORMS:
        return jax.lax.Precision.HIGHEST
    return getattr(jax.lax.DotAlgorithmPreset, preset)


def chunk_maps(w, u, kd, decay_last, *, precision=None):
    """Per-chunk maps from the WY factors.

    Args:
      w, kd: [..., C, Dk]; u: [..., C, Dv]; decay_last: [...] (exp of the chunk's log decay).
    Returns:
      a [..., Dk, Dk], b [..., Dk, Dv] float32.
    """
    dk = w.shape[-1]
    eye = jnp.eye(dk, dtype=_F32)
    precision = _by_dtype(precision, w, u, kd)
    a = (decay_last.astype(_F32)[..., None, None] * eye
         - jnp.einsum("...cd,...ce->...de", kd, w, preferred_element_type=_F32,
                      precision=precision))
    b = jnp.einsum("...cd,...ce->...de", kd, u, preferred_element_type=_F32, precision=precision)
    return a, b


def then(first, second, *, precision=None):
    """The map that runs `first` and then `second` (both (a [..., Dk, Dk], b [..., Dk, Dv]))."""
    a1, b1 = first
    a2, b2 = second
    precision = _by_dtype(precision, a1, b1, a2, b2)
    mm = lambda x, y: jnp.einsum("...ij,...jk->...ik", x, y, precision=precision)
    return mm(a2, a1), mm(a2, b1) + b2


def apply(maps, state, *, precision=None):
    """A S + B: the state after the map's tokens from `state` [..., Dk, Dv]."""
    a, b = maps
    precision = _by_dtype(precision, a, b, state)
    return jnp.einsum("...ij,...jk->...ik", a, state, precision=precision) + b


def apply_chain(a, b, state, count=None, *, precision=None):
    """Run maps 0, 1, ... in order from `state`: (((S A_0 + B_0) A_1 + B_1) ...) in the left-acting
    layout, one batched matmul per map (never a replay of the tokens).

    Args:
      a: [L, ..., Dk, Dk]; b: [L, ..., Dk, Dv]; state: [..., Dk, Dv].
      count: None (all L maps) or an int array broadcastable to the batch dims [...]: only maps
        with index < count are applied (the rest are skipped per element), so a fixed-L device
        array can hold chains of any length.
    Returns:
      the state after the chain, [..., Dk, Dv] float32.
    """
    def step(s, xs):
        i, a_i, b_i = xs
        nxt = apply((a_i, b_i), s, precision=precision)
        if count is None:
            return nxt, None
        use = (i < jnp.asarray(count))[..., None, None]
        return jnp.where(use, nxt, s), None

    idx = jnp.arange(a.shape[0], dtype=jnp.int32)
    out, _ = jax.lax.scan(step, state.astype(_F32), (idx, a.astype(_F32), b.astype(_F32)))
    return out


def ragged_maps(q, k, v, g, beta, cu_q_lens, select=None, final_of=None, packings=None,
                b0=None, a0=None, **kernel):
    """Each sequence of a ragged batch from a zero state, with its map, by any ragged
    implementation (ragged.ragged_prefill's `kernel` options): the plain pass gives the outputs
    and B (the final state from zero); the state is linear in S0, so a second pass with v = 0
    from S0 = I (a state of Dk value columns) ends in A itself. With Dk = Dv (Qwen3.5) the two
    passes run the same compiled kernels, so a capturing step compiles no recurrent path the
    plain span step lacks (no float32 XLA transition scan, no wider kernel shapes).

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv]; cu_q_lens: [S+1] int32 (sequences start
    at position 0). select: None (a map for every sequence) or [M] int32 distinct sequence ids
    (-1: none) whose maps are wanted: the second pass then runs over their rows only, gathered
    into a stream of M sequences, so a step that captures a few of many pieces pays for those.
    final_of: None or [K] int32 sequence ids whose B to return (ragged_prefill's final_of).
    packings: None, or `maps_packing(...)` of this batch computed once by the caller (then
    cu_q_lens, select and final_of are read from it).
    b0, a0: None (zero states, identity transitions), or the maps already run before the
    sequences (a map captured in pieces over several steps): b0 [N, Hv, Dk, Dv] the plain pass's
    initial states, indexed by its packing's seq_of_chunk (a caller's packing may map several
    sequences to one: index 0 a zero state, say); a0 [S or M, Hv, Dk, Dk] the transition pass's,
    so a comes back composed, a_seq a0.
    Returns out [T, Hv, Dv] float32, b [S or K, Hv, Dk, Dv] float32 and a [S or M, Hv, Dk, Dk]
    float32 (I for an empty sequence or a -1).
    """
    n_tokens, hv, dv = v.shape
    dk = k.shape[2]
    if packings is None:
        packings = maps_packing(cu_q_lens, n_tokens, select, final_of,
                                chunk=kernel.get("chunk", 64))
    plain, sel = packings
    s0 = jnp.zeros((1, hv, dk, dv), _F32) if b0 is None else b0.astype(_F32)
    out, b, _ = ragged_prefill(q, k, v, g, beta, None, None, s0, packing=plain, **kernel)
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=_F32), (sel["lens"].shape[0], hv, dk, dk))
    # the transition pass's outputs are dropped and q enters no state, so it reads k as q: a
    # kernel pass gathers one stream fewer (ragged_prefill gathers each distinct array once)
    _, a, _ = ragged_prefill(k, k, jnp.zeros((n_tokens, hv, dk), v.dtype), g, beta, None, None,
                             eye if a0 is None else a0.astype(_F32), packing=sel, **kernel)
    return out, b, a


def maps_packing(cu_q_lens, n_tokens: int, select=None, final_of=None, *, chunk: int = 64,
                 source_rows=None, n_source: int | None = None, max_chunks: int | None = None):
    """ragged_maps' two packings (ragged.packing, aligned zero starts): the plain pass's and the
    transition pass's (over the `select`ed sequences' rows only), from the batch's metadata
    alone, so a caller running several layers computes them once. source_rows, n_source: the
    batch's rows in a larger stream (ragged.packing). max_chunks: ragged.packing's, for both
    passes (the selected pieces are some of the batch's)."""
    seqs = cu_q_lens.shape[0] - 1
    kw = dict(chunk=chunk, aligned=True, n_source=n_source, max_chunks=max_chunks)
    plain = ragged_packing(cu_q_lens, jnp.zeros(seqs, jnp.int32), n_tokens, final_of=final_of,
                           source_rows=source_rows, **kw)
    if select is None:
        return plain, ragged_packing(cu_q_lens, jnp.zeros(seqs, jnp.int32), n_tokens,
                                     source_rows=source_rows, **kw)
    src, cu_sel = selected_rows(cu_q_lens, select, n_tokens)
    rows = src if source_rows is None else jnp.asarray(source_rows, jnp.int32)[src]
    kw["n_source"] = n_tokens if n_source is None else n_source
    return plain, ragged_packing(cu_sel, jnp.zeros(select.shape[0], jnp.int32), n_tokens,
                                 source_rows=rows, **kw)


def selected_rows(cu_q_lens, select, n_tokens):
    """The rows of sequences `select` [M] (-1: none; distinct, so they fit T rows) back to back:
    (source row of each of the T rows [T] int32, their cu_q_lens [M + 1] int32). Rows past the
    last selected one are padding (ragged_prefill ignores them)."""
    seqs = cu_q_lens.shape[0] - 1
    ok = (select >= 0) & (select < seqs)
    sel = jnp.clip(select, 0, seqs - 1)
    lens = jnp.where(ok, cu_q_lens[sel + 1] - cu_q_lens[sel], 0)
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(lens).astype(jnp.int32)])
    rows = jnp.arange(n_tokens, dtype=jnp.int32)
    j = jnp.clip(jnp.searchsorted(cu, rows, side="right", method="compare_all") - 1, 0,
                 select.shape[0] - 1)
    src = jnp.clip(cu_q_lens[sel[j]] + rows - cu[j], 0, n_tokens - 1)
    return src, cu
