"""A segment's token ids -> (Python ints, the same as an int64 array), by whole-list passes in C,
and remembered per list object so that the same list given again costs one comparison.

A cached span request converts its 8 x 4K span ids inside its time to first token (issue 28): a
check per token in Python cost ~20 ms; one C pass over 33K ids (array("q"), which takes ints and
numpy ints and refuses anything else) costs ~0.5 ms, and the list of Python ints made from it as
much again. A job that reuses its documents' id lists passes the same list objects call after
call: `SegmentMemo` keeps a copy of each list it converted and, when the same object comes back,
compares it with that copy (list equality: one pointer compare per entry while the entries are
the objects it held, ~20 us for 33K ids) and reuses the conversion when nothing changed.

An entry changed after its first call to an equal value of another type (1 -> True or 1.0) still
compares equal and is taken as the int it equals; any other change is converted (and checked)
again.

A caller that builds a new list (or tuple) for each request from ids it keeps (`Span(list(doc))`,
as benchmarks/rag_ttft.py does) gives an equal list of the same int objects: it is found by its
length and a few sampled ids and taken when its items are the very objects of the remembered
copy (their pointers compared in place: minipic_jax/list_items.py, ~2 us a 4K-id span).
Otherwise (other int objects of equal values, or an interpreter whose lists are not read that
way) it is compared with the remembered copy (list equality) and taken when it holds Python ints
only (`sum` stays an int: no float, numpy scalar or other type that compares equal to an int)
and no bool where the remembered ids are 0 or 1 (the only values a bool equals). Converting
each new list again, and the page faults of the remembered copies churning, were most of a
cached-span request's prompt time on that path (benchmarks/RESULTS.md, "RAG headline").
"""

from __future__ import annotations

import array
import collections
import numbers
import operator
import threading

import numpy as np

from minipic_jax.list_items import item_bytes, same_items

MIN_MEMO_IDS = 256  # shorter segments are converted every time (cheaper than remembering them)
MEMO_IDS = 1 << 19  # ids remembered in all (each ~60 bytes: its int, the copies, the array)


def is_token(t) -> bool:
    """An int or numpy int, not a bool (an int subclass, but never a token id)."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _is_array(x) -> bool:
    return hasattr(x, "__array__") and hasattr(x, "ndim") and not isinstance(x, (str, bytes))


def convert(content, what: str) -> tuple[list[int], np.ndarray | None]:
    """Token ids (a list, tuple or 1-D integer array) -> (a new list of Python ints, the same
    as int64; None where an id does not fit int64, for the request checks to name). A TypeError
    naming the first entry that is no int ("`what` token ids must be ints; index k is ...")."""
    if _is_array(content) and content.ndim == 1 and content.dtype.kind in "iu":
        arr = np.asarray(content)
        if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            return arr.tolist(), None
        arr = arr.astype(np.int64)
        return arr.tolist(), arr
    if type(content) in (list, tuple) and len(content) < MIN_MEMO_IDS and \
            set(map(type, content)) <= {int}:
        # a short list of Python ints (a prompt's question): one type pass, ~3 us instead of
        # the C passes below (~7 us: their fixed costs outweigh the ids)
        try:
            return list(content), np.array(content, np.int64)
        except OverflowError:  # an id beyond int64: below, which leaves it to the checks
            pass
    try:  # ints and numpy ints (array("q") takes their __index__); bools checked below
        arr = np.frombuffer(array.array("q", content), np.int64)
    except (TypeError, OverflowError):
        arr = None
    if arr is not None:
        for k in np.flatnonzero((arr >> 1) == 0):  # 0 or 1: only those can be bools
            if isinstance(content[k], bool):
                _refuse(what, k, content[k])
        return (list(content) if _python_ints(content) else arr.tolist()), arr
    ids = list(content)
    for k, t in enumerate(ids):
        if not is_token(t):
            _refuse(what, k, t)
    return [int(t) for t in ids], None  # ints beyond int64: the request checks name them


def _python_ints(content, sum_fits: bool = False) -> bool:
    """Whether the entries (ints or numpy ints, bools refused already) are all Python ints,
    which a list of them can keep: their sum stays a Python int only then (a numpy int makes it
    a numpy scalar). sum() adds machine-size ints in C: half the cost of new int objects.
    `sum_fits`: the ids are known to be such that no partial sum leaves int64 (`_sum_fits`), so
    numpy ints among them cannot wrap and numpy's error state is left as it is (entering it
    costs more than the sum of a short segment)."""
    try:
        if sum_fits:
            return type(sum(content)) is int
        with np.errstate(over="ignore"):  # numpy ints may wrap while summed: only the type counts
            return type(sum(content)) is int
    except (TypeError, ValueError, OverflowError):
        return False


def _sum_fits(arr: np.ndarray) -> bool:
    """No partial sum of these int64 ids, in any order, leaves int64."""
    if not arr.size:
        return True
    return arr.size * max(abs(int(arr.min())), abs(int(arr.max()))) < 2 ** 63


def _refuse(what: str, k: int, t) -> None:
    raise TypeError(f"{what} token ids must be ints; index {k} is {t!r} ({type(t).__name__})")


class SegmentMemo:
    """`convert` remembered per list, tuple or numpy array object (least recently used first
    out beyond MEMO_IDS ids). Thread-safe; a hit hands out the remembered list and array, which
    callers copy (build_prompt concatenates them) and never change."""

    def __init__(self, max_ids: int = MEMO_IDS):
        self.max_ids = max_ids
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._num_ids = 0
        self._by_content: dict = {}  # _content_key -> the key of the entry that has it
        self._lock = threading.Lock()
        self.hits = 0

    def convert(self, content, what: str) -> tuple[list[int], np.ndarray | None]:
        """`convert(content, what)`, reused while `content` is the object converted before and
        holds the same ids, or a list / tuple equal to one converted before holding Python ints
        (see the module doc)."""
        snap = _snapshot_kind(content)
        if snap is None or len(content) < MIN_MEMO_IDS:
            return convert(content, what)
        key, ckey = id(content), _content_key(content)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] is not content:
                entry = self._entries.get(self._by_content.get(ckey))
                same_object = False
            else:
                same_object = True
            if entry is not None:
                self._entries.move_to_end(id(entry[0]))
        # the very objects remembered (ids checked when converted) need no further check
        if entry is not None and (same_items(content, entry[7]) or (
                _unchanged(entry[1], content) and (
                    same_object or _python_ints_as_remembered(content, entry[5], entry[6])))):
            self.hits += 1
            return entry[2], entry[3]
        ids, arr = convert(content, what)
        if arr is not None:
            copy = snap(content)  # holds the objects: their pointers (item_bytes) stay theirs
            self._keep(key, (content, copy, ids, arr, ckey,
                             np.flatnonzero((arr >> 1) == 0).tolist(), _sum_fits(arr),
                             item_bytes(copy) if type(copy) is list else None))
        return ids, arr

    def _keep(self, key: int, entry: tuple) -> None:
        with self._lock:
            self._drop(self._entries.pop(key, None))
            self._entries[key] = entry  # holds `content`: its id is not reused meanwhile
            self._num_ids += len(entry[2])
            if entry[4] is not None:
                self._by_content[entry[4]] = key
            while self._num_ids > self.max_ids and len(self._entries) > 1:
                self._drop(self._entries.popitem(last=False)[1])

    def _drop(self, entry) -> None:
        if entry is None:
            return
        self._num_ids -= len(entry[2])
        if entry[4] is not None and self._by_content.get(entry[4]) == id(entry[0]):
            del self._by_content[entry[4]]


def _snapshot_kind(content):
    """How to copy `content` for a later comparison; None: not remembered (text, other
    iterables, arrays of other libraries)."""
    if type(content) is list:
        return list  # a shallow copy: the same int objects, compared by pointer first
    if type(content) is tuple:
        return lambda c: c  # immutable
    if type(content) is np.ndarray and content.ndim == 1:
        return np.copy
    return None


def _content_key(content):
    """A list's or tuple's length and a few of its ids (None for an ndarray, or where an entry
    cannot be hashed): finds an equal one converted before; equality is checked after."""
    if type(content) is np.ndarray:
        return None
    n = len(content)
    key = (type(content), n) + operator.itemgetter(0, 1, n // 3, n // 2, 2 * n // 3, -1)(content)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _python_ints_as_remembered(content, zero_one: list[int], sum_fits: bool) -> bool:
    """Whether `content`, equal to remembered ids, holds what its conversion would give: Python
    ints only (see _python_ints; a float, numpy scalar or Decimal makes the sum another type)
    and no bool, which can only sit where the remembered ids are 0 or 1 (`zero_one`)."""
    if not _python_ints(content, sum_fits):
        return False
    return not any(type(content[k]) is bool for k in zero_one)


def _unchanged(snapshot, content) -> bool:
    if type(content) is np.ndarray:
        return snapshot.dtype == content.dtype and np.array_equal(snapshot, content)
    try:  # an entry whose comparison raises (an array in a list) is converted, which names it
        return snapshot is content or bool(snapshot == content)
    except (TypeError, ValueError):
        return False
