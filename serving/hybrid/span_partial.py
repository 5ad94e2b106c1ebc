"""Long spans on hybrid models: a non-final SSEP span longer than one step, captured in pieces
over several steps (host bookkeeping, plain Python; docs/DESIGN.md section 5).

A span's rows read a local recurrence that starts from zero at the span start; the flow (the
sequence's own state) runs through them like through any prompt's. So a span can be chunked like
any prompt if its *local* state crosses the steps, and that state is exactly what the span's map
holds: B (the state the span leaves from zero), the conv tail, and A. A long span therefore holds
one slot of the span-map pool from its first piece to its last:

  * its first piece is captured into the slot (A1, B1, tail1, count1), like a span computed whole;
  * each later piece enters with the map so far (SpanPieces.entry: the local pass starts from B,
    the conv window reads the tail, the captured transition starts from A) and writes the
    composed map back: A = A_k A_so_far, B and the tail run on, counts add
    (M_total = M_k o ... o M_1);
  * after the last piece's step the slot holds the whole span's map, stored under the span's key
    like any captured map, and reused at any offset (serving/hybrid/span_cache.py).

While pieces are missing the entry stays unwritten (`get` misses it) and pinned (never evicted);
a request that wants the span waits for its blocks (span_cache: the owner publishes them) and
then skips it. A chunk ends inside a long span only when the step has a capture left and, for a
first piece, a slot can be had; otherwise it ends before the span and waits (`SpanMapCache.cut`).

Preemption (or abort) of a sequence part way through a long span: its KV blocks are dropped and
it recomputes from a checkpoint that lies before the span (checkpoints are never inside spans),
so the half-captured map is useless: it is discarded (`discard`) and the slot freed; the span is
captured again from its start on the next admission. Nothing finished is lost: a map stored
complete stays. A span whose key is taken (stored already, or this sequence's blocks are not the
ones the table publishes) is still carried through a slot under a private key and dropped after
its last piece: its rows need the local state whatever becomes of the map.
"""

from __future__ import annotations

import dataclasses
import itertools

_tags = itertools.count()


@dataclasses.dataclass(eq=False)
class Partial:
    entry: object  # the checkpoint-store Entry of the slot
    tag: tuple  # a private dependency naming this capture alone (store.drop_dependent drops it)
    private: bool  # held under a private key: dropped once complete, never published


def begin(store, key, confirm: bytes, deps, value: float) -> Partial | None:
    """A slot for a long span's map, held until its last piece (`key` None: a private key).
    None when no slot can be had."""
    tag = ("long-span", next(_tags))
    private = key is None
    slot = store.reserve(tag if private else key, confirm, 0, tuple(deps) + (tag,), value)
    if slot < 0:
        return None
    e = store.device[tag if private else key]
    e.pins += 1  # the hold: the store's launch pin goes after this step, the hold after the last
    return Partial(e, tag, private)


def live(store, p: Partial) -> bool:
    """The slot is still this capture's (a fault may have cleared the store)."""
    return store.device.get(p.entry.key) is p.entry


def finish(store, p: Partial) -> None:
    """The step being scheduled computes the span's last piece: like a reserved entry, the
    slot is written by that step (the store marks it written after the launch, or drops it if
    the step is abandoned) and the hold goes with the launch."""
    store.writing.append(p.entry)
    store.launch_pins.append(p.entry)


def after_launch(store, held, done, doomed) -> None:
    """After a step's launch (and the store's after_launch, which marks the entries of `reserve`
    and `finish` written and releases launch pins): entries still missing pieces stay
    unwritten; private ones completed are dropped, and so are discarded ones a launch pin kept."""
    for p in held:
        if live(store, p):
            p.entry.written = False
    for p in [p for p in done if p.private] + doomed:
        if live(store, p):
            store.drop_dependent(p.tag)


def discard(store, p: Partial) -> bool:
    """Free a half-captured span's slot (its sequence left); a no-op after a fault cleared it.
    False when a launch pin still holds it: drop it after that launch (`after_launch`)."""
    if not live(store, p):
        return True
    store.release(p.entry)
    p.entry.written = False
    if p.entry.pins:
        return False
    store.drop_dependent(p.tag)
    return True


def slot_available(store) -> bool:
    """Whether `store.reserve` could find a slot now (a free one, or an unpinned entry)."""
    return bool(store.free_slots) or any(e.pins == 0 for e in store.device.values())
