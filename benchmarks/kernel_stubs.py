"""Opaque stand-ins for Pallas kernels in CPU-compiled bench programs (interpret mode would
inline a kernel's body into the CPU program and its loops would count as XLA's work): what is
left in the compiled program is what XLA runs around the kernels. The GDN pipeline's own stubs
(which also record its work) live with their benches (span_step_work, span_step_ops)."""

from __future__ import annotations

import jax
import numpy as np


def stub_pack() -> None:
    """kernels_pallas.gated_delta.stream_pack.pack (the packed stream's gather, the default
    since session 34) as one host callback of the same shapes, its operands read (so XLA keeps
    what fills them). Its own bytes (the used chunks' rows) are in no XLA count."""
    from kernels_pallas.gated_delta import stream_pack

    def pack(xs, src, n_used, *, chunk, **_):
        shapes = tuple(jax.ShapeDtypeStruct((src.shape[0],) + x.shape[1:], x.dtype) for x in xs)
        host = lambda *_: tuple(np.zeros(s.shape, s.dtype) for s in shapes)  # noqa: E731
        return list(jax.pure_callback(host, shapes, *xs, src, n_used))
    stream_pack.pack = pack
