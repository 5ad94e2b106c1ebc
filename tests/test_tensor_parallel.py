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

import pytest

from tests.conftest import REPO

RUN_SLOW = os.environ.get("MINIPIC_RUN_SLOW") == "1" or "--run-slow" in sys.argv
# per fixture: the largest logprob difference to TP=1 allowed (fp32 summation order only)
TOL = {"llama_gqa2_llama3rope": 1e-5, "llama_mha": 1e-5, "qwen3_5_gva2": 3e-5}


def _runs(fixture: str, sizes: str, extra_env=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS="--xla_force_host_platform_device_count=4", **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "tests.tp_runs", fixture, sizes], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)


def _check(fixture: str, layers: int):
    proc = _runs(fixture, "1,2,4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
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
    assert base["all_reduces"] == 0
    return base


def test_tp_llama_gqa_matches_tp1():
    base = _check("llama_gqa2_llama3rope", layers=2)
    assert min(base["cached"][1:]) > 0  # the repeated spans hit (position-free KV)


@pytest.mark.skipif(not RUN_SLOW, reason="slow: MINIPIC_RUN_SLOW=1 or --run-slow")
@pytest.mark.parametrize("fixture,layers", [("llama_mha", 2), ("qwen3_5_gva2", 4)])
def test_tp_matches_tp1_slow(fixture, layers):
    _check(fixture, layers)


def test_tp_errors():
    code = ("from minipic_jax import LLM\n"
            "from tests.conftest import FIXTURES\n"
            "for tp in (3, 8):\n"
            "    try:\n"
            "        LLM(str(FIXTURES / 'llama_mha'), num_kv_blocks=8, max_model_len=64,\n"
            "            tensor_parallel_size=tp)\n"
            "    except ValueError as e:\n"
            "        print(e)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert "tensor_parallel_size=3 does not divide the model's num_heads=4" in lines[0]
    assert "tensor_parallel_size=8 exceeds the 4 cpu device(s)" in lines[1]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        from serving.config import Config
        Config(tensor_parallel_size=0)
