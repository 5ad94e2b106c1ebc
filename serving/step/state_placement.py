"""Where the engine's device state lives under tensor parallelism: one rule for all of it.

The state a step takes and returns (the cache: KV pages and a hybrid's recurrent conv / delta
states; the recurrent checkpoint pool; the span-map pool) is placed by the rules table
(serving/step/sharding.py) from the family's `cache_axes`; a pool takes the axes of the state it
holds (checkpoint_pool.pool_axes, span_maps.pool_axes), so a checkpoint is restored into the
shards it was taken from. Two halves keep it so:

- `place` (on the host) puts state there when the runner receives it: pools allocated on one
  device are split; state already placed is kept as it is (no copy);
- `pin` (inside every step variant) constrains what the step returns to the same placement.
  Without it XLA's propagation chooses each output's placement per program (a Qwen3.5 conv state
  came out split over its channels, which the table keeps whole), and the next variant, compiled
  for the table's placement, refused it ("compiled for input shardings that disagree").
"""

from __future__ import annotations

from serving.hybrid import checkpoint_pool, span_maps
from serving.step import sharding


def _apply(how, family, mcfg, mesh, cache, pool, maps):
    axes = family.cache_axes(mcfg)
    if cache is not None:
        cache = how(cache, axes, mesh)
    if pool is not None:
        pool = how(pool, checkpoint_pool.pool_axes(axes), mesh)
    if maps is not None:
        maps = how(maps, span_maps.pool_axes(axes), mesh)
    return cache, pool, maps


def place_pools(family, mcfg, mesh, pool, maps):
    """(checkpoint pool, span-map pool) moved to their rules-table placement (None stays None;
    arrays already there are kept); as they are without a mesh (one device)."""
    if mesh is None:
        return pool, maps
    return _apply(sharding.place, family, mcfg, mesh, None, pool, maps)[1:]


def pin_outputs(family, mcfg, mesh, outputs):
    """A step's outputs (cache, packed, prev tokens, checkpoint pool, span-map pool), inside
    the traced step, with the state constrained to its rules-table placement."""
    cache, packed, prev, pool, maps = outputs
    cache, pool, maps = _apply(sharding.pin, family, mcfg, mesh, cache, pool, maps)
    return cache, packed, prev, pool, maps
