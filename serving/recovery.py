"""Bring the engine back to a state the next step can run from after an exception inside a
step (a fault in scheduling, a page move or the jitted call) or an interrupt between steps.

The failed call's own requests are aborted and their blocks freed. Every other request keeps
its tokens and is preempted (recomputed from them later): a half-done step may have allocated
blocks, planned copy-ins that never ran or moved no frontier, and preemption is the one
operation that leaves a sequence consistent whatever the step did. Nothing finished is lost:
results a failed step had already made are returned by the next `step()`; tokens still in
flight are sampled again.
"""

from __future__ import annotations

from serving.sequence import Status


def recover(engine, request_ids) -> None:
    """Abort `request_ids` and make the engine consistent (block ref counts, free list, hash
    table, host tier) for the requests that remain. If a device step was dispatched and never
    read back, the pages it may have written are dropped from the cache."""
    sched, bm = engine.scheduler, engine.bm
    device_ok = _read_back_inflight(engine)
    request_ids = set(request_ids)
    for rid in request_ids:
        engine.abort_request(rid)
    engine.discard_results(request_ids)
    # copy-ins planned by the failed step that did not run: their blocks are published as ready
    # but hold stale pages
    for b, h in sched.pending_copy_in:
        if bm.hash[b] == h:
            bm._unregister(b)
    sched.pending_copy_in = []
    engine.discard_evictions()  # pages not gathered: only their host copies are lost
    sched._resolved_early = False
    for job in list(sched.span_jobs):
        sched.preempt(job)
    for seq in reversed(list(sched.running)):  # the oldest ends up first in the queue
        sched.preempt(seq)
    if engine.hybrid_cache is not None:  # checkpoints a failed step reserved were never written
        engine.hybrid_cache.abandon_step(device_ok)
    if not device_ok:
        _drop_unverified_pages(engine)


def _read_back_inflight(engine) -> bool:
    """Wait for the steps in flight (a launched step stays in flight until read back), then
    drop every pending token (async scheduling: their requests sample them again after the
    preemption: a step that failed part way may have left the host and that step out of step,
    so its tokens are not applied). Returns whether those steps completed: if not, the pages
    they wrote cannot be trusted."""
    device_ok = engine.drop_in_flight()
    for seq in engine.live_sequences():
        while seq.num_pending:
            seq.drop_placeholder()
        if seq.ends_with_pending:  # finished by length on a dropped token: run it again
            seq.ends_with_pending = False
            seq.status = Status.WAITING
            seq.num_computed = 0
            engine.scheduler.waiting.appendleft(seq)
    return device_ok


def _drop_unverified_pages(engine) -> None:
    """Forget every cached block (all are free after the preemptions) and the host copies not
    yet read back: after a failed device step their contents are unknown."""
    bm = engine.bm
    for b in range(bm.num_blocks):
        if bm.ref[b] == 0 and bm.hash[b] != -1:
            bm._unregister(b)
    tier = engine.offload
    if tier is not None and tier.pending:
        lost = {id(batch) for batch in tier.pending}
        for h in [h for h, (_, batch, _) in tier.entries.items() if id(batch) in lost]:
            del tier.entries[h]
        tier.pending = []
