"""A list's items as the bytes of their object pointers: two lists give equal bytes exactly when
they hold the same objects in the same order (identity, not equality).

Why: a cached span request's new id lists (`Span(list(doc))`, tokenizer output kept by the
caller) hold the same int objects as lists converted before (minipic_jax/segment_ids.py). List
equality cannot tell 1 from 1.0 or True, so the memo proved the types with a `sum` over every
id (~7 ns an id: ~0.23 ms of the request's 33K ids, the largest host cost left in issue 28);
the same objects as a remembered copy, whose ids were checked when it was converted, need no
check at all, and comparing pointers is a memcmp (~0.5 ns an id, ~2 us a 4K-id span).

How: CPython's PyListObject (the object header, ob_size, then `PyObject **ob_item`) is read
through ctypes, holding the GIL (ctypes.string_at and a PyDLL memcmp are Python-API calls), as
PyList_GET_ITEM does in C. The layout is probed once at import on a list of known objects; any
other interpreter or build (free-threaded, trace-refs, another implementation) gets None from
`item_bytes` (and False from `same_items`), and callers take their general path. Between the
header's read and the compare other threads may run: a list that another thread grows or
shrinks meanwhile (a race in the caller, whose request holds that list) may be compared
against its old item storage.
"""

from __future__ import annotations

import ctypes
import struct
import sys
import sysconfig

_PTR = ctypes.sizeof(ctypes.c_void_p)
_HEAD = struct.Struct(f"{'q' if _PTR == 8 else 'i'}P")  # ob_size, ob_item


def _size_offset() -> int | None:
    """Where ob_size sits in a list object (after ob_refcnt and ob_type), or None where this
    interpreter may lay lists out otherwise (checked once by `_probe`)."""
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    if hasattr(sys, "getobjects"):  # a trace-refs build: two more pointers in every header
        return None
    return 2 * _PTR


def _read(lst: list, offset: int) -> bytes:
    size, items = _HEAD.unpack(ctypes.string_at(id(lst) + offset, _HEAD.size))
    return ctypes.string_at(items, size * _PTR) if size else b""


def _probe(offset: int | None) -> int | None:
    if offset is None:
        return None
    objects = [object() for _ in range(3)]
    want = struct.pack(f"{len(objects)}P", *map(id, objects))
    return offset if _read(objects, offset) == want else None


def _memcmp():
    """libc's memcmp called holding the GIL (a PyDLL function: no other thread runs while it
    reads a list's items), or None where the process exposes none (then the items are copied
    out and compared as bytes)."""
    try:
        fn = ctypes.PyDLL(None).memcmp
    except (OSError, AttributeError, TypeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t)
    return fn


_OFFSET = _probe(_size_offset())
_MEMCMP = _memcmp() if _OFFSET is not None else None


def item_bytes(lst: list) -> bytes | None:
    """The pointers of `lst`'s items as bytes (8 per item on a 64-bit host), or None where this
    interpreter's lists are not read this way. `lst` must be a `list` exactly."""
    if _OFFSET is None or type(lst) is not list:
        return None
    return _read(lst, _OFFSET)


def same_items(lst, remembered: bytes | None) -> bool:
    """Whether `lst` is a list of exactly the objects whose pointers `remembered` holds
    (`item_bytes` of a list of them, which must be kept alive so that no other object takes
    an address), in order; compared in place, without copying `lst`'s items out."""
    if remembered is None or _OFFSET is None or type(lst) is not list:
        return False
    if _MEMCMP is None:
        return _read(lst, _OFFSET) == remembered
    size, items = _HEAD.unpack(ctypes.string_at(id(lst) + _OFFSET, _HEAD.size))
    n = len(remembered)
    return size * _PTR == n and (not n or _MEMCMP(items, remembered, n) == 0)
