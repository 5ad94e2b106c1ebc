"""Why an interpreted Mosaic GPU kernel can hang on a small CPU machine, and the check for it.

The Mosaic GPU interpreter (jax/_src/pallas/mosaic_gpu/interpret) runs a CTA's warpgroups as
threads, each executing the kernel as an XLA computation whose barrier waits block inside host
callbacks (Barrier._wait: a condition variable). XLA's CPU client continues a computation on its
intra-op thread pool ("tf_XLAEigen" threads) once some of its work went there, and that pool has
one thread per schedulable CPU unless the PJRT_NPROC environment variable (read once, when JAX
creates the CPU client) says otherwise. With 2 CPUs, two warpgroups blocked in barrier waits can
hold both pool threads while the third warpgroup, the one they wait for, needs a pool thread to
go on: nothing moves. Observed (2026-12-05) on the 2-core machine with the paged-keys prefill
kernel (its rotating cases hung in some runs), and on one core with mosaic_prefill's gathered
path and the paged kernel's unrotated case, which pass on 2 cores, and on 2 cores with
mosaic_prefill under an outer jax.jit; with PJRT_NPROC=4 none hangs. The
kernels' barrier protocols are not at fault: in each hang the third warpgroup's next operation
was no wait, it never ran.

Four threads suffice: at most two warpgroups of the CTA wait while the third runs, and an
outer jit may hold one more in the interpreter's thread-map callback. tests/conftest.py sets
PJRT_NPROC; a script that interprets these kernels must set it before JAX starts.
"""

from __future__ import annotations

import os
import warnings

NEEDED = 4  # three warpgroups of a CTA and the caller


def pool_threads() -> int:
    """The XLA CPU client's intra-op pool size as the client reads it (PJRT_NPROC, NPROC, else
    the schedulable CPUs; the client takes it when JAX starts, so set it before)."""
    for name in ("PJRT_NPROC", "NPROC"):
        value = os.environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def warn_if_pool_too_small() -> None:
    """Warn (once per place) that an interpreted multi-warpgroup kernel may hang here."""
    threads = pool_threads()
    if threads < NEEDED:
        warnings.warn(
            f"the Mosaic GPU interpreter may hang with {threads} XLA CPU pool threads: set "
            f"PJRT_NPROC={NEEDED} before JAX starts (kernels_pallas/paged_attention/"
            "interpret_threads.py)", RuntimeWarning, stacklevel=3)
