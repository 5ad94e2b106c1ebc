"""Request isolation in the KV pool (serving/cache/page_zeroing.py): a page the block manager hands
out is zeroed on the device before the step that first uses it, so a slot its new owner never
writes (a pad slot of a Span's last block, the tail of a sequence's last block) holds exactly 0,
whatever the block held before. The GPU attention kernels multiply the softmax weights by whole
pages of V (0 x NaN = NaN): they rely on it.

The pool is poisoned with NaN (all of it after construction, or every free page between two
batches); after every step, every slot of every page a live sequence reads through its block
table must be finite where that sequence (or the request that computed a shared block) wrote
it and exactly 0 elsewhere, and the outputs must equal an unpoisoned engine's bit for bit. A
copy-in from the host tier must arrive intact (not zeroed after it lands)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES, make_tiny_llm
from minipic_jax import LLM, Prompt, SamplingParams, Span, build_prompt
from serving.cache.kv_pool import page_leaf

B = 16
SP = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)


def page_leaves(eng):
    return [x for x in jax.tree.leaves(eng.runner.cache) if page_leaf(x, eng.num_blocks, B)]


def poison(eng, blocks=None) -> None:
    """Set every slot of `blocks` (default: the whole pool) to NaN in every page leaf."""
    ids = jnp.asarray(np.arange(eng.num_blocks) if blocks is None else np.asarray(blocks, int))
    eng.runner.cache = jax.tree.map(
        lambda x: x.at[ids].set(jnp.nan) if page_leaf(x, eng.num_blocks, B) else x,
        eng.runner.cache)


def free_blocks(eng) -> list[int]:
    return [b for b in range(eng.num_blocks) if eng.bm.ref[b] == 0]


def assert_unwritten_slots_are_zero(eng) -> int:
    """Check the pages each live sequence reads (blocks [0, ceil(num_computed / B)) of its table):
    a slot of a computed non-pad token is finite, every other slot exactly 0. Returns the number
    of unwritten slots checked."""
    pages = [np.asarray(x) for x in page_leaves(eng)]
    checked = 0
    for seq in eng.scheduler.running + eng.scheduler.span_jobs:
        n, prompt = seq.num_computed, seq.num_prompt_tokens
        for j in range(-(-n // B)):
            idx = np.arange(j * B, (j + 1) * B)
            pad = np.zeros(B, bool)
            in_prompt = idx < prompt
            pad[in_prompt] = seq.layout.is_pad[idx[in_prompt]]
            wrote = (idx < n) & ~pad
            b = seq.block_table[j]
            for x in pages:
                assert np.isfinite(x[b][wrote]).all(), (seq.request_id, j, b)
                assert (x[b][~wrote] == 0).all(), (
                    f"request {seq.request_id}: block {j} (page {b}) has unwritten slots "
                    f"{np.flatnonzero(~wrote).tolist()} holding {x[b][~wrote].ravel()[:4]}")
            checked += int((~wrote).sum())
    return checked


def run(llm, tag: str, prompts) -> tuple[list, int]:
    """Run `prompts` step by step on the engine, checking the live pages after every step;
    returns (outputs in prompt order, unwritten slots checked)."""
    eng = llm.llm_engine
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}{i}", p, SP)
    outs, checked = {}, 0
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step())
        checked += assert_unwritten_slots_are_zero(eng)
    return [outs[f"{tag}{i}"] for i in range(len(prompts))], checked


def as_tuple(out):
    o = out.outputs[0]
    return (o.token_ids, [d[t].logprob for d, t in zip(o.logprobs, o.token_ids)],
            out.num_cached_tokens)


def prompts_with_pads(llm, rng, count: int) -> list[list[int]]:
    """Prompt / Span / Prompt layouts (each Span padded to its block's end), every length random,
    so pad slots sit inside blocks and last blocks are partial; one long plain prompt, admitted
    whole, takes more fresh pages than its step's own input holds."""
    def toks(n):
        return [int(t) for t in rng.integers(1, 256, n)]
    m = llm.llm_engine.markers
    out = [build_prompt([Prompt(toks(int(rng.integers(1, 20)))),
                         Span(toks(int(rng.integers(3, 40)))),
                         Prompt(toks(int(rng.integers(1, 20))))], block_size=B, **m)
           for _ in range(count - 1)]
    return out + [toks(150)]


def poisoned_vs_clean(make, seed: int, counts=(5, 6)) -> None:
    """Two engines from `make()` run the same two batches (with pads); one has its whole pool
    NaN before the first, and every free page NaN (the prefix cache forgotten, so nothing is a
    hit on a poisoned page) before the second, which reuses the first's blocks. Unwritten slots
    must be 0 in both, and the outputs equal."""
    outs, checked = {}, {}
    for poisoned in (False, True):
        llm = make()
        eng, rng = llm.llm_engine, np.random.default_rng(seed)
        if poisoned:
            poison(eng)
        first, n1 = run(llm, "a", prompts_with_pads(llm, rng, counts[0]))
        eng.reset_prefix_cache()
        if poisoned:
            poison(eng, free_blocks(eng))
        second, n2 = run(llm, "b", prompts_with_pads(llm, rng, counts[1]))
        outs[poisoned] = [as_tuple(o) for o in first + second]
        checked[poisoned] = n1 + n2
        assert eng.runner.zeroer.num_separate > 0  # the long prompt's pages, before its step
    assert checked[True] > 0
    assert outs[True] == outs[False]


# the engines here run on one token bucket (min_token_bucket = max_num_batched_tokens): one
# compiled step per sampling mode instead of one per bucket (CI time)
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_poisoned_pool_unwritten_slots_are_zero_and_outputs_equal(async_scheduling, fresh_rng):
    poisoned_vs_clean(lambda: make_tiny_llm(async_scheduling=async_scheduling, num_kv_blocks=40,
                                            max_num_seqs=4, max_num_batched_tokens=64,
                                            min_token_bucket=64),
                      int(fresh_rng.integers(1 << 30)))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the zeroing kernel runs on a GPU")
def test_poisoned_pool_with_the_zeroing_kernel(fresh_rng, monkeypatch):
    """page_zeroing.ZERO_KERNEL on (the step's zeroing as one Pallas kernel, compiled): the same
    isolation and outputs as the scatters."""
    from serving.cache import page_zeroing
    monkeypatch.setattr(page_zeroing, "ZERO_KERNEL", True)
    poisoned_vs_clean(lambda: make_tiny_llm(async_scheduling=True, num_kv_blocks=40,
                                            max_num_seqs=4, max_num_batched_tokens=64,
                                            min_token_bucket=64),
                      int(fresh_rng.integers(1 << 30)))


@pytest.mark.slow  # CI time (14 s of compiles); the Llama engines above cover the zeroing in CI
def test_hybrid_model_pages_are_zeroed_too(fresh_rng):
    """Qwen3.5 (Gated DeltaNet + attention): its attention layers' pages are zeroed (its
    recurrent slots are reset by their own flags). One token bucket (CI time: each step variant
    of this model compiles for seconds)."""
    poisoned_vs_clean(lambda: LLM(str(FIXTURES / "qwen3_5_tied"), max_num_seqs=3,
                                  max_num_batched_tokens=64, min_token_bucket=64,
                                  max_model_len=192, num_kv_blocks=20),
                      int(fresh_rng.integers(1 << 30)), counts=(3, 3))


def test_host_tier_copy_in_arrives_intact_in_a_poisoned_pool(fresh_rng):
    """A prefix evicted to the host tier and copied back in: its pages are not zeroed after the
    copy lands (the tokens and logprobs of an engine without prefix caching, which computes
    everything), while the fresh pages around it are (the slot checks)."""
    seed = int(fresh_rng.integers(1 << 30))
    outs = {}
    for caching in (False, True):
        llm = make_tiny_llm(num_kv_blocks=14, max_num_seqs=2, max_num_batched_tokens=64,
                            min_token_bucket=64, cpu_offload_gb=0.01,
                            enable_prefix_caching=caching)
        eng, rng = llm.llm_engine, np.random.default_rng(seed)
        m = eng.markers
        system = [int(t) for t in rng.integers(1, 256, 4 * B)]

        def with_question(n):
            q = [int(t) for t in rng.integers(1, 256, n)]
            return build_prompt([Prompt(system), Span(q[:n // 2]), Prompt(q[n // 2:])],
                                block_size=B, **m)
        poison(eng)
        results = run(llm, "first", [with_question(9)])[0]
        others = [[int(t) for t in rng.integers(1, 256, 100)] for _ in range(3)]
        results += run(llm, "evict", others)[0]  # 7 blocks each: the prefix leaves the pool
        poison(eng, [b for b in free_blocks(eng) if eng.bm.hash[b] == -1])
        results += run(llm, "again", [with_question(11)])[0]
        outs[caching] = [as_tuple(o)[:2] for o in results]
    assert eng.offload.num_restored >= 4, eng.offload.num_restored  # the 4 system blocks
    assert results[-1].num_cached_tokens >= 4 * B
    for (tokens, lp), (want_tokens, want_lp) in zip(outs[True], outs[False]):
        assert tokens == want_tokens
        np.testing.assert_allclose(lp, want_lp, atol=1e-5)


def test_recurrent_state_shaped_like_pages_is_neither_zeroed_nor_moved():
    """A page leaf is a K/V page array by field, not by shape alone: with 4 state slots, 4 value
    heads and 4-token blocks, Qwen3.5's delta state [4, 4, Dk, Dv] has a page pool's leading dims
    (as 16 heads do at the default block size 16 when max_num_seqs == num_kv_blocks); zeroing
    fresh pages or moving pages to the host tier must leave it alone."""
    from configs.presets import get_preset
    from minipic_jax.models import qwen3_5
    from serving.cache.page_zeroing import zero_pages
    from serving.tiers.offload import PageMover

    cfg = get_preset("tiny_qwen3_5")
    slots = pages = cfg.linear_num_value_heads
    cache = qwen3_5.init_cache(cfg, pages, pages, max_num_seqs=slots)
    assert cache.delta[0].shape[:2] == (pages, pages)  # the collision this test is about
    cache = jax.tree.map(jnp.ones_like, cache)
    zeroed = zero_pages(cache, jnp.array([1], jnp.int32), pages, pages)
    for x in zeroed.delta + zeroed.conv:
        assert bool(jnp.all(x == 1))
    for x in zeroed.k + zeroed.v:
        assert bool(jnp.all(x[1] == 0)) and bool(jnp.all(x[0] == 1))
    moved = PageMover(pages, pages).gather(cache, [1]).materialize()
    assert len(moved) == len(cache.k) + len(cache.v)


def test_one_zeroing_kernel_is_the_per_leaf_scatter(fresh_rng):
    """paged_attention/triton_zero.py (page_zeroing.ZERO_KERNEL): one program per page id zeroes
    that page in every leaf, interpreted here: the leaves the per-leaf XLA scatters give, bit
    for bit, with padding ids (P, -1), a repeated id and pages left alone; `takes` refuses
    mixed leaves and non-power-of-2 rows."""
    from kernels_pallas.paged_attention import triton_zero
    leaves = [jnp.asarray(fresh_rng.standard_normal((9, 4, 2, 8)), jnp.bfloat16)
              for _ in range(5)]
    ids = jnp.asarray([3, 9, 0, 3, -1, 7, 9, 9], jnp.int32)
    got = jax.jit(lambda ls, i: triton_zero.zero_pages_triton(ls, i, interpret=True))(leaves, ids)
    for x, y in zip(leaves, got):
        want = x.at[jnp.asarray([3, 0, 7])].set(0)  # (JAX's .at would wrap -1 to page 8)
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
        assert bool(jnp.all(y[1] == x[1]))
    assert triton_zero.takes(leaves, 4) == ""
    assert "several shapes" in triton_zero.takes(leaves + [leaves[0][:, :2]], 4)
    assert "power of 2" in triton_zero.takes([jnp.zeros((9, 4, 3, 8))], 4)


def test_a_steps_zeroing_lowers_to_one_kernel_on_a_gpu(monkeypatch):
    """With ZERO_KERNEL a one-GPU step's zeroing (Qwen3.5-0.8B's 6 attention layers: 12 page
    leaves of [P, 16, 2, 256] bf16) lowers for an H100 to one Triton call aliasing the 12
    leaves, and no scatter; off, 12 scatters."""
    from serving.cache import page_zeroing
    from tests.cuda_lowering import abstract_h100
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    sd = jax.ShapeDtypeStruct
    cache = {"k": [sd((512, 16, 2, 256), jnp.bfloat16)] * 6,
             "v": [sd((512, 16, 2, 256), jnp.bfloat16)] * 6}
    monkeypatch.setattr(page_zeroing, "page_mask", lambda c, p, b: [True] * 12)
    texts = {}
    for on in (False, True):
        monkeypatch.setattr(page_zeroing, "ZERO_KERNEL", on)
        with abstract_h100():
            texts[on] = jax.jit(lambda c, i: page_zeroing.zero_pages(
                c, i, 512, 16)).trace(cache, sd((32,), jnp.int32)).lower(
                lowering_platforms=("cuda",)).as_text()
    assert texts[False].count("stablehlo.scatter") >= 12 and "xla.gpu.triton" not in texts[False]
    assert texts[True].count("xla.gpu.triton") == 1 and "stablehlo.scatter" not in texts[True]
    assert texts[True].count("output_operand_alias<") == 12
