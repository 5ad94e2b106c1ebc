"""Tensor parallelism on forced host devices: TP=2 / TP=4 give TP=1's greedy tokens (and the HF
fixture's greedy tokens) with logprobs within 1e-5, KV pools split by KV heads, Megatron
all-reduces only (no logits gather), and clear errors for sizes the model cannot split.

The runs need XLA_FLAGS=--xla_force_host_platform_device_count=4 before JAX starts, so they run
in a subprocess (tests/tp_runs.py); the other tests' JAX stays on one device. The default run
covers Llama GQA at TP=2 and 4 (4 > KV heads: KV heads replicated); MINIPIC_RUN_SLOW=1 (or
--run-slow) adds Llama MHA and Qwen3.5 (GDN + gated attention) at TP=2 and 4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from serving.config import Config
from tests.conftest import FIXTURES, REPO

RUN_SLOW = os.environ.get("MINIPIC_RUN_SLOW") == "1" or "--run-slow" in sys.argv
# per fixture: the largest logprob difference to TP=1 allowed (fp32 summation order only; the
# hybrid's recurrent state carries rounding from layer to layer: 2.2e-5 measured at TP=4)
TOL = {"llama_gqa2_llama3rope": 1e-5, "llama_mha": 1e-5, "qwen3_5_gva2": 3e-5}


def _runs(fixture: str, *flags: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, "-m", "tests.tp_runs", fixture, "1,2,4", *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(runs: dict, fixture: str, layers: int) -> dict:
    base = runs["1"]
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


def test_tp_llama_gqa_matches_tp1_and_errors():
    """GQA (4 query / 2 KV heads) at TP=2 (one KV head per device) and TP=4 (KV heads
    replicated); then the errors for TP=3 and TP=8 (4 devices)."""
    runs = _runs("llama_gqa2_llama3rope", "--errors")
    base = _check(runs, "llama_gqa2_llama3rope", layers=2)
    assert min(base["cached"][1:]) > 0  # the repeated spans hit (position-free KV)
    assert "tensor_parallel_size=3 does not divide the model's num_heads=4" in runs["errors"][0]
    assert "tensor_parallel_size=8 exceeds the 4 cpu device(s)" in runs["errors"][1]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        Config(tensor_parallel_size=0)


@pytest.mark.skipif(not RUN_SLOW, reason="slow: MINIPIC_RUN_SLOW=1 or --run-slow")
def test_tp_llama_mha_matches_tp1_slow():
    _check(_runs("llama_mha"), "llama_mha", layers=2)


@pytest.mark.skipif(not RUN_SLOW, reason="slow: MINIPIC_RUN_SLOW=1 or --run-slow")
def test_tp_qwen3_5_matches_tp1_slow():
    """Qwen3.5 (GDN + gated attention; TP=4 > 2 KV heads and 2 GDN key heads: both replicated),
    and its recurrent checkpoints at positions 64 and 128 of a 150-token prefill: TP vs TP=1
    (fp32 summation order; measured 1.3e-5 delta, 1.0e-4 conv at TP=4) and TP=1's final states
    vs HF's cache."""
    runs = _runs("qwen3_5_gva2", "--checkpoints")
    _check(runs, "qwen3_5_gva2", layers=4)
    cks = {tp: {k: np.asarray(v) for k, v in r.items()} for tp, r in runs["checkpoints"].items()}
    hf = np.load(FIXTURES / "qwen3_5_gva2" / "reference.npz")["delta_2"]
    np.testing.assert_allclose(cks["1"]["final_delta"], hf, atol=1e-5, rtol=0)
    for tp in ("2", "4"):
        for key, tol in (("ck_delta", 5e-5), ("ck_conv", 3e-4), ("final_delta", 5e-5)):
            np.testing.assert_allclose(cks[tp][key], cks["1"][key], atol=tol, rtol=0,
                                       err_msg=f"TP={tp} {key}")
