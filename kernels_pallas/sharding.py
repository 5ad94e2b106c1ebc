"""Tensor parallelism for the kernels: each op runs on its device's heads under `shard_map`.

The engine's jitted step traces the model under an abstract mesh with a `TP_AXIS` axis
(`jax.sharding.use_abstract_mesh`); the wrappers here read it and, when its size is > 1, run the
kernel per shard: queries / new K,V / recurrent state split over heads, KV pages split over KV
heads, metadata replicated. Heads never interact inside these ops, so no collective is needed
here (the Megatron all-reduces come after the output projections, where the model's einsums
contract the sharded head axis). Without a mesh (or size 1) they are the plain api calls, so
model code is the same for one device and many. Signatures match the api functions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels_pallas.gated_delta import api as _gdn
from kernels_pallas.paged_attention import api as _attn

TP_AXIS = "tp"

_HEADS = P(None, TP_AXIS, None)  # [T, H, D]
_PAGES = P(None, None, TP_AXIS, None)  # [P, B, K, D]
_REPLICATED = P()


def tp_mesh():
    """The trace's abstract mesh when it splits TP_AXIS over > 1 devices, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TP_AXIS not in mesh.axis_names or mesh.shape[TP_AXIS] == 1:
        return None
    return mesh


def whole(x):
    """`x` kept whole on every device of the trace's TP mesh (as is without one): for values
    every device computes in full (a GDN layer's conv output: its [q | k | v] channels do not
    split by heads), which XLA would otherwise split by its own choice and gather back."""
    mesh = tp_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, _REPLICATED))


def _per_shard(fn, mesh, in_specs, out_specs):
    # check_vma off: Pallas calls carry no varying-axis annotations
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def write_kv(k_pages, v_pages, k, v, slot_mapping, **kw):
    """api.write_kv per KV-head shard (pages [P, B, K, D] and k/v [T, K, D] split over K)."""
    mesh = tp_mesh()
    if mesh is None:
        return _attn.write_kv(k_pages, v_pages, k, v, slot_mapping, **kw)
    return _per_shard(lambda kp, vp, k_, v_, s: _attn.write_kv(kp, vp, k_, v_, s, **kw), mesh,
                      (_PAGES, _PAGES, _HEADS, _HEADS, _REPLICATED), (_PAGES, _PAGES))(
        k_pages, v_pages, k, v, slot_mapping)


def paged_attention(q, k_pages, v_pages, metadata, inv_freq, **kw):
    """api.paged_attention per head shard: device i holds query heads [i H/N, (i+1) H/N) and
    their KV heads [i K/N, (i+1) K/N) (query head h reads KV head h // (H/K), so a contiguous
    split keeps every group on one device)."""
    mesh = tp_mesh()
    if mesh is None:
        return _attn.paged_attention(q, k_pages, v_pages, metadata, inv_freq, **kw)
    return _per_shard(lambda q_, kp, vp, md: _attn.paged_attention(q_, kp, vp, md, inv_freq, **kw),
                      mesh, (_HEADS, _PAGES, _PAGES, _REPLICATED), _HEADS)(
        q, k_pages, v_pages, metadata)


def _key_heads_per_device(q, k, mesh):
    """q / k [T, Hk, D] with each key head repeated to one per device where Hk < devices (a
    contiguous split of the value heads then keeps each with the key head it reads)."""
    n, hk = mesh.shape[TP_AXIS], q.shape[1]
    if hk % n:
        q, k = jnp.repeat(q, n // hk, axis=1), jnp.repeat(k, n // hk, axis=1)
    return q, k


def _decode_per_shard(fn, args, gate_specs, kw):
    """One of gated_delta.api's decode-in-place calls, args (q, k, v, *gates, cu_q_lens, cache,
    slots, keep) with the gates' specs `gate_specs`, per head shard: the state cache split over
    heads as ragged_gated_delta's states are. Returns (out, cache)."""
    mesh = tp_mesh()
    if mesh is None:
        return fn(*args, **kw)
    state = P(None, TP_AXIS, None, None)
    ins = (_HEADS, _HEADS, _HEADS) + gate_specs + (_REPLICATED, state, _REPLICATED, _REPLICATED)
    args = _key_heads_per_device(args[0], args[1], mesh) + tuple(args[2:])
    return _per_shard(functools.partial(fn, **kw), mesh, ins, (_HEADS, state))(*args)


def ragged_decode_in_place(q, k, v, g, beta, cu_q_lens, cache, slots, keep, **kw):
    """gated_delta.api.ragged_decode_in_place per head shard."""
    gates = P(None, TP_AXIS)
    return _decode_per_shard(_gdn.ragged_decode_in_place,
                             (q, k, v, g, beta, cu_q_lens, cache, slots, keep), (gates, gates), kw)


def ragged_decode_layer_in_place(q, k, v, a, b, a_log, dt_bias, z, norm, cu_q_lens, cache, slots,
                                 keep, **kw):
    """gated_delta.api.ragged_decode_layer_in_place per head shard (the gates' per-head vectors
    and z split over heads too)."""
    gates, per_head = P(None, TP_AXIS), P(TP_AXIS)
    return _decode_per_shard(_gdn.ragged_decode_layer_in_place,
                             (q, k, v, a, b, a_log, dt_bias, z, norm, cu_q_lens, cache, slots,
                              keep), (gates, gates, per_head, per_head, _HEADS, _REPLICATED), kw)


def ragged_gated_delta(q, k, v, g, beta, cu_q_lens, pos0, state0, *, checkpoint_at=None, **kw):
    """gated_delta.ragged.ragged_gated_delta per head shard: q/k [T, Hk, Dk], v [T, Hv, Dv],
    g/beta [T, Hv], state [S, Hv, Dk, Dv] split over heads (value head j reads key head
    j // (Hv/Hk), so a contiguous split keeps every group on one device; with Hk < devices the
    key heads are repeated to one per device first, which keeps that mapping)."""
    mesh = tp_mesh()
    if mesh is None:
        return _gdn.ragged_gated_delta(q, k, v, g, beta, cu_q_lens, pos0, state0,
                                       checkpoint_at=checkpoint_at, **kw)
    kw.pop("packing", None)  # per shard: recomputed inside (its arrays are not shard inputs)
    q, k = _key_heads_per_device(q, k, mesh)
    state = P(None, TP_AXIS, None, None)
    gates = P(None, TP_AXIS)
    ins = (_HEADS, _HEADS, _HEADS, gates, gates, _REPLICATED, _REPLICATED, state)
    if checkpoint_at is None:
        def fn(*ops):
            out, new, _ = _gdn.ragged_gated_delta(*ops, **kw)
            return out, new
        out, new = _per_shard(fn, mesh, ins, (_HEADS, state))(
            q, k, v, g, beta, cu_q_lens, pos0, state0)
        return out, new, None

    def fn_ck(*ops):
        return _gdn.ragged_gated_delta(*ops[:-1], checkpoint_at=ops[-1], **kw)
    flat = isinstance(checkpoint_at, _gdn.CheckpointRows)  # [K, Hv, ...], else [S, M, Hv, ...]
    ck_spec = P(None, TP_AXIS, None, None) if flat else P(None, None, TP_AXIS, None, None)
    return _per_shard(fn_ck, mesh, ins + (_REPLICATED,), (_HEADS, state, ck_spec))(
        q, k, v, g, beta, cu_q_lens, pos0, state0, checkpoint_at)
