"""Span prompts on a hybrid model through the engine: tokens and logprobs equal the float64 hybrid
span reference (tests/hybrid_span_reference.py), for prompts with the same spans at other offsets
and in other orders in one batch, a prompt ending in a span, and chunked prefills (64-token steps)
that cut between segments. Cold (serving/hybrid/span_rows.py: spans computed) and warm (serving/
span_cache.py: cached spans skipped, their maps composed on device), across batches and within
one, with a small span-map store that evicts and offloads."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hybrid_span_reference as hsr
from minipic_jax import LLM, SamplingParams
from minipic_jax.prompts import Prompt, Span
from serving.config_groups import flat_names
from tests.test_resident_tables import _watch

SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)


def _slow_decay(llm):
    """The preset's GDN heads forget within a few tokens (A_log = 1: exp(g) ~ 0.03 per token), so
    a wrong entry state would barely show a few tokens later. Heads from A_log = -5 (exp(g) ~ 0.99
    per token) to 0, as trained models mix them; the step takes params as an argument, so
    nothing recompiles, and the reference reads the same params."""
    runner = llm.llm_engine.runner
    lays = []
    for lp in runner.params["layers"]:  # the params dict (qwen3_5_modules layout)
        if "a_log" in lp["mixer"]:  # a GDN layer
            old = lp["mixer"]["a_log"]
            lp = dict(lp, mixer=dict(lp["mixer"], a_log=jnp.linspace(-5.0, 0.0, old.shape[0],
                                                                    dtype=old.dtype)))
        lays.append(lp)
    runner.params = dict(runner.params, layers=tuple(lays))
    return llm


@pytest.fixture(scope="module")
def llm():
    return _slow_decay(LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=4,
                           max_num_batched_tokens=64, min_token_bucket=64, max_model_len=512,
                           block_size=16, num_kv_blocks=96))


def _check(llm, out):
    """Teacher-forced: every generated token is the reference's argmax, its logprob within 1e-5."""
    eng = llm.llm_engine
    m, bs = eng.markers, llm.config.block_size
    kept, seg, span = hsr.segments(list(out.prompt_token_ids), bs, m["pad_token_id"],
                                   m["ssep_token_id"], m["pdep_token_id"])
    gen = list(out.outputs[0].token_ids)
    full = kept + gen[:-1]
    seg_full = np.r_[seg, np.full(len(gen) - 1, seg[-1])]
    ref = hsr.reference_logprobs(eng.runner.params, eng.runner.mcfg, full, seg_full, span)
    ref = ref[len(kept) - 1:]
    err = 0.0
    for j, tok in enumerate(gen):
        assert ref[j, tok] >= ref[j].max() - 1e-6, f"token {j}: {tok} is not the argmax"
        got = next(iter(out.outputs[0].logprobs[j].values())).logprob
        err = max(err, abs(got - ref[j, tok]))
    return err


def test_span_prompts_match_the_reference(llm):
    rng = np.random.default_rng(19)
    text = lambda n: bytes(rng.integers(97, 123, n).tolist()).decode()  # noqa: E731
    sys_a, sys_b, question = Prompt(text(20)), Prompt(text(45)), Prompt(text(9))
    doc1, doc2, doc3 = Span(text(40)), Span(text(13)), Span(text(29))
    prompts = [[sys_a, doc1, doc2, question],
               [sys_b, doc2, doc1, question],  # other offsets, other order
               [doc3, doc1, question],  # starts with a span
               [sys_a, question, doc3],  # ends in a span: generated tokens extend it
               [sys_b, question, Span("x")]]  # a short final span: the flow still shows
    outs = llm.generate(prompts, SP, use_tqdm=False)
    assert any(key[3] for key in llm.llm_engine.runner._bufs)  # steps ran with span pieces
    errs = [_check(llm, o) for o in outs]
    print(f"max abs logprob error per prompt vs the float64 reference: {errs}")
    assert max(errs) < 1e-5


@pytest.mark.slow  # CI time: --run-slow
@settings(max_examples=4, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), min_size=1, max_size=5))
def test_random_segment_structures_match_the_reference(llm, segments):
    """Random structures (span or plain segments of 1..40 characters), two requests per batch:
    the structure and the same segments in reverse order."""
    rng = np.random.default_rng(sum(n for _, n in segments))
    parts = [(Span if span else Prompt)(bytes(rng.integers(97, 123, n).tolist()).decode())
             for span, n in segments]
    outs = llm.generate([parts, parts[::-1]], SP, use_tqdm=False)
    assert max(_check(llm, o) for o in outs) < 1e-5


def test_non_final_span_longer_than_a_step_is_rejected_without_a_span_map_pool(llm):
    """A span longer than a step goes in pieces through the span-map pool (below); without the
    pool (span_map_gb=0) it is refused before any work, naming the span and its size."""
    groups = llm.config.span_maps
    llm.config.span_maps = dataclasses.replace(groups, budget_gb=0)
    eng = _fresh(llm)
    try:
        assert eng.hybrid_cache.spans is None
        with pytest.raises(ValueError, match=r"request 1: segment 1, an SSEP span at token "
                                             r"index 16, has 101 tokens, more than one step "
                                             r"takes \(60"):
            llm.generate([[Span("short"), Prompt("question?")],
                          [Prompt("sys"), Span("a" * 100), Prompt("question?")]], SP,
                         use_tqdm=False)
    finally:
        llm.config.span_maps = groups
        _fresh(llm)


def _fresh(llm, **options):
    """The module's engine (compiled once) with an empty prefix cache and a span-map store sized
    by `options` (Config fields, read by reset_prefix_cache)."""
    flat = flat_names(type(llm.config))  # span_map_gb -> (span_maps, budget_gb), ...
    for name, value in options.items():
        group, field = flat[name]
        setattr(llm.config, group, dataclasses.replace(getattr(llm.config, group), **{field: value}))
    llm.llm_engine.reset_prefix_cache()
    return llm.llm_engine


def _watch_tables(runner, monkeypatch):
    """The step kinds dispatched, and the device tables checked against the host's after every
    step (tests/test_resident_tables.py's _watch); monkeypatch puts the dispatch back."""
    monkeypatch.setattr(runner, "_dispatch", runner._dispatch)
    seen, _ = _watch(runner)
    kinds, dispatch = [], runner._dispatch

    def kind_noted(ints, floats, use_prev, kw):
        kinds.append("compose" if kw.get("compose") else "spans" if kw.get("spans") else "plain")
        return dispatch(ints, floats, use_prev, kw)
    runner._dispatch = kind_noted
    return kinds, seen


def _span_stats(eng):
    return {k: v for k, v in eng.get_stats().items() if k.startswith("span")}


def _docs(rng, *lengths):
    return [Span(bytes(rng.integers(97, 123, n).tolist()).decode()) for n in lengths]


def _run(llm, batches):
    errs = []
    for batch in batches:
        errs += [_check(llm, o) for o in llm.generate(batch, SP, use_tqdm=False)]
    return max(errs)


def test_cached_spans_are_skipped_and_match_the_reference(llm, monkeypatch):
    """A request waits for the spans another one is computing, then skips them. A second batch
    reuses five cached spans at other offsets, in other orders, as one chain of
    four (the last shorter than the conv window), split by a plain segment (two chains), and
    around a new span (computed and captured). (Chains of 4 keep to one compiled shape; the slow
    sweep draws longer ones.) Span steps and the compose programs before them (which take no
    tables) leave the device block tables equal to the host's (serving/step/resident_tables.py;
    checked on this engine, which compiles once for the file, rather than on one of its own)."""
    eng = _fresh(llm, span_map_gb=None, span_map_host_gb=0.0)
    kinds, seen = _watch_tables(eng.runner, monkeypatch)
    rng = np.random.default_rng(7)
    sys_a, sys_b, q1, q2 = (Prompt(bytes(rng.integers(97, 123, n).tolist()).decode())
                            for n in (20, 45, 9, 3))
    d1, d2, d3, d4, d5 = _docs(rng, 40, 13, 29, 16, 1)  # d5: two tokens, shorter than the conv
    cold = [[sys_a, d1, d2, q1], [d3, d5, d4, q2], [d2, d1, q2]]  # the third waits for d1, d2
    warm = [[sys_b, d2, d1, q1], [d4, d1, d3, d5, q2], [d2, sys_a, d4, q1],
            [sys_a, d1, *_docs(rng, 7), d3, q2]]
    err = _run(llm, [cold, warm])
    st = _span_stats(eng)
    print(f"max abs logprob error vs the float64 reference: {err:.2e}; {st}")
    assert err < 1e-5
    assert st["spans_skipped"] == 12 and st["span_maps_captured"] == 6
    assert st["span_admission_waits"] > 0
    assert seen["mismatch"] == [] and seen["steps"] > 5, seen
    assert {"spans", "compose", "plain"} <= set(kinds), kinds
    # blocks of 16 tokens (SSEP + text, padded): d1 3, d2 1, d3 2, d4 2, d5 1
    assert st["span_tokens_skipped"] == 16 * ((1 + 3) + (1 + 3) + (2 + 3 + 2 + 1) + (1 + 2)
                                              + (3 + 2))


@pytest.mark.slow  # CI time (tests/test_span_cache.py checks the moves and drops cheaply)
def test_small_span_map_store_evicts_and_offloads_exactly(llm):
    """Two device slots and two host slots for six spans: maps are evicted to the host, brought
    back for a hit, forgotten when the host is full; a chain longer than the device tier skips
    what it can pin and computes the rest. Later requests of one batch reuse spans that earlier
    ones computed (max_num_seqs=4, six requests)."""
    nbytes = _fresh(llm, span_map_gb=None).hybrid_cache.spans.store.nbytes
    two = 2.5 * nbytes / (1 << 30)
    eng = _fresh(llm, span_map_gb=two, span_map_host_gb=two)
    try:
        rng = np.random.default_rng(11)
        sys_a, q = Prompt("system prompt"), Prompt("question?")
        d = _docs(rng, 17, 30, 5, 22, 9, 33)
        batches = [[[sys_a, d[0], d[1], q], [d[2], d[3], q], [d[4], d[5], q],
                    [d[3], d[0], q], [sys_a, d[2], d[1], q], [d[5], d[4], d[1], q]],
                   [[d[1], d[2], d[3], d[0], q], [d[0], sys_a, d[4], q]]]
        err = _run(llm, batches)
        st = _span_stats(eng)
        print(f"max abs logprob error vs the float64 reference: {err:.2e}; {st}")
        assert err < 1e-5
        assert st["span_map_device_slots"] == 2 and st["span_map_host_slots"] == 2
        assert st["span_maps_offloaded"] > 0 and st["span_maps_onloaded"] > 0
        assert st["span_maps_evicted"] > 0 and st["spans_skipped"] > 0
    finally:
        _fresh(llm, span_map_gb=None, span_map_host_gb=0.0)


def test_span_prompts_resume_from_checkpoints_then_skip_spans(llm):
    """Prefix checkpoints in span prompts (after PDEP blocks only): a second request resumes at
    the first span's start after a 151-token system prompt (token 160, off the GDN chunk grid:
    the cold chunk stopped there), then skips the cached spans; a third resumes exactly at a
    span's start on the grid (128) and enters that cached span right after the restore."""
    eng = _fresh(llm, span_map_gb=None, span_map_host_gb=0.0)
    rng = np.random.default_rng(3)
    text = lambda n: bytes(rng.integers(97, 123, n).tolist()).decode()  # noqa: E731
    sys150, sys128, q = Prompt(text(150)), Prompt(text(127)), Prompt(text(6))  # + BOS
    d1, d2, d3 = _docs(rng, 20, 35, 11)
    before = dict(eng.get_stats())
    err = _run(llm, [[[sys150, d1, d2, q], [sys128, d3, d1, q]],  # waits for d1, skips it
                     [[sys150, d2, d1, Prompt("other")]],
                     [[sys128, d3, d2, q]]])
    st = eng.get_stats()
    print(f"max abs logprob error vs the float64 reference: {err:.2e}; {_span_stats(eng)}")
    assert err < 1e-5
    assert st["checkpoint_hits"] - before["checkpoint_hits"] == 2
    assert st["tokens_resumed"] - before["tokens_resumed"] == 160 + 128
    assert st["spans_skipped"] == 5


@pytest.mark.slow  # CI time (another compiled step variant): --run-slow
def test_span_maps_off_recomputes_every_span(llm):
    """span_map_gb=0 (the A/B baseline): no map pool, every span computed, same outputs."""
    eng = _fresh(llm, span_map_gb=0)
    try:
        assert eng.runner.span_pool is None and eng.hybrid_cache.spans is None
        rng = np.random.default_rng(13)
        d1, d2 = _docs(rng, 25, 18)
        q = Prompt("why?")
        err = _run(llm, [[[d1, d2, q]], [[Prompt("sys"), d2, d1, q]]])
        assert err < 1e-5 and "spans_skipped" not in eng.get_stats()
    finally:
        _fresh(llm, span_map_gb=None)


@pytest.mark.slow  # CI time: --run-slow
@settings(max_examples=10, deadline=None, derandomize=True)
@given(st.lists(st.lists(st.tuples(st.integers(0, 6), st.booleans()), min_size=1, max_size=5),
                min_size=2, max_size=5))
def test_random_structures_cold_then_warm_match_the_reference(llm, prompts):
    """Random prompts over a shared pool of four spans and three plain texts (drawn as (item,
    reverse-the-rest)), in two batches: the first computes and captures, the second reuses the
    spans at other offsets and in other orders; a later request of one batch may reuse what an
    earlier one computed."""
    rng = np.random.default_rng(len(prompts))
    texts = [bytes(rng.integers(97, 123, n).tolist()).decode() for n in (23, 5, 40, 14, 9, 31, 2)]
    items = [Span(t) for t in texts[:4]] + [Prompt(t) for t in texts[4:]]
    parts = [[items[i] for i, _ in p] for p in prompts]
    parts = [p[::-1] if prompts[k][0][1] else p for k, p in enumerate(parts)]
    eng = _fresh(llm, span_map_gb=None, span_map_host_gb=0.0)
    half = len(parts) // 2
    err = _run(llm, [parts[:half] + parts[:1], parts[half:] + [parts[0][::-1]]])
    assert err < 1e-5, _span_stats(eng)


@pytest.fixture(scope="module")
def small_llm():
    """Few KV blocks (attention blocks evicted, and with them the maps above them), a span-map
    store of three device slots."""
    return _slow_decay(LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=2,
                           max_num_batched_tokens=64, min_token_bucket=64, max_model_len=512,
                           block_size=16, num_kv_blocks=24,
                           span_map_gb=3.5 * 29188 / (1 << 30)))


@pytest.mark.slow  # CI time: --run-slow
def test_maps_follow_their_blocks_under_kv_eviction(small_llm):
    eng = small_llm.llm_engine
    rng = np.random.default_rng(5)
    docs = _docs(rng, 30, 12, 44, 20, 7, 26)
    q = Prompt("and so?")
    batches = [[[docs[i % 6], docs[(i + 1) % 6], q] for i in range(k, k + 3)] for k in (0, 2, 4, 1)]
    batches.append([[docs[0], docs[1], q], [docs[5], docs[4], docs[3], q]])
    worst = 0.0
    for batch in batches:
        worst = max(worst, _run(small_llm, [batch]))
        store, table = eng.hybrid_cache.spans.store, eng.bm.table
        for e in list(store.device.values()) + list(store.host.values()):
            assert all(h in table for h in e.deps), "a map outlived one of its span's blocks"
    st_ = _span_stats(eng)
    print(f"max abs logprob error vs the float64 reference: {worst:.2e}; {st_}")
    assert worst < 1e-5 and st_["span_maps_evicted"] > 0 and st_["spans_skipped"] > 0
    assert eng.bm.num_evicted > 0


def _long_doc(rng, n):
    return Span(bytes(rng.integers(97, 123, n).tolist()).decode())


def test_spans_longer_than_a_step_are_captured_in_pieces_and_reused(llm):
    """Issue 29 item 1: spans of 150 to 230 tokens (64-token steps: 60 a sequence) are computed
    in pieces over several steps, their maps composed piece by piece in one slot (a step may
    end one request's long span and start another's); a third request skips two of them.
    Outputs equal the float64 reference. A second batch reuses the long spans at other
    offsets, in other orders, with new questions: skipped whole (their tokens counted as
    cached), still exact."""
    eng = _fresh(llm)
    rng = np.random.default_rng(41)
    sys_a, q1, q2 = Prompt("system prompt"), Prompt("what is it?"), Prompt("and now?")
    d1, d2, d3, d4 = (_long_doc(rng, n) for n in (149, 229, 20, 179))
    err = _run(llm, [[[sys_a, d1, d3, d2, q1], [d4, q2], [d2, Prompt("x"), d1, q2]]])
    st = _span_stats(eng)
    assert err < 1e-5 and st["span_maps_captured"] == 4, st
    assert st["spans_skipped"] == 2, st  # the third request's d2 and d1
    outs = llm.generate([[d4, d1, Prompt("new")], [Prompt("y"), d2, q1]], SP, use_tqdm=False)
    err = max(err, max(_check(llm, o) for o in outs))
    st = _span_stats(eng)
    print(f"max abs logprob error vs the float64 reference: {err:.2e}; {st}")
    assert err < 1e-5 and st["spans_skipped"] == 5 and st["span_maps_captured"] == 4
    # blocks of 16 (SSEP + text, padded): d1 150 tokens -> 10 blocks, d2 230 -> 15, d4 180 -> 12
    assert st["span_tokens_skipped"] == 16 * (2 * 10 + 2 * 15 + 12)
    assert outs[0].num_cached_tokens >= 16 * (12 + 10) and outs[1].num_cached_tokens >= 16 * 15


def test_two_requests_continue_long_spans_in_one_step(llm, monkeypatch):
    """Steps where two requests each carry a long span's map on (a short span that does not fit
    the rest of a step leaves the budget to the other request): every piece reads its own entry."""
    from serving.hybrid import span_step
    continuing, fill = [], span_step.fill_maps

    def counted(batch, v, starts):
        fill(batch, v, starts)
        continuing.append(int((v["cap_cont"] > 0).sum()))
    monkeypatch.setattr(span_step, "fill_maps", counted)
    _fresh(llm)
    rng = np.random.default_rng(41)
    d1, d2, d3, d4, d5 = (_long_doc(rng, n) for n in (100, 110, 45, 120, 45))
    err = _run(llm, [[[d1, d3, d2, d5, Prompt("what is it?")], [d4, Prompt("and now?")]]])
    assert err < 1e-5 and max(continuing) == 2, continuing


def test_a_long_span_gets_a_slot_beside_the_maps_its_request_pins(llm):
    """Two device slots: a request that computes a long span before two cached ones pins one of
    them only, so the long span's pieces have a slot (pinning both would stall it for good)."""
    groups = llm.config.span_maps
    nbytes = _fresh(llm).hybrid_cache.spans.store.nbytes
    llm.config.span_maps = dataclasses.replace(groups, budget_gb=2.5 * nbytes / (1 << 30))
    eng = _fresh(llm)
    try:
        rng = np.random.default_rng(47)
        c1, c2 = _docs(rng, 20, 30)
        err = _run(llm, [[[c1, c2, Prompt("q")]], [[_long_doc(rng, 150), c1, c2, Prompt("q2")]]])
        st = _span_stats(eng)
        assert st["span_map_device_slots"] == 2 and st["spans_skipped"] == 1, st
        assert err < 1e-5
    finally:
        llm.config.span_maps = groups
        _fresh(llm)


def test_a_preempted_half_captured_long_span_is_recomputed_exactly(llm):
    """A request preempted with a long span half captured (its map so far in a held slot): the
    slot is freed, nothing half-made is ever served, and the span is captured again from its
    start when the request comes back; a later request reuses the whole map exactly."""
    eng = _fresh(llm)
    rng = np.random.default_rng(43)
    doc, q = _long_doc(rng, 200), Prompt("why?")
    ids, _ = llm.to_token_ids([Prompt("sys"), doc, q])
    eng.add_request("half", ids, SP)
    seq = eng.scheduler.waiting[0]
    outs = []
    while not seq.span.partial:
        outs += eng.step()
    store = eng.hybrid_cache.spans.store
    (part,) = seq.span.partial.values()
    assert not part.entry.written and part.entry.pins == 1
    eng._read_back_early()  # as the scheduler does before it preempts
    eng.scheduler.preempt(seq)
    assert not seq.span.partial and part.entry.key not in store.device  # slot freed
    while eng.has_unfinished():
        outs += eng.step()
    assert seq.num_preemptions == 1 and _check(llm, outs[0]) < 1e-5
    st = _span_stats(eng)
    assert st["span_maps_captured"] == 1 and st["span_maps_stored"] == 2, st  # one discarded
    err = _run(llm, [[[doc, Prompt("again?")]]])
    assert err < 1e-5 and _span_stats(eng)["spans_skipped"] == 1

