"""The engine's gated delta kernel (Config.gdn.impl, flat keyword gdn_impl): resolved once at
start by the kernel registry for the model's shapes (serving/step/kernel_choices.py gdn_choice),
a name that cannot take them refused at LLM(...) naming the option, the name and why; the
resolved name reaches the step's GDN layers; and with "mosaic" the engine's step at Qwen3.5-0.8B's
layer shapes in bf16 lowers for CUDA on this CPU-only machine (traced as on a GPU, kernel bodies
lowered through Mosaic GPU and Triton for an abstract H100)."""

from __future__ import annotations

import dataclasses
import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.presets import PRESETS
from kernels_pallas.gated_delta import api, ragged
from minipic_jax.models import llama, qwen3_5
from serving.config import Config
from serving.step.kernel_choices import gdn_choice
from serving.step.model_runner import ModelRunner
from serving.step.step_inputs import layout
from tests.cuda_lowering import abstract_h100

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"  # as test_gated_delta_mosaic.py
TINY = PRESETS["tiny_qwen3_5"]  # Dk = Dv = 16
# one period of Qwen3.5-0.8B's layer pattern at its shapes (GDN 16 heads of 128, attention
# 8 / 2 heads of 256), a small vocabulary: the step's kernels are those of the full model
QWEN35_LAYERS = dataclasses.replace(PRESETS["qwen3_5_0_8b"], vocab_size=1024, num_layers=2,
                                    layer_types=("linear_attention", "full_attention"))


def _choose(impl, cfg=TINY, dtype=jnp.bfloat16, platform="gpu", family=qwen3_5):
    return gdn_choice(Config.from_flat(gdn_impl=impl), family, cfg, dtype, platform)


def test_gdn_impl_is_chosen_for_the_models_shapes():
    assert Config.from_flat(gdn_impl="mosaic").gdn.impl == "mosaic"
    assert _choose("auto") == "pallas_fused" and _choose("auto", platform="cpu") == "xla"
    assert _choose("mosaic", QWEN35_LAYERS) == "mosaic"
    assert _choose("mosaic_intra", QWEN35_LAYERS, jnp.float16) == "mosaic_intra"
    assert _choose("auto", family=llama) is None  # no recurrent layers: nothing to choose
    with pytest.raises(ValueError, match="no gated delta layers"):
        _choose("mosaic", family=llama)  # and naming a kernel for them is a mistake
    why = r"gdn_impl \(Config.gdn.impl\): implementation='mosaic' "
    with pytest.raises(ValueError, match=why + "needs Dk, Dv multiples of 64 up to 128, got "
                                                "Dk=16 Dv=16"):
        _choose("mosaic")
    with pytest.raises(ValueError, match=why + "needs bf16/f16 values, got float32"):
        _choose("mosaic", QWEN35_LAYERS, jnp.float32)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="'mosaic' runs on a GPU")
def test_llm_refuses_a_gdn_impl_it_cannot_run(monkeypatch):
    from minipic_jax import LLM
    from serving.hybrid import hybrid_prefix
    with pytest.raises(ValueError, match=r"gdn_impl \(Config.gdn.impl\) must be one of .*"
                                         r"got 'triton'"):
        LLM("tiny_qwen3_5", gdn_impl="triton")  # before the model is looked for

    def no_work(*args, **kwargs):
        raise AssertionError("the checkpoint pool was built before the kernel check")

    monkeypatch.setattr(hybrid_prefix, "build", no_work)  # the engine's first device memory
    with pytest.raises(ValueError, match=r"gdn_impl \(Config.gdn.impl\): implementation="
                                         r"'mosaic' needs a GPU"):
        LLM("tiny_qwen3_5", gdn_impl="mosaic", max_num_seqs=2, max_num_batched_tokens=32,
            max_model_len=128, num_kv_blocks=32, warmup=False)
    with pytest.raises(ValueError, match=r"gdn_impl \(Config.gdn.impl\)='xla' .* no gated delta"):
        LLM("tiny_llama", gdn_impl="xla", max_num_seqs=2, max_num_batched_tokens=32,
            max_model_len=128, num_kv_blocks=32, warmup=False)  # a Llama has no GDN layers


def _gpu_runner(monkeypatch, mcfg, dtype, gdn_impl):
    """A ModelRunner chosen and traced as on a GPU (its kernels compiled, not interpreted)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    config = Config(max_num_seqs=2, max_num_batched_tokens=128, max_model_len=256,
                    num_kv_blocks=16, min_token_bucket=128, enable_prefix_caching=False)
    config = dataclasses.replace(config, gdn=dataclasses.replace(config.gdn, impl=gdn_impl))
    params = qwen3_5.init_params(mcfg, jax.random.PRNGKey(0), dtype)
    loaded = types.SimpleNamespace(cfg=mcfg, params=params, family=qwen3_5, tokenizer=None)
    return ModelRunner(config, loaded, 16, dtype)


def _traced_step(runner, monkeypatch):
    """(traced prefill step of 128 rows, the implementations its GDN layers asked for)."""
    asked = []
    run = ragged.ragged_prefill

    def spy(*args, **kwargs):
        asked.append(kwargs["implementation"])
        return run(*args, **kwargs)

    monkeypatch.setattr(ragged, "ragged_prefill", spy)
    t, s = 128, runner.config.seq_bucket(128)
    ints = jax.ShapeDtypeStruct((layout(t, s, runner.nb, block_size=runner.block_size)[1],),
                                jnp.int32)
    floats = jax.ShapeDtypeStruct((2 * s,), jnp.float32)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          (runner.params, runner.cache))
    step = jax.jit(lambda *a: runner._step_impl(*a, t=t, s=s, all_greedy=True, use_filter=False,
                                                num_logprobs=0, decode_only=False))
    return step.trace(*shapes, ints, floats), asked


@pytest.mark.parametrize("impl,runs", [("auto", "pallas_fused"), ("xla", "xla")])
def test_the_chosen_kernel_reaches_the_step(impl, runs, monkeypatch):
    runner = _gpu_runner(monkeypatch, TINY, jnp.float32, impl)
    assert runner.gdn_impl == runs
    _, asked = _traced_step(runner, monkeypatch)
    assert asked and set(asked) == {runs}, asked  # every GDN layer of the step


def test_mosaic_engine_step_lowers_for_cuda(monkeypatch):
    """The whole step (attention, GDN with the Mosaic solve and output kernels and the Triton
    scan, sampling) at Qwen3.5-0.8B's layer shapes in bf16, lowered for an abstract H100, with
    one Mosaic kernel per shape: two GDN layers share the solve and the output kernel (a kernel
    lowered per layer gets a fresh name, so a distinct hash, and the GPU compiled each again:
    the 0.8B engine's 2048-token step held 36, mosaic_calls.one_kernel_per_shape)."""
    two_gdn = dataclasses.replace(QWEN35_LAYERS, num_layers=3, layer_types=(
        "linear_attention", "linear_attention", "full_attention"))
    runner = _gpu_runner(monkeypatch, two_gdn, jnp.bfloat16, "mosaic")
    with abstract_h100():
        traced, asked = _traced_step(runner, monkeypatch)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert asked == ["mosaic", "mosaic"], asked
    kernels = re.findall(r'kernel_hash = "([^"]*)"', text)  # one per Mosaic kernel emitted
    assert len(kernels) == len(set(kernels)) == 2, len(kernels)  # the solve and the output
    assert "xla.gpu.triton" in text  # the state scan (and attention)


@pytest.mark.slow  # ~5 s interpreted; compiled in the next device run
def test_mosaic_path_takes_the_models_float32_q_k(fresh_rng):
    """The GDN layer hands the kernel q, k L2-normalised in float32 and v in bf16: the Mosaic
    path rounds q/k to bf16 (as the Triton kernels' dots do) and matches XLA on the rounded
    operands within 2 eps_bf16 of the largest value (test_gated_delta_mosaic.py's bound), two
    sequences, one resumed at a chunk boundary from its own state."""
    from test_gated_delta_mosaic import _inputs
    q, k, v, g, beta, _ = _inputs(fresh_rng, 1, 128, 1, 2, 64, dtype=jnp.float32)
    rows = [x[0, :110] for x in (q, k, v.astype(jnp.bfloat16), g, beta)]
    cu, pos0 = np.array([0, 70, 110], np.int32), np.array([0, 64], np.int32)
    s0 = jnp.asarray(fresh_rng.standard_normal((2, 2, 64, 64)), jnp.float32)
    got = api.ragged_gated_delta(*rows, cu, pos0, s0, implementation="mosaic",
                                 interpret=INTERPRET, decode=False)
    rounded = [x.astype(jnp.bfloat16).astype(jnp.float32) for x in rows[:2]] + rows[2:]
    want = api.ragged_gated_delta(*rounded, cu, pos0, s0, implementation="xla", decode=False)
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    for a, b in zip(got[:2], want[:2]):
        b = np.asarray(b, np.float32)
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=0,
                                   atol=2 * eps * np.abs(b).max())


@pytest.mark.slow  # ~35 s with the kernels interpreted; compiled in the next device run
def test_engine_with_the_mosaic_kernels_matches_xla(monkeypatch, fresh_rng):
    """Two prompts (one over a chunk boundary) through a bf16 engine whose GDN layers take
    Dk = Dv = 64: with "mosaic" (interpreted on CPU) the greedy tokens equal the XLA engine's
    and the logprobs agree within 2e-2 (bf16 steps round differently:
    test_engine_decode_kernel.py's bound)."""
    from minipic_jax import LLM, SamplingParams
    from serving.step import model_runner
    monkeypatch.setitem(PRESETS, "tiny_qwen3_5_d64", dataclasses.replace(
        TINY, linear_key_head_dim=64, linear_value_head_dim=64))
    prompts = [fresh_rng.integers(1, 500, size=n).tolist() for n in (70, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=1)
    kw = dict(dtype="bfloat16", max_num_seqs=2, max_num_batched_tokens=128, max_model_len=256,
              num_kv_blocks=64, enable_prefix_caching=False, warmup=False)
    runs = {}
    for impl in ("xla", "mosaic"):
        name = impl + "_interpret" if impl == "mosaic" and INTERPRET else impl
        monkeypatch.setattr(model_runner, "gdn_choice", lambda *a, name=name: name)
        runs[impl] = LLM("tiny_qwen3_5_d64", **kw).generate(prompts, params, use_tqdm=False)
    for want, got in zip(runs["xla"], runs["mosaic"]):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        lp = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
              for o in (want, got)]
        np.testing.assert_allclose(lp[1], lp[0], atol=2e-2)
