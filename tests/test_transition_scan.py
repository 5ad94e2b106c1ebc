"""A capturing span step's map products by a scan over the local pieces' chunks
(qwen3_5_joint.TRANSITIONS_IN_STREAM = False, the default since session 33: transition_scan.py, ragged.
_chunk_products on the XLA path) against the transition pass inside the joint stream (True, the
form before): the layer's core outputs, states, checkpoints, local finals and transitions bit for
bit, on test_span_joint_layer.py's layouts with captures (captures of -1, empty and leading empty
sequences, long-span entries: a product from the entry's A), with the XLA scan and the Pallas
kernels (interpreted on CPU, compiled with MINIPIC_COMPILED=1), the kernels' outputs starting as
NaN. The stream loses the transition pass's chunks, the layer gains one kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minipic_jax.models import qwen3_5_gdn, qwen3_5_joint, qwen3_5_spans
from test_span_joint_layer import (CHUNK, DK, DV, EXACT_ON_THIS_BACKEND, HV, KC, PALLAS, T,
                                   assert_outputs_equal, kernel_options, layer_case)
from test_span_joint_layer import nan_scan_outputs  # noqa: F401 (a fixture)
from test_span_joint_pass import _inputs, assert_switch_keeps_the_step
from tests.jaxpr_walk import primitive_counts


def _layer(rng, case, impl):
    """(fn(in_stream, *x) running the layer in that form, x, rows used)."""
    pieces, x, cu, p0, ck = layer_case(rng, case)
    delta0 = jnp.asarray(rng.standard_normal((cu.shape[0] - 1, HV, DK, DV)), jnp.float32)
    kernel = kernel_options(impl)

    saved = qwen3_5_joint.TRANSITIONS_IN_STREAM

    def core(in_stream, *x):
        qwen3_5_joint.TRANSITIONS_IN_STREAM = in_stream  # read by `prepare` as it is traced
        try:
            plan = qwen3_5_spans.for_layer(
                qwen3_5_spans.prepare(pieces, cu, T, KC, CHUNK, p0), 0)
            out = qwen3_5_gdn.recurrent_core(x, cu, p0, delta0, plan, checkpoint_at=ck,
                                             decode=False, packing=None, **kernel)
        finally:
            qwen3_5_joint.TRANSITIONS_IN_STREAM = saved
        return out, plan["joint"]["joint"]["src"].shape[0] // CHUNK
    return core, x, int(cu[-1])


# the default layout ("vk") by default; "kv" and the XLA form in the slow tier (CI time)
@pytest.mark.parametrize("case,impl,layout", [
    ("shifted, empty, captures of -1", PALLAS, "vk"), ("leading empty sequences", PALLAS, "vk"),
    pytest.param("shifted, empty, captures of -1", PALLAS, "kv", marks=pytest.mark.slow),
    pytest.param("shifted, empty, captures of -1", "xla", None, marks=pytest.mark.slow)])
def test_products_by_scan_are_the_stream_pass_bit_for_bit(fresh_rng, nan_scan_outputs,
                                                          monkeypatch, case, impl, layout):
    if layout is not None:  # the scan kernels' state layout (fused_triton.DEFAULTS: "vk")
        from kernels_pallas.gated_delta import fused_triton
        monkeypatch.setitem(fused_triton.DEFAULTS, "layout", layout)
    core, x, rows = _layer(fresh_rng, case, impl)
    outs, chunks = {}, {}
    for in_stream in (True, False):  # a fresh function each: its own trace
        got, chunks[in_stream] = jax.jit(lambda *x, s=in_stream: core(s, *x))(*x)
        outs[in_stream] = [None if a is None else np.asarray(a) for a in got]
    assert_outputs_equal(outs[True], outs[False], rows, exact=EXACT_ON_THIS_BACKEND,
                         names=("core", "delta", "checkpoints", "local finals", "transitions"))
    # the products are far from zero and from I: a wrong initial row or chunk range would show
    a_span = outs[False][4]
    assert np.abs(a_span).max() > 1e-2
    assert np.abs(a_span - np.eye(DK)).max() > 1e-2
    assert chunks[False] < chunks[True], chunks  # the static stream lost the pass's chunks


def test_the_scan_form_adds_one_kernel_a_layer(fresh_rng):
    core, x, _ = _layer(fresh_rng, "shifted, empty, captures of -1", PALLAS)
    counts = {}
    for in_stream in (True, False):
        jaxpr = jax.jit(lambda *x, s=in_stream: core(s, *x)).trace(*x).jaxpr
        counts[in_stream] = primitive_counts(jaxpr.jaxpr)["pallas_call"]
    assert counts[False] == counts[True] + 1, counts


@pytest.mark.slow  # (CI time: the in-stream form is off; the layer-level twins run by default)
def test_a_capturing_step_is_the_stream_form_bit_for_bit(fresh_rng):
    """The whole warm step (tiny Qwen3.5, XLA scan, captures continuing long spans): logits,
    recurrent states, checkpoints and the span-map pool after the captures' store.
    The plumbing through the model: its decays make a state forget where it started, so the
    layer tests above are the ones that tell a wrong final or product apart."""
    assert_switch_keeps_the_step(_inputs("warm", True, fresh_rng), "TRANSITIONS_IN_STREAM", True, False)


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("with_init", [False, True])
def test_the_kernel_lowers_for_cuda_at_qwen3_5_widths(layout, with_init):
    """The transition kernel lowered for an H100 (Triton) at Qwen3.5-0.8B's GDN widths (16 value
    heads, Dk = 128, bf16 W / KD), from I and from a span-map pool layer's A: what a CPU can
    check of the compiled kernel before a device compiles it."""
    from kernels_pallas.gated_delta import fused_triton, transition_scan
    from kernels_pallas.gated_delta.state_rows import StateRows
    from tests.cuda_lowering import abstract_h100, map_pool_0_8b
    SD = jax.ShapeDtypeStruct
    nc, hv, dk, m = 24, 16, 128, 8
    opt = fused_triton.DEFAULTS
    wk = SD((1, nc * CHUNK, hv, dk), jnp.bfloat16)
    args = [wk, wk, SD((hv, nc), jnp.float32), SD((m,), jnp.int32), SD((m,), jnp.int32)]

    def run(w, kd, dl, first, count, *init):
        rows = StateRows((init[0],), init[1], init[2], (3,)) if init else None
        return transition_scan.products(w, kd, dl, first, count, rows, chunk=CHUNK,
                                        dot_dtype=jnp.bfloat16,
                                        options=dict(opt, layout=layout), interpret=False)
    if with_init:
        args += [map_pool_0_8b().a, SD((m,), jnp.int32), SD((m,), jnp.int32)]
    with abstract_h100():
        text = jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
