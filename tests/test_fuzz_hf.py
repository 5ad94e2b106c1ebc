"""Differential fuzzer: the engine against HF transformers on random Span/Prompt structures.

The oracle is tests/fixtures/fuzz_cases.json, made by scripts/make_fuzz_fixtures.py
(transformers 5.24.0, float64, Block-Attention as a custom 4D mask + position_ids): requests
drawn from a small pool of shared spans and system prompts, and follow-up turns that repeat a
request with its greedy output and add segments (they reuse blocks filled during generation).
Every configuration replays the cases: greedy tokens equal, the top-3 logprobs of every step
within 1e-5 of HF's (float32 engine).

Configurations: block sizes 8/16/32; a large pool, or a tiny one that forces eviction and
preemption with a host tier of three blocks; fcfs/barrier/isps; sync and async loops. The
default run replays a few cases on a representative pair of configurations; the full sweep
(every case x every configuration) is marked slow: `pytest tests/test_fuzz_hf.py --run-slow`.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from conftest import FIXTURES
from minipic_jax import LLM, Prompt, SamplingParams, Span, build_prompt

FUZZ = json.loads((FIXTURES / "fuzz_cases.json").read_text())
ATOL = 1e-5
HOST_TIER_BLOCKS = 3
CONFIGS = [dict(block_size=bs, tiny=tiny, scheduling_policy=policy, async_scheduling=a)
           for bs, tiny, policy, a in itertools.product((8, 16, 32), (False, True),
                                                        ("fcfs", "barrier", "isps"), (False, True))]
# the default run: every feature at least once, on few compiles
DEFAULT = [dict(block_size=8, tiny=True, scheduling_policy="isps", async_scheduling=True),
           dict(block_size=32, tiny=False, scheduling_policy="barrier", async_scheduling=False)]
DEFAULT_CASES = 3


def config_id(c):
    return (f"bs{c['block_size']}-{'tiny' if c['tiny'] else 'large'}-{c['scheduling_policy']}-"
            f"{'async' if c['async_scheduling'] else 'sync'}")


def prompt_ids(req, block_size):
    segs = [(Prompt if kind == "P" else Span)(toks) for kind, toks in req["segments"]]
    return build_prompt(segs, block_size=block_size, **FUZZ["markers"])


def make_llm(c, cases):
    bs = c["block_size"]
    longest = max(len(prompt_ids(r, bs)) for case in cases for t in case["turns"] for r in t)
    need = -(-(longest + FUZZ["max_new"]) // bs)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=512 * 8 // bs)
    if c["tiny"]:
        # one request fits, a few do not: eviction, preemption and host-tier churn
        kw = dict(max_num_seqs=3, max_num_batched_tokens=32, num_kv_blocks=need)
    llm = LLM(str(FIXTURES / FUZZ["model"]), dtype="float32", max_model_len=512,
              block_size=bs, scheduling_policy=c["scheduling_policy"],
              async_scheduling=c["async_scheduling"], **FUZZ["markers"], **kw,
              cpu_offload_gb=HOST_TIER_BLOCKS * kv_bytes_per_token() * bs / 2**30 if c["tiny"]
              else 0.0)
    if c["tiny"]:
        assert llm.llm_engine.offload.capacity == HOST_TIER_BLOCKS
    return llm


def kv_bytes_per_token():
    cfg = json.loads((FIXTURES / FUZZ["model"] / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 4


def compare(req, out, where):
    """Tokens equal, HF's top logprobs within ATOL at every step. Returns the comparisons."""
    got = out.outputs[0]
    assert got.token_ids == req["greedy"], f"{where}: tokens {got.token_ids} != HF {req['greedy']}"
    n = 0
    for j, (ids, lps) in enumerate(zip(req["top_ids"], req["top_logprobs"])):
        for tid, want in zip(ids, lps):
            assert tid in got.logprobs[j], f"{where} step {j}: HF top token {tid} missing"
            err = abs(got.logprobs[j][tid].logprob - want)
            assert err < ATOL, f"{where} step {j} token {tid}: |engine - HF| = {err:.2e}"
            n += 1
    return n + len(req["greedy"])


def replay(c, cases):
    """Run every case's turns through one engine; returns the number of comparisons."""
    llm = make_llm(c, cases)
    bs = c["block_size"]
    sp = SamplingParams(temperature=0.0, max_tokens=FUZZ["max_new"], ignore_eos=True,
                        logprobs=FUZZ["top"])
    n, seed_index = 0, {case["seed"]: i for i, case in enumerate(cases)}
    for turn in (0, 1):
        reqs = [(case["seed"], k, r) for case in cases for k, r in enumerate(case["turns"][turn])]
        outs = llm.generate([prompt_ids(r, bs) for _, _, r in reqs], sp, use_tqdm=False)
        for (seed, k, req), out in zip(reqs, outs):
            n += compare(req, out, f"{config_id(c)} case {seed} turn {turn} request {k}")
            if turn and not c["tiny"]:
                # the blocks the parent filled (prompt, then output but its last token) are
                # hits, up to the block holding the follow-up's last token
                parent = len(prompt_ids(cases[seed_index[seed]]["turns"][0][req["parent"]], bs))
                last = len(prompt_ids(req, bs)) - 1
                want = min((parent + FUZZ["max_new"] - 1) // bs, last // bs) * bs
                assert out.num_cached_tokens >= want, (seed, k, out.num_cached_tokens, want)
    eng = llm.llm_engine
    assert not eng.has_unfinished() and eng.bm.num_free == eng.num_blocks
    stats = eng.get_stats()
    if c["tiny"]:
        assert stats["blocks_evicted"] > 0 and stats["blocks_offloaded"] > 0, stats
    print(f"{config_id(c)}: {len(cases)} cases, {n} comparisons, preemptions "
          f"{stats['preemptions']}, restored from host {stats['blocks_restored']}")
    return n, stats


@pytest.mark.parametrize("c", DEFAULT, ids=config_id)
def test_engine_matches_hf_on_fuzz_cases(c):
    n, stats = replay(c, FUZZ["cases"][:DEFAULT_CASES])
    if c["tiny"]:  # these cases are known to preempt and to restore from the host tier
        assert stats["preemptions"] > 0 and stats["blocks_restored"] > 0, stats


@pytest.mark.slow
@pytest.mark.parametrize("c", CONFIGS, ids=config_id)
def test_engine_matches_hf_on_all_fuzz_cases(c):
    replay(c, FUZZ["cases"])


def test_fixture_is_what_the_script_describes():
    """The oracle file's own invariants: no marker id in prompts, margins respected."""
    marker_ids = set(FUZZ["markers"].values())
    for case in FUZZ["cases"]:
        for turn in case["turns"]:
            for req in turn:
                assert not marker_ids & {t for _, toks in req["segments"] for t in toks}
                for lps in req["top_logprobs"]:
                    assert np.all(-np.diff(lps) >= FUZZ["min_gap"])
