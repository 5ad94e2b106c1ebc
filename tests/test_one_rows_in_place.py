"""A hybrid prefill step's one-row sequences stepped by the GDN decode kernel
(qwen3_5.ONE_ROWS_IN_PLACE; a span step's joint stream with qwen3_5_joint.ONE_ROWS): the chunked
pass packs them as if they had no rows (ragged.packing's skip, joint.Pass's) and the decode
kernel steps their states in place after it.

- the packing: a skipped sequence's rows get no slot and every other sequence is packed and
  computed exactly as in the batch without the skipped rows (XLA path, bit for bit);
- the step (tiny_qwen3_5, its GDN kernels interpreted): the other sequences' logits, states and
  checkpoints bit for bit the chunked form's; the one-row sequences' within float32 rounding
  of it (the decode kernel's step against a one-row chunk), resets and checkpoints included;
- a span step's joint stream: the same, against the stream with them (both finals forms);
- decode_rows.ROWS_IN_KERNEL: the kernel reading the rows itself, bit for bit the gathers;
- lowered for CUDA: the step calls the decode kernel after the chunked pass; engines' tokens
  (plain and span prompts, slow tier).
MINIPIC_COMPILED=1 runs the kernels compiled on a GPU."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gated_delta import ragged
from minipic_jax.models import qwen3_5, qwen3_5_gdn_core, qwen3_5_joint
from tiny_hybrid_step import tiny_step

IMPL = "pallas_fused" if os.environ.get("MINIPIC_COMPILED") == "1" else "pallas_fused_interpret"


def _inputs(counts, seed, hk=2, hv=4, d=16):
    rng = np.random.default_rng(seed)
    t = sum(counts) + 3  # padding rows past the last sequence
    q = rng.standard_normal((t, hk, d)).astype(np.float32)
    k = rng.standard_normal((t, hk, d)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((t, hv, d)).astype(np.float32)
    g = -rng.uniform(0.01, 0.5, (t, hv)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (t, hv)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    pos0 = rng.integers(0, 200, len(counts)).astype(np.int32)
    state0 = rng.standard_normal((len(counts), hv, d, d)).astype(np.float32)
    return [jnp.asarray(x) for x in (q, k, v, g, beta)], cu, pos0, jnp.asarray(state0)


def test_skipped_sequences_are_packed_as_the_batch_without_their_rows():
    counts = [9, 1, 70, 1, 0, 4, 1]
    skip = np.array([c == 1 for c in counts])
    x, cu, pos0, state0 = _inputs(counts, seed=3)
    t = x[0].shape[0]

    @jax.jit  # one program per packing form (op by op, ~340 ops compiled one by one: CI time)
    def prefill(x, cu, pos0, s0, skip):
        pk = None if skip is None else ragged.packing(cu, pos0, t, skip=skip)
        out, final, _ = ragged.ragged_prefill(*x, cu, pos0, s0, packing=pk)
        return out, final, None if pk is None else pk["n_used"]

    out, final, n_used = prefill(x, cu, pos0, state0, jnp.asarray(skip))
    # the reference: the same batch with the skipped sequences' rows taken out
    seq_of_row = np.searchsorted(cu, np.arange(t), side="right") - 1
    kept = np.flatnonzero((np.arange(t) < cu[-1]) & ~skip[np.clip(seq_of_row, 0, len(counts) - 1)])
    lens = np.where(skip, 0, counts)
    cu_ref = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    pad = [(0, t - kept.size)]
    x_ref = [jnp.asarray(np.pad(np.asarray(a)[kept], pad + [(0, 0)] * (a.ndim - 1))) for a in x]
    out_ref, final_ref, _ = prefill(x_ref, cu_ref, pos0, state0, None)
    np.testing.assert_array_equal(np.asarray(out)[kept], np.asarray(out_ref)[:kept.size])
    np.testing.assert_array_equal(np.asarray(final), np.asarray(final_ref))
    skipped_rows = np.setdiff1d(np.arange(t), kept)
    assert not np.asarray(out)[skipped_rows].any()  # no slot: zeros
    np.testing.assert_array_equal(np.asarray(final)[skip], np.asarray(state0)[skip])
    assert int(n_used) < int(ragged.packing(cu, pos0, t)["n_used"])
    # every sequence skipped: no chunk used, every final its start
    out, final, n_used = prefill(x, cu, pos0, state0, jnp.ones(len(counts), bool))
    assert int(n_used) == 0 and not np.asarray(out).any()
    np.testing.assert_array_equal(np.asarray(final), np.asarray(state0))


def _step(counts, reset, ck_seqs, seed, impl=IMPL):
    """tiny_step in float32, a checkpoint at the end of each sequence in ck_seqs."""
    return tiny_step(counts, reset, jnp.float32, seed, impl, ck_seqs)


def test_one_rows_step_by_the_decode_kernel(monkeypatch):
    """Sequences 1 (reset), 3 and 6 have one row; 6 has a checkpoint, so the chunked pass keeps
    it; 0 (multi-row, reset) must keep the chunked pass's final though the decode kernel runs
    after it; 4 has no row."""
    counts, reset = [9, 1, 17, 1, 0, 4, 1], [1, 1, 0, 0, 0, 0, 0]
    run, params, cache, slots = _step(counts, reset, ck_seqs=(0, 2, 6), seed=5)
    calls = []
    real = qwen3_5_gdn_core.gdn_one_rows
    monkeypatch.setattr(qwen3_5_gdn_core, "gdn_one_rows",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(qwen3_5, "ONE_ROWS_IN_PLACE", on)
        jax.clear_caches()  # the switch is read while tracing
        outs[on] = jax.jit(run)(params, cache)
        assert bool(calls) == on
    from configs.presets import PRESETS
    assert len(calls) == PRESETS["tiny_qwen3_5"].layer_types.count("linear_attention")
    one = np.array([1, 3])  # the sequences the decode kernel steps; their logits rows too (a
    # row per sequence with rows, in order: sequence 4 has none)
    (lg_off, cache_off, ck_off), (lg_on, cache_on, ck_on) = outs[False], outs[True]
    lg_off, lg_on = np.asarray(lg_off), np.asarray(lg_on)
    others = np.setdiff1d(np.arange(lg_on.shape[0]), one)
    np.testing.assert_array_equal(lg_on[others], lg_off[others])
    np.testing.assert_allclose(lg_on[one], lg_off[one], rtol=2e-5, atol=2e-5)
    for got, want in zip(jax.tree.leaves(ck_on), jax.tree.leaves(ck_off)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for layer_on, layer_off in zip(cache_on.delta, cache_off.delta):
        layer_on, layer_off = np.asarray(layer_on), np.asarray(layer_off)
        keep_slots = np.setdiff1d(np.arange(layer_on.shape[0]), slots[one])
        np.testing.assert_array_equal(layer_on[keep_slots], layer_off[keep_slots])
        np.testing.assert_allclose(layer_on[slots[one]], layer_off[slots[one]], rtol=2e-5,
                                   atol=2e-6)
        assert np.abs(layer_on[slots[one]] - layer_off[slots[one]]).max() > 0  # another path
    for got, want in zip(cache_on.conv, cache_off.conv):  # later layers' inputs of the
        # one-row sequences differ by the earlier layers' rounding
        got, want = np.asarray(got), np.asarray(want)
        np.testing.assert_array_equal(got[keep_slots], want[keep_slots])
        np.testing.assert_allclose(got[slots[one]], want[slots[one]], rtol=2e-5, atol=2e-6)


def test_the_one_row_sequences_are_those_without_a_checkpoint():
    from kernels_pallas.gated_delta.checkpoint_rows import CheckpointRows
    cu = jnp.asarray([0, 9, 10, 27, 28, 28, 32, 33], jnp.int32)
    assert qwen3_5._one_rows(cu, None).tolist() == [0, 1, 0, 1, 0, 0, 1]
    ck = CheckpointRows(seq=jnp.asarray([0, 6, 3], jnp.int32),
                        pos=jnp.asarray([64, 200, -1], jnp.int32))  # 3's row is unused
    assert qwen3_5._one_rows(cu, ck).tolist() == [0, 1, 0, 1, 0, 0, 0]


def test_one_rows_lower_to_the_decode_kernel_after_the_chunked_pass(monkeypatch):
    """Lowered for CUDA (abstract H100): with the switch each GDN layer calls the in-place
    decode kernel, aliased to the state cache; without it, none."""
    from tests.cuda_lowering import abstract_h100
    texts = {}
    for on in (False, True):
        monkeypatch.setattr(qwen3_5, "ONE_ROWS_IN_PLACE", on)
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        run, params, cache, _ = _step([9, 1, 17, 1], [0, 0, 1, 0], ck_seqs=(0,), seed=2,
                                      impl="pallas_fused")
        with abstract_h100():
            texts[on] = jax.jit(run).trace(params, cache).lower(
                lowering_platforms=("cuda",)).as_text()
    from configs.presets import PRESETS
    n_gdn = PRESETS["tiny_qwen3_5"].layer_types.count("linear_attention")
    assert texts[False].count("gdn_decode_in_place") == 0
    assert texts[True].count("gdn_decode_in_place") >= n_gdn


@pytest.mark.slow  # (CI time) the packing test runs a batch with nothing to pack by default
@pytest.mark.parametrize("counts", [[1, 1, 1], [1, 0, 2]])
def test_steps_without_a_chunk_to_run_or_with_one_row_only(monkeypatch, counts):
    """Every sequence of one row (none left for the chunked pass), and a step mixing one with a
    two-row sequence: the same results as the chunked form within float32 rounding."""
    run, params, cache, _ = _step(counts, [0] * len(counts), ck_seqs=(), seed=9)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(qwen3_5, "ONE_ROWS_IN_PLACE", on)
        jax.clear_caches()
        outs[on] = jax.jit(run)(params, cache)
    for got, want in zip(jax.tree.leaves(outs[True]), jax.tree.leaves(outs[False])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.slow  # two engines' compiles each (~20-40 s of CI's 2 cores); the model-level
# tests above hold the switch's results in every run
@pytest.mark.parametrize("spans", [False, True])
def test_an_engine_with_one_rows_in_place_gives_the_same_tokens(monkeypatch, spans):
    """Through LLM.generate (tiny_qwen3_5, its GDN kernels interpreted, a decode variant of its
    own so prefill steps are known prefill on the host): decodes riding with a later request's
    chunked prefill (plain prompts, or span prompts: span steps' joint streams) give the tokens
    of the chunked form, logprobs within float32 rounding, and the prefill steps did step
    one-row sequences by the decode kernel."""
    from minipic_jax import LLM, Prompt, SamplingParams, Span
    rng = np.random.default_rng(11)
    ids = lambda n: rng.integers(5, 200, n).tolist()  # noqa: E731
    prompts = [{"prompt_token_ids": ids(n)} for n in (7, 150, 12, 90)]
    if spans:
        doc = [Span(ids(40)), Span(ids(70))]
        prompts = [[Prompt(ids(9)), doc[0], Prompt(ids(5))], [Prompt(ids(12))],
                   [Prompt(ids(20)), doc[1], doc[0], Prompt(ids(8))], [Prompt(ids(6))]]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    calls, real = [], qwen3_5_gdn_core.gdn_one_rows
    monkeypatch.setattr(qwen3_5_gdn_core, "gdn_one_rows",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    joint_skips, plan = [], qwen3_5_joint.plan  # span steps' streams that skip one-row flows
    monkeypatch.setattr(qwen3_5_joint, "plan", lambda *a, **k: joint_skips.append(
        (a[9:] + (k.get("one_row"),))[0] is not None) or plan(*a, **k))
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(qwen3_5, "ONE_ROWS_IN_PLACE", on)
        monkeypatch.setattr(qwen3_5_joint, "ONE_ROWS", on)
        calls.clear()
        joint_skips.clear()
        llm = LLM("tiny_qwen3_5", max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64,
                  decode_attn_impl="triton_decode", warmup=False, step_cache="off",
                  num_kv_blocks=64)
        llm.llm_engine.runner.gdn_impl = "pallas_fused_interpret"  # Config takes compiled names
        outs[on] = llm.generate(prompts, sp, use_tqdm=False)
        assert bool(calls) == on  # traced into the prefill variants
        assert any(joint_skips) == (on and spans), joint_skips
    for want, got in zip(outs[False], outs[True]):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for lw, lg in zip(want.outputs[0].logprobs, got.outputs[0].logprobs):
            assert lg.keys() == lw.keys()
            for t in lw:
                assert abs(lg[t].logprob - lw[t].logprob) < 1e-4


@pytest.mark.parametrize("in_place", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_span_steps_one_rows_leave_the_joint_stream(monkeypatch, in_place):
    """A span step's joint stream (qwen3_5_joint) with its one-row flow sequences skipped and
    stepped by the decode kernel after it: every other output bit for bit the stream's with
    them (core rows, the layer's states, checkpoints, the captured pieces' local finals and
    transitions), theirs within float32 rounding; the finals written in place (in_place, the
    engine's form) or returned [S]."""
    import dataclasses
    from kernels_pallas.gated_delta.api import CheckpointRows, from_cache
    from minipic_jax.models import qwen3_5_gdn, qwen3_5_spans
    from test_span_joint_layer import (CASES, CHUNK, DK, DV, HV, KC, PALLAS, T, kernel_options,
                                       layer_case)
    monkeypatch.setitem(CASES, "one rows", ([90, 1, 70, 1, 1, 60], [70, 5, 0, 31, 9, 130], 24,
                                            [1, -1, 3, -1], [True, False, True, False], None))
    rng = np.random.default_rng(21)
    pieces, x, cu, p0, ck = layer_case(rng, "one rows")
    one = np.array([0, 1, 0, 1, 1, 0], bool)
    pieces = dataclasses.replace(pieces, carry_local=pieces.carry_local & ~jnp.asarray(one))
    keep_ck = ~one[np.asarray(ck.seq)]  # checkpoints of the chunked sequences only
    ck = CheckpointRows(seq=ck.seq[keep_ck], pos=ck.pos[keep_ck])
    assert np.asarray(qwen3_5._one_rows(cu, ck, pieces)).tolist() == one.tolist()
    slots = jnp.asarray(rng.permutation(12)[:6], jnp.int32)
    keep = jnp.asarray([1, 0, 0, 1, 1, 1], bool)  # a reset one-row and a reset chunked one
    cache = jnp.asarray(rng.standard_normal((12, HV, DK, DV)), jnp.float32)
    kernel = kernel_options(PALLAS)
    seq_of_row = qwen3_5_gdn.rows_of_seqs(cu, T)

    def layer(one_row, cache, *x):
        plan = qwen3_5_spans.for_layer(qwen3_5_spans.prepare(pieces, cu, T, KC, CHUNK, p0,
                                                             one_row=one_row), 0)
        d0 = from_cache(cache, slots, keep, write_final=in_place)
        core, delta, ckpt, local, a_span = qwen3_5_gdn.recurrent_core(
            x, cu, p0, d0, plan, checkpoint_at=ck, decode=False, packing=None, one_row=one_row,
            seq_of_row=seq_of_row, **kernel)
        if not in_place:  # carried, then scattered (qwen3_5._gdn_layer)
            use = plan["carry_use"][:, None, None, None]
            delta = cache.at[slots].set(jnp.where(use, local[:6], delta))
        return core, delta, ckpt, local, a_span

    monkeypatch.setattr(qwen3_5_joint, "FINALS_IN_PLACE", in_place)
    outs = [[None if a is None else np.asarray(a) for a in jax.jit(
        lambda c, *x, o=o: layer(o, c, *x))(cache, *x)] for o in (None, jnp.asarray(one))]
    (core0, delta0, ck0, local0, a0), (core1, delta1, ck1, local1, a1) = outs
    rows = np.arange(T)
    mine = (rows < int(cu[-1])) & one[np.asarray(seq_of_row)]
    other = (rows < int(cu[-1])) & ~mine
    np.testing.assert_array_equal(core1[other], core0[other])
    np.testing.assert_allclose(core1[mine], core0[mine], rtol=2e-5, atol=2e-5)
    s_one = np.asarray(slots)[one]
    s_other = np.setdiff1d(np.arange(12), s_one)
    np.testing.assert_array_equal(delta1[s_other], delta0[s_other])
    np.testing.assert_allclose(delta1[s_one], delta0[s_one], rtol=2e-5, atol=2e-5)
    assert np.abs(delta1[s_one] - delta0[s_one]).max() > 0  # the decode kernel's step
    for got, want in [(ck1, ck0), (local1[6:], local0[6:]), (a1, a0)]:
        np.testing.assert_array_equal(got, want)


def test_the_decode_kernel_reads_the_rows_itself_bit_for_bit(monkeypatch):
    """decode_rows.ROWS_IN_KERNEL: the decode kernel reads each sequence's row in the step's
    arrays (no gathers before it): the same outputs and cache bit for bit, resets, unmarked and
    padding sequences included."""
    from kernels_pallas.gated_delta import decode_rows
    counts = [9, 1, 70, 1, 0, 4, 1]
    x, cu, _, _ = _inputs(counts, seed=8)
    rng = np.random.default_rng(8)
    cache = jnp.asarray(rng.standard_normal((10, 4, 16, 16)), jnp.float32)
    slots = jnp.asarray(rng.permutation(10)[:7], jnp.int32)
    keep = jnp.asarray([1, 0, 1, 1, 1, 0, 1], bool)
    one = jnp.asarray([c == 1 for c in counts])
    interpret = IMPL.endswith("_interpret")
    outs = []
    for on in (False, True):
        monkeypatch.setattr(decode_rows, "ROWS_IN_KERNEL", on)
        outs.append(jax.jit(lambda *a: decode_rows.one_rows_in_place(
            *a, interpret=interpret))(*x, jnp.asarray(cu), one, cache, slots, keep))
    for got, want in zip(jax.tree.leaves(outs[1]), jax.tree.leaves(outs[0])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.abs(np.asarray(outs[1][0])[np.asarray(one)]).max() > 0
