"""Paged attention over position-free (unrotated) or rotated keys, for a ragged batch.

Cache layout (one layer): k_pages, v_pages [P, B, K, D] (vLLM's layout: a new token's K/V is one
contiguous row, so writes are a plain row scatter; a (page, head) tile is a strided 2-D box that
TMA loads directly).

`write_kv` stores new K/V rows (never rotated in `position_free` mode); `paged_attention` reads them
back through the block table. In `position_free` mode the keys are rotated at read time by their
logical position in *this* request, so one physical page can serve many requests at different
offsets. Queries are always passed unrotated and rotated by their own logical position.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.paged_attention.metadata import AttentionMetadata
from kernels_pallas.paged_attention.mosaic_decode import decode_attention_mosaic, mosaic_limits
from kernels_pallas.paged_attention.mosaic_decode_mma import (decode_attention_mosaic_mma,
                                                              decode_choice, mma_limits)
from kernels_pallas.paged_attention.mosaic_decode_ws import decode_attention_mosaic_ws, ws_limits
from kernels_pallas.paged_attention.mosaic_mixed import mixed_call, mixed_limits, prefill_choice
from kernels_pallas.paged_attention.mosaic_prefill import (mosaic_prefill_limits,
                                                           prefill_attention_mosaic)
from kernels_pallas.paged_attention.triton_decode import decode_paged_attention_triton
from kernels_pallas.paged_attention.triton_ragged import ragged_paged_attention_triton
from kernels_pallas.paged_attention.triton_write import write_kv_triton
from kernels_pallas.rope import apply_rope

KV_MODES = ("position_free", "rotated")
IMPLEMENTATIONS = ("xla", "triton", "triton_decode", "decode", "mosaic", "mosaic_prefill",
                   "prefill", "mixed")


WRITE_IMPLEMENTATIONS = ("xla", "triton")


def write_kv(k_pages, v_pages, k, v, slot_mapping, *, implementation: str | None = None,
             interpret: bool = False):
    """Scatter new K/V rows into their slots; rows with slot -1 are dropped.

    Args:
      k_pages, v_pages: [P, B, K, D] cache of one layer.
      k, v: [T, K, D] new rows (unrotated in position_free mode).
      slot_mapping: [T] int32 flat slot page * B + offset, or -1; real slots are distinct.
      implementation: None (the Pallas row copy on GPU, XLA elsewhere), "xla" (a scatter) or
        "triton" (Pallas, Triton lowering, pages aliased in place; triton_write.py). A named
        Pallas implementation runs interpreted on CPU.
      interpret: run the Pallas kernel in interpret mode.
    Returns:
      (k_pages, v_pages) updated.
    """
    num_pages, page_size, kv_heads, head_dim = k_pages.shape
    if k.shape[1:] != (kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"write_kv: k/v {k.shape}/{v.shape} do not match pages {k_pages.shape}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"write_kv: slot_mapping {slot_mapping.shape} must be [{k.shape[0]}]")
    if implementation is None:
        small = num_pages * page_size * kv_heads * head_dim < 2 ** 31  # int32 offsets
        implementation = "triton" if (jax.default_backend() == "gpu" or interpret) and small \
            else "xla"
    if implementation not in WRITE_IMPLEMENTATIONS:
        raise ValueError(f"write_kv: unknown implementation {implementation!r}; "
                         f"use one of {WRITE_IMPLEMENTATIONS}")
    if implementation == "triton":
        return write_kv_triton(k_pages, v_pages, k, v, slot_mapping,
                               interpret=interpret or jax.default_backend() == "cpu")
    flat = num_pages * page_size
    # Every row gets a distinct index (real slots are distinct by construction; dropped rows go
    # to distinct out-of-range indices), so XLA may scatter without atomics or serialisation.
    rows = jnp.arange(slot_mapping.shape[0], dtype=jnp.int32)
    slots = jnp.where(slot_mapping < 0, flat + rows, slot_mapping)

    def scatter(pages, new):
        return pages.reshape(flat, kv_heads, head_dim).at[slots].set(
            new.astype(pages.dtype), mode="drop", unique_indices=True).reshape(pages.shape)

    return scatter(k_pages, k), scatter(v_pages, v)


def paged_attention(q, k_pages, v_pages, metadata: AttentionMetadata, inv_freq, *,
                    kv_mode: str = "position_free", attention_scaling: float = 1.0,
                    sm_scale: float | None = None, implementation: str | None = None,
                    interpret: bool = False, kernel_options: dict | None = None):
    """Causal, window-limited attention of a ragged batch over a paged cache.

    Args:
      q: [T, H, D] unrotated queries.
      k_pages, v_pages: [P, B, K, D] (H % K == 0).
      metadata: AttentionMetadata for this batch.
      inv_freq: [R/2] float32 RoPE inverse frequencies (R <= D; dims past R are not rotated).
      kv_mode: "position_free" (keys stored unrotated, rotated here) or "rotated".
      attention_scaling: RoPE cos/sin scale (1.0 for default, llama3 and linear scaling).
      sm_scale: softmax scale, default 1/sqrt(D).
      implementation: None (the ragged Pallas kernel on GPU when its shape limits allow, else
        XLA; for steps known to be decode-only pass "decode"), "xla", "triton" (Pallas, Triton
        lowering; ragged prefill + decode), "triton_decode" (decode-only: one query per
        sequence, split-K), "decode" (decode-only: the Mosaic MMA kernel with its measured
        defaults for head_dim 128 where it takes the shapes and no option but max_position is
        given, else triton_decode), "mosaic" (Mosaic GPU, decode-only) or "mosaic_prefill"
        (Mosaic GPU flash attention for prefill-shaped batches), "mixed" (engine steps: prefill
        sequences on mosaic_prefill, decode rows on "decode"; mosaic_mixed.py) or "prefill"
        ("mixed" on a GPU where it takes the shapes, else triton, else XLA: prefill_choice).
        The Pallas ones run on CPU in interpret mode (forced there when named explicitly).
      interpret: run Pallas kernels in interpret mode (CPU).
      kernel_options: optional dict of options for the Pallas kernel: triton (block_q,
        block_k, kv_group, prerotate, num_warps, num_stages), triton_decode (kv_group, splits,
        block_k, num_warps, num_stages, rope: how keys get cos/sin, "trig" | "table" |
        "table_bf16", see triton_decode.py (default: table_bf16 / table
        when max_position is given, else trig); max_position: static bound on the positions,
        needed by the table modes; packed: bf16x2 key rotation, default on for bf16),
        mosaic (pages_per_step, splits, stages, max_position: cos/sin rows by TMA from a
        table; p_in_registers; consumers: the warp-specialised kernel with that many compute
        warpgroups, mosaic_decode_ws.py, with its packed and rotate_math options; mma: True
        for the warp-level MMA kernel, mosaic_decode_mma.py, keys rotated in registers, with
        its packed and kv_group options).
    Returns:
      [T, H, D] in q's dtype. A query attends to the valid keys of its own sequence whose logical
      position p satisfies window_start <= p <= query position.
    """
    options = dict(kernel_options or {})
    if interpret or jax.default_backend() != "gpu":
        return _attend(q, k_pages, v_pages, metadata, inv_freq, kv_mode=kv_mode,
                       attention_scaling=attention_scaling, sm_scale=sm_scale,
                       implementation=implementation, interpret=interpret, options=options)
    _validate(q, k_pages, v_pages, metadata, inv_freq, kv_mode)
    _validate_values(q, k_pages, metadata)
    return _attend_once(q, k_pages, v_pages, metadata, inv_freq, kv_mode=kv_mode,
                        attention_scaling=attention_scaling, sm_scale=sm_scale,
                        implementation=implementation, options=tuple(sorted(options.items())))


@functools.partial(jax.jit, static_argnames=("kv_mode", "attention_scaling", "sm_scale",
                                             "implementation", "options"))
def _attend_once(q, k_pages, v_pages, metadata, inv_freq, *, kv_mode, attention_scaling,
                 sm_scale, implementation, options):
    """_attend under its own jit (compiled kernels only): a model's layers call it with the same
    shapes, so it is traced and lowered once per step variant and each layer calls that one
    function. Lowering a Mosaic GPU kernel takes seconds per call site (32 per step variant
    without this; engine warm-up, benchmarks/RESULTS.md "RAG headline")."""
    return _attend(q, k_pages, v_pages, metadata, inv_freq, kv_mode=kv_mode,
                   attention_scaling=attention_scaling, sm_scale=sm_scale,
                   implementation=implementation, interpret=False, options=dict(options))


def _attend(q, k_pages, v_pages, metadata, inv_freq, *, kv_mode, attention_scaling, sm_scale,
            implementation, interpret, options, new_kv=None):
    """paged_attention's checks and dispatch; new_kv = (k, v) [T, K, D] (as stored) makes the
    triton_decode kernel write this step's rows itself (write_kv_and_attend)."""
    _validate(q, k_pages, v_pages, metadata, inv_freq, kv_mode)
    _validate_values(q, k_pages, metadata)
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    if implementation is None:
        on_gpu = jax.default_backend() == "gpu"
        fits = not _triton_limits(q, k_pages, inv_freq, options.get("block_k"))
        implementation = "triton" if (on_gpu or interpret) and fits else "xla"
    if implementation == "decode":
        implementation, options = decode_choice(q, k_pages, inv_freq, kv_mode, metadata,
                                                options)
    if implementation == "prefill":
        implementation, options = prefill_choice(q, k_pages, inv_freq, options, interpret)
    if implementation != "xla" and jax.default_backend() == "cpu":
        interpret = True  # a Pallas kernel named explicitly can only run interpreted on CPU
    if implementation == "xla":
        return _xla_paged_attention(q, k_pages, v_pages, metadata, inv_freq, kv_mode=kv_mode,
                                    attention_scaling=attention_scaling, sm_scale=sm_scale)
    rotate_keys = kv_mode == "position_free"
    if implementation == "triton":
        problem = _triton_limits(q, k_pages, inv_freq, options.get("block_k"))
        kernel = functools.partial(ragged_paged_attention_triton, **options)
        decode_only = False
    elif implementation == "triton_decode":
        problem = _triton_limits(q, k_pages, inv_freq,
                                 options.get("block_k", max(64, k_pages.shape[1])))
        kernel = functools.partial(decode_paged_attention_triton, **options)
        decode_only = True
    elif implementation == "mosaic":
        options.setdefault("pages_per_step", max(1, 64 // k_pages.shape[1]))
        shape = (q, k_pages, inv_freq, rotate_keys, options["pages_per_step"],
                 metadata.block_tables.shape[1])
        table = options.get("max_position") is not None
        if options.pop("mma", False):  # warp-level MMAs on registers
            problem = mma_limits(*shape, options.get("stages", 3), table,
                                 options.get("kv_group", 1))
            kernel = functools.partial(decode_attention_mosaic_mma, **options)
        elif options.get("consumers"):  # the warp-specialised kernel
            options.setdefault("stages", 4)
            problem = ws_limits(*shape, options["stages"], options["consumers"], table)
            kernel = functools.partial(decode_attention_mosaic_ws, **options)
        else:
            problem = mosaic_limits(*shape, options.get("stages", 3), table,
                                    options.get("p_in_registers", False))
            kernel = functools.partial(decode_attention_mosaic, **options)
        decode_only = True
    elif implementation == "mosaic_prefill":
        problem = mosaic_prefill_limits(q, k_pages)
        kernel, decode_only = prefill_attention_mosaic, False
    elif implementation == "mixed":
        if problem := mixed_limits(q, k_pages):
            raise ValueError(f"paged_attention: implementation='mixed' {problem}")
        return mixed_call(q, k_pages, v_pages, metadata, inv_freq, kv_mode=kv_mode,
                          attention_scaling=attention_scaling, sm_scale=sm_scale,
                          interpret=interpret, options=options)
    else:
        raise ValueError(f"paged_attention: unknown implementation {implementation!r}")
    if problem:
        raise ValueError(f"paged_attention: implementation={implementation!r} {problem}")
    if decode_only:
        _check_decode_only(metadata, implementation)
    rope = functools.partial(apply_rope, positions=metadata.q_positions, inv_freq=inv_freq,
                             attention_scaling=attention_scaling)
    extra = {}
    if new_kv is not None:  # fused write: the kernel scores each new key from its input
        k, v = new_kv
        if k.shape != (q.shape[0],) + k_pages.shape[2:] or v.shape != k.shape:
            raise ValueError(f"write_kv_and_attend: k/v {k.shape}/{v.shape} must be [T, K, D] "
                             f"= {(q.shape[0],) + k_pages.shape[2:]}")
        _check_new_slots(metadata, k_pages.shape[1])
        extra["new_kv"] = (k, rope(k) if rotate_keys else k, v)
    return kernel(rope(q), k_pages, v_pages, metadata, inv_freq, rotate_keys=rotate_keys,
                  attention_scaling=attention_scaling, sm_scale=sm_scale, interpret=interpret,
                  **extra)


def write_kv_and_attend(q, k, v, k_pages, v_pages, metadata: AttentionMetadata, inv_freq, *,
                        kv_mode: str = "position_free", attention_scaling: float = 1.0,
                        sm_scale: float | None = None, implementation: str | None = None,
                        write_impl: str | None = None, interpret: bool = False,
                        kernel_options: dict | None = None):
    """A layer's cache step: write this step's K/V rows, then attend (`write_kv`, then
    `paged_attention`; same arguments). Returns (out [T, H, D], k_pages, v_pages).

    k is as stored (rotated by the caller in "rotated" mode). With implementation
    "triton_decode" and kernel_options["fused_write"] = True, the decode kernel writes the rows
    itself and scores each new key from its input (no separate write kernel, no read-back): every
    query's slot must hold its own key (at the query's position) in a page no other sequence of
    the batch reads (checked when not tracing), as in a decode step.
    """
    options = dict(kernel_options or {})
    if options.pop("fused_write", False) and implementation == "triton_decode":
        return _attend(q, k_pages, v_pages, metadata, inv_freq, kv_mode=kv_mode,
                       attention_scaling=attention_scaling, sm_scale=sm_scale,
                       implementation=implementation, interpret=interpret, options=options,
                       new_kv=(k, v))
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, metadata.slot_mapping,
                                implementation=write_impl, interpret=interpret)
    out = paged_attention(q, k_pages, v_pages, metadata, inv_freq, kv_mode=kv_mode,
                          attention_scaling=attention_scaling, sm_scale=sm_scale,
                          implementation=implementation, interpret=interpret,
                          kernel_options=options)
    return out, k_pages, v_pages


def _check_new_slots(md, page_size):
    """Fused write: each query's slot holds its sequence's key at the query's position, in a
    page no other sequence of the batch reads (checked when not tracing)."""
    fields = (md.cu_q_lens, md.num_blocks, md.block_tables, md.block_pos_start,
              md.block_num_valid, md.slot_mapping, md.q_positions)
    if any(isinstance(x, jax.core.Tracer) for x in fields):
        return
    cu, nb, tables, starts, n_valid, slots, pos = (np.asarray(x) for x in fields)
    in_use = np.arange(tables.shape[1])[None, :] < nb[:, None]
    for s in np.flatnonzero(np.diff(cu) > 0):
        t = int(cu[s])
        page, off = divmod(int(slots[t]), page_size)
        entry = np.flatnonzero(in_use[s] & (tables[s] == page) & (off < n_valid[s]))
        if slots[t] < 0 or not any(starts[s, e] + off == pos[t] for e in entry):
            raise ValueError(f"write_kv_and_attend: fused_write needs each query's slot to hold "
                             f"its own key; sequence {s} (token {t}) writes slot "
                             f"{int(slots[t])}, which is not its key at position {int(pos[t])}")
        readers = np.flatnonzero(np.any(in_use & (tables == page), axis=1))
        if readers.size > 1:
            raise ValueError(f"write_kv_and_attend: fused_write: sequence {s} writes page {page}, "
                             f"which sequences {readers.tolist()} read in this batch")


def _check_decode_only(md, implementation):
    """Decode kernels take at most one query per sequence (checked when not tracing)."""
    if isinstance(md.cu_q_lens, jax.core.Tracer):
        return
    lens = np.diff(np.asarray(md.cu_q_lens))
    if np.any(lens > 1):
        s = int(np.argmax(lens > 1))
        raise ValueError(f"paged_attention: implementation={implementation!r} is decode-only; "
                         f"sequence {s} has {int(lens[s])} query tokens")


def _is_pow2(n):
    return n > 0 and n & (n - 1) == 0


def _triton_limits(q, k_pages, inv_freq, block_k):
    """Why the Triton kernel cannot take these shapes ('' when it can): Triton tiles are powers of 2."""
    head_dim, page_size, half = q.shape[-1], k_pages.shape[1], inv_freq.shape[-1]
    if block_k is None:
        block_k = max(32, page_size)
    if not _is_pow2(head_dim) or head_dim < 16:
        return f"needs a power-of-2 head_dim >= 16, got {head_dim}"
    if half and not _is_pow2(half):
        return f"needs a power-of-2 rotary half-dim, got {half}"
    if not _is_pow2(block_k) or block_k % page_size or block_k < 16:
        return f"needs block_k (power of 2, >= 16) to be a multiple of page size {page_size}"
    return ""


_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)
_INT_FIELDS = ("q_positions", "q_window_start", "q_seq", "cu_q_lens", "num_blocks", "block_tables",
               "block_pos_start", "block_num_valid", "slot_mapping")


def _validate(q, k_pages, v_pages, md, inv_freq, kv_mode):
    if kv_mode not in KV_MODES:
        raise ValueError(f"paged_attention: kv_mode must be one of {KV_MODES}, got {kv_mode!r}")
    if q.ndim != 3 or k_pages.ndim != 4:
        raise ValueError(f"paged_attention: q must be [T, H, D] and pages [P, B, K, D], "
                         f"got q{q.shape} k_pages{k_pages.shape}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"paged_attention: k_pages {k_pages.shape} != v_pages {v_pages.shape}")
    tokens, heads, head_dim = q.shape
    kv_heads = k_pages.shape[2]
    if k_pages.shape[3] != head_dim:
        raise ValueError(f"paged_attention: head_dim of q ({head_dim}) != pages ({k_pages.shape[3]})")
    if heads % kv_heads:
        raise ValueError(f"paged_attention: {heads} query heads not a multiple of {kv_heads} kv heads")
    if 2 * inv_freq.shape[-1] > head_dim:
        raise ValueError(f"paged_attention: rotary dim {2 * inv_freq.shape[-1]} > head_dim {head_dim}")
    for name in ("q_positions", "q_window_start", "q_seq", "slot_mapping"):
        if getattr(md, name).shape != (tokens,):
            raise ValueError(f"paged_attention: metadata.{name} must be [{tokens}], "
                             f"got {getattr(md, name).shape}")
    seqs = md.block_tables.shape[0]
    for name in ("block_pos_start", "block_num_valid"):
        if getattr(md, name).shape != md.block_tables.shape:
            raise ValueError(f"paged_attention: metadata.{name} must match block_tables "
                             f"{md.block_tables.shape}, got {getattr(md, name).shape}")
    if md.cu_q_lens.shape != (seqs + 1,) or md.num_blocks.shape != (seqs,):
        raise ValueError(f"paged_attention: cu_q_lens must be [{seqs + 1}] and num_blocks [{seqs}]")
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if x.dtype not in _FLOATS:
            raise ValueError(f"paged_attention: {name} dtype must be float32/bfloat16/float16, "
                             f"got {x.dtype}")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"paged_attention: k_pages {k_pages.dtype} != v_pages {v_pages.dtype}")
    if not jnp.issubdtype(inv_freq.dtype, jnp.floating):
        raise ValueError(f"paged_attention: inv_freq must be floating, got {inv_freq.dtype}")
    for name in _INT_FIELDS:
        if getattr(md, name).dtype != jnp.int32:
            raise ValueError(f"paged_attention: metadata.{name} must be int32, "
                             f"got {getattr(md, name).dtype}")


def _validate_values(q, k_pages, md):
    """Data-dependent checks; they need concrete arrays, so they are skipped under jit (tracers)."""
    fields = (md.cu_q_lens, md.num_blocks, md.block_tables, md.block_num_valid)
    if any(isinstance(x, jax.core.Tracer) for x in fields):
        return
    cu, nb, tables, n_valid = (np.asarray(x) for x in fields)
    num_pages, page_size = k_pages.shape[:2]
    max_blocks = tables.shape[1]
    if cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > q.shape[0]:
        raise ValueError(f"paged_attention: cu_q_lens must rise from 0 to at most {q.shape[0]} "
                         f"tokens, got {cu.tolist()}")
    bad = np.flatnonzero((nb < 0) | (nb > max_blocks))
    if bad.size:
        s = int(bad[0])
        raise ValueError(f"paged_attention: sequence {s} uses {int(nb[s])} blocks, table holds "
                         f"{max_blocks}")
    in_use = np.arange(max_blocks)[None, :] < nb[:, None]
    bad = np.argwhere(in_use & ((tables < 0) | (tables >= num_pages)))
    if bad.size:
        s, b = (int(i) for i in bad[0])
        raise ValueError(f"paged_attention: block_tables[{s}, {b}] = {int(tables[s, b])} is "
                         f"outside the pool [0, {num_pages})")
    bad = np.argwhere(in_use & ((n_valid < 0) | (n_valid > page_size)))
    if bad.size:
        s, b = (int(i) for i in bad[0])
        raise ValueError(f"paged_attention: block_num_valid[{s}, {b}] = {int(n_valid[s, b])} "
                         f"not in [0, {page_size}]")


@functools.partial(jax.named_call, name="xla_paged_attention")
def _xla_paged_attention(q, k_pages, v_pages, md, inv_freq, *, kv_mode, attention_scaling,
                         sm_scale):
    """Gather + dense fallback: runs anywhere; memory O(T * NB * B * K * D)."""
    tokens, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    seqs, max_blocks = md.block_tables.shape
    group = heads // kv_heads
    n_keys = max_blocks * page_size

    offsets = jnp.arange(page_size, dtype=jnp.int32)
    key_pos = (md.block_pos_start[:, :, None] + offsets).reshape(seqs, n_keys)  # [S, N]
    in_use = jnp.arange(max_blocks)[None, :] < md.num_blocks[:, None]  # [S, NB]
    valid = ((offsets[None, None, :] < md.block_num_valid[:, :, None]) & in_use[:, :, None])
    valid = valid.reshape(seqs, n_keys)  # [S, N]

    keys = k_pages[md.block_tables].reshape(seqs, n_keys, kv_heads, head_dim)  # [S, N, K, D]
    values = v_pages[md.block_tables].reshape(seqs, n_keys, kv_heads, head_dim)
    values = jnp.where(valid[:, :, None, None], values, 0)  # pad slots may hold garbage (NaN)
    if kv_mode == "position_free":
        keys = apply_rope(keys.reshape(seqs * n_keys, kv_heads, head_dim), key_pos.reshape(-1),
                          inv_freq, attention_scaling).reshape(keys.shape)
    q_rot = apply_rope(q, md.q_positions, inv_freq, attention_scaling)  # [T, H, D]

    seq = jnp.clip(md.q_seq, 0, seqs - 1)
    k_t = keys[seq].astype(jnp.float32)  # [T, N, K, D]
    v_t = values[seq].astype(jnp.float32)
    q_g = q_rot.astype(jnp.float32).reshape(tokens, kv_heads, group, head_dim)
    hi = jax.lax.Precision.HIGHEST  # fp32 means fp32 (GPUs default to TF32 for f32 dots)
    scores = jnp.einsum("tkgd,tnkd->tkgn", q_g, k_t, precision=hi) * sm_scale  # [T, K, G, N]
    kp = key_pos[seq]  # [T, N]
    mask = (valid[seq] & (kp <= md.q_positions[:, None]) & (kp >= md.q_window_start[:, None]))
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - row_max)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    out = jnp.einsum("tkgn,tnkd->tkgd", probs, v_t, precision=hi) / jnp.where(denom == 0, 1.0, denom)
    return out.reshape(tokens, heads, head_dim).astype(q.dtype)
