"""benchmarks/step_variants.py: the engine's last step compiled again with other command-buffer
settings and replayed in the same process (issue 28's A/B). On CPU with the GPU's options (XLA:CPU
parses and ignores them): every row samples what the engine's own executable samples, the
options reach the compile, and the engine's executable is back in its table afterwards."""

import json

from conftest import make_tiny_llm
from benchmarks import step_variants
from minipic_jax import SamplingParams
from serving.step.compile_options import step_compiler_options


def test_compare_replays_each_setting_and_restores_the_engines_executable(compile_calls):
    llm = make_tiny_llm(max_num_batched_tokens=16, min_token_bucket=16, max_model_len=128)
    llm.generate([[256, 72, 101, 108, 108, 111]], SamplingParams(temperature=0.0, max_tokens=1),
                 use_tqdm=False)
    runner = llm.llm_engine.runner
    ints, floats, kw = runner.last_inputs
    steps = runner._step
    table_before = dict(steps._table)
    seen = compile_calls
    seen.clear()  # the engine's own compiles above are not the comparison's
    rows = step_variants.compare(runner, ints, floats, kw, ["off", "on", "GRAPHS"], repeats=1,
                                 profile=True, platform="gpu")
    assert [r["setting"] for r in rows] == ["engine", "off", "on", "GRAPHS"]
    assert seen == [step_compiler_options(x, "gpu") for x in ("off", "on", "GRAPHS")]
    assert rows[0]["options"] == {} and rows[2]["options"] == step_compiler_options("on", "gpu")
    assert "not a valid enum value" in rows[3]["error"]  # one failing setting keeps the others
    good = rows[:3]
    assert all(r["sampled"] == rows[0]["sampled"] for r in good)
    assert all(r["dispatch_ms"] > 0 and r["step_alone_ms"] > 0 for r in good)
    assert all(r["command_buffers"] == 0 and r["kernels_per_step"] == 0 for r in good)  # CPU
    assert steps._table == table_before and not steps._spelled
    lines = step_variants.table(rows)
    assert len(lines) == 5 and lines[2].split()[0] == "off" and "failed" in lines[4]


def test_ttft_summary_reads_each_run_and_says_which_is_missing(tmp_path):
    row = {"cold": False, "parts_ms": {"step_call": 3.25}}
    res = {"config": "ttft", "generate": {"rows": [dict(row, cold=True), row, row],
                                          "cold_ms": 848.0, "cached_ms": 20.4,
                                          "cold_over_cached": 41.6, "cached_host_ms": 11.27},
           "cached_step_profile": {"dispatch_ms": 3.4, "step_alone_ms": 18.5,
                                   "kernel_busy_ms_per_step": 15.0, "kernels_per_step": 650,
                                   "hlo_ops": {"command_buffers": 2}}}
    (tmp_path / "a.json").write_text(json.dumps({"results": [res]}))
    lines = step_variants.ttft_summary({"xla": tmp_path / "a.json", "on": tmp_path / "b.json"})
    assert lines[1].split() == ["xla", "848.0", "20.40", "41.6", "11.27", "3.25", "3.40",
                                "18.50", "15.00", "650", "2"]
    assert lines[2].split()[:3] == ["on", "no", "result"] and len(lines) == 3
