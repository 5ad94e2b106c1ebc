"""Shared test helpers (keep small and generic)."""

from __future__ import annotations

import os
import pathlib
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The Mosaic GPU interpreter runs a CTA's warpgroups as threads whose barrier waits block inside
# XLA host callbacks, and XLA's CPU client runs a computation's continuation on its intra-op pool
# (one thread per schedulable CPU unless PJRT_NPROC says otherwise). On a 2-core machine two
# waiting warpgroups held both pool threads and the third, the one they waited for, never ran:
# the interpreted kernels hung at times (more often on one core). Four threads: a CTA's three
# warpgroups and the caller (kernels_pallas/paged_attention/interpret_threads.py says more).
_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
os.environ.setdefault("PJRT_NPROC", str(max(4, _cpus or 1)))
# Engines in subprocesses of tests write no user-level compilation cache unless a test asks for one
# (minipic_jax/compile_cache.py); this process uses the suite's cache below.
os.environ.setdefault("MINIPIC_COMPILATION_CACHE_DIR", "off")
# On CPU the suite's time is mostly XLA compiling step programs, and most of a compile is LLVM's
# optimisation of the generated code, which tests of tiny shapes never win back at run time: the
# backend at -O0 took three engine test files from 55 to 44 s. XLA's CPU fast-math is off either
# way, but -O0 does not contract a * b + c into one FMA (two roundings, as numpy float32): float32
# results may differ in the last bits from the default level's (tests/test_tensor_parallel.py).
# MINIPIC_TEST_XLA_OPT=1 keeps the default; a GPU run (MINIPIC_COMPILED) is left alone.
if (os.environ["JAX_PLATFORMS"] == "cpu" and os.environ.get("MINIPIC_TEST_XLA_OPT") != "1"
        and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Tests build many engines over the same tiny shapes: a persistent compilation cache lets every
# engine after the first load its executables instead of compiling them again (XLA compiles are
# most of the suite's time on CPU). Set JAX_COMPILATION_CACHE_DIR to choose the folder.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    jax.config.update("jax_compilation_cache_dir",
                      str(pathlib.Path(__file__).resolve().parents[1] / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

# Engines in the suite start their steps at 8 rows, as on an accelerator: the CPU default of one
# row (serving/config.py) compiles three more step variants per engine, which doubled the suite's
# compile time. tests/test_cpu_step_size.py checks the shipped CPU default, and one-row steps run
# in the engine tests that name min_token_bucket=1.
import serving.config as _serving_config  # noqa: E402

_serving_config.CPU_MIN_TOKEN_BUCKET = 8

# No stored step executables either (serving/step/executable_store.py): a test that patches code
# the step traces must trace it; tests of the store name a folder of their own (Config.step_cache).
# Engines in subprocesses have no compilation cache (above), so no store.
import serving.step.executable_store as _executable_store  # noqa: E402

_executable_store.DEFAULT_SETTING = "off"

# No warm-up in LLM() either (minipic_jax/warmup.py): each test's engine compiles only the step
# variants it meets; tests of the warm-up pass warmup=True.
import minipic_jax.warmup as _warmup  # noqa: E402

_warmup.DEFAULT = False


# Hypothesis: derandomized by default (the examples follow from each test's name: never flaky,
# and a failure prints its example and a @reproduce_failure blob); MINIPIC_HYPOTHESIS=fresh draws
# new examples each run.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("deterministic", derandomize=True, print_blob=True)
_hypothesis_settings.register_profile("fresh", derandomize=False, print_blob=True)
_hypothesis_settings.load_profile("fresh" if os.environ.get("MINIPIC_HYPOTHESIS") == "fresh"
                                  else "deterministic")


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run tests marked slow (MINIPIC_RUN_SLOW=1 does the same)")


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` are skipped unless --run-slow or MINIPIC_RUN_SLOW=1: the default run
    keeps a representative case of each (README, Development)."""
    if config.getoption("--run-slow") or os.environ.get("MINIPIC_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow (or MINIPIC_RUN_SLOW=1)")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)

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


DEFAULT_TEST_SEED = 20261202


def replay_seed(request) -> int:
    """The randomized tests' salt: fixed by default, so every run (CI included) draws the same
    inputs; MINIPIC_TEST_SEED=<int> replays one, MINIPIC_TEST_SEED=fresh draws a new one per test
    (to hunt for seed-dependent failures). Printed (pytest shows it with a failure) with the
    command that replays it."""
    env = os.environ.get("MINIPIC_TEST_SEED", "")
    if env == "fresh":
        salt = int(np.random.SeedSequence().entropy % (1 << 32))
    else:
        salt = int(env) if env else DEFAULT_TEST_SEED
    print(f"seed: {salt} (replay: MINIPIC_TEST_SEED={salt} pytest '{request.node.nodeid}')")
    return salt


@pytest.fixture
def fresh_rng(request):
    """A numpy Generator seeded from the test id plus the run's salt (see `replay_seed`)."""
    return np.random.default_rng([replay_seed(request), zlib.crc32(request.node.nodeid.encode())])


@pytest.fixture
def compile_calls(monkeypatch):
    """The `compiler_options` of every `Lowered.compile` call made while the test runs."""
    seen = []
    real = jax.stages.Lowered.compile

    def spy(self, compiler_options=None):
        seen.append(compiler_options)
        return real(self, compiler_options=compiler_options)
    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    return seen


def once_per_run(tmp_path_factory, name: str, compute):
    """compute()'s JSON-able result, computed once per test run: under pytest-xdist the tests of
    a module may be spread over the workers, and a module fixture then ran once on each (a
    30 s subprocess twice: CI time); the first worker computes it under a file lock, the others
    read its file. Without xdist: compute()."""
    import json

    from filelock import FileLock
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return compute()
    path = tmp_path_factory.getbasetemp().parent / f"{name}.json"
    with FileLock(str(path) + ".lock"):
        if not path.is_file():
            path.write_text(json.dumps(compute()))
        return json.loads(path.read_text())
