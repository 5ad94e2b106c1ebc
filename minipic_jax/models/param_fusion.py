"""Fusing a model family's projections that read the same input into one matrix per layer
(`Config.fuse_weights`; each family's `fuse_params` says which), one layer at a time."""

from __future__ import annotations

from typing import Callable

import jax


def fuse_layers(params: dict, fuse_layer: Callable, consumed: Callable, is_fused: Callable, *,
                consume: bool = False) -> dict:
    """`params` with every layer not yet fused (`is_fused(layer)`) replaced by
    `fuse_layer(layer)`. With consume=True each array `consumed(layer)` lists is deleted once
    the last layer reading it is fused (layers may share arrays), never the embedding or the LM
    head, so peak memory grows by one layer only (the caller must hold no other reference to
    `params`)."""
    uses: dict[int, int] = {}  # array id -> layers still to fuse that read it
    for lp in params["layers"]:
        if not is_fused(lp):
            for x in consumed(lp):
                uses[id(x)] = uses.get(id(x), 0) + 1
    keep = {id(params["embed"]), id(params.get("lm_head"))}
    fused = []
    for lp in params["layers"]:
        if is_fused(lp):
            fused.append(lp)
            continue
        f = fuse_layer(lp)
        if consume:
            jax.block_until_ready(f)
            for x in consumed(lp):
                uses[id(x)] -= 1
                if uses[id(x)] == 0 and id(x) not in keep:
                    x.delete()
        fused.append(f)
    return {**params, "layers": tuple(fused)}


def all_fused(params: dict, fused_key: str, family: str) -> bool:
    """Whether every layer of a params dict is fused (holds `fused_key`); False when none is, a
    ValueError naming `family` when they mix."""
    kinds = {fused_key in lp for lp in params["layers"]}
    if len(kinds) > 1:
        raise ValueError(f"{family} params mix fused and unfused layers; fuse all or none")
    return kinds == {True}
