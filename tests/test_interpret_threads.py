"""The Mosaic GPU interpreter needs 4 XLA CPU pool threads (kernels_pallas/paged_attention/
interpret_threads.py): with one per CPU, the 2-core machine's interpreted three-warpgroup kernels
hung at times (two warpgroups' barrier waits held both pool threads, the third never ran)."""

import os
import pathlib

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas.paged_attention import interpret_threads


def _xla_pool_threads() -> int:
    """Threads of XLA's CPU intra-op pool in this process (Linux names them tf_XLAEigen)."""
    tasks = pathlib.Path("/proc/self/task")
    return sum((t / "comm").read_text().strip() == "tf_XLAEigen" for t in tasks.iterdir())


@pytest.mark.skipif(not pathlib.Path("/proc/self/task").exists() or jax.default_backend() != "cpu",
                    reason="counts the CPU client's pool threads through Linux's /proc")
def test_the_suite_gives_the_interpreter_enough_xla_pool_threads():
    """tests/conftest.py sets PJRT_NPROC before JAX starts; the CPU client's pool has that many."""
    jax.block_until_ready(jnp.ones((64, 64)) @ jnp.ones((64, 64)))
    assert _xla_pool_threads() >= interpret_threads.NEEDED
    assert interpret_threads.pool_threads() >= interpret_threads.NEEDED


def test_a_small_pool_is_named_in_a_warning(monkeypatch):
    monkeypatch.setenv("PJRT_NPROC", "2")
    assert interpret_threads.pool_threads() == 2
    with pytest.warns(RuntimeWarning, match="PJRT_NPROC=4"):
        interpret_threads.warn_if_pool_too_small()
    monkeypatch.setenv("PJRT_NPROC", "4")
    assert interpret_threads.pool_threads() == 4
