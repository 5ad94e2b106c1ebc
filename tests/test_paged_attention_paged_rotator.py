"""The paged-keys kernel with a fourth, rotating warpgroup (PagedOptions.rotator) vs the numpy
reference: a ring refill (3 key steps in one range) and one-step splits, page starts at an
offset of 37 (no multiple of 8). One batch holds both (the long sequence's 5 key steps split
3 + 2, the short one's single step in one split): an interpreted call costs ~9 s whatever its
size, most of it tracing the four warpgroups (CI time).

Interpreted, four warpgroups are four threads whose barrier waits block XLA CPU pool threads:
three may wait while the fourth runs, and the caller holds one more, so the suite's 4 pool
threads (tests/conftest.py, interpret_threads.py) may not do; the check then runs in a child
process with PJRT_NPROC=6. Compiled (MINIPIC_COMPILED=1) it runs here.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from kernels_pallas.paged_attention.mosaic_prefill_paged import PagedOptions

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check_rotator(seed: int) -> None:
    """One batch through the rotating warpgroup against the reference: 605 keys (5 steps of
    128, split [0, 3) + [3, 5): the ring refilled within a range) beside 105 (one step, one
    split used of two)."""
    from tests.test_paged_attention_mixed import _check
    from tests.test_paged_attention_paged_keys import _run
    rng = np.random.default_rng(seed)
    options = PagedOptions(max_position=1024 + 37, rotator=(208, 24, 72))
    out, q, k, v, md, inv = _run(rng, [(600, 5, 0), (100, 5, 0)], splits=2, shift=37,
                                 options=options)
    _check(out, q, k, v, md, inv, "position_free")


@pytest.mark.slow  # paged_k (and its rotator) is off, 1.41x slower on an H100: CI time
def test_rotating_warpgroup_matches_reference(fresh_rng):
    seed = int(fresh_rng.integers(1 << 31))
    if not INTERPRET:
        check_rotator(seed)
        return
    env = dict(os.environ, PJRT_NPROC="6", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([_ROOT, os.path.join(_ROOT, "tests")]))
    code = f"from tests.test_paged_attention_paged_rotator import check_rotator; check_rotator({seed})"
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=_ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_rotator_options_name_what_is_wrong():
    with pytest.raises(ValueError, match='cos_sin must be "keys"'):
        PagedOptions(cos_sin="pages", rotator=(208, 24, 72))
    with pytest.raises(ValueError, match="exceed 512"):
        PagedOptions(rotator=(232, 40, 72))
    with pytest.raises(ValueError, match="multiples of 8"):
        PagedOptions(rotator=(208, 20, 72))
