"""The RL demo (`minipic-bench rl`): its loop runs on a tiny preset in seconds and writes the
reward curve; the rollout comparison's plain loop samples the same model as the engine."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import cli, dense_sampler, rl_task
from benchmarks.rl_loop import grpo_advantages
from minipic_jax import SamplingParams
from tests.conftest import make_tiny_llm


def test_rl_command_runs_steps_and_writes_the_curve(tmp_path, capsys):
    assert cli.main(["rl", "--model", "tiny_llama", "--steps", "3", "--prompts", "4",
                     "--samples", "4", "--max-tokens", "3", "--out-dir", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "rl_run.json").read_text())
    assert [h["step"] for h in got["history"]] == [0, 1, 2]
    assert all(np.isfinite(h["loss"]) and h["update_s"] > 0 for h in got["history"])
    assert (tmp_path / "rl_reward.png").stat().st_size > 1000
    assert "time split" in capsys.readouterr().out


def test_grpo_advantages_are_per_group():
    adv = np.asarray(grpo_advantages(np.array([1, 0, 0, 0, .1, .1, .1, .1], np.float32), 4))
    np.testing.assert_allclose(adv[:4].sum(), 0, atol=1e-5)
    assert adv[0] > 0 > adv[1] and not adv[4:].any()


def test_task_checker():
    prompts, answers = rl_task.make_prompts("add", np.random.default_rng(0), 3)
    a, b = prompts[0][:-1].split("+")
    assert answers[0] == str(int(a) + int(b))
    assert rl_task.reward("add", " 12\n", "12") == 1.0
    assert rl_task.reward("add", "123", "12") == 0.1
    assert rl_task.reward("last_letter", "x", "j") == 0.0


def test_plain_loop_samples_the_engine_model():
    llm = make_tiny_llm(min_token_bucket=64)  # one step variant, not a prefill and a decode one
    prompt = list(range(40, 70))
    ref = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    loaded = llm.llm_engine.loaded
    params = loaded.family.unfuse_params(llm.llm_engine.runner.params)
    fns = dense_sampler.make_sampler(loaded.cfg, temperature=0.0)
    got = dense_sampler.sample(params, loaded.cfg, prompt, 2, 6, dtype=jnp.float32, fns=fns)
    assert np.asarray(got).tolist() == [ref[0].outputs[0].token_ids] * 2


def test_update_timing_rows():
    """`rl --update-timing` on a tiny preset: the step never re-traces, the write programs are
    prepared apart so no update compiles, and no array outlives an update (CPU has no allocator stats:
    the memory columns are the live arrays')."""
    from benchmarks import rl_measure
    got = rl_measure.update_timing("tiny_llama", "float32", repeats=2, max_num_seqs=2,
                                   max_model_len=64, num_kv_blocks=16, block_size=16)
    assert [r["step_retraces"] for r in got["updates"]] == [0, 0]
    assert got["updates"][1]["compiles"] == 0 and got["generate_compiles_after"] == 0
    assert got["write_programs_prepared"] == 2
    assert [r["compiles"] for r in got["updates"]] == [0, 0]
    assert [r["live_growth"] for r in got["updates"]] == [0, 0]


def test_rollout_compare_of_several_prompts_against_the_floor(tmp_path):
    """`rl --rollout-compare` with B prompts x G samples: both loops timed, each decode step
    against the weight-read floor measured in the same process."""
    assert cli.main(["rl", "--rollout-compare", "--model", "tiny_llama", "--rollout-prompts",
                     "2", "--samples", "2", "--rollout-prompt-len", "20",
                     "--rollout-new-tokens", "4", "--copy-gb", "0.01",
                     "--out-dir", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "rl_measure.json").read_text())["rollout_compare"]
    assert (got["prompts"], got["samples"]) == (2, 2) and got["copy_rate_GBps"] > 0
    assert got["floor_ms"] == pytest.approx(got["weights_bytes"] / (got["copy_rate_GBps"] * 1e9) * 1e3, rel=1e-12)  # the same quotient; float order
    for name in ("engine", "plain_loop"):
        row = got[name]
        assert row["decode_step_ms"] > 0 and row["over_floor"] > 0 and row["prefill_seconds"] > 0
    assert got["speedup"] > 0
