"""How the gated delta Mosaic GPU kernels (intra_mosaic.py, output_mosaic.py) are called: one
kernel per shape in a jitted program, named for profiles, run only over the chunks in use."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def one_kernel_per_shape(*static_argnames):
    """jax.jit (these arguments static) for a function that calls a Mosaic GPU kernel. Inside
    an outer jit, every call of one shape (the GDN layers of an engine step) then lowers to one
    function holding one kernel, called once per layer. Called bare, each call lowers a module
    of its own that Mosaic GPU stamps with a fresh name (mosaic_gpu.dump_basename =
    "body_<counter>"), so its kernel hash differs and the GPU compiles the same kernel again:
    Qwen3.5-0.8B's 2048-token step held 36 distinct kernels (18 layers x 2) and took ~20 s more
    host lowering, before the GPU compiled each (tests/test_engine_gdn_kernel.py counts them).
    Separate step variants (jit programs) still compile their own copies. Interpreted (the
    keyword `interpret` true) the function runs as it is: the interpreter's callbacks dispatch
    jax ops themselves, and a jit dispatched eagerly around them deadlocked the CPU client
    against the caller's next op (a ragged prefill after another, in one test process)."""
    def wrap(fn):
        jitted = jax.jit(fn, static_argnames=static_argnames)

        @functools.wraps(fn)
        def call(*args, interpret, **kwargs):
            return (fn if interpret else jitted)(*args, interpret=interpret, **kwargs)
        return call
    return wrap


def named(fn, name: str):
    """fn under `name`, the kernel's name in a profile (Mosaic GPU names a kernel after its
    body function: benchmarks/gdn_bench.py --profile sorts kernels into parts by name)."""
    def kernel(*refs):
        fn(*refs)
    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def chunks_below(kernel, n_in: int, used, n_chunks: int):
    """`kernel(*in_refs, *out_refs, *scratch)` of a grid (N, NT, H) named ("n", "c", "h"), run
    only for chunks below `used` (an int32 scalar; None: every chunk, the kernel unchanged):
    dots.chunks_below for the Mosaic kernels (a packed stream sized for the worst case costs its
    used chunks only; the others' outputs are left unwritten, never read). Returns (kernel,
    extra inputs): the count travels as one more input, [1] int32, after the n_in others.
    A (count, live) pair (dots.chunks_below's) runs the chunks below count: the ones live marks
    0 are computed and never read."""
    if used is None:
        return kernel, ()
    if isinstance(used, tuple):
        used = used[0]

    def body(*refs):
        @pl.when(lax.axis_index("c") < refs[n_in][0])
        def _():
            kernel(*refs[:n_in], *refs[n_in + 1:])
    return body, (jnp.reshape(jnp.minimum(used, n_chunks), (1,)).astype(jnp.int32),)
