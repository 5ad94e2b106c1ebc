"""The one admission routine's pieces (host, plain Python): the plan every cache kind contributes
to, and filling a sequence's block table from it (CacheManager.admit runs them in order).

A plan names, per logical block of the sequence, a cached block to share or None; of the None
ones, those copied in from a lower tier (host tier, span store). Llama plans every
position-independent hit (serving/cache/prefix_keys.py); a hybrid model's recurrent part plans
the blocks below its resume point and the blocks of the spans it skips
(serving/hybrid/hybrid_prefix.py, span_cache.py). The routine is the same for both: count,
share, allocate, register, plan copy-ins, set num_cached_tokens, undo on an exception part way.
"""

from __future__ import annotations

import dataclasses
import enum
import time

import numpy as np

from serving.sequence import Status


class Refused(enum.Enum):
    """Why CacheManager.admit took nothing (falsy, as its False was)."""

    FULL = "no seat or not enough blocks"  # nothing behind it may go first (FCFS)
    # the request waits on work in flight: a span or checkpoint another request is computing, or
    # no restore row left this step. It keeps its place; a later request may go first
    WAITS = "waits on work in flight"

    def __bool__(self) -> bool:
        return False


@dataclasses.dataclass(slots=True)
class AdmissionPlan:
    blocks: list  # per logical block [0, seq.num_blocks_needed): a cached block to share, or None
    misses: list[int]  # ascending indices of the None entries (blocks allocated here)
    host: set  # of the misses, those copied in from a lower tier
    # Llama: a lower-tier block whose registration fails (its key twice in one prompt) is
    # computed instead. Hybrid (False): it is copied in all the same -- a block below the resume
    # point is never recomputed, the recurrent state resumes after it.
    host_recomputes: bool = True
    resume: int | None = None  # hybrid: token index the sequence resumes at; None: as it is
    detail: object = None  # the recurrent part's own record (CacheManager: commit / cancel)
    hits_array: object = None  # hits() as an int64 array when the planner has it, else None

    @classmethod
    def from_kinds(cls, n: int, planned: dict, resume: int, detail) -> "AdmissionPlan":
        """A hybrid plan from {block index: ("hit", block) | ("host", None)} over n blocks."""
        blocks, host = [None] * n, set()
        for j, (kind, b) in planned.items():
            if kind == "hit":
                blocks[j] = b
            else:
                host.add(j)
        misses = [j for j, b in enumerate(blocks) if b is None]
        return cls(blocks, misses, host, False, resume, detail)

    def hits(self) -> list[int]:
        """The planned blocks in block order (the entries between the misses, sliced)."""
        out, start = [], 0
        for j in self.misses:
            out += self.blocks[start:j]
            start = j + 1
        return out + self.blocks[start:]

    def blocks_needed(self, bm, hits: list[int], arr=None) -> int:
        """Free blocks the plan takes from pool `bm`: one per miss, and each hit (`hits()`; `arr`:
        them as an int64 array, or None) no one holds now."""
        return len(self.misses) + bm.num_idle(hits, arr)


def fill_table(bm, keys, seq, plan: AdmissionPlan, hits: list[int], copy_in: list,
               lookup) -> int:
    """Append `seq`'s blocks in block order: the planned hits (already shared) as they are,
    a new block at each miss -- registered ready with a copy-in queued on `copy_in` when a
    lower tier (`lookup`) holds it, else owned and registered pending. Returns the blocks
    whose KV is cached (hits and copy-ins)."""
    table, cached, hashes = seq.block_table, len(hits), keys.hashes(seq)
    strict, start = not plan.host_recomputes, 0
    for j in plan.misses:
        table.extend(plan.blocks[start:j])  # the hits before block j
        start = j + 1
        b = bm.allocate()
        table.append(b)
        h = hashes[j] if j < len(hashes) else None
        if j in plan.host and (strict or lookup.contains(h)):
            bm.register(b, h, keys.confirm(seq, j), seq.seq_id, ready=True)
            if strict or bm.hash[b] == h:
                copy_in.append((b, h))
                cached += 1
                continue
        seq.owned.add(j)
        if h is not None:
            bm.register(b, h, keys.confirm(seq, j), seq.seq_id)
    table.extend(plan.blocks[start:])
    return cached


def seed_table_array(seq, plan: AdmissionPlan, hits) -> None:
    """The block table `fill_table` just built from an empty one, as the int64 array
    Sequence.table_array keeps, made from the hits' array (`hits`) and the few blocks allocated
    at the misses: no entry converted from the list again."""
    table, n = seq.block_table, len(plan.blocks)
    if len(table) != n or n - len(plan.misses) != hits.size:
        return  # not the plan's table: Sequence.table_array converts it when asked
    tail = [table[j] for j in plan.misses]
    if not plan.misses or plan.misses[0] == hits.size:  # the misses follow every hit (a
        # cached request: its last block): no mask over the ~2,000 hits
        arr = np.concatenate([hits, np.array(tail, np.int64)])
    else:
        arr = np.empty(n, np.int64)
        is_miss = np.zeros(n, bool)
        is_miss[plan.misses] = True
        arr[~is_miss] = hits
        arr[is_miss] = tail
    arr.flags.writeable = False
    seq.memo.table_array = (table, arr)


def undo_fill(bm, seq, plan: AdmissionPlan, shared: list[int], copy_in: list) -> None:
    """An admission that raised part way (a fault in allocation): give back every block it took
    and unpublish the copy-ins it queued (their pages never arrive), so the sequence is as it was
    in the queue. Edits `copy_in` in place."""
    mine = set(seq.block_table)
    for b, h in [x for x in copy_in if x[0] in mine]:
        if bm.hash[b] == h:
            bm.unregister(b)
    copy_in[:] = [x for x in copy_in if x[0] not in mine]
    new = [b for j, b in enumerate(seq.block_table) if plan.blocks[j] is None]
    bm.release(new + shared, seq.seq_id)
    seq.block_table = []
    seq.owned = set()


def seat(seq, seats: list[int], resume: int | None) -> None:
    """Give the admitted `seq` a seat: running, its block table not yet on the device; with a
    resume point (hybrid), it computes from there (state from a checkpoint, or zero at 0)."""
    if resume is not None:
        seq.num_computed = resume
    seq.seat = seats.pop()
    seq.synced_blocks = 0  # the runner's host block-table row for this seat is stale
    seq.status = Status.RUNNING
    seq.needs_reset = resume is None or resume == 0
    seq.ready_ptr = 0
    if seq.first_scheduled_time is None:
        seq.first_scheduled_time = time.time()
    seq.ever_admitted = True
