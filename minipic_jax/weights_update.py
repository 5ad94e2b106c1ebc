"""`LLM.update_weights`: new weights of the same shapes and dtypes replace the served ones in
place, with no reload, re-trace or recompile.

The step executables take the params as an argument (serving/step/model_runner.py), so new arrays of
the same avals and placement run through the same compiled programs. What the engine does to
weights at load time is done again here, the same way: fusing QKV and gate/up one layer at a time
(`family.fuse_params`), or under tensor parallelism placing each leaf by the rules table
(serving/step/sharding.py, KV heads replicated as at load). On one device the new weights are
written into the served buffers (minipic_jax/weights_write.py), so the engine keeps serving arrays
of its own, the allocator sees nothing freed or allocated, and beyond the caller's params the
update holds one layer's temporaries at most. Under tensor parallelism the same per device:
each new leaf is placed by the rules table and written into the served shards by write programs
compiled for the mesh (KV heads repeated inside them).

Everything cached under the old weights is invalidated: the prefix cache, host tier and hybrid
checkpoint / span-map stores are forgotten (`reset_prefix_cache`), and a fresh random nonce enters
every block hash's root (`WeightsVersion.root`), so no key made after the update equals one made
before it. The persistent span store, keyed by the loaded checkpoint's fingerprint, is detached:
blocks of updated weights are neither read from it nor written to it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import numpy as np

from minipic_jax import weights_write
from minipic_jax.models import nnx_pure
from serving.step import sharding
from serving.cache.hashing import root_hash


@dataclass(slots=True)
class WeightsVersion:
    """The served weights' identity in the cache namespace: a generation count (0 = as loaded)
    and a nonce drawn at each update, mixed into every root hash."""

    hash_fn: object
    generation: int = 0
    nonce: bytes = b""
    spec: object = None  # the family's (unfused) params as ShapeDtypeStructs
    writer: object = None  # weights_write.(Sharded)WeightsWriter, made when first needed

    def root(self, cache_salt: str | None) -> int:
        h0 = root_hash(self.hash_fn, cache_salt)
        if not self.generation:
            return h0  # as loaded: keys shared with other processes of the same checkpoint
        return self.hash_fn(h0, self.nonce, b"W")

    def bump(self) -> None:
        self.generation += 1
        self.nonce = self.generation.to_bytes(8, "little") + os.urandom(16)


def params_spec(params, dtype) -> dict:
    """ShapeDtypeStructs of the loaded (unfused) params in the engine dtype (host params of a
    tensor-parallel load are cast to it as they are placed)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(dtype)), params)


def as_params_dict(params):
    """The family's params dict from what a trainer holds: the dict itself, a Flax NNX State
    (`nnx.state(model)`, layers keyed by index) or an NNX module."""
    from flax import nnx
    if isinstance(params, nnx.Module):
        params = nnx.state(params)
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    if isinstance(params, dict) and isinstance(params.get("layers"), dict):
        params = nnx_pure.from_state_dict(params)
    return params


def _dtype_of(x):
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def check_params(params, spec) -> None:
    """ValueError naming the first leaf of `params` that is missing, extra, deleted, or of
    another shape or dtype than `spec`'s; nothing is touched."""
    want = dict(jax.tree_util.tree_flatten_with_path(spec)[0])
    got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    names = {jax.tree_util.keystr(p): p for p in want}
    got_names = {jax.tree_util.keystr(p): p for p in got}
    for name, path in names.items():
        if name not in got_names:
            raise ValueError(f"update_weights: leaf params{name} is missing (want shape "
                             f"{want[path].shape}, dtype {want[path].dtype})")
        x, w = got[got_names[name]], want[path]
        if isinstance(x, jax.Array) and x.is_deleted():
            raise ValueError(f"update_weights: leaf params{name} is a deleted array (donated "
                             f"or deleted before the call)")
        shape = tuple(np.shape(x))
        if shape != w.shape or _dtype_of(x) != w.dtype:
            raise ValueError(f"update_weights: leaf params{name} has shape {shape}, dtype "
                             f"{_dtype_of(x)}; the served model needs shape {w.shape}, dtype "
                             f"{w.dtype}")
    extra = sorted(set(got_names) - set(names))
    if extra:
        raise ValueError(f"update_weights: leaf params{extra[0]} is not a parameter of the "
                         f"served model")
    if jax.tree.structure(params) != jax.tree.structure(spec):
        raise ValueError(f"update_weights: params have the structure "
                         f"{jax.tree.structure(params)}, the served model "
                         f"{jax.tree.structure(spec)}")


def _free(old_leaves, keep: set) -> None:
    """Delete served arrays (all the engine's own) but those in `keep` (ids of the new params':
    a caller that donated arrays and passes them again)."""
    for x in old_leaves:
        if isinstance(x, jax.Array) and id(x) not in keep and not x.is_deleted():
            x.delete()


def _placed(x, target, donate: bool, served: set):
    """`x` committed to the served weights' device (no copy when already there); a served array
    passed back in is copied, as it is about to be written over."""
    if id(x) in served:
        return jax.device_put(x, target, may_alias=False)
    return jax.device_put(x, target, donate=donate and isinstance(x, jax.Array)
                          and not x.sharding.is_equivalent_to(target, x.ndim))


def _source(x, target, donate: bool, served: set):
    """A new leaf as a tensor-parallel write program takes it: an array already laid out over the
    mesh's devices as it is (the program reshards it on device; a layout other than the rules
    table's compiles its program once), anything else placed by the rules table (`target`):
    host arrays are sliced on the host, each device receiving its own slice; an array on one
    device is sliced there by `jax.device_put`, whose small slicing programs (one per shape)
    compile at the first update that passes such arrays."""
    mesh = target.mesh
    if (id(x) not in served and isinstance(x, jax.Array)
            and isinstance(x.sharding, jax.sharding.NamedSharding)
            and x.sharding.mesh.devices.tolist() == mesh.devices.tolist()):
        return x
    return _placed(x, target, donate, served)


def _writer(version: WeightsVersion, runner, loaded):
    if version.writer is None and runner.mesh is None:
        version.writer = weights_write.WeightsWriter(runner.family, runner.config.fuse_weights)
    elif version.writer is None:  # tensor parallelism: KV heads repeated as at load
        copies = sharding.kv_replication(loaded.cfg, runner.config.tensor_parallel_size)
        version.writer = weights_write.ShardedWeightsWriter(copies)
    return version.writer


def _top_keys(params: dict) -> list:
    return [k for k in params if k != "layers"]


def _sharded_parts(runner, loaded, new: dict):
    """(served, new, logical axes) of the top-level leaves, then of each layer (the unit each
    tensor-parallel write program takes)."""
    axes = loaded.family.param_axes(loaded.cfg)
    old, top = runner.params, _top_keys(runner.params)
    yield {k: old[k] for k in top}, {k: new[k] for k in top}, {k: axes[k] for k in top}
    yield from zip(old["layers"], new["layers"], axes["layers"])


def prepare(llm) -> int:
    """Compile the write programs an update will run (`LLM` warm-up calls it), so no update
    compiles anything; returns how many compiled now. Under tensor parallelism: the programs
    for new leaves placed by the rules table (what host arrays, arrays on one device and arrays
    so placed by the caller become); arrays on the mesh in another layout compile their own
    at the first update that passes them (`_source`)."""
    engine, version = llm.llm_engine, llm.weights_version
    runner = engine.runner
    writer = _writer(version, runner, engine.loaded)
    before, old = writer.compiles, runner.params
    if runner.mesh is not None:  # each new leaf as it will be placed (source_shardings)
        for served, spec, axes in _sharded_parts(runner, engine.loaded, version.spec):
            targets = sharding.source_shardings(spec, axes, runner.mesh, writer.copies)
            writer.ensure(served, jax.tree.map(
                lambda s, t: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=t), spec,
                targets), axes)
        return writer.compiles - before
    target = jax.tree.leaves(old)[0].sharding  # where install_single puts the new leaves
    spec = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=target),
                        version.spec)
    top = _top_keys(old)
    writer.ensure({k: old[k] for k in top}, {k: spec[k] for k in top}, layer=False)
    for served, new in zip(old["layers"], spec["layers"]):
        writer.ensure(served, new, layer=True)
    return writer.compiles - before


def install_single(runner, new: dict, donate: bool, writer) -> dict:
    """One device: the new weights written into the served buffers (minipic_jax/weights_write.py:
    the top-level leaves in one program, then each layer, fused as at load when `fuse_weights`),
    so nothing is freed or allocated but one layer's temporaries. A donated caller's arrays are
    deleted once written. Returns the served params (the same buffers)."""
    old = runner.params
    target = jax.tree.leaves(old)[0].sharding
    served = {id(x) for x in jax.tree.leaves(old)}
    top_keys = _top_keys(old)
    top = writer({k: old[k] for k in top_keys},
                 {k: jax.tree.map(lambda x: _placed(x, target, donate, served), new[k])
                  for k in top_keys}, layer=False)
    layers = []
    for i, lp in enumerate(new["layers"]):
        lp = jax.tree.map(lambda x: _placed(x, target, donate, served), lp)
        layers.append(jax.block_until_ready(writer(old["layers"][i], lp, layer=True)))
        del lp  # a layer moved from elsewhere is freed before the next one moves
    if donate:
        _free(jax.tree.leaves(new), served)
    return {**jax.block_until_ready(top), "layers": tuple(layers)}


def install_sharded(runner, loaded, new: dict, donate: bool, writer) -> dict:
    """Tensor parallelism: as `install_single`, per device. Each new leaf goes to the mesh as
    `_source` says (by the rules table, `sharding.source_shardings`, unless already on the mesh),
    and a write program compiled for the mesh repeats the KV heads as the load did
    (`replicate_kv_heads`) and writes every shard into the served shard's buffer. Nothing served
    is freed or allocated; beyond the caller's arrays an update holds one part's placed copies
    (the top-level leaves' or one layer's) and the program's temporaries."""
    served_ids = {id(x) for x in jax.tree.leaves(runner.params)}
    out = []
    for served, part, axes in _sharded_parts(runner, loaded, new):
        targets = sharding.source_shardings(part, axes, runner.mesh, writer.copies)
        part = jax.tree.map(lambda x, t: _source(x, t, donate, served_ids), part, targets)
        out.append(jax.block_until_ready(writer(served, part, axes)))
        del part  # a layer moved from elsewhere is freed before the next one moves
    if donate:
        _free(jax.tree.leaves(new), served_ids)
    return {**out[0], "layers": tuple(out[1:])}


def _detach_span_store(engine) -> None:
    """The persistent span store is keyed by the fingerprint of the checkpoint the engine loaded
    (serving/tiers/fingerprint.py): after an update it neither reads nor writes it (its blocks would
    describe other weights). The host tier above it stays (it is forgotten with the cache)."""
    engine.cache.detach_store()


def update_weights(llm, params, *, donate: bool = False) -> int:
    """See `LLM.update_weights`. Returns the new weights generation."""
    engine = llm.llm_engine
    version: WeightsVersion = llm.weights_version
    if engine.has_unfinished() or engine.num_in_flight:
        raise RuntimeError("update_weights: requests are still running; call it between "
                           "generate() calls")
    params = as_params_dict(params)
    check_params(params, version.spec)  # before anything changes: old weights keep serving
    engine.flush_kv_store()  # blocks of the old weights reach the store under the old keys
    _detach_span_store(engine)
    runner = engine.runner
    writer = _writer(version, runner, engine.loaded)
    if runner.mesh is None:
        served = install_single(runner, params, donate, writer)
    else:
        served = install_sharded(runner, engine.loaded, params, donate, writer)
    del params
    runner.params = engine.loaded.params = served
    version.bump()
    engine.reset_prefix_cache()
    return version.generation


def attach(engine, spec) -> WeightsVersion:
    """The engine's weights version (generation 0), made the source of its block hashes' roots."""
    from serving.cache.hashing import make_hash_fn
    version = WeightsVersion(make_hash_fn(engine.config.hash_algo), spec=spec)
    engine.cache.keys.root_hash_fn = version.root
    return version
