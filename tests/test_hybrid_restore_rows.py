"""A hybrid step's restores are R = checkpoint_plan.restore_rows(S) flat rows (issue 29): the step
gathers and writes R pool states per GDN layer, not one per sequence (at 64 seats ~0.95 GB per
layer, CPU count, whatever the step restored); the scheduler keeps a step's restores within R,
an admission that finds no row left waiting a step in its place."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from minipic_jax import SamplingParams
from serving.hybrid import checkpoint_plan
from tests.test_hybrid_checkpoint_rows import _stub_llm, traced_prefill_step, value_shapes


def test_the_engine_step_gathers_restore_rows_not_one_state_per_sequence():
    """The plain prefill step of a 64-seat tiny_qwen3_5 engine with an 8-slot checkpoint pool,
    traced (abstract weights): no value stacked over the GDN layers holds more states than the
    pool's slots, the K checkpoint rows or the R restore rows. Before, the restore gathered the
    pool at every one of the S = 64 sequences ([Lg, 64, ...]) and wrote all 64 masked."""
    slots = 8
    jaxpr, s, tail, layers = traced_prefill_step(64, slots)
    sizes = [shape[1] for shape in value_shapes(jaxpr)  # [layers, n, *tail]: stacked states
             if len(shape) == len(tail) + 2 and shape[0] == layers and shape[2:] == tail]
    bound = max(slots, checkpoint_plan.step_rows(s), checkpoint_plan.restore_rows(s))
    assert checkpoint_plan.restore_rows(s) in sizes, sizes  # the restore gather, R rows
    assert max(sizes) <= bound < s, (sizes, bound, s)


def test_a_crowded_step_keeps_its_restores_within_the_rows_in_order():
    """A 200-token prompt stores its checkpoints; then twelve prompts sharing its first 192
    tokens are submitted together (one 2,048-token step could admit all twelve, each resuming
    from a checkpoint): every launched step restores at most RESTORE_ROWS (here 8, then 4),
    every prompt is restored exactly once, in submission order. Before, the first step
    restored all twelve (the step's [S] restore field)."""
    rng = np.random.default_rng(7)
    kw = dict(max_num_seqs=12, max_num_batched_tokens=2048, min_token_bucket=64,
              max_model_len=512, num_kv_blocks=400, checkpoint_free_room=True)
    llm = _stub_llm(**kw)
    base = rng.integers(0, 256, 200).tolist()
    sp = SamplingParams(max_tokens=1)
    llm.generate([base], sp, use_tqdm=False)
    cache, per_step, cur = llm.llm_engine.hybrid_cache, [], []
    annotate, launched = cache.annotate, cache.after_launch
    cache.annotate = lambda mgr, e: annotate(mgr, e) or (
        e.restore_slot >= 0 and cur.append(e.seq.seq_id))
    cache.after_launch = lambda: (launched(), per_step.append(list(cur)), cur.clear())
    prompts = [base[:192] + rng.integers(0, 256, 8).tolist() for _ in range(12)]
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in got), [o.num_cached_tokens for o in got]
    counts = [len(step) for step in per_step if step]
    assert max(counts) <= checkpoint_plan.RESTORE_ROWS < sum(counts) == 12, counts
    order = [i for step in per_step for i in step]
    assert order == sorted(order) and len(set(order)) == 12, order


def test_a_running_sequence_whose_restore_finds_no_row_runs_no_chunk():
    """A sequence admitted without its chunk running (e.g. held at a barrier) still holds its
    restore; in a step with no restore row left it computes nothing (and keeps its restore for
    the next step) rather than overflowing the step's R rows."""
    from serving.hybrid.hybrid_prefix import HybridPrefixCache
    cache = HybridPrefixCache(SimpleNamespace(free_slots=0), SimpleNamespace(chunk=64), 16)
    seq = SimpleNamespace(num_computed=128, hybrid=SimpleNamespace(
        restore_entry=object(), ck_positions=[], ck_cuts=[]),
        layout=SimpleNamespace(span_block=np.zeros(1, bool)))
    assert cache.chunk_stop(seq, None) is None  # a row left: the chunk runs
    cache.restores_left = 0
    assert cache.chunk_stop(seq, None) == 128


def test_more_restores_than_the_step_rows_is_an_error_naming_the_sequence():
    from serving.step.step_inputs import fill_checkpoints
    v = {name: np.zeros(n, np.int32) for name, n in
         (("ck_seq", 4), ("ck_pos", 4), ("ck_slot", 4), ("restore_seq", 2), ("restore_slot", 2))}
    def e(seq_id, slot):
        return SimpleNamespace(seq=SimpleNamespace(seq_id=seq_id), restore_slot=slot,
                               ck_pos=-1, ck_slot=-1, ck_more=())
    fill_checkpoints([e(1, 5), e(2, -1), e(3, 6)], v)
    assert v["restore_seq"].tolist() == [0, 2] and v["restore_slot"].tolist() == [5, 6]
    with pytest.raises(ValueError, match=r"restores: sequence 9 \(batch row 2\) takes 1 after 2"):
        fill_checkpoints([e(1, 5), e(2, 4), e(9, 6)], v)


def test_the_compose_program_takes_its_sequences_restore_row():
    """A sequence entering cached span maps has its restore done by the compose program
    (span_compose.fill): its flat restore row moves there and is cleared in the step's inputs;
    another sequence's row stays."""
    from serving.hybrid import span_compose
    v = dict(state_slots=np.array([3, 4, 5], np.int32), reset=np.array([1, 0, 0], np.int32),
             restore_seq=np.array([0, 2], np.int32), restore_slot=np.array([7, 9], np.int32))
    cv = dict(slot=np.zeros(1, np.int32), reset=np.zeros(1, np.int32),
              restore=np.full(1, -1, np.int32), chain=np.full((1, 2), -1, np.int32))
    batch = [SimpleNamespace(map_chain=()), SimpleNamespace(map_chain=()),
             SimpleNamespace(map_chain=(11,))]
    span_compose.fill(batch, v, cv)
    assert cv["slot"].tolist() == [5] and cv["restore"].tolist() == [9]
    assert v["restore_seq"].tolist() == [0, -1] and v["restore_slot"].tolist() == [7, -1]
