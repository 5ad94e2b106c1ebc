"""Config.compilation.command_buffer (flat `step_command_buffer`, issue 28): XLA command buffers
per step executable on a GPU, nothing passed elsewhere; checked naming the option; the options
reach each step's compile and key the executable store (serving/step/compile_options.py)."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import pytest

from configs.presets import PRESETS
from minipic_jax.models import llama
from serving.config import Config
from serving.step import compile_options
from serving.step.compile_options import COMMAND_BUFFER_TYPES, step_compiler_options
from serving.step.model_runner import ModelRunner
from serving.step.step_executables import StepExecutables

ON = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN",
      "xla_gpu_graph_min_graph_size": 1}


def test_bad_settings_are_refused_naming_the_option():
    where = r"step_command_buffer \(Config.compilation.command_buffer\)"
    with pytest.raises(ValueError, match=where + r".*unknown command-buffer type\(s\) \['BOGUS'\]"):
        Config.from_flat(step_command_buffer="FUSION,BOGUS")
    with pytest.raises(ValueError, match=where + ".*not a string: True"):
        Config.from_flat(step_command_buffer=True)
    from minipic_jax import LLM
    with pytest.raises(ValueError, match=where):  # raised before the model loads
        LLM("tiny_llama3", step_command_buffer="graphs")
    assert Config.from_flat(step_command_buffer="FUSION, WHILE").compilation.command_buffer


def test_options_per_setting_and_platform():
    assert step_compiler_options("on", "cpu") == {}  # off a GPU nothing is passed
    assert step_compiler_options("on", "gpu") == ON == step_compiler_options("on", "cuda")
    assert step_compiler_options("off", "gpu") == {"xla_gpu_enable_command_buffer": ""}
    assert step_compiler_options("xla", "gpu") == {}
    assert step_compiler_options(None, "gpu") == \
        step_compiler_options(compile_options.DEFAULT_SETTING["gpu"], "gpu")
    assert step_compiler_options("FUSION,WHILE", "gpu") == {
        "xla_gpu_enable_command_buffer": "FUSION,WHILE", "xla_gpu_graph_min_graph_size": 1}


def test_every_gpu_option_is_one_xla_parses():
    """XLA:CPU parses (and ignores) the GPU debug options: an unknown name or type would be an
    INVALID_ARGUMENT here, as on the GPU, so a renamed option fails before a device run."""
    low = jax.jit(lambda x: x + 1).lower(jnp.ones(2))
    for setting in ("on", "off", ",".join(COMMAND_BUFFER_TYPES)):
        low.compile(compiler_options=step_compiler_options(setting, "gpu"))
    with pytest.raises(Exception, match="not a valid enum value"):
        low.compile(compiler_options={"xla_gpu_enable_command_buffer": "GRAPHS"})


def _runner(monkeypatch, platform, **kw):
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    mcfg = dataclasses.replace(PRESETS["tulu3_block_ft"], vocab_size=512, hidden_size=64,
                               intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=1)
    params = llama.init_params(mcfg, jax.random.PRNGKey(0), jnp.float32)
    loaded = types.SimpleNamespace(cfg=mcfg, params=params, family=llama, tokenizer=None)
    cfg = Config.from_flat(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                           num_kv_blocks=8, **kw)
    return ModelRunner(cfg, loaded, 8, jnp.float32)


def test_the_runner_compiles_its_steps_with_the_options_on_a_gpu_only(monkeypatch):
    assert _runner(monkeypatch, "gpu", step_command_buffer="on")._step.compiler_options == ON
    assert _runner(monkeypatch, "cpu", step_command_buffer="on")._step.compiler_options == {}


def _double(x, *, k=2):
    return x * k


def test_options_reach_compile_and_key_the_store(tmp_path, compile_calls):
    """A step stored without the options is not loaded with them (and the reverse)."""
    seen = compile_calls

    def start(options):
        steps = StepExecutables(_double, signature_of=_double, donate_argnums=(),
                                context=lambda: "ctx", store_setting=str(tmp_path),
                                compiler_options=options)
        steps.prepare([((jnp.ones(3),), {"k": 3})])
        assert float(steps(jnp.ones(3), k=3)[0]) == 3.0
        return steps.counts
    assert start({}) == {"loaded": 0, "compiled": 1}
    assert start({}) == {"loaded": 1, "compiled": 0}
    assert start(ON) == {"loaded": 0, "compiled": 1}  # not the executable stored without them
    assert start(ON) == {"loaded": 1, "compiled": 0}
    assert seen == [None, ON]
