"""A span step's GDN finals written into the layer's state cache by the scan kernel
(qwen3_5_joint.FINALS_IN_PLACE: StateRows.final_rows, a carry_local sequence's final from its
last local piece's program) against the finals gathered, carried and scattered back (the form
before): the written cache, the core outputs, checkpoints, the captured pieces' local finals and
transitions bit for bit, on test_span_joint_layer.py's layouts (empty and leading empty
sequences, captures of -1, long-span entries) with reset sequences and random carry_local, the
Pallas kernels interpreted (compiled with MINIPIC_COMPILED=1; outputs starting as NaN, the
sequences' programs run last first) and the XLA path (its finals scattered); the whole capturing
step (tiny Qwen3.5); the capturing step lowered for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gated_delta.api import from_cache
from minipic_jax.models import qwen3_5_gdn, qwen3_5_joint, qwen3_5_spans
from test_span_joint_layer import (CHUNK, DK, DV, EXACT_ON_THIS_BACKEND, HV, KC, PALLAS, T,
                                   assert_outputs_equal, kernel_options, layer_case)
from test_span_joint_layer import nan_scan_outputs  # noqa: F401 (a fixture)
from test_span_joint_pass import _inputs, assert_switch_keeps_the_step

SLOTS = 12  # the state cache's rows: more than the sequences, in a shuffled order


@pytest.fixture
def sequences_in_reverse(nan_scan_outputs, monkeypatch):
    """The scan kernel's programs take their sequences last first (the interpreter runs a grid in
    order; a GPU in any): a program that wrote a slot another one still has to read (a carried
    piece's final into its flow's slot) shows."""
    from kernels_pallas.gated_delta import seq_scan
    shim = seq_scan.pl  # nan_scan_outputs' namespace
    first = shim.program_id

    def reversed_id(axis):
        pid = first(axis)
        return shim.num_programs(2) - 1 - pid if axis == 2 else pid
    monkeypatch.setattr(shim, "program_id", reversed_id)


def _run(rng, case, impl, trans_in_stream):
    """Both forms' (core, cache, checkpoints, captured local finals, transitions), the rows
    used, the cache before and the sequences' slots."""
    pieces, x, cu, p0, ck = layer_case(rng, case)
    s = cu.shape[0] - 1
    cache = jnp.asarray(rng.standard_normal((SLOTS, HV, DK, DV)), jnp.float32)
    slots = jnp.asarray(rng.permutation(SLOTS)[:s], jnp.int32)
    keep = jnp.asarray(np.arange(s) % 3 != 1)  # every third sequence starts from zeros
    kernel = kernel_options(impl)
    mc = 0 if pieces.capture is None else pieces.capture.shape[0]

    saved = qwen3_5_joint.FINALS_IN_PLACE, qwen3_5_joint.TRANSITIONS_IN_STREAM

    def layer(in_place, cache, *x):
        qwen3_5_joint.FINALS_IN_PLACE = in_place  # read by `prepare` as it is traced
        qwen3_5_joint.TRANSITIONS_IN_STREAM = trans_in_stream
        try:
            plan = qwen3_5_spans.for_layer(
                qwen3_5_spans.prepare(pieces, cu, T, KC, CHUNK, p0), 0)
            d0 = from_cache(cache, slots, keep, write_final=in_place)
            core, delta, ckpt, local, a_span = qwen3_5_gdn.recurrent_core(
                x, cu, p0, d0, plan, checkpoint_at=ck, decode=False, packing=None, **kernel)
        finally:
            qwen3_5_joint.FINALS_IN_PLACE, qwen3_5_joint.TRANSITIONS_IN_STREAM = saved
        if not in_place:  # the form before: carried, then scattered (qwen3_5._gdn_layer)
            use = plan["carry_use"][:, None, None, None]
            delta = cache.at[slots].set(jnp.where(use, local[:s], delta))
        return core, delta, ckpt, local[local.shape[0] - mc:], a_span

    outs = {}
    for in_place in (False, True):  # a fresh function each: its own trace
        got = jax.jit(lambda c, *x, f=in_place: layer(f, c, *x))(cache, *x)
        outs[in_place] = [None if a is None else np.asarray(a) for a in got]
    return outs, int(cu[-1]), np.asarray(cache), np.asarray(slots)


# the default transition form (a scan) by default; the in-stream form (off) and the XLA path (the
# CPU engine tests run it end to end) in the slow tier (CI time)
@pytest.mark.parametrize("case,impl,trans_in_stream", [
    ("shifted, empty, captures of -1", PALLAS, False),
    ("leading empty sequences", PALLAS, False)] + [
    pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("shifted, empty, captures of -1", PALLAS, True), ("no capture", PALLAS, True),
        ("shifted, empty, captures of -1", "xla", False)]])
def test_finals_written_by_the_kernel_are_the_scattered_ones_bit_for_bit(
        fresh_rng, sequences_in_reverse, case, impl, trans_in_stream):
    outs, rows, cache, slots = _run(fresh_rng, case, impl, trans_in_stream)
    assert_outputs_equal(outs[False], outs[True], rows, exact=EXACT_ON_THIS_BACKEND,
                         names=("core", "cache", "checkpoints", "captured local finals",
                                "transitions"))
    written = outs[True][1]
    others = np.setdiff1d(np.arange(SLOTS), slots)  # rows of no sequence: untouched
    np.testing.assert_array_equal(written[others], cache[others])
    assert not np.array_equal(written[slots], cache[slots])  # ... and the step's written


@pytest.mark.slow  # (CI time: the layer tests above tell the forms apart; the engine runs this one)
def test_a_capturing_step_writes_the_same_caches(fresh_rng):
    """The whole warm step (tiny Qwen3.5, XLA; captures continuing long spans): logits, caches,
    checkpoints and the span-map pool.
    The plumbing through the model: its decays make a state forget where it started, so the
    layer tests above are the ones that tell a wrong final or product apart."""
    assert_switch_keeps_the_step(_inputs("warm", True, fresh_rng), "FINALS_IN_PLACE", False, True)


def test_the_capturing_step_lowers_for_cuda_with_both_forms(monkeypatch):
    """Qwen3.5-0.8B's widths (one GDN layer), a capturing warm step's shapes (rag's 1,024 rows x
    16 sequences), finals in place and the transitions by a scan, lowered for an H100: the
    scan kernel's final_rows operand and the transition kernel reach Triton, once each."""
    import re

    from tests.cuda_lowering import capturing_step_text
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the kernels chosen as on one
    texts = {}
    for forms in ((False, True), (True, False)):
        monkeypatch.setattr(qwen3_5_joint, "FINALS_IN_PLACE", forms[0])
        monkeypatch.setattr(qwen3_5_joint, "TRANSITIONS_IN_STREAM", forms[1])
        texts[forms] = capturing_step_text()
    kernels = {f: len(re.findall("xla.gpu.triton", t)) for f, t in texts.items()}
    assert kernels[(True, False)] == kernels[(False, True)] + 1, kernels  # + the transitions
