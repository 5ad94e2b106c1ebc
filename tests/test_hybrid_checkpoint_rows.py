"""A hybrid step's checkpoints are K = checkpoint_plan.step_rows(S) flat rows (issue 29): the
step returns and moves K recurrent states per GDN layer, not S M (at the default 64 seats and
M = 8, 576 states of 1 MiB per layer: ~18 ms of every prefill step on an H100); the scheduler
keeps a step's checkpoints within K, stopping a chunk before the first that does not fit, and
the flat rows compute the states the [S, M] form did."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gated_delta import ragged
from kernels_pallas.gated_delta.checkpoint_rows import CheckpointRows
from minipic_jax import LLM, SamplingParams
from serving.hybrid import checkpoint_plan
from serving.model_contract import CHECKPOINT_BREAKS
from tests.jaxpr_walk import outer_eqns


def traced_prefill_step(seats: int, pool_slots: int, t: int = 64):
    """(jaxpr, S, state tail [Hv, Dk, Dv], GDN layers) of the plain prefill step of bucket `t` of a
    `seats`-seat tiny_qwen3_5 engine with a `pool_slots`-slot checkpoint pool, traced with
    abstract weights."""
    from benchmarks.lower_time import abstract, build_runner
    from configs.presets import get_preset
    from serving.hybrid import checkpoint_pool
    r = build_runner("tiny_qwen3_5", "float32", max_num_seqs=seats, max_num_batched_tokens=64,
                     min_token_bucket=64, max_model_len=512, block_size=16, num_kv_blocks=64)
    lay = checkpoint_pool.state_layout(r.family, r.mcfg, 16, jnp.float32)
    r.ck_pool = jax.eval_shape(lambda: checkpoint_pool.allocate(lay, pool_slots))
    ints, floats, kw = next(st for st in r.warmup_steps()
                            if st[2]["t"] == t and not st[2]["decode_only"])
    traced = r._step.jitted.trace(*abstract(r._args(ints, floats, False, kw)), **kw)
    cfg = get_preset("tiny_qwen3_5")
    tail = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    return traced.jaxpr.jaxpr, kw["s"], tail, cfg.layer_types.count("linear_attention")


def value_shapes(jaxpr):
    """The shape of every value the step computes (jaxpr_walk.outer_eqns: sub-jaxprs included)."""
    return [tuple(v.aval.shape) for eqn in outer_eqns(jaxpr) for v in eqn.outvars
            if hasattr(v.aval, "shape")]


def _state_values(jaxpr, tail, layers: int) -> list[int]:
    """States per GDN layer of every value whose trailing dims are `tail` (a recurrent state's
    [Hv, Dk, Dv]): its leading size, less a leading layer axis (values stacked over the `layers`
    GDN layers: restores, checkpoints)."""
    out = []
    for shape in value_shapes(jaxpr):
        lead = shape[:-len(tail)]
        if lead and shape[-len(tail):] == tail:
            out.append(int(np.prod(lead[1:] if len(lead) > 1 and lead[0] == layers else lead)))
    return out


def test_the_engine_step_holds_no_state_per_sequence_and_checkpoint_column():
    """The plain prefill step of a 16-seat tiny_qwen3_5 engine with the checkpoint pool, traced
    (abstract weights): no value holds more recurrent states per GDN layer than the cache's
    seats + 1, the packed scan's chunks (its breaks' included) + 1 or S + K (the kernel's finals and checkpoint rows).
    Before, the checkpoints were [S, M] = 128 states a layer (the kernel path: S + S M)."""
    seats, t = 16, 64
    jaxpr, s, tail, layers = traced_prefill_step(seats, 8, t)
    sizes = _state_values(jaxpr, tail, layers)
    chunks = ragged.packed_chunks(t, s, 64) + CHECKPOINT_BREAKS  # a break may add a chunk
    bound = max(seats + 1, chunks + 1, s + checkpoint_plan.step_rows(s))
    assert sizes and max(sizes) <= bound < s * checkpoint_plan.CHECKPOINTS_PER_STEP, \
        (max(sizes), bound)


# the XLA form runs end to end in the CPU engine tests; the default run checks the kernels' here
# (CI time: the suite is near its 10 minutes on a 2-core machine); --run-slow runs both
@pytest.mark.parametrize("impl", [pytest.param("xla", marks=pytest.mark.slow), "pallas_fused"])
def test_flat_rows_give_the_states_of_the_per_sequence_form(fresh_rng, impl):
    """Three sequences, checkpoints as [S, M] and as the same rows flattened (and as a reordered
    subset): equal states, and a row's unused entry returns its sequence's state0."""
    rng = fresh_rng
    hk = hv = 2
    dk = dv = 16
    lens, pos0 = np.array([70, 5, 40]), np.array([0, 64, 24])
    t = int(lens.sum())
    cu = jnp.asarray(np.r_[0, np.cumsum(lens)], jnp.int32)
    q, k = (jnp.asarray(rng.standard_normal((t, hk, dk)) * 0.3, jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((t, hv, dv)), jnp.float32)
    g = jnp.asarray(-rng.random((t, hv)) * 0.2, jnp.float32)
    beta = jnp.asarray(rng.random((t, hv)), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((3, hv, dk, dv)) * 0.1, jnp.float32)
    ck = np.array([[64, 70], [69, -1], [64, -1]], np.int32)  # grid, end, end, -1, grid
    kw = dict(chunk=16, implementation=impl, interpret=impl != "xla")
    args = (q, k, v, g, beta, cu, jnp.asarray(pos0, jnp.int32), s0)
    # jitted: eagerly each op of the packing was an XLA program of its own
    prefill = jax.jit(lambda *a, at: ragged.ragged_prefill(*a, checkpoint_at=at, **kw))
    _, _, want = prefill(*args, at=jnp.asarray(ck))
    rows = CheckpointRows(jnp.asarray([2, 0, 1, 0, 1], jnp.int32),
                          jnp.asarray([64, 70, 69, 64, -1], jnp.int32))
    _, _, got = prefill(*args, at=rows)
    want = np.asarray(want)
    np.testing.assert_array_equal(np.asarray(got),
                                  np.stack([want[2, 0], want[0, 1], want[1, 0], want[0, 0],
                                            np.asarray(s0[1])]))


def _stub_llm(**kw):
    """tiny_qwen3_5 with the jitted step stubbed (host only: chunks and checkpoints)."""
    from benchmarks.engine_host import StubStep
    llm = LLM("tiny_qwen3_5", dtype="float32", seed=0, **kw)
    llm.llm_engine.runner._step = StubStep(llm.llm_engine.vocab_size)
    return llm


def test_a_crowded_step_keeps_its_checkpoints_within_the_rows_and_loses_none():
    """Twelve cold 200-token prompts admitted together (2,048-token steps, free room on: 36
    checkpoints, three a prompt, as a GPU's pool sizes them): every launched step takes at most
    CHECKPOINT_ROWS, and every prompt still stores the checkpoints it takes alone. Before, the
    first step took more than its rows (the runner's fill_checkpoints refuses it); then a prompt
    whose chunk started at a checkpoint with no row left moved on without it (the H100 run of
    session 23: two a prompt, CPU's pool of 64 slots, never left one at a chunk's start)."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, 200).tolist() for _ in range(12)]
    kw = dict(max_num_seqs=12, max_num_batched_tokens=2048, min_token_bucket=64,
              max_model_len=512, num_kv_blocks=400, checkpoint_free_room=True,
              checkpoints_per_prompt=4)
    taken = {}
    for crowd in (True, False):
        llm = _stub_llm(**kw)
        cache, per_step, cur = llm.llm_engine.hybrid_cache, [], []
        annotate, launched = cache.annotate, cache.after_launch
        cache.annotate = lambda mgr, e, cur=cur: annotate(mgr, e) or cur.append(
            (e.seq.seq_id % 12, [p for p, s in ((e.ck_pos, e.ck_slot),) + e.ck_more if s >= 0]))
        cache.after_launch = lambda cur=cur, per_step=per_step: (
            launched(), per_step.append(list(cur)), cur.clear())
        sp = SamplingParams(max_tokens=1)
        if crowd:
            llm.generate(prompts, sp, use_tqdm=False)
        else:
            for p in prompts:
                llm.generate([p], sp, use_tqdm=False)
        rows = [sum(len(ps) for _, ps in step) for step in per_step]
        if crowd:
            assert max(rows) <= checkpoint_plan.CHECKPOINT_ROWS < sum(rows), rows
        taken[crowd] = sorted((i, p) for step in per_step for i, ps in step for p in ps)
    assert taken[True] == taken[False]


def test_more_checkpoints_than_the_step_rows_is_an_error_naming_the_sequence():
    from serving.step.step_inputs import fill_checkpoints
    k = 4
    v = {name: np.zeros(n, np.int32) for name, n in
         (("ck_seq", k), ("ck_pos", k), ("ck_slot", k), ("restore_seq", 2), ("restore_slot", 2))}
    seq = SimpleNamespace(seq_id=7)
    e = SimpleNamespace(seq=seq, restore_slot=-1, ck_pos=64, ck_slot=1, ck_more=((128, 2),))
    fill_checkpoints([e, e], v)
    assert v["ck_seq"].tolist() == [0, 0, 1, 1] and v["ck_slot"].tolist() == [1, 2, 1, 2]
    with pytest.raises(ValueError, match=r"sequence 7 \(batch row 2\) takes 2 after 4"):
        fill_checkpoints([e, e, e], {**v, "restore_slot": np.zeros(3, np.int32)})


@pytest.mark.parametrize("first", [True, False])
def test_each_layer_takes_its_checkpoints_before_writing_its_states_back(first, monkeypatch):
    """The engine's prefill step orders each GDN layer's checkpoint states before the write of
    its states into the cache (qwen3_5.CHECKPOINTS_FIRST: one optimization barrier a layer,
    whose outputs the cache scatter reads). Without it XLA fused every layer's checkpoint
    selects, which read the layer's starting states, into one fusion after the last layer and
    copied seven layers' [65, 16, 128, 128] state caches twice to keep them (H100 HLO of the
    qwen3_5_0_8b step at 64 seats, benchmarks/RESULTS.md); the flag off is the old program."""
    from minipic_jax.models import qwen3_5
    monkeypatch.setattr(qwen3_5, "CHECKPOINTS_FIRST", first)
    jaxpr, _, tail, layers = traced_prefill_step(4, 8)
    eqns = list(outer_eqns(jaxpr))
    barriers = [e for e in eqns if e.primitive.name == "optimization_barrier"  # of states
                and any(tuple(v.aval.shape[-3:]) == tail for v in e.outvars)]
    assert len(barriers) == (layers if first else 0)
    held = {id(v) for e in barriers for v in e.outvars}
    written = [e for e in eqns if e.primitive.name == "scatter"
               and tuple(e.invars[0].aval.shape[1:]) == tail
               and any(id(v) in held for v in e.invars)]
    assert len(written) == (layers if first else 0)  # each layer's delta write-back reads one
