"""benchmarks/step_variants.py: the engine's last step compiled again with other command-buffer
settings and replayed in the same process (issue 28's A/B). On CPU with the GPU's options (XLA:CPU
parses and ignores them): every row samples what the engine's own executable samples, the
options reach the compile, and the engine's executable is back in its table afterwards."""

import jax

from conftest import make_tiny_llm
from benchmarks import step_variants
from minipic_jax import SamplingParams
from serving.step.compile_options import step_compiler_options


def test_compare_replays_each_setting_and_restores_the_engines_executable(monkeypatch):
    llm = make_tiny_llm(max_num_batched_tokens=16, min_token_bucket=16, max_model_len=128)
    llm.generate([[256, 72, 101, 108, 108, 111]], SamplingParams(temperature=0.0, max_tokens=1),
                 use_tqdm=False)
    runner = llm.llm_engine.runner
    ints, floats, kw = runner.last_inputs
    steps = runner._step
    table_before = dict(steps._table)
    seen = []
    real = jax.stages.Lowered.compile

    def spy(self, compiler_options=None):
        seen.append(compiler_options)
        return real(self, compiler_options=compiler_options)
    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    rows = step_variants.compare(runner, ints, floats, kw, ["off", "on"], repeats=1,
                                 profile=True, platform="gpu")
    assert [r["setting"] for r in rows] == ["engine", "off", "on"]
    assert seen == [step_compiler_options("off", "gpu"), step_compiler_options("on", "gpu")]
    assert rows[0]["options"] == {} and rows[2]["options"] == step_compiler_options("on", "gpu")
    assert all(r["sampled"] == rows[0]["sampled"] for r in rows)
    assert all(r["dispatch_ms"] > 0 and r["step_alone_ms"] > 0 for r in rows)
    assert all(r["command_buffers"] == 0 and r["kernels_per_step"] == 0 for r in rows)  # CPU
    assert steps._table == table_before and not steps._spelled
    lines = step_variants.table(rows)
    assert len(lines) == 4 and lines[2].split()[0] == "off"
