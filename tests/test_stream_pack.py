"""The packed stream gathered by a kernel that writes only the used chunks (stream_pack.py,
`PACK_KERNEL`): take_rows' values in every used chunk; and the ragged GDN kernels downstream give
the same outputs, finals, checkpoints, local finals and transitions bit for bit as with XLA's
gather, on a ragged batch and on span steps' joint streams. The chunks past n_used stay
unwritten (the interpreter leaves them NaN), so a kernel that read one would show. Interpret
mode on CPU; `MINIPIC_COMPILED=1` compiles the kernels on a GPU (the same bits there too: the
kernels see the same used chunks)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_span_joint_layer
from kernels_pallas.gated_delta import stream_pack
from kernels_pallas.gated_delta.ragged import take_rows
from test_stream_rows import (JOINT_OUTPUTS, RAGGED_OUTPUTS, both_forms, joint_case,
                              ragged_case)

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"


@pytest.mark.parametrize("n_used", [0, 5, 9])
def test_pack_is_take_rows_in_the_used_chunks(fresh_rng, n_used):
    t, chunk, n_chunks = 50, 16, 7
    xs = [jnp.asarray(fresh_rng.standard_normal((t, 4, 32)), jnp.bfloat16),
          jnp.asarray(fresh_rng.standard_normal((t, 2, 32)), jnp.float32),
          jnp.asarray(fresh_rng.standard_normal((t, 4)), jnp.float32)]
    src = fresh_rng.integers(0, t + 20, n_chunks * chunk).astype(np.int32)  # >= t: zeros
    got = jax.jit(lambda *a: stream_pack.pack(a[:3], a[3], a[4], chunk=chunk, block_f=64,
                                              interpret=INTERPRET))(*xs, src, jnp.int32(n_used))
    used = min(n_used, n_chunks) * chunk
    for x, g in zip(xs, got):
        want = np.asarray(take_rows(x, src))
        assert g.shape == want.shape and g.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(g)[:used], want[:used])
    if used:  # both kinds of slot checked
        assert (src[:used] >= t).any() and (src[:used] < t).any()


def test_pack_refuses_a_row_it_cannot_tile():
    x = jnp.zeros((8, 3, 5), jnp.float32)
    with pytest.raises(ValueError, match=r"row of 15 values .*\(shape \(8, 3, 5\)\)"):
        stream_pack.pack([x], jnp.zeros(16, jnp.int32), 1, chunk=16, interpret=True)
    with pytest.raises(ValueError, match="20 slots are not whole chunks of 16"):
        stream_pack.pack([jnp.zeros((8, 4))], jnp.zeros(20, jnp.int32), 1, chunk=16,
                         interpret=True)


def test_ragged_batch_is_the_gathered_stream_bit_for_bit(fresh_rng, monkeypatch):
    fn, rows = ragged_case(fresh_rng)
    gathered, packed = both_forms(monkeypatch, stream_pack, "PACK_KERNEL", fn)
    for name, a, b in zip(RAGGED_OUTPUTS, gathered, packed):
        np.testing.assert_array_equal(b, a, err_msg=name)
    assert np.abs(packed[0][:rows]).max() > 0


# CI time: slow tier (--run-slow); by default the joint streams run the pack kernel in
# test_span_joint_layer.py's interpreted kernel cases (against XLA, unwritten chunks NaN)
@pytest.mark.slow
@pytest.mark.parametrize("case", ["shifted, empty, captures of -1", "leading empty sequences"])
def test_joint_stream_is_the_gathered_stream_bit_for_bit(fresh_rng, monkeypatch, case):
    fn, rows, plan = joint_case(fresh_rng, case)
    gathered, packed = both_forms(monkeypatch, stream_pack, "PACK_KERNEL", fn)
    for name, a, b in zip(JOINT_OUTPUTS, gathered, packed):
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(b[:rows] if name == "core" else b,
                                          a[:rows] if name == "core" else a, err_msg=name)
    chunk = test_span_joint_layer.CHUNK
    used = int(plan["joint"]["joint"]["n_used"])
    slots = plan["joint"]["joint"]["src"].shape[0] // chunk
    assert 0 < used < slots  # the stream has chunks the kernel leaves unwritten


def test_the_kernel_lowers_for_cuda_at_qwen3_5_widths():
    """The pack kernel lowered for an H100 (Triton) at rag's span step (1,024 rows, a 122-chunk
    stream) and Qwen3.5-0.8B's GDN widths: q, k, v bf16 [T, 16, 128], g, beta float32 [T, 16]."""
    from tests.cuda_lowering import abstract_h100
    sd = jax.ShapeDtypeStruct
    t, slots = 1024, 122 * 64
    qkv = sd((t, 16, 128), jnp.bfloat16)
    gb = sd((t, 16), jnp.float32)

    def run(q, k, v, g, beta, src, used):
        return stream_pack.pack([q, k, v, g, beta], src, used, chunk=64, interpret=False)
    with abstract_h100():
        text = jax.jit(run).trace(qkv, qkv, qkv, gb, gb, sd((slots,), jnp.int32),
                                  sd((), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
