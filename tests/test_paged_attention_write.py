"""write_kv: the Pallas row copy (interpret mode on CPU) against a numpy oracle and the XLA scatter.

Oracle: a numpy loop that copies each row with slot >= 0 into a flat copy of the pages. Fresh
random slots (distinct, some -1), random pages and rows, bf16 and fp32, odd K * D widths.
On a GPU, `JAX_PLATFORMS=cuda MINIPIC_COMPILED=1 pytest tests/test_paged_attention_write.py`
runs the same cases compiled (Triton).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention.api import write_kv

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"


def _case(rng, pages, page_size, kv_heads, head_dim, tokens, dtype, drop_frac=0.25):
    shape = (pages, page_size, kv_heads, head_dim)
    kp = rng.normal(size=shape).astype(np.float32)
    vp = rng.normal(size=shape).astype(np.float32)
    k = rng.normal(size=(tokens, kv_heads, head_dim)).astype(np.float32)
    v = rng.normal(size=(tokens, kv_heads, head_dim)).astype(np.float32)
    slots = rng.choice(pages * page_size, size=tokens, replace=False).astype(np.int32)
    slots[rng.random(tokens) < drop_frac] = -1
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (cast(kp), cast(vp), cast(k), cast(v), jnp.asarray(slots)), slots


def _oracle(kp, vp, k, v, slots):
    kp, vp = (np.asarray(x, np.float32).copy() for x in (kp, vp))
    flat_k = kp.reshape(-1, *kp.shape[2:])
    flat_v = vp.reshape(-1, *vp.shape[2:])
    for t, s in enumerate(slots):
        if s >= 0:
            flat_k[s] = np.asarray(k[t], np.float32)
            flat_v[s] = np.asarray(v[t], np.float32)
    return kp, vp


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dims,tokens,rows", [((9, 4, 2, 16), 13, None), ((5, 8, 3, 8), 17, 2),
                                              ((6, 4, 1, 32), 1, 1)])
def test_triton_write_matches_oracle_and_xla(dtype, dims, tokens, rows, fresh_rng):
    rng = fresh_rng
    args, slots = _case(rng, *dims, tokens, dtype)
    want_k, want_v = _oracle(*args[:4], slots)
    if rows is None:
        got_k, got_v = jax.jit(write_kv, static_argnames=("implementation",))(
            *args, implementation="triton")
    else:
        from kernels_pallas.paged_attention.triton_write import write_kv_triton
        got_k, got_v = write_kv_triton(*args, rows=rows, interpret=INTERPRET)
    xla_k, xla_v = write_kv(*args, implementation="xla")
    for got, xla, want in ((got_k, xla_k, want_k), (got_v, xla_v, want_v)):
        assert got.dtype == dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)  # a copy: exact
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(xla, np.float32))


def test_triton_write_all_dropped_leaves_pages(fresh_rng):
    rng = fresh_rng
    args, _ = _case(rng, 4, 4, 2, 16, 6, jnp.float32, drop_frac=1.1)
    kp, vp = write_kv(*args, implementation="triton")
    np.testing.assert_array_equal(np.asarray(kp), np.asarray(args[0]))
    np.testing.assert_array_equal(np.asarray(vp), np.asarray(args[1]))


def test_write_kv_bad_input():
    rng = np.random.default_rng(0)
    args, _ = _case(rng, 4, 4, 2, 16, 6, jnp.float32)
    with pytest.raises(ValueError, match="unknown implementation"):
        write_kv(*args, implementation="cuda")
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(*args[:4], args[4][:3])
    with pytest.raises(ValueError, match="do not match pages"):
        write_kv(args[0], args[1], args[2][:, :1], args[3][:, :1], args[4])


@pytest.mark.parametrize("rows", [2, 4])
def test_triton_write_dropped_rows_next_to_slot_zero(rows, fresh_rng):
    """Dropped rows share a program with a real write to slot 0 (masked lanes must not undo it)."""
    args, _ = _case(fresh_rng, 4, 4, 2, 16, 8, jnp.float32)
    slots = np.array([-1, 0, -1, 5, 9, -1, -1, 3], np.int32)
    args = (*args[:4], jnp.asarray(slots))
    from kernels_pallas.paged_attention.triton_write import write_kv_triton
    got_k, got_v = write_kv_triton(*args, rows=rows, interpret=INTERPRET)
    want_k, want_v = _oracle(*args[:4], slots)
    np.testing.assert_array_equal(np.asarray(got_k), want_k)
    np.testing.assert_array_equal(np.asarray(got_v), want_v)
