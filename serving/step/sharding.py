"""Tensor parallelism: the mesh, and params / cache placed by their logical axes.

One rules table maps a logical axis name (the names of each family's `param_axes` /
`cache_axes`) to a mesh axis. Megatron's split: attention by heads (Q heads, KV heads, the
KV pool's heads axis), the MLP by its intermediate axis, the vocabulary (embedding rows, LM
head columns, so logits stay split over devices and sampling reduces across them on device),
Gated DeltaNet by its heads; everything else replicated. XLA then puts the all-reduces where
a sharded axis is contracted: after the attention / GDN output projections and the MLP down
projection. The kernels run per shard under `shard_map` (kernels_pallas/sharding.py).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from kernels_pallas.sharding import TP_AXIS

# logical axis name -> mesh axis (None or absent: replicated)
RULES: dict[str, str | None] = {
    "heads": TP_AXIS,
    "kv_heads": TP_AXIS,
    "mlp": TP_AXIS,
    "vocab": TP_AXIS,
    "gdn_heads": TP_AXIS,
    "embed": None,
    "head_dim": None,
    "gdn_conv": None,  # [q | k | v] concatenated: a contiguous split would not follow heads
    "gdn_v": None,
}
# axes that must split evenly (a KV head, a GDN head, lives on one device); others that do not
# divide stay replicated (e.g. an odd vocabulary)
MUST_DIVIDE = ("kv_heads", "heads", "gdn_heads")


def make_mesh(tensor_parallel_size: int) -> Mesh:
    """A 1-D mesh over the first `tensor_parallel_size` devices (axis TP_AXIS)."""
    devices = jax.devices()
    if tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} exceeds the "
                         f"{len(devices)} {jax.default_backend()} device(s) available")
    return Mesh(np.asarray(devices[:tensor_parallel_size]), (TP_AXIS,),
                axis_types=(AxisType.Auto,))


def kv_replication(mcfg, n: int) -> int:
    """How many copies of each KV head the mesh needs (1, or n / num_kv_heads when n is a
    multiple of it: each device then holds the one KV head its query heads read, as vLLM does).
    ValueError when `n` does not split the heads."""
    counts = {"num_heads": mcfg.num_heads}
    if "linear_attention" in (mcfg.layer_types or ()):
        counts["linear_num_value_heads"] = mcfg.linear_num_value_heads
        hk = mcfg.linear_num_key_heads
        if hk % n and n % hk:
            counts["linear_num_key_heads"] = hk
    for name, count in counts.items():
        if count % n:
            raise ValueError(f"tensor_parallel_size={n} does not divide the model's {name}="
                             f"{count}; use a tensor_parallel_size that divides it")
    k = mcfg.num_kv_heads
    if k % n == 0:
        return 1
    if n % k == 0:
        return n // k
    raise ValueError(f"tensor_parallel_size={n} neither divides nor is a multiple of the "
                     f"model's num_kv_heads={k}")


def replicate_kv_heads(params, axes_tree, copies: int):
    """Every "kv_heads" axis repeated `copies` times (copy i of head k at k * copies + i, so
    query head h still reads its KV head h // (H / K'))."""
    if copies == 1:
        return params

    def rep(axes, x):
        if x is None or axes is None or "kv_heads" not in axes:
            return x
        return jax.numpy.repeat(x, copies, axis=axes.index("kv_heads"))
    return jax.tree.map(rep, axes_tree, params, is_leaf=_is_axes)


def spec_for(axes, shape, n: int) -> P:
    """PartitionSpec of one array from its logical axis names (RULES)."""
    if axes is None:
        return P()
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match an array of shape {shape}")
    out = []
    for name, size in zip(axes, shape):
        mesh_axis = RULES.get(name)
        if mesh_axis is not None and size % n:
            if name in MUST_DIVIDE:
                raise ValueError(f"axis {name!r} of size {size} does not split over {n} devices")
            mesh_axis = None
        out.append(mesh_axis)
    return P(*out)


def _is_axes(x) -> bool:
    return x is None or (isinstance(x, tuple) and len(x) > 0 and
                         all(a is None or isinstance(a, str) for a in x))


def shardings(tree, axes_tree, mesh: Mesh):
    """NamedSharding per array of `tree` (arrays or ShapeDtypeStructs) from `axes_tree`."""
    n = mesh.shape[TP_AXIS]
    return jax.tree.map(
        lambda axes, x: None if x is None else NamedSharding(mesh, spec_for(axes, x.shape, n)),
        axes_tree, tree, is_leaf=_is_axes)


def source_shardings(tree, axes_tree, mesh: Mesh, copies: int = 1):
    """NamedSharding per array of `tree` as given, before `replicate_kv_heads` repeats its KV
    heads `copies` times: `shardings`' placement, but a "kv_heads" axis to be repeated stays
    whole on every device (fewer heads than devices: each device then repeats and keeps its own
    copies, with no communication). With copies == 1 the served placement itself."""
    if copies > 1:
        axes_tree = jax.tree.map(
            lambda axes: axes if axes is None else tuple(None if a == "kv_heads" else a
                                                         for a in axes),
            axes_tree, is_leaf=_is_axes)
    return shardings(tree, axes_tree, mesh)


def shard_params(params, axes_tree, mesh: Mesh):
    """Params placed per their logical axes (each array's source is freed once moved)."""
    target = shardings(params, axes_tree, mesh)
    return jax.tree.map(lambda x, s: jax.device_put(x, s, donate=True), params, target)


def stream_params(host_params, axes_tree, mesh: Mesh, dtype, copies: int = 1):
    """Host arrays (e.g. memory-mapped checkpoint views, `convert_hf(..., host=True)`) placed
    per their logical axes, one tensor at a time: each device receives only its slice, read from
    the host array and cast to `dtype` on its own, so beyond the (mapped) checkpoint host memory
    holds one tensor's slices at most (devices holding the same slice share one copy).
    "kv_heads" axes are repeated `copies` times as `replicate_kv_heads` does, by reading each
    slice's source heads."""
    n = mesh.shape[TP_AXIS]

    def place(axes, host):
        if host is None:
            return None
        shape = list(host.shape)
        kv = axes.index("kv_heads") if copies > 1 and axes and "kv_heads" in axes else None
        if kv is not None:
            shape[kv] *= copies
        target = NamedSharding(mesh, spec_for(axes, shape, n))
        slices = {}  # devices that hold the same slice share one host copy

        def read(index):
            key = tuple((i.start, i.stop) for i in index)
            if key not in slices:
                if kv is not None:  # replicated head j is source head j // copies
                    heads = np.arange(shape[kv])[index[kv]] // copies
                    index = index[:kv] + (heads,) + index[kv + 1:]
                # copied: the device array must never alias the memory map
                slices[key] = np.array(host[index], dtype=dtype, order="C", copy=True)
            return slices[key]
        return jax.make_array_from_callback(tuple(shape), target, read)
    return jax.tree.map(place, axes_tree, host_params, is_leaf=_is_axes)


def _is_host(params) -> bool:
    return all(isinstance(x, np.ndarray) for x in jax.tree.leaves(params))


def place_model(loaded, tensor_parallel_size: int, dtype=None):
    """Mesh over `tensor_parallel_size` devices and `loaded.params` placed on it (KV heads
    replicated when the size is a multiple of them). Params that are host (numpy) arrays are
    streamed tensor by tensor (`stream_params`, cast to `dtype`); device arrays are moved.
    Returns (mesh, model config as the engine sees it: num_kv_heads = the heads its pool and
    kernels hold)."""
    mesh = make_mesh(tensor_parallel_size)
    copies = kv_replication(loaded.cfg, tensor_parallel_size)
    axes = loaded.family.param_axes(loaded.cfg)
    params, loaded.params = loaded.params, None
    if _is_host(params):
        if dtype is None:
            raise ValueError("place_model: host (numpy) params need the compute dtype")
        loaded.params = stream_params(params, axes, mesh, dtype, copies)
    else:
        loaded.params = shard_params(replicate_kv_heads(params, axes, copies), axes, mesh)
    del params
    mcfg = loaded.cfg
    if copies > 1:
        mcfg = dataclasses.replace(mcfg, num_kv_heads=mcfg.num_kv_heads * copies)
    return mesh, mcfg


def pin(tree, axes_tree, mesh: Mesh):
    """`tree` inside a traced program, constrained to its rules-table placement. State a program
    takes and returns (the cache, the recurrent pools) must come out where it went in: otherwise
    XLA's propagation picks the output's placement per program (a GDN conv state came out split
    over its channels while the table keeps it whole), and the next variant, compiled for the
    table's placement, refuses it."""
    return jax.lax.with_sharding_constraint(tree, shardings(tree, axes_tree, mesh))


def place(tree, axes_tree, mesh: Mesh):
    """Arrays of `tree` moved to their rules-table placement; those already there are kept (no
    copy)."""
    def put(x, target):
        if x is None or x.sharding.is_equivalent_to(target, x.ndim):
            return x
        return jax.device_put(x, target)
    return jax.tree.map(put, tree, shardings(tree, axes_tree, mesh))


def init_sharded(make, axes_tree, mesh: Mesh):
    """`make()` (e.g. a zeroed KV pool) created directly in its shards: no full copy on one
    device."""
    target = shardings(jax.eval_shape(make), axes_tree, mesh)
    return jax.jit(make, out_shardings=target)()
