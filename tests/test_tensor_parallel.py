"""Tensor parallelism on forced host devices: TP=2 / TP=4 give TP=1's greedy tokens (and the HF
fixture's greedy tokens) with logprobs within 1e-5, KV pools split by KV heads, Megatron
all-reduces only (no logits gather), and clear errors for sizes the model cannot split.

The runs need XLA_FLAGS=--xla_force_host_platform_device_count=4 before JAX starts, so they run
in a subprocess (tests/tp_runs.py); the other tests' JAX stays on one device. The default run
covers Llama GQA at TP=2 and 4 (4 > KV heads: KV heads replicated), streamed loading (equal
to the old path; one tensor's slices on the host at a time) and a small Qwen3.5 engine at TP=2
(its recurrent state kept where the rules table places it, step after step); MINIPIC_RUN_SLOW=1 (or --run-slow)
adds Llama MHA and Qwen3.5 (GDN + gated attention) at TP=2 and 4, each also with prefix caching
and CPU offload at TP=2, and Qwen3.5 against the float64 reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from serving.config import Config
from tests.conftest import FIXTURES, REPO, once_per_run

RUN_SLOW = os.environ.get("MINIPIC_RUN_SLOW") == "1" or "--run-slow" in sys.argv
# per fixture: the largest logprob difference to TP=1 allowed (fp32 summation order only; the
# hybrid's recurrent state carries rounding from layer to layer: 2.2e-5 measured at TP=4, where
# TP=1 itself is 2.0e-5 from the float64 reference and TP=4 8.5e-6: test_tp_qwen3_5_...)
TOL = {"llama_gqa2_llama3rope": 1e-5, "llama_mha": 1e-5, "qwen3_5_gva2": 3e-5}


def _runs(fixture: str, *flags: str, sizes: str = "1,2,4") -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, "-m", "tests.tp_runs", fixture, sizes, *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(runs: dict, fixture: str, layers: int) -> dict:
    base = runs["1"]
    for tp in ("1", "2", "4"):  # the device block tables equal the host's, whole on every device
        assert runs[tp]["tables_equal"] and runs[tp]["tables_replicated"], f"TP={tp} tables"
    for i, (got, want) in enumerate(zip(base["tokens"], base["hf_greedy"])):
        assert got == want, f"TP=1 prompt {i}: {got} != HF {want}"
    for tp in ("2", "4"):
        r = runs[tp]
        assert r["tokens"] == base["tokens"], f"TP={tp} tokens differ"
        err = max(abs(a - b) for x, y in zip(r["logprobs"], base["logprobs"]) for a, b in zip(x, y))
        print(f"{fixture} TP={tp}: max |logprob - TP1| = {err:.2e}")
        assert err <= TOL[fixture], f"TP={tp}: logprob error {err:.2e}"
        assert r["cached"] == base["cached"]
        # the pool is split over KV heads: each device holds kv_heads / tp (at least 1)
        assert r["kv_spec"][2] == "tp" and set(r["kv_spec"][:2] + r["kv_spec"][3:]) == {"None"}
        assert r["kv_shard_shape"][2] == max(base["kv_shape"][2] // int(tp), 1)
        assert r["kv_shard_shape"][:2] == base["kv_shape"][:2]
        # Megatron: 2 per layer (attention / mixer out, MLP down), the vocab-split embedding
        # lookup, and the sampler's reductions over the vocab split; logits never gathered
        assert 2 * layers + 1 <= r["all_reduces"] <= 2 * layers + 6, r["all_reduces"]
        for shape in r["all_gather_shapes"]:
            assert "260" not in shape, f"logits gathered: {shape}"
    return base


def _check_cached(runs: dict, fixture: str) -> None:
    """TP=2 with prefix caching and a host tier (cpu_offload_gb) equals TP=1: the same tokens,
    logprobs, cached tokens, and blocks (and a hybrid's recurrent checkpoints) offloaded to host
    memory and brought back."""
    base, r = runs["cached"]["1"], runs["cached"]["2"]
    assert r["tokens"] == base["tokens"]
    err = max(abs(a - b) for x, y in zip(r["logprobs"], base["logprobs"]) for a, b in zip(x, y))
    print(f"{fixture} cached + offload TP=2: max |logprob - TP1| = {err:.2e}")
    assert err <= TOL[fixture], f"cached TP=2: logprob error {err:.2e}"
    assert r["cached"] == base["cached"] and min(base["cached"][-2:]) > 0, base["cached"]
    assert r["stats"] == base["stats"], (r["stats"], base["stats"])
    assert base["stats"]["blocks_offloaded"] > 0 and base["stats"]["blocks_restored"] > 0
    if "checkpoint_hits" in base["stats"]:
        s = base["stats"]
        assert min(s["checkpoint_hits"], s["checkpoints_offloaded"],
                   s["checkpoints_onloaded"]) > 0, s


def _f64_errors(runs: dict, fixture: str) -> dict:
    """Per TP size, the largest |logprob - float64 reference| (tests/hybrid_span_reference.py:
    the same prompts and generated tokens, token by token in numpy float64), and as "np32" that
    of the same numpy model in float32 (tests/float32_reference.py): float32's own floor."""
    from minipic_jax.loading import load_model
    from tests import hybrid_span_reference as hsr
    from tests.float32_reference import float32_reference, log_softmax
    lm = load_model(str(FIXTURES / fixture))
    h32 = float32_reference()
    base, m = runs["1"], runs["1"]["markers"]
    errs = {tp: 0.0 for tp in ("1", "2", "4", "np32")}
    for i, prompt in enumerate(base["prompts"]):
        out = base["tokens"][i]
        kept, seg, span = hsr.segments(prompt, 16, m["pad_token_id"], m["ssep_token_id"],
                                       m["pdep_token_id"])
        n = len(kept)  # generated tokens extend the last segment (a generated pad id is text)
        seg = np.concatenate([seg, np.full(len(out) - 1, seg[-1])])
        ref = hsr.reference_logprobs(lm.params, lm.cfg, kept + out[:-1], seg, span)
        rows = np.arange(n - 1, n - 1 + len(out))
        want = ref[rows, out]
        r32 = h32.reference_logprobs(lm.params, lm.cfg, kept + out[:-1], seg, span)
        assert r32.dtype == np.float32, r32.dtype  # no float64 left in the float32 model
        r32 = log_softmax(r32)
        errs["np32"] = max(errs["np32"], float(np.abs(r32[rows, out] - want).max()))
        for tp in ("1", "2", "4"):
            got = np.asarray(runs[tp]["logprobs"][i])
            errs[tp] = max(errs[tp], float(np.abs(got - want).max()))
    return errs


def _check_stream(r: dict) -> None:
    """Streamed loading equals the old path; host memory holds one tensor's slices at a time,
    never the model; the default device receives nothing (the old path loads it all there)."""
    assert r["equal"] == {"2": True, "4": True}, r["equal"]
    assert r["calls"] == r["tensors"] and r["placed_devices"] == [2, 3], r
    assert r["total"] >= 3 * r["largest"], r  # the check below tells one tensor from the model
    assert r["staged"] <= r["largest"] + (64 << 10), r
    assert r["gained"] == 0 and r["old_default"] == r["total"], r


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory) -> dict:
    """The default (not slow) subprocess: Llama GQA at TP=1/2/4, its errors and streamed
    loading, and the small Qwen3.5 engine at TP=1/2 (tp_runs.hybrid); once per test run
    (tests/conftest.once_per_run)."""
    return once_per_run(tmp_path_factory, "tp_default_runs", lambda: _runs(
        "llama_gqa2_llama3rope", "--errors", "--stream", "--hybrid"))


def test_tp_llama_gqa_matches_tp1_and_errors(default_runs):
    """GQA (4 query / 2 KV heads) at TP=2 (one KV head per device) and TP=4 (KV heads
    replicated); then the errors for TP=3 and TP=8 (4 devices), and streamed loading."""
    runs = default_runs
    _check_stream(runs["stream"])
    base = _check(runs, "llama_gqa2_llama3rope", layers=2)
    assert min(base["cached"][1:]) > 0  # the repeated spans hit (position-free KV)
    assert "tensor_parallel_size=3 does not divide the model's num_heads=4" in runs["errors"][0]
    assert "tensor_parallel_size=8 exceeds the 4 cpu device(s)" in runs["errors"][1]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        Config(tensor_parallel_size=0)


def test_tp_hybrid_generates_as_tp1(default_runs):
    """A Qwen3.5 engine at TP=2 generates TP=1's greedy tokens, logprobs within TOL, through
    steps that reuse one compiled variant (each takes the recurrent state the last returned:
    it once came out split over the conv channels and the next step refused it), and a
    prefix-cache hit that restores a recurrent checkpoint; the cache and the checkpoint and
    span-map pools are where the rules table places them before the first step (a variant
    compiled for pools still on one device would have XLA choose their placement) and after the
    last (serving/step/state_placement.py); the step's collectives are Megatron's all-reduces.
    """
    base, r = default_runs["hybrid"]["1"], default_runs["hybrid"]["2"]
    assert "error" not in base, base["error"]
    assert "error" not in r, f"TP=2: {r['error']}"
    assert r["tokens"] == base["tokens"]
    err = max(abs(a - b) for x, y in zip(r["logprobs"], base["logprobs"]) for a, b in zip(x, y))
    assert err <= TOL["qwen3_5_gva2"], f"TP=2: logprob error {err:.2e}"
    assert r["cached"] == base["cached"] == [0, 0, 64], (r["cached"], base["cached"])
    assert r["checkpoint_hits"] == base["checkpoint_hits"] == 1
    for when in ("placed_first", "placed_last"):  # the pools placed as the runner takes them
        assert {"cache.conv[0]", "ck_pool.conv", "span_pool.tail"} <= set(r[when]), r[when]
        assert all(r[when].values()), (when, r[when])
    # Megatron's all-reduces only (4 layers); nothing gathered: not the logits, and not the conv
    # state, which XLA computed split over its channels and gathered back to its placement
    # before the GDN conv output was kept whole (kernels_pallas/sharding.whole)
    assert r["collectives"], r
    for variant, c in r["collectives"].items():
        assert 2 * 4 + 1 <= c["all_reduces"] <= 2 * 4 + 6, (variant, c)
        assert not c["all_gathers"], (variant, c)


def test_tp_hybrid_decode_in_place_generates_as_tp1(default_runs):
    """The in-place GDN decode (qwen3_5.GDN_DECODE_IN_PLACE, its glue form: each head shard's
    kernel on its own heads and cache slice) at TP=2 gives TP=1's tokens (the gather / step /
    scatter path), logprobs within TOL; its kernel was traced in every GDN layer (3 of the
    fixture's 4) for the decode variant."""
    base, r = default_runs["hybrid"]["1"], default_runs["hybrid_in_place"]
    assert "error" not in r, f"TP=2 in place: {r['error']}"
    assert r["tokens"] == base["tokens"]
    err = max(abs(a - b) for x, y in zip(r["logprobs"], base["logprobs"]) for a, b in zip(x, y))
    assert err <= TOL["qwen3_5_gva2"], f"TP=2 in place: logprob error {err:.2e}"
    assert r["kernel_calls"] > 0 and r["kernel_calls"] % 3 == 0, r["kernel_calls"]


@pytest.mark.skipif(not RUN_SLOW, reason="slow: MINIPIC_RUN_SLOW=1 or --run-slow")
def test_tp_llama_mha_matches_tp1_slow():
    """MHA at TP=2 / 4; and prefix caching with CPU offload at TP=2."""
    runs = _runs("llama_mha", "--cached")
    _check(runs, "llama_mha", layers=2)
    _check_cached(runs, "llama_mha")


@pytest.mark.skipif(not RUN_SLOW, reason="slow: MINIPIC_RUN_SLOW=1 or --run-slow")
def test_tp_qwen3_5_matches_tp1_slow():
    """Qwen3.5 (GDN + gated attention; TP=4 > 2 KV heads and 2 GDN key heads: both replicated),
    prefix caching (checkpoint hits) with CPU offload at TP=2, its logprobs against the float64
    reference, and its recurrent checkpoints at positions 64 and 128 of a 150-token prefill: TP
    vs TP=1 (fp32 summation order; measured 1.3e-5 delta, 1.0e-4 conv at TP=4) and TP=1's final
    states vs HF's cache."""
    runs = _runs("qwen3_5_gva2", "--checkpoints", "--cached", "--gdn")
    _check(runs, "qwen3_5_gva2", layers=4)
    _check_cached(runs, "qwen3_5_gva2")
    # why TP differs from TP=1 at all: the GDN kernel per head shard is bit for bit the one
    # call over all heads, so only the all-reduces' summation order differs. Against float64
    # each size may sit as far as float32 itself does (an independent numpy float32 model: 2.4e-5
    # at the worst token, the same sign as every TP size) plus the summation-order allowance TP
    # has against TP=1 (TOL). A fixed 3e-5 bar left 0.8e-5 above that floor, which the suite's
    # CPU -O0 (no FMA contraction, tests/conftest.py) took: TP=2 3.09e-5, 2.66e-5 at the default
    # level (measured 2.3e-5 TP=1, 3.1e-5 TP=2, 2.2e-5 TP=4; notes in docs/DESIGN.md, tensor
    # parallelism). A bf16 cast or a low-precision reduction is orders of magnitude past it.
    assert runs["gdn_per_shard"] == {"2": 0.0, "4": 0.0}, runs["gdn_per_shard"]
    f64 = _f64_errors(runs, "qwen3_5_gva2")
    print(f"qwen3_5_gva2 max |logprob - float64 reference| per TP size: {f64}")
    floor = f64.pop("np32")
    assert floor <= 1e-4, f"the float32 reference itself is off float64 by {floor:.2e}"
    assert max(f64.values()) <= floor + TOL["qwen3_5_gva2"], (f64, floor)
    cks = {tp: {k: np.asarray(v) for k, v in r.items()} for tp, r in runs["checkpoints"].items()}
    hf = np.load(FIXTURES / "qwen3_5_gva2" / "reference.npz")["delta_2"]
    np.testing.assert_allclose(cks["1"]["final_delta"], hf, atol=1e-5, rtol=0)
    for tp in ("2", "4"):
        for key, tol in (("ck_delta", 5e-5), ("ck_conv", 3e-4), ("final_delta", 5e-5)):
            np.testing.assert_allclose(cks[tp][key], cks["1"][key], atol=tol, rtol=0,
                                       err_msg=f"TP={tp} {key}")
