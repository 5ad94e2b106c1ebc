"""The checkpoint and span-map stores' slot moves (serving/hybrid/checkpoint_store.py: entries
evicted to the host tier, entries brought back), applied to the runner's device pools before the
step that needs them is launched."""

from __future__ import annotations


def apply_moves(cache, runner) -> None:
    """The step's slot moves of the checkpoint store and (spans) the span-map store of `cache`
    (hybrid_prefix.HybridPrefixCache) between their device pools and host tiers, applied to the
    runner's pools before the launch."""
    from serving.hybrid import checkpoint_pool, span_maps  # device code: imported when used
    ck_pool, span_pool = runner.ck_pool, runner.span_pool
    moved = False
    spans = cache.spans
    if spans is not None:  # span maps (serving/hybrid/span_cache.py), the same store bookkeeping
        out, inn = spans.store.take_moves()
        if out or inn:
            span_pool, moved = span_maps.apply_moves(span_pool, out, inn), True
    if ck_pool is not None:
        out, inn = cache.store.take_moves()
        if out or inn:
            ck_pool, moved = checkpoint_pool.apply_moves(ck_pool, out, inn), True
    if moved:  # pools nothing moved are the runner's, already placed: no host work per step
        runner.use_recurrent_pools(ck_pool, span_pool)
