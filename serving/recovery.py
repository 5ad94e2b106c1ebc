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
    device_ok = _read_back_inflight(engine)
    request_ids = set(request_ids)
    for rid in request_ids:
        engine.abort_request(rid)
    engine.discard_results(request_ids)
    sched.forget_early_read()
    for job in list(sched.span_jobs):
        sched.preempt(job)
    for seq in reversed(list(sched.running)):  # the oldest ends up first in the queue
        sched.preempt(seq)
    # copy-ins and checkpoints the failed step planned never ran; without device_ok no cached
    # page can be trusted (CacheManager.abandon_step)
    engine.cache.abandon_step(device_ok)


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

