"""The cache manager's part for a hybrid model's recurrent layers (serving/cache/manager.py).

Attention blocks are the manager's own; this part adds what recurrent state needs: where an
admission resumes (the deepest checkpoint, the spans it skips: serving/hybrid/hybrid_prefix.py,
span_cache.py), a chunk's stops and cuts (at most one checkpoint per chunk; a non-final span in
one step), the chunk's restore / checkpoint / span-map fields, and the checkpoint and span-map
stores' slot moves. Without prefix caching (`cache` None) only the span cut is left.
"""

from __future__ import annotations

from serving.hybrid import slot_moves, span_rows


class RecurrentCheckpoints:
    def __init__(self, block_size: int, cache=None):
        self.block_size = block_size
        self.cache = cache  # HybridPrefixCache, or None (prefix caching off)

    @property
    def caches(self) -> bool:
        return self.cache is not None

    def plan_admission(self, mgr, seq):
        """The AdmissionPlan of `seq` (None: it waits a step); see HybridPrefixCache."""
        return self.cache.plan_admission(mgr, seq)

    def commit(self, mgr, seq, plan) -> None:
        self.cache.commit(mgr, seq, plan.detail)

    def cancel(self, plan) -> None:
        self.cache.cancel(plan.detail)

    def release(self, seq) -> None:
        """`seq` leaves before its restore ran or its pinned span maps were entered."""
        if self.cache is not None:
            self.cache.drop_restore(seq)

    def note_request(self, mgr, seq) -> None:
        """A request was added: a span prompt's spans are counted (span_capture)."""
        spans = None if self.cache is None else self.cache.spans
        if spans is not None and seq.layout.span_block.any():
            spans.note(mgr, seq)

    def chunk_stop(self, seq, stop_at, budget: int):
        return stop_at if self.cache is None else self.cache.chunk_stop(seq, stop_at, budget)

    def cut_chunk(self, seq, idx, frontier: int):
        """A non-final span stays in one step (span_rows.cut_chunk), a long one goes in pieces
        when the span-map cache can carry them (SpanMapCache.cut)."""
        if seq.layout.span_block.any():
            spans = None if self.cache is None else self.cache.spans
            if spans is not None:
                return spans.cut(seq, idx, frontier)
            return span_rows.cut_chunk(seq, idx, frontier, self.block_size)
        return idx, frontier

    def annotate(self, mgr, entry) -> None:
        if self.cache is not None:
            self.cache.annotate(mgr, entry)

    def after_launch(self) -> None:
        if self.cache is not None:
            self.cache.after_launch()

    def move_slots(self, runner) -> None:
        """The checkpoint and span-map stores' slot moves, applied to the runner's pools."""
        if self.cache is not None:
            slot_moves.apply_moves(self.cache, runner)

    def abandon_step(self, device_ok: bool) -> None:
        if self.cache is not None:
            self.cache.abandon_step(device_ok)

    def drop_dependent(self, block_hash: int) -> None:
        if self.cache is not None:
            self.cache.drop_dependent(block_hash)

    def stats(self) -> dict:
        return {} if self.cache is None else self.cache.stats()
