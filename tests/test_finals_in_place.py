"""A hybrid prefill step's GDN finals written into the state cache by the scan kernel
(qwen3_5.GDN_FINALS_IN_PLACE, StateRows.write_final) instead of scattered after it: the same
logits, caches and checkpoints bit for bit on tiny_qwen3_5, its GDN kernels interpreted, over
ragged batches with resets, sequences without tokens this step and checkpoints; and on a
CUDA lowering the layer's scan aliases the state cache and no state scatter is left.
MINIPIC_COMPILED=1 runs the kernels compiled on a GPU."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minipic_jax.models import qwen3_5
from tiny_hybrid_step import tiny_step

IMPL = "pallas_fused" if os.environ.get("MINIPIC_COMPILED") == "1" else "pallas_fused_interpret"


def _step(counts, reset, dtype, checkpoints: bool, seed: int, impl=IMPL):
    """tiny_step's (run, params, cache); with checkpoints one at each sequence's end."""
    run, params, cache, _ = tiny_step(counts, reset, dtype, seed, impl,
                                      range(len(counts)) if checkpoints else None)
    return run, params, cache


# each case compiles both forms (~3-7 s on a 2-core CI machine): the default run keeps the one
# with resets, a sequence without tokens and checkpoints; --run-slow runs all three
@pytest.mark.parametrize("counts,reset,dtype,checkpoints", [
    ([9, 0, 17, 4], [0, 1, 1, 0], jnp.float32, True),
    pytest.param([33, 2, 0], [1, 0, 0], jnp.bfloat16, False, marks=pytest.mark.slow),
    pytest.param([70], [0], jnp.float32, True, marks=pytest.mark.slow)])
def test_finals_in_place_is_the_scatter_bit_for_bit(monkeypatch, counts, reset, dtype,
                                                    checkpoints):
    run, params, cache = _step(counts, reset, dtype, checkpoints, seed=len(counts))
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(qwen3_5, "GDN_FINALS_IN_PLACE", on)
        # each form traced anew: jax.jit(run) of the same `run` reused the first form's trace
        # (JAX caches traces by the function object, and the switch is read while tracing),
        # so the two "forms" were one program; clear_caches also drops any inner cached trace
        jax.clear_caches()
        outs[on] = jax.jit(run)(params, cache)
    for got, ref in zip(jax.tree.leaves(outs[True]), jax.tree.leaves(outs[False])):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))


def test_finals_in_place_lowers_to_an_aliased_scan_and_no_state_scatter(monkeypatch):
    """Lowered for CUDA (abstract H100, Triton kernels): with the switch the step's GDN scan
    calls alias an operand to an output, and the [S] state scatters into the layers' state
    caches are gone."""
    from configs.presets import PRESETS
    from tests.cuda_lowering import abstract_h100
    run, params, cache = _step([9, 0, 17, 4], [0, 1, 1, 0], jnp.bfloat16, True, seed=4,
                               impl="pallas_fused")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # Pallas compiled, not interpreted
    texts = {}
    for on in (False, True):
        monkeypatch.setattr(qwen3_5, "GDN_FINALS_IN_PLACE", on)

        def step(p, c):
            return run(p, c)
        with abstract_h100():
            texts[on] = jax.jit(step).trace(params, cache).lower(
                lowering_platforms=("cuda",)).as_text()
    n_gdn = PRESETS["tiny_qwen3_5"].layer_types.count("linear_attention")
    state = "x".join(map(str, cache.delta[0].shape))  # [P, Hv, Dk, Dv] float32

    def state_scatters(text):  # scatters whose result is a layer's state cache
        lines = text.splitlines()
        return sum(f"-> tensor<{state}xf32>" in " ".join(lines[i:i + 5])
                   for i, line in enumerate(lines) if "stablehlo.scatter" in line)
    assert state_scatters(texts[False]) == n_gdn and state_scatters(texts[True]) == 0
    aliases = {on: len(re.findall(r"output_operand_alias<", t)) for on, t in texts.items()}
    assert aliases[True] == aliases[False] + 1, aliases  # the layers call one scan function


@pytest.mark.slow  # two engines' compiles (~18 s of CI's 2 cores); the switches are off by
# default and the model-level tests above hold their bits in every run; s31_device.sh runs it
def test_an_engine_with_both_switches_gives_the_same_tokens_and_logprobs(monkeypatch):
    """Through LLM.generate (tiny_qwen3_5, its GDN kernels interpreted, a decode variant of its
    own so prefill steps are known prefill on the host): GDN_FINALS_IN_PLACE and
    qwen3_5_gdn.DECODE_GATES_IN_PROJ on give the tokens and logprobs of both off, exactly, over
    chunked prompts (a prompt longer than a step), checkpoints and three sequences decoding
    together; the prefill steps did take the in-place finals."""
    from kernels_pallas.gated_delta import ragged
    from minipic_jax import LLM, SamplingParams
    from minipic_jax.models import qwen3_5_gdn
    rng = np.random.default_rng(7)
    prompts = [{"prompt_token_ids": rng.integers(5, 200, n).tolist()} for n in (23, 90, 41)]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    seen, real = [], ragged.finals_in_kernel
    monkeypatch.setattr(ragged, "finals_in_kernel",
                        lambda *a: seen.append(real(*a)) or seen[-1])
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(qwen3_5, "GDN_FINALS_IN_PLACE", on)
        monkeypatch.setattr(qwen3_5_gdn, "DECODE_GATES_IN_PROJ", on)
        seen.clear()
        llm = LLM("tiny_qwen3_5", max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64,
                  decode_attn_impl="triton_decode", warmup=False, step_cache="off",
                  num_kv_blocks=64)  # its own pool size on a GPU too (the default is 4,096 on CPU)
        llm.llm_engine.runner.gdn_impl = "pallas_fused_interpret"  # Config takes compiled names
        outs[on] = llm.generate(prompts, sp, use_tqdm=False)
        assert any(seen) == on, seen  # the prefill steps wrote their finals in place
    for want, got in zip(outs[False], outs[True]):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for lw, lg in zip(want.outputs[0].logprobs, got.outputs[0].logprobs):
            assert {t: p.logprob for t, p in lg.items()} == {t: p.logprob for t, p in lw.items()}
