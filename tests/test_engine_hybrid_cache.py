"""Prefix caching on a hybrid model (tiny_qwen3_5): a request that resumes from a recurrent
checkpoint gives the tokens and logprobs of the same request computed from scratch.

The oracle for every request is the same request with a cache_salt nobody else uses (no block and
no checkpoint can hit: the engine computes it all). One engine (one compile) serves every test;
each test isolates its traffic with its own salts. A request that resumed nothing
(num_cached_tokens == 0) was computed from scratch already; the others are compared. The pool is
small (80 KV blocks, 4 device and 4 host checkpoint slots) so workloads evict, offload, preempt."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipic_jax import LLM, SamplingParams
from minipic_jax.models import qwen3_5
from minipic_jax.prompts import Prompt, Span

CKPT_BYTES = 16896  # tiny_qwen3_5: 3 GDN layers x (128 x 3 conv + 4 x 16 x 16 delta) x 4 bytes
SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
_salts = itertools.count()


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=4,
               max_num_batched_tokens=64, min_token_bucket=64, max_model_len=1280,
               block_size=16, num_kv_blocks=80, checkpoint_gb=4 * CKPT_BYTES / 2**30,
               cpu_offload_gb=8 * CKPT_BYTES / 2**30, checkpoints_per_prompt=4)


def _alone(llm, prompts, sp=SP):
    """The oracle: each prompt computed from scratch (a fresh salt: nothing can hit)."""
    return [llm.generate([p], sp, use_tqdm=False, cache_salt=f"ref{next(_salts)}")[0]
            for p in prompts]


def _assert_exact(llm, got, prompts, sp=SP, limit=None):
    """Outputs that resumed from a checkpoint equal their prompts computed from scratch."""
    hit = [i for i, o in enumerate(got) if o.num_cached_tokens > 0][:limit]
    assert hit, "no request resumed from a checkpoint: the test checks nothing"
    _assert_same([got[i] for i in hit], _alone(llm, [prompts[i] for i in hit], sp))


def _assert_same(got, want):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, f"request {i}"
        lg = [next(iter(d.values())).logprob for d in g.outputs[0].logprobs]
        lw = [next(iter(d.values())).logprob for d in w.outputs[0].logprobs]
        assert np.max(np.abs(np.subtract(lg, lw))) <= 1e-5, f"request {i}: {lg} vs {lw}"


def _tokens(rng, n):
    return rng.integers(0, 256, n).tolist()


def test_908_token_system_prompt_caches_896_tokens_after_the_first(llm):
    """vLLM's hybrid caching caches 0 tokens of a 908-token shared prefix (its blocks are 528+
    tokens and a prefix must end on one); a checkpoint at the last 64-token chunk boundary
    serves every later request: 896 tokens."""
    rng = np.random.default_rng(908)
    system = _tokens(rng, 908)
    prompts = [system + _tokens(rng, int(n)) for n in rng.integers(8, 40, 4)]
    salt = f"sys{next(_salts)}"
    first = llm.generate([prompts[0]], SP, use_tqdm=False, cache_salt=salt)
    rest = llm.generate(prompts[1:], SP, use_tqdm=False, cache_salt=salt)
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [896] * 3
    _assert_exact(llm, rest, prompts[1:], limit=2)


@settings(max_examples=5, deadline=None, derandomize=True, database=None)
@given(depths=st.lists(st.integers(0, 330), min_size=2, max_size=3),
       tails=st.lists(st.integers(1, 70), min_size=3, max_size=3))
def test_resume_at_any_overlap_depth_is_exact(llm, depths, tails):
    """Requests sharing a random prefix to random depths (not chunk- or block-aligned): each
    resumes at the deepest checkpoint at or below the blocks it matches, never deeper, and its
    output equals the request computed from scratch."""
    rng = np.random.default_rng(len(depths) * 1000 + depths[0])
    print(f"depths={depths} tails={tails}")
    base = _tokens(rng, 330)
    prompts = [base[:d] + _tokens(rng, t) for d, t in zip(depths, tails)]
    salt = f"hyp{next(_salts)}"
    got = [llm.generate([p], SP, use_tqdm=False, cache_salt=salt)[0] for p in prompts]
    for i, (p, o) in enumerate(zip(prompts, got)):
        lcp = max((_lcp(p, q) for q in prompts[:i]), default=0)
        matched = min(lcp, len(p) - 1) // 16 * 16
        assert o.num_cached_tokens % 64 == 0 and o.num_cached_tokens <= matched
    hit = [i for i, o in enumerate(got) if o.num_cached_tokens > 0]
    _assert_same([got[i] for i in hit], _alone(llm, [prompts[i] for i in hit]))
    _HITS.append(len(hit))


_HITS: list[int] = []


def test_the_depth_examples_did_resume():
    if not _HITS:
        pytest.skip("runs after test_resume_at_any_overlap_depth_is_exact (same module)")
    assert sum(_HITS) >= 3, _HITS  # the property test above was not vacuous


def _lcp(a, b):
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def test_eviction_offload_and_preemption_while_restoring_stay_exact(llm):
    """Four 192-token prefixes (12 planned checkpoints for 4 device + 4 host slots) push
    checkpoints to the host tier and out; a request reaching one that sits on the host tier
    resumes from it (it comes back to the device), one sharing a whole prefix resumes too;
    then four requests restoring from one prefix outgrow the 80-block pool and are preempted and
    restored again. The resumed outputs equal the from-scratch ones."""
    rng = np.random.default_rng(5)
    prefixes = [_tokens(rng, 192) for _ in range(4)]
    salt = f"evict{next(_salts)}"
    st0 = llm.llm_engine.get_stats()
    first = [p + _tokens(rng, 20) for p in prefixes]
    got = [llm.generate([p], SP, use_tqdm=False, cache_salt=salt)[0] for p in first]
    on_host = _on_host(llm, prefixes, salt)
    assert on_host, "no checkpoint reached the host tier"
    k, c = on_host[-1]
    again = [prefixes[k][:c + 12] + _tokens(rng, 25), prefixes[2] + _tokens(rng, 25)]
    got += [llm.generate([p], SP, use_tqdm=False, cache_salt=salt)[0] for p in again]
    st1 = llm.llm_engine.get_stats()
    long_sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    crowd = [prefixes[3] + _tokens(rng, 264) for _ in range(4)]  # 4 x 17 own + 12 shared
    got_c = llm.generate(crowd, long_sp, use_tqdm=False, cache_salt=salt)
    st2 = llm.llm_engine.get_stats()
    for k in ("checkpoints_offloaded", "checkpoints_onloaded", "checkpoints_evicted"):
        assert st1[k] > st0[k], (k, {j: (st0[j], st1[j]) for j in st0 if "checkpoint" in j})
    assert st2["preemptions"] > st1["preemptions"]
    assert got[4].num_cached_tokens == c and got[5].num_cached_tokens > 0
    _assert_exact(llm, got, first + again)
    again_c = [i for i, o in enumerate(got_c) if o.metrics.num_preemptions > 0]
    assert again_c and all(got_c[i].num_cached_tokens == 192 for i in again_c)
    _assert_exact(llm, [got_c[i] for i in again_c], [crowd[i] for i in again_c], long_sp, 1)


def test_a_second_call_continuing_the_first_ones_outputs_stays_exact(llm):
    """Issue 12's shape: call 1 caches three prompts sharing a base to random depths, and their
    generated blocks; call 2 sends their continuations (prompt + output) cut a few tokens past a
    64-token checkpoint position, a repeat, a longer cut of the base, and each of those with
    another last token, 4 at a time in 64-token steps. A request admitted in the step that
    writes the checkpoint it would resume from used to restore the slot unwritten, and
    checkpointed the wrong state on, deeper, for the requests after it."""
    rng = np.random.default_rng(2)
    base, salt = _tokens(rng, 300), f"calls{next(_salts)}"
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0)
    first = [base[:int(d)] + _tokens(rng, 3) for d in rng.integers(120, 260, 3)]
    out = llm.generate(first, sp, use_tqdm=False, cache_salt=salt)
    second = []
    for p, o in zip(first, out):
        full = p + o.outputs[0].token_ids
        cut = len(full) // 64 * 64 + int(rng.integers(1, 9))
        second.append(full[:cut] + _tokens(rng, max(0, cut - len(full))))
    second += [first[0], base[:int(rng.integers(200, 300))]]
    second += [q[:-1] + [7] for q in second]
    got = llm.generate(second, sp, use_tqdm=False, cache_salt=salt)
    _assert_exact(llm, got, second, sp, limit=3)


def test_a_checkpoint_whose_step_never_launched_is_not_restored(llm, monkeypatch):
    """The launch of the step that takes a prompt's checkpoint at 64 fails: recovery drops the
    entry it reserved (a later step's launch used to mark it written, and a request resumed from
    the slot no step wrote)."""
    rng = np.random.default_rng(64)
    base, salt = _tokens(rng, 100), f"fault{next(_salts)}"
    runner = llm.llm_engine.runner
    launch = runner.launch

    def fail_once(*args, **kwargs):
        runner.launch = launch
        raise RuntimeError("injected launch fault")

    monkeypatch.setattr(runner, "launch", fail_once)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([base + [1, 2, 3]], SP, use_tqdm=False, cache_salt=salt)
    prompts = [base + [4, 5, 6], base + [7, 8, 9]]
    got = [llm.generate([p], SP, use_tqdm=False, cache_salt=salt)[0] for p in prompts]
    assert [o.num_cached_tokens for o in got] == [0, 64]
    _assert_exact(llm, got, prompts)


def test_more_restores_than_the_step_has_rows_wait_in_order_and_stay_exact(llm, monkeypatch):
    """Four requests sharing a 128-token prefix arrive together, 16 tokens each to compute: one
    64-token step could admit and restore all four. With one restore row a step (hybrid_prefix
    .RESTORE_ROWS; this engine's steps carry R = restore_rows(4) = 4) each admission that finds
    no row waits a step in its place: one restore a step, in submission order, and every output
    equals its prompt computed from scratch (issue 29)."""
    from serving.hybrid import hybrid_prefix
    rng = np.random.default_rng(16)
    base, salt = _tokens(rng, 140), f"rows{next(_salts)}"
    llm.generate([base], SP, use_tqdm=False, cache_salt=salt)
    cache, per_step, cur = llm.llm_engine.hybrid_cache, [], []
    annotate, launched = cache.annotate, cache.after_launch
    monkeypatch.setattr(hybrid_prefix, "RESTORE_ROWS", 1)
    monkeypatch.setattr(cache, "restores_left", 1)
    monkeypatch.setattr(cache, "annotate", lambda mgr, e: annotate(mgr, e) or (
        e.restore_slot >= 0 and cur.append(e.seq.seq_id)))
    monkeypatch.setattr(cache, "after_launch", lambda: (
        launched(), per_step.append(list(cur)), cur.clear()))
    prompts = [base[:128] + _tokens(rng, 16) for _ in range(4)]
    got = llm.generate(prompts, SP, use_tqdm=False, cache_salt=salt)
    assert [o.num_cached_tokens for o in got] == [128] * 4
    order = [i for step in per_step for i in step]
    assert [len(step) for step in per_step if step] == [1] * 4 and order == sorted(order), per_step
    monkeypatch.undo()
    cache.restores_left = hybrid_prefix.RESTORE_ROWS
    _assert_same(got, _alone(llm, prompts))


def _on_host(llm, prefixes, salt):
    """(prefix index, depth) of the checkpoints of these prefixes now on the host tier."""
    from serving.cache.hashing import block_keys, make_hash_fn, root_hash
    h = make_hash_fn(llm.config.hash_algo)
    store, out = llm.llm_engine.hybrid_cache.store, []
    for k, p in enumerate(prefixes):
        flat = np.zeros(len(p) // 16, bool)
        keys = block_keys(h, p, 16, flat, flat, root_hash(h, salt))
        out += [(k, c) for c in (64, 128, 192) if keys[c // 16 - 1] in store.host]
    return out


@pytest.mark.slow  # ~16 s; test_engine_hybrid_spans keeps the warm span path in the default run
def test_span_prompts_skip_cached_spans_only_pdep_works(llm):
    """Spans on hybrids (issue 19, tests/test_engine_hybrid_spans.py checks their outputs): the
    second time, the cached span's three blocks are skipped (its map composed), nothing else is
    reused (no checkpoints in span prompts)."""
    salt = f"spans{next(_salts)}"
    for cached in (0, 48):
        out = llm.generate([[Span("a" * 40), Prompt("question?")]], SP, use_tqdm=False,
                           cache_salt=salt)
        assert out[0].num_cached_tokens == cached and len(out[0].outputs[0].token_ids) == 4
    out = llm.generate([[Prompt("a" * 40), Prompt("question?")]], SP, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_stats_report_the_store_and_bytes_exactly(llm):
    st_ = llm.llm_engine.get_stats()
    cfg = llm.llm_engine.loaded.cfg
    assert st_["checkpoint_bytes"] == qwen3_5.state_nbytes(cfg)["total"] == CKPT_BYTES
    pool = llm.llm_engine.runner.ck_pool
    assert pool.conv.nbytes + pool.delta.nbytes == 4 * CKPT_BYTES
    assert (st_["checkpoint_device_slots"], st_["checkpoint_host_slots"]) == (4, 4)
    assert st_["checkpoint_device_bytes"] == st_["checkpoints_device"] * CKPT_BYTES
    assert st_["checkpoint_host_bytes"] == st_["checkpoints_host"] * CKPT_BYTES
    assert st_["tokens_recomputed"] == st_["tokens_matched"] - st_["tokens_resumed"] >= 0
    assert st_["checkpoint_strategy"] == "dp" and st_["checkpoint_plan"]
    assert all(p % 64 == 0 for p in st_["checkpoint_plan"])
