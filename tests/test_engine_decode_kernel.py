"""Decode-only steps run their own kernel (Config.decode_attn_impl): same tokens and logprobs."""

import dataclasses
import functools

import numpy as np
import pytest

import kernels_pallas.paged_attention.api as attention_api
import kernels_pallas.paged_attention.decode_common as decode_common
import kernels_pallas.paged_attention.write as write_api
from minipic_jax import LLM, SamplingParams
from serving.step import model_runner


def spy_on(monkeypatch, module, name, record=lambda kwargs: 1):
    """Wrap module.name so each call appends record(kwargs) to the returned list."""
    calls, kernel = [], getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(record(kwargs))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def spy_on_kernel(monkeypatch, registry, name, record=lambda kwargs: 1):
    """Wrap the entry function of registry[name] (a kernel registry dict) the same way."""
    calls, impl = [], registry[name]

    def spy(*args, **kwargs):
        calls.append(record(kwargs))
        return impl.run(*args, **kwargs)

    monkeypatch.setitem(registry, name, dataclasses.replace(impl, run=spy))
    return calls


def assert_same_tokens_and_logprobs(expected, got, atol):
    for want, out in zip(expected, got):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        lp_want = [d[t].logprob for d, t in zip(want.outputs[0].logprobs, want.outputs[0].token_ids)]
        lp_got = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
        np.testing.assert_allclose(lp_got, lp_want, atol=atol)


def test_decode_only_steps_use_decode_kernel_and_match_xla(monkeypatch, fresh_rng):
    prompts = [fresh_rng.integers(1, 500, size=n).tolist() for n in (5, 23, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)
    expected = LLM("tiny_llama", max_num_seqs=4, attn_impl="xla").generate(
        prompts, params, use_tqdm=False)

    traced = spy_on_kernel(monkeypatch, attention_api.ATTENTION, "triton_decode")
    llm = LLM("tiny_llama", max_num_seqs=4, attn_impl="xla", decode_attn_impl="triton_decode")
    got = llm.generate(prompts, params, use_tqdm=False)
    assert traced, "decode-only steps did not reach the decode kernel"
    assert_same_tokens_and_logprobs(expected, got, atol=1e-4)


def assert_same_up_to_ties(expected, got, atol):
    """Greedy runs of two numerically different paths: tokens equal and logprobs within `atol`
    until the first step where they pick different tokens; there the two tokens must be tied
    within `2 * atol` in the expected run's top logprobs (either path may take either one), and
    the continuations are not compared. Needs logprobs >= 2."""
    for want, out in zip(expected, got):
        w, o = want.outputs[0], out.outputs[0]
        for j, (tw, to) in enumerate(zip(w.token_ids, o.token_ids)):
            if tw != to:
                assert to in w.logprobs[j], f"step {j}: token {to} not among the top logprobs"
                gap = w.logprobs[j][tw].logprob - w.logprobs[j][to].logprob
                assert abs(gap) <= 2 * atol, f"step {j}: {tw} vs {to} is no tie (gap {gap})"
                break
            np.testing.assert_allclose(o.logprobs[j][to].logprob, w.logprobs[j][tw].logprob,
                                       atol=atol, err_msg=f"step {j}")


def test_unknown_kernel_is_an_error_before_any_work():
    with pytest.raises(ValueError, match="Config.decode_attn_impl must be None or one of"):
        LLM("tiny_llama", max_num_seqs=2, decode_attn_impl="nope")


def test_triton_kv_write_matches_xla_write(monkeypatch, fresh_rng):
    """Config.write_kv_impl='triton' (Pallas row copy, interpreted here) reaches the kernel and
    gives the same tokens and logprobs as the XLA scatter, prefill chunks and decodes mixed."""
    prompts = [fresh_rng.integers(1, 500, size=n).tolist() for n in (7, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1)
    # an explicit pool: the default one on a GPU is too large for the row copy's int32 offsets;
    # one token bucket (16): one compiled step per engine (CI time)
    kw = dict(max_num_seqs=2, max_num_batched_tokens=16, min_token_bucket=16, attn_impl="xla",
              num_kv_blocks=256)
    expected = LLM("tiny_llama", write_kv_impl="xla", **kw).generate(prompts, params,
                                                                     use_tqdm=False)
    traced = spy_on_kernel(monkeypatch, write_api.WRITE, "triton")
    got = LLM("tiny_llama", write_kv_impl="triton", **kw).generate(prompts, params, use_tqdm=False)
    assert traced, "write_kv_impl='triton' did not reach the Pallas write"
    assert_same_tokens_and_logprobs(expected, got, atol=1e-5)
    with pytest.raises(ValueError, match="Config.write_kv_impl"):
        LLM("tiny_llama", write_kv_impl="cuda")


@pytest.mark.slow  # the decode kernel's default path: test_decode_only_steps_use_decode_kernel...
def test_decode_rope_table_option_matches_xla(monkeypatch, fresh_rng):
    """The table RoPE variant of the decode kernel, selected through Config.decode_attn_options."""
    seen = spy_on_kernel(monkeypatch, attention_api.ATTENTION, "triton_decode",
                         lambda kwargs: kwargs.get("rope"))
    host_tables = spy_on(monkeypatch, decode_common, "_host_rope_table")
    prompts = [fresh_rng.integers(1, 500, size=n).tolist() for n in (7, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=1)
    expected = LLM("tiny_llama", max_num_seqs=2, attn_impl="xla").generate(
        prompts, params, use_tqdm=False)
    llm = LLM("tiny_llama", max_num_seqs=2, attn_impl="xla", decode_attn_impl="triton_decode",
              decode_attn_options={"rope": "table"})
    options = llm.llm_engine.runner.decode_options
    assert (options.rope, options.max_position) == ("table", llm.config.max_model_len)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert seen and set(seen) == {"table"}, seen
    assert host_tables, "the jitted step built the cos|sin table in the graph, not on the host"
    assert_same_tokens_and_logprobs(expected, got, atol=1e-4)


def test_decode_default_takes_the_mosaic_kernel_for_d128_bf16(monkeypatch, fresh_rng):
    """"auto" decode steps as chosen on a GPU, for a bf16 model with head_dim 128: the Mosaic
    decode kernel (interpreted here) runs them and matches the XLA path.

    The two paths round differently in bf16 (8-bit mantissa: 2^-8 relative per rounding, on
    logits of a few units after one layer and the LM head), so logprobs agree within 2e-2 and a
    greedy step whose top two tokens are that close may go either way: compared up to such a
    tie (it once failed on an argmax tie)."""
    import dataclasses

    from configs import presets
    cfg = dataclasses.replace(presets.PRESETS["tiny_llama"], hidden_size=128, num_layers=1,
                              head_dim=128)
    monkeypatch.setitem(presets.PRESETS, "tiny_llama_d128", cfg)
    prompts = [fresh_rng.integers(1, 500, size=n).tolist() for n in (9, 21)]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2)
    kw = dict(dtype="bfloat16", max_num_seqs=2, attn_impl="xla")
    expected = LLM("tiny_llama_d128", **kw).generate(prompts, params, use_tqdm=False)
    traced = spy_on_kernel(monkeypatch, attention_api.ATTENTION, "mosaic_decode")
    monkeypatch.setattr(model_runner, "attention_choices",
                        functools.partial(model_runner.attention_choices, platform="gpu"))
    llm = LLM("tiny_llama_d128", decode_attn_impl="auto", **kw)
    assert llm.llm_engine.runner.decode_impl == "mosaic_decode"
    got = llm.generate(prompts, params, use_tqdm=False)
    assert traced, "decode-only steps did not reach the Mosaic decode kernel"
    assert_same_up_to_ties(expected, got, atol=2e-2)
