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

from gdn_inputs import gdn_inputs
from kernels_pallas.gated_delta import api, stream_pack
from kernels_pallas.gated_delta.api import CheckpointRows
from kernels_pallas.gated_delta.ragged import take_rows
from minipic_jax.models import qwen3_5_gdn, qwen3_5_spans

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"


def _both(monkeypatch, fn):
    out = {}
    for flag in (False, True):
        monkeypatch.setattr(stream_pack, "PACK_KERNEL", flag)
        # a new function each time: jax.jit caches a trace by the function, and the switch is
        # read when it traces
        out[flag] = [None if x is None else np.asarray(x) for x in jax.jit(lambda: fn())()]
    return out[False], out[True]


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
    hk, hv, dk, dv, chunk = 1, 2, 16, 16, 16
    lens, pos0 = [20, 0, 5, 37, 16, 1], [3, 0, 16, 0, 32, 7]
    t = sum(lens) + 7  # bucket padding rows
    x = tuple(a[0] for a in gdn_inputs(fresh_rng, 1, t, hk, hv, dk, dv))
    s0 = fresh_rng.standard_normal((len(lens), hv, dk, dv)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ends = np.array(pos0) + np.array(lens)
    ck = np.stack([ends, [16, -1, 16, 32, 48, -1]], axis=1).astype(np.int32)

    def fn():
        return api.ragged_gated_delta(*x, cu, np.array(pos0, np.int32), s0,
                                      checkpoint_at=jnp.asarray(ck), chunk=chunk,
                                      implementation="pallas_fused", interpret=INTERPRET,
                                      decode=False)
    gathered, packed = _both(monkeypatch, fn)
    for name, a, b in zip(("out", "final", "checkpoints"), gathered, packed):
        np.testing.assert_array_equal(b, a, err_msg=name)
    assert np.abs(packed[0][: cu[-1]]).max() > 0


# CI time: slow tier (--run-slow); by default the joint streams run the pack kernel in
# test_span_joint_layer.py's interpreted kernel cases (against XLA, unwritten chunks NaN)
@pytest.mark.slow
@pytest.mark.parametrize("case", ["shifted, empty, captures of -1", "leading empty sequences"])
def test_joint_stream_is_the_gathered_stream_bit_for_bit(fresh_rng, monkeypatch, case):
    import test_span_joint_layer as t
    lens, pos0, g, caps, cont, local_chunks = t.CASES[case]
    pieces = t._pieces(fresh_rng, lens, g, caps, cont, local_chunks)
    x = tuple(jnp.asarray(a[0]) for a in gdn_inputs(fresh_rng, 1, t.T, t.HK, t.HV, t.DK, t.DV))
    delta0 = jnp.asarray(fresh_rng.standard_normal((len(lens), t.HV, t.DK, t.DV)), jnp.float32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    p0 = jnp.asarray(pos0, jnp.int32)
    ends = np.asarray(pos0) + np.asarray(lens)
    ck = CheckpointRows(seq=jnp.asarray(np.repeat(np.arange(len(lens)), 2), jnp.int32),
                        pos=jnp.asarray(np.stack([ends, (np.asarray(pos0) // t.CHUNK + 1)
                                                  * t.CHUNK], 1).reshape(-1), jnp.int32))
    plan = qwen3_5_spans.for_layer(qwen3_5_spans.prepare(pieces, cu, t.T, t.KC, t.CHUNK, p0), 0)

    def fn():
        return qwen3_5_gdn.recurrent_core(x, cu, p0, delta0, plan, checkpoint_at=ck,
                                          decode=False, packing=None,
                                          implementation="pallas_fused", interpret=INTERPRET)
    gathered, packed = _both(monkeypatch, fn)
    rows = int(cu[-1])
    names = ("core", "delta", "checkpoints", "local finals", "transitions")
    for name, a, b in zip(names, gathered, packed):
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(b[:rows] if name == "core" else b,
                                          a[:rows] if name == "core" else a, err_msg=name)
    used = int(plan["joint"]["joint"]["n_used"])
    slots = plan["joint"]["joint"]["src"].shape[0] // t.CHUNK
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
