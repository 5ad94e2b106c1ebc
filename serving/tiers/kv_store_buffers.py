"""Host buffers that span-store reads land in, and their transfer to the device.

A run read is the kernel's copy out of the page cache into a host buffer, a checksum pass, and a
transfer. From ordinary (pageable) memory the runtime first copies the bytes into a pinned
staging buffer of its own and then DMAs them: a second copy of every byte on the host. So the
buffers are *pinned* host arrays (JAX memory kind "pinned_host"), filled through a numpy view of
their memory: the transfer is then one DMA. Backends without pinned host memory, or where a
self-test fails (the bytes written through the view must reach the device, and a later write to
the buffer must not change what was sent), get plain numpy buffers. Either kind is reused once
its data is on the device (no fresh pages to fault in, pin or, on a VM, be granted).

Pinned buffers are opt-in (`Config.kv_store.pinned`, flat `kv_store_pinned`): alone on the
H200 (the file-layer bench) read + send from pinned buffers was faster than from plain ones, but
inside an engine process the H200 refused the allocations (`benchmarks/history/span_store.md`,
the failed warm phases), so plain buffers stay the default until that is understood.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import threading

import jax
import numpy as np


def _owner(a: np.ndarray):
    """The pinned JAX array under a numpy view made by `_pinned_view`, or None."""
    b = a
    while b is not None:
        owner = getattr(b, "minipic_owner", None)
        if owner is not None:
            return owner
        b = getattr(b, "base", None)
    return None


def _pinned_view(shape, dtype, sharding) -> np.ndarray:
    """A numpy array over the memory of a fresh pinned host JAX array (which the view keeps
    alive)."""
    dtype = np.dtype(dtype)
    arr = jax.device_put(np.zeros(shape, dtype), sharding)
    arr.block_until_ready()
    mem = (ctypes.c_uint8 * arr.nbytes).from_address(arr.unsafe_buffer_pointer())
    mem.minipic_owner = arr
    return np.frombuffer(mem, np.uint8).view(dtype).reshape(shape)


@functools.cache
def pinned_shardings():
    """(pinned host, device) shardings of the default device when pinned buffers work here,
    else None (checked once per process)."""
    try:
        dev = jax.local_devices()[0]  # where a plain device_put lands
        pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
        a = _pinned_view((3, 256), np.uint16, pinned)
        want = np.arange(a.size, dtype=np.uint16).reshape(a.shape)
        a[:] = want
        sent = jax.device_put(_owner(a), on_dev)
        sent.block_until_ready()
        a[:] = 0
        ok = np.array_equal(np.asarray(sent), want) and \
            sent.unsafe_buffer_pointer() != _owner(a).unsafe_buffer_pointer()
    except Exception:  # no pinned memory kind, no buffer pointer: plain buffers
        return None
    return (pinned, on_dev) if ok else None


class RunBuffers:
    """A pool of host arrays for run reads (`take`), sent to the device by `send`, which returns
    the buffer to the pool once the transfer is done. Thread-safe."""

    def __init__(self, per_shape: int, cap_bytes: int = 4 << 30, pinned: bool = False, *,
                 required: bool = True):
        """pinned: pinned host buffers where the backend has them; where it has not, a
        ValueError when `required`, else plain buffers (`self.pinned` says which)."""
        self.per_shape = per_shape
        self.cap_bytes = cap_bytes  # pooled bytes kept (pinned memory is locked RAM)
        self.shardings = pinned_shardings() if pinned else None
        if pinned and required and self.shardings is None:
            raise ValueError("pinned host buffers are not available on this backend")
        self.free: dict[tuple, list] = collections.defaultdict(list)
        self.pooled = 0
        self.lock = threading.Lock()

    @property
    def pinned(self) -> bool:
        return self.shardings is not None

    def take(self, shape, dtype) -> np.ndarray:
        key = (tuple(shape), np.dtype(dtype))
        with self.lock:
            stack = self.free.get(key)
            if stack:
                a = stack.pop()
                self.pooled -= a.nbytes
                return a
        if self.shardings is not None:
            try:
                return _pinned_view(shape, dtype, self.shardings[0])
            except Exception:  # pinned memory exhausted: a plain buffer this time
                pass
        return np.empty(shape, dtype)

    def give(self, a: np.ndarray) -> None:
        with self.lock:
            stack = self.free[(a.shape, a.dtype)]
            if len(stack) < self.per_shape and self.pooled + a.nbytes <= self.cap_bytes:
                stack.append(a)
                self.pooled += a.nbytes

    def send(self, a: np.ndarray):
        """`a` on the device (waits for the transfer). The buffer goes back to the pool unless
        the device array aliases it (a CPU backend may not copy); returns (device array,
        whether `a` is still needed as its storage)."""
        owner, dev = _owner(a), None
        if owner is not None:
            try:
                dev = jax.device_put(owner, self.shardings[1])
                dev.block_until_ready()
            except Exception:  # the runtime refused this one: a plain transfer of the view
                dev = None
        if dev is None:
            dev = jax.device_put(a)
            dev.block_until_ready()
        if dev.unsafe_buffer_pointer() == a.ctypes.data:
            return dev, True
        self.give(a)
        return dev, False
