"""Why an interpreted Mosaic GPU kernel can hang on a small CPU machine, and the check for it.

The Mosaic GPU interpreter (jax/_src/pallas/mosaic_gpu/interpret) runs a CTA's warpgroups as
threads, each executing the kernel as an XLA computation whose barrier waits block inside host
callbacks (Barrier._wait: a condition variable). XLA's CPU client may continue a computation on
its thread pools ("tf_XLAEigen" threads), each sized to the schedulable CPUs unless the
PJRT_NPROC environment variable (read when JAX creates the CPU client) says otherwise. Two
warpgroups blocked in barrier waits can then hold both threads of a 2-CPU pool while the third
warpgroup, the one they wait for, waits for a thread of that pool to go on: nothing moves.
Seen on 2026-12-05 (2-core machine): the paged-keys kernel's rotating cases hung in about half
the runs; on one core (taskset) its unrotated case and mosaic_prefill's gathered path, which
pass on 2 cores, hung at times; mosaic_prefill under an outer jax.jit hung on 2 cores (the
2026-11-30 CI note). In each hang the two waiting warpgroups' callbacks sat on the two
tf_XLAEigen threads and the third had made no call at all in its CTA, though its next
operation was no wait (a TMA issue or a query load): the barrier protocols are not at fault.
With PJRT_NPROC=4 none of these hung (tests/test_paged_attention_paged_keys.py's interpreted
cases, on one core too).

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
