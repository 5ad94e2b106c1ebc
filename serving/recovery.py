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
    sched = engine.scheduler
    device_ok = _read_back_inflight(engine) and not engine._step_unread
    engine._step_unread = False
    request_ids = set(request_ids)
    for rid in request_ids:
        engine.abort_request(rid)
    engine._early = [o for o in engine._early if o.request_id not in request_ids]
    sched._resolved_early = False
    for job in list(sched.span_jobs):
        sched.preempt(job)
    for seq in reversed(list(sched.running)):  # the oldest ends up first in the queue
        sched.preempt(seq)
    # copy-ins and checkpoints the failed step planned never ran; without device_ok no cached
    # page can be trusted (CacheManager.abandon_step)
    engine.cache.abandon_step(device_ok)


def _read_back_inflight(engine) -> bool:
    """Async scheduling: wait for the step in flight, then drop every pending token (their
    requests sample them again after the preemption: a step that failed part way may have left
    the host and that step out of step, so its tokens are not applied). Returns whether the
    step completed: if not, the pages it wrote cannot be trusted."""
    inflight, engine._inflight = engine._inflight, None
    device_ok = True
    if inflight is not None:
        try:
            engine.runner.fetch(inflight[1])
        except Exception:  # noqa: BLE001 -- the original error is the one re-raised
            device_ok = False
    for seq in list(engine._seqs.values()):
        while seq.num_pending:
            seq.drop_placeholder()
        if seq.ends_with_pending:  # finished by length on a dropped token: run it again
            seq.ends_with_pending = False
            seq.status = Status.WAITING
            seq.num_computed = 0
            engine.scheduler.waiting.appendleft(seq)
    return device_ok

