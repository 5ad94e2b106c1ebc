"""The Mosaic prefill pre-pass's live-only gather (triton_gather.py) vs the XLA whole-table gather.

On every key step the prefill kernel may read (below each sequence row's last block in use) the
two must agree: keys rotated by position (position_free) or copied (rotated), pads and entries
past num_blocks zeroed although the pages hold NaN there. Steps past that are left unwritten (the
kernel never reads them): the test does not look at them. Interpret mode on CPU;
MINIPIC_COMPILED=1 compiles it for the GPU.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention.mosaic_prefill_prep import BLOCK_KV, gather_kv
from kernels_pallas.paged_attention.triton_gather import gather_live
from tests.test_paged_attention_mgpu_prefill import _inputs

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"

CASES = [
    # position_free, partial rotary: a row into its second key step, a dead row
    # (no blocks, as an unused prefill slot)
    pytest.param(jnp.float32, 1, 64, 32, "position_free", [(136, 4, 0), (0, 0, 0)],
                 id="f32-pf-R32"),
    # bf16, rotated mode, two kv heads, with a short row
    pytest.param(jnp.bfloat16, 2, 128, None, "rotated", [(130, 5, 0), (0, 0, 0), (3, 1, 0)],
                 id="bf16-rotated", marks=[pytest.mark.slow] if INTERPRET else []),
]


@pytest.mark.parametrize("dtype,kv_heads,head_dim,rotary,kv_mode,specs", CASES)
def test_live_gather_matches_xla_gather_where_the_kernel_reads(dtype, kv_heads, head_dim, rotary,
                                                                kv_mode, specs, fresh_rng):
    _, k, v, md, inv = _inputs(fresh_rng, dtype, kv_heads, 1, head_dim, rotary, 0.3, True, specs)
    rotate = kv_mode == "position_free"
    want_k, want_v, _ = gather_kv(k, v, md, inv, rotate_keys=rotate, attention_scaling=0.9)
    n_pad = want_k.shape[1]
    got_k, got_v = gather_live(k, v, md, inv, n_pad=n_pad, step_keys=BLOCK_KV,
                               rotate_keys=rotate, attention_scaling=0.9, interpret=INTERPRET)
    assert got_k.shape == want_k.shape and got_k.dtype == want_k.dtype
    page = k.shape[1]
    for s, nb in enumerate(np.asarray(md.num_blocks)):
        end = -(-int(nb) * page // BLOCK_KV) * BLOCK_KV  # keys of the steps the kernel may read
        for got, want in ((got_k, want_k), (got_v, want_v)):
            g = np.asarray(got[s, :end].astype(jnp.float32))
            w = np.asarray(want[s, :end].astype(jnp.float32))
            assert np.all(np.isfinite(g)), f"row {s}: a pad or unused entry was not zeroed"
            tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bf16: one rounding step apart
            np.testing.assert_allclose(g, w, atol=tol, rtol=tol, err_msg=f"sequence row {s}")


def test_keys_only_gather_skips_values(fresh_rng):
    """values=False (the kernel reads V from the pages: mosaic_prefill.prepare's direct_v): the
    same keys, no value buffer."""
    _, k, v, md, inv = _inputs(fresh_rng, jnp.float32, 1, 1, 64, None, 0.3, True,
                               [(136, 4, 0), (0, 0, 0)])
    n_pad = -(-md.block_tables.shape[1] * k.shape[1] // BLOCK_KV) * BLOCK_KV
    kw = dict(n_pad=n_pad, step_keys=BLOCK_KV, rotate_keys=True, attention_scaling=0.9,
              interpret=INTERPRET)
    want_k, _ = gather_live(k, v, md, inv, **kw)
    got_k, got_v = gather_live(k, v, md, inv, values=False, **kw)
    assert got_v is None
    end = -(-int(md.num_blocks[0]) * k.shape[1] // BLOCK_KV) * BLOCK_KV
    np.testing.assert_array_equal(np.asarray(got_k[0, :end]), np.asarray(want_k[0, :end]))


def test_direct_values_limits():
    """direct_v takes page sizes that tile a key step in 8-row boxes, and tables that fit SMEM."""
    from kernels_pallas.paged_attention.mosaic_prefill_prep import direct_v_limits
    assert direct_v_limits(16, 2112) == ""  # the engine's 33,792 positions
    assert direct_v_limits(16, 8192) == ""
    assert "page size" in direct_v_limits(4, 100)
    assert "page size" in direct_v_limits(24, 100)
    assert "exceed" in direct_v_limits(16, 8193)
