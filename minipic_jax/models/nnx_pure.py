"""Flax NNX modules used pure-functionally: the pieces every model family shares.

A family's modules own the math and the parameter metadata (shapes and logical sharding axes);
they never hold live weights at run time. Params are a plain nested dict (`nnx.to_pure_dict`
layout, except that `layers` is a tuple) that jitted steps take as an argument; `merge` binds them
into the family's cached graph definition inside the trace, which costs nothing at run time.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx


def param(shape, axes, dtype) -> nnx.Param:
    """A parameter with logical axis names (mapped to a mesh by the caller, never here)."""
    return nnx.Param(jnp.zeros(shape, dtype), out_sharding=axes, eager_sharding=False)


def abstract(build: Callable[[], nnx.Module]):
    """(graphdef, abstract state) of the module `build()` makes; no weights are allocated. Built
    outside any mesh: the logical axis names are metadata here (serving/step/sharding.py maps them to
    a mesh), and Flax would read them as mesh axes of an enclosing one (the engine's step traces
    under its TP mesh). Families cache the result per config."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return nnx.split(nnx.eval_shape(build))


def to_state_dict(params: dict) -> dict:
    """A params dict in nnx's pure-dict layout (layers keyed by index)."""
    return {**params, "layers": dict(enumerate(params["layers"]))}


def from_state_dict(pure: dict) -> dict:
    """nnx's pure dict as a params dict (layers a tuple)."""
    layers_ = pure["layers"]
    return {**pure, "layers": tuple(layers_[i] for i in range(len(layers_)))}


def shapes(state) -> dict:
    """The params dict of an abstract state with shape tuples as leaves."""
    return from_state_dict(jax.tree.map(lambda a: tuple(a.shape), nnx.to_pure_dict(state)))


def logical_axes(state) -> dict:
    """The params dict of an abstract state with each leaf's logical axis names (a tuple of str
    or None), read from the modules' nnx.Param annotations."""
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    return from_state_dict(jax.tree.map(tuple, specs, is_leaf=lambda s: isinstance(
        s, jax.sharding.PartitionSpec)))


def merge(graphdef, params: dict):
    """The module whose parameters are `params` (traced arrays inside jit: no copies)."""
    return nnx.merge(graphdef, to_state_dict(params))
