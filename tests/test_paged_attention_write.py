"""write_kv: the Pallas row copy (interpret mode on CPU) against a numpy oracle and the XLA scatter.

Oracle: a numpy loop that copies each row with slot >= 0 into a flat copy of the pages. Fresh
random slots (distinct, some -1), random pages and rows, bf16 and fp32, odd K * D widths.
On a GPU, `JAX_PLATFORMS=cuda MINIPIC_COMPILED=1 pytest tests/test_paged_attention_write.py`
runs the same cases compiled (Triton).
"""

import dataclasses
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


# --- write_kv_and_attend: the layer's cache step (write, then attend) ---

from kernels_pallas.paged_attention.api import write_kv_and_attend  # noqa: E402
from kernels_pallas.paged_attention.random_inputs import inv_freq_for, random_batch  # noqa: E402
from kernels_pallas.paged_attention.reference import paged_attention_reference  # noqa: E402


def _own_slots(md, page_size):
    """slot_mapping of a decode batch: each query's own key (at its position)."""
    cu, nb = np.asarray(md.cu_q_lens), np.asarray(md.num_blocks)
    tables, starts, n_valid = (np.asarray(x) for x in (md.block_tables, md.block_pos_start,
                                                        md.block_num_valid))
    slots = np.full(md.num_tokens, -1, np.int32)
    for s in np.flatnonzero(np.diff(cu) > 0):
        t, p = int(cu[s]), int(md.q_positions[int(cu[s])])
        b = [e for e in range(nb[s]) if starts[s, e] <= p < starts[s, e] + n_valid[s, e]][0]
        slots[t] = tables[s, b] * page_size + p - starts[s, b]
    return slots


def test_write_then_attend_sees_the_new_rows(fresh_rng):
    """The slots being written hold NaN before the step: the attention must read the new rows."""
    page_size, kv_heads, group, head_dim = 8, 2, 3, 16
    md, num_pages, tokens = random_batch(fresh_rng, [(13, 1, 0), (30, 1, 9), (0, 1, 0)],
                                         page_size=page_size, pad_prob=0.4, pad_tokens=2)
    slots = _own_slots(md, page_size)
    md = dataclasses.replace(md, slot_mapping=jnp.asarray(slots))
    shape = (num_pages, page_size, kv_heads, head_dim)
    kp, vp = (fresh_rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    for x in (kp, vp):
        x.reshape(-1, kv_heads, head_dim)[slots[slots >= 0]] = np.nan
    q = jnp.asarray(fresh_rng.standard_normal((tokens, kv_heads * group, head_dim)), jnp.float32)
    k, v = (jnp.asarray(fresh_rng.standard_normal((tokens, kv_heads, head_dim)), jnp.float32)
            for _ in range(2))
    inv = jnp.asarray(inv_freq_for(head_dim))
    # under jit, as a layer calls it: one compile, not one per eager op (CI time)
    out, kp_w, vp_w = jax.jit(lambda *a: write_kv_and_attend(
        *a, inv, write_impl="xla", implementation="xla"))(q, k, v, jnp.asarray(kp),
                                                          jnp.asarray(vp), md)
    want_k, want_v = _oracle(kp, vp, k, v, slots)
    np.testing.assert_array_equal(np.asarray(kp_w), want_k)
    np.testing.assert_array_equal(np.asarray(vp_w), want_v)
    ref = paged_attention_reference(q, want_k, want_v, md, inv)
    n = int(md.cu_q_lens[-1])
    got = np.asarray(out, np.float64)[:n]
    assert np.linalg.norm(got - ref[:n]) / np.linalg.norm(ref[:n]) < 1e-5
