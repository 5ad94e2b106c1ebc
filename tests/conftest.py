"""Shared test helpers (keep small and generic)."""

from __future__ import annotations

import os
import pathlib
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent compilation cache in tests unless a test turns it on (minipic_jax/compile_cache.py)
os.environ.setdefault("MINIPIC_COMPILATION_CACHE_DIR", "off")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
REPO = FIXTURES.parents[1]
# Tiny HF models written by scripts/make_hf_fixtures.py (transformers 5.24.0).
LLAMA_FIXTURES = ("llama_mha", "llama_gqa2_llama3rope", "llama_gqa4_tied_hd16", "mistral_gqa4")


def make_tiny_llm(**overrides):
    """The engine tests' `LLM`: the tiny_llama preset on a small pool (block size 16)."""
    from minipic_jax import LLM
    args = dict(dtype="float32", seed=0, max_num_seqs=4, max_num_batched_tokens=64,
                max_model_len=256, block_size=16, num_kv_blocks=128)
    args.update(overrides)
    return LLM("tiny_llama", **args)


def hf_reference(folder: pathlib.Path) -> dict:
    """A fixture's reference.npz as {prompts, greedy, logits: lists per prompt, inv_freq}."""
    ref = np.load(folder / "reference.npz")
    n = sum(1 for k in ref.files if k.startswith("prompt_"))
    return {"prompts": [ref[f"prompt_{i}"].tolist() for i in range(n)],
            "greedy": [ref[f"greedy_{i}"].tolist() for i in range(n)],
            "logits": [ref[f"logits_{i}"] for i in range(n)],
            "inv_freq": ref["inv_freq"]}


@pytest.fixture
def fresh_rng(request):
    """A numpy Generator seeded from the test id plus a random salt (printed on failure)."""
    salt = int(np.random.SeedSequence().entropy % (1 << 32))
    print(f"fresh_rng salt={salt}")
    return np.random.default_rng([salt, zlib.crc32(request.node.nodeid.encode())])
