"""`minipic-bench hybrid-spans` (benchmarks/hybrid_span_request.py) on CPU: tiny_qwen3_5 at the
shapes of tests/test_warmup_spans.py (its compiles are shared), spans of 40 tokens, through the
same code path as the GPU run. Every call's row is written, the reordered calls hit the cache,
and a compile is counted when one happens."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import hybrid_span_request as bench

SHAPE = ["--model", "tiny_qwen3_5", "--dtype", "float32", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "64", "--min-token-bucket", "64", "--max-model-len", "512",
         "--block-size", "16", "--num-kv-blocks", "96"]
SIZES = ["--system-tokens", "20", "--spans", "3", "--span-tokens", "40",
         "--question-tokens", "12", "--long-span-tokens", "100", "--max-tokens", "4"]


def _args(argv):
    p = argparse.ArgumentParser()
    bench.add_parser(p)
    return p.parse_args(argv)


# ~15 s on CPU (six span requests, then two replayed under a form): slow tier for CI time; run it
# before a device call of the bench
# (MINIPIC_RUN_SLOW=1 ./minipic test tests/test_hybrid_span_request_bench.py)
@pytest.mark.slow
def test_bench_writes_every_row_and_the_reordered_calls_hit(tmp_path, capsys):
    out = tmp_path / "hspan.json"
    from kernels_pallas.paged_attention import triton_ragged
    assert bench.run(_args(SHAPE + SIZES + ["--json", str(out), "--profile-top", "1",
                                           "--profile-forms", "RAGGED_SPLITS=0",
                                           "--device-trace"])) == 0
    assert triton_ragged.RAGGED_SPLITS is True  # the form's switch put back
    result = json.loads(out.read_text())
    assert list(result["rows"]) == [f"{k} {name}" for k, name in bench.CALLS]
    rows = {k.split()[0]: r for k, r in result["rows"].items()}
    assert all(r["accepted"] for r in rows.values()), rows["g"]
    assert rows["g"]["num_spans"] == 3  # 3 x (100 + 32) + 36 <= 512
    for key in "abdf":  # fresh ids: nothing cached
        assert rows[key]["cached_tokens"] == 0, key
    for key in "ce":  # the system prompt and the three spans: cached
        assert rows[key]["cached_tokens"] >= 3 * 32, key
    assert rows["a"]["prompt_tokens"] == 20 + 3 * 40 + 12
    for key in "abcdef":
        assert rows[key]["wall_ms"] > 0 and rows[key]["compiles"] >= 0
    assert rows["b"]["step_compiles"] == 0  # the warm-up readied the span variants
    assert result["startup"]["warmup_variants"] >= 2
    goals = [g["goal"] for g in result["goals"]]
    assert len(goals) == 6 and goals[0].startswith("compiles in b")
    table = capsys.readouterr().out
    assert "c reordered" in table and "goal" in table
    assert result["device_bursts"] == []  # --device-trace ran the call; a CPU has no GPU plane
    assert "device timeline of a reordered call: 0 bursts" in table
    # --profile-top: the reordered prefill and decode steps replayed, as they are and under the
    # form (recompiled: the runner's programs dropped), each a timing line
    timed = [line for line in result["profile"] if "ms/step" in line]
    assert [line.split(" t=")[0].split(": ")[0] for line in timed] == [
        "profile-top reordered prefill", "profile-top reordered decode",
        "profile-top RAGGED_SPLITS=0 reordered prefill",
        "profile-top RAGGED_SPLITS=0 reordered decode"]


def test_a_bad_profile_form_is_refused_before_the_engine_starts():
    import pytest
    for form in ("RAGGED_SPLITS=2", "NO_SUCH_SWITCH=1", "RAGGED_SPLITS"):
        with pytest.raises(ValueError, match="is not NAME=0\\|1 of a program switch"):
            bench.run(_args(SHAPE + SIZES + ["--profile-top", "1", "--profile-forms", form]))


def test_a_compile_during_a_call_is_counted():
    """An engine started without warm-up compiles its plain step on the first call: counted."""
    from minipic_jax import SamplingParams
    from minipic_jax.prompts import Prompt
    counter = bench.CompileCounter()
    llm, startup = bench.make_llm(_args(SHAPE + SIZES + ["--no-warmup"]), counter)
    assert startup["warmup_variants"] == 0
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    row = bench.timed_generate(llm, [Prompt(list(range(10, 60)))], sp, counter)
    assert row["step_compiles"] >= 1
    # the step's XLA program: compiled, or loaded from the suite's persistent cache
    assert row["xla_compiles"] + row["xla_cache_loads"] >= 1
    again = bench.timed_generate(llm, [Prompt(list(range(70, 120)))], sp, counter)
    assert again["compiles"] == 0


def test_a_program_loaded_from_the_persistent_cache_is_a_load_not_a_compile():
    """JAX fires its backend-compile event for a persistent-cache load too: the counter tells
    them apart (the suite's compilation cache is on, every compile written: tests/conftest.py)."""
    import jax
    import jax.numpy as jnp
    counter = bench.CompileCounter()
    x = jnp.ones((7, 13), jnp.float32)
    c0 = counter.read()
    jax.jit(lambda v: v * 3.0 + 1.0)(x).block_until_ready()  # compiled, or loaded on a rerun
    c1 = counter.read()
    assert (c1["xla_compiles"] - c0["xla_compiles"]) + (
        c1["xla_cache_loads"] - c0["xla_cache_loads"]) == 1
    jax.jit(lambda v: v * 3.0 + 1.0)(x).block_until_ready()  # a new function: the same program
    c2 = counter.read()
    assert c2["xla_compiles"] == c1["xla_compiles"]
    assert c2["xla_cache_loads"] == c1["xla_cache_loads"] + 1
