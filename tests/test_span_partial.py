"""The slot a long span holds while it is captured in pieces (serving/hybrid/span_partial.py):
unwritten and pinned until its last piece's step is launched, then an ordinary stored map; freed
when its sequence leaves part way, also when a launch pin still holds it or a fault abandoned the
step; a private one (key taken) never stored. Plain host bookkeeping over a CheckpointStore."""

from serving.hybrid import span_partial
from serving.hybrid.checkpoint_store import CheckpointStore


def _launch(store, held, done=(), doomed=()):
    store.after_launch()
    span_partial.after_launch(store, held, list(done), list(doomed))


def test_a_long_span_slot_is_unwritten_until_its_last_piece_then_stored():
    store = CheckpointStore(2, 0, 100)
    p = span_partial.begin(store, 7, b"c", (1, 2, 3), 48.0)
    held = [p]
    for _ in range(3):  # first piece, then two more
        _launch(store, held)
        assert store.get(7, b"c") is None and p.entry.pins == 1  # held, never evicted
        assert span_partial.slot_available(store)  # the other slot
    held.remove(p)
    span_partial.finish(store, p)
    _launch(store, held, done=[p])
    assert store.get(7, b"c") is p.entry and p.entry.pins == 0
    store.drop_dependent(2)  # a block of the span goes for good: so does the map
    assert store.get(7, b"c") is None and len(store.free_slots) == 2


def test_a_sequence_leaving_part_way_frees_the_slot():
    store = CheckpointStore(1, 0, 100)
    p = span_partial.begin(store, 7, b"c", (1, 2), 32.0)
    _launch(store, [p])
    assert not span_partial.slot_available(store)
    assert span_partial.discard(store, p)
    assert not store.contains(7) and store.free_slots == [0]
    # left in the schedule that reserved it: its launch pin holds it until that launch
    q = span_partial.begin(store, 8, b"d", (4,), 16.0)
    assert not span_partial.discard(store, q)
    _launch(store, [], doomed=[q])
    assert not store.contains(8) and span_partial.slot_available(store)


def test_an_abandoned_last_piece_leaves_no_map():
    store = CheckpointStore(2, 0, 100)
    p = span_partial.begin(store, 7, b"c", (1,), 32.0)
    _launch(store, [p])
    span_partial.finish(store, p)
    store.abandon_launch()  # the step with the last piece never ran
    assert not store.contains(7)
    _launch(store, [], done=[p])  # the next launch must not bring it back
    assert store.get(7, b"c") is None and span_partial.discard(store, p)  # a no-op now


def test_a_private_slot_is_dropped_once_complete():
    store = CheckpointStore(1, 0, 100)
    p = span_partial.begin(store, None, b"", (), 32.0)
    assert p.private
    _launch(store, [p])
    span_partial.finish(store, p)
    _launch(store, [], done=[p])
    assert not store.device and span_partial.slot_available(store)
