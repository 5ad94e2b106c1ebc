"""kernels_pallas/row_matmul: a decode step's MLP in two kernels (the norm with the gate/up
product and SwiGLU, the down product with the residual add), interpreted on the CPU:

- the kernels against reference.mlp (float32 and bf16, both norm forms, 8-64 rows): within the
  float32 accumulation's order (the kernels sum BLOCK_K-row blocks; every rounding to the model
  dtype as the XLA form rounds, so a bf16 value differs only where a float32 sum straddles a
  rounding boundary, by a unit or two in the last place); reference.mlp against the model's own XLA
  MLP (qwen3_5_modules.Qwen35Block), bit for bit;
- shapes the kernels do not take raise errors naming them;
- a Qwen3.5 decode step with layers.MLP_ROW_KERNEL on: the kernels in its program, its
  logits and caches those of the XLA step within float32 rounding; lowered for CUDA, its MLPs are the two
  Triton kernels a block.
MINIPIC_COMPILED=1 runs the kernels compiled (on a GPU).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.row_matmul import api, reference

SEED = 37  # every draw below comes from it
INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"
GDN_IMPL = "pallas_fused_interpret" if INTERPRET else "pallas_fused"


def _mlp_inputs(rows, e, f, dtype, seed=SEED):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, e)), dtype)
    norm_w = jnp.asarray(rng.standard_normal(e) * 0.1, dtype)
    w_gate_up = jnp.asarray(rng.standard_normal((e, 2 * f)) / np.sqrt(e), dtype)
    w_down = jnp.asarray(rng.standard_normal((f, e)) / np.sqrt(f), dtype)
    return x, norm_w, w_gate_up, w_down


@pytest.mark.parametrize("rows", [8, 16, 64])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("unit_offset", [True, False])
def test_kernels_are_the_reference_mlp(rows, dtype, unit_offset):
    x, norm_w, w_gate_up, w_down = _mlp_inputs(rows, 256, 384, dtype)
    kw = dict(eps=1e-6, unit_offset=unit_offset)
    with jax.default_matmul_precision("highest" if dtype == jnp.float32 else None):
        want = reference.mlp(x, norm_w, w_gate_up, w_down, **kw)  # (IEEE float32, as the kernel)
        h = reference.rms_norm(x, norm_w, 1e-6, unit_offset)
        gu = jnp.einsum("te,ef->tf", h, w_gate_up)
    got = api.mlp(x, norm_w, w_gate_up, w_down, interpret=INTERPRET, **kw)
    assert got.dtype == x.dtype and got.shape == x.shape
    act = api.norm_swiglu(x, norm_w, w_gate_up, interpret=INTERPRET, **kw)
    for a, b in ((got, want), (act, jax.nn.silu(gu[:, :384]) * gu[:, 384:])):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if dtype == jnp.float32:
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
            continue
        # a unit or two of bf16 (2^-8 relative) at the value or at the output's scale (a
        # difference of products near 0)
        np.testing.assert_allclose(a, b, rtol=2.0 ** -7, atol=2.0 ** -7 * np.abs(b).max())
        assert np.mean(a != b) < 0.05  # only values near a rounding boundary differ


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_reference_is_the_models_mlp(dtype):
    """reference.mlp is what a Qwen3.5 block's XLA path computes (its norm, fused weights)."""
    from configs.presets import PRESETS
    from minipic_jax.models import qwen3_5_modules as modules
    cfg = dataclasses.replace(PRESETS["tiny_qwen3_5"], hidden_size=128, intermediate_size=256)
    block = modules.Qwen35Block(cfg, "linear_attention", dtype, fused=True)
    x, norm_w, w_gate_up, w_down = _mlp_inputs(8, 128, 256, dtype)
    block.mlp_norm[...], block.w_gate_up[...], block.w_down[...] = norm_w, w_gate_up, w_down
    from minipic_jax.models import layers
    want = x + block.mlp(layers.rms_norm(x, norm_w, cfg.rms_norm_eps, unit_offset=True))
    got = reference.mlp(x, norm_w, w_gate_up, w_down, eps=cfg.rms_norm_eps, unit_offset=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_shapes_the_kernels_do_not_take_raise_errors_that_name_them():
    x, norm_w, w_gate_up, w_down = _mlp_inputs(8, 256, 384, jnp.float32)
    with pytest.raises(ValueError, match=r"norm_swiglu: 12 rows"):
        api.norm_swiglu(x[:6].repeat(2, 0), norm_w, w_gate_up, eps=1e-6, unit_offset=True)
    with pytest.raises(ValueError, match=r"norm_swiglu: x \(8, 256\), norm_w \(255,\)"):
        api.norm_swiglu(x, norm_w[:255], w_gate_up, eps=1e-6, unit_offset=True)
    with pytest.raises(ValueError, match=r"matmul_residual: y \(8, 384\), w \(384, 256\), "
                                         r"residual \(8, 128\)"):
        api.matmul_residual(x[:, :384].repeat(2, 1)[:, :384], w_down, x[:, :128])
    with pytest.raises(ValueError, match=r"widths \(88, 256\)"):
        api.matmul_residual(x[:, :88], w_down[:88], x)
    with pytest.raises(ValueError, match="implementation must be 'triton' or 'xla'"):
        api.mlp(x, norm_w, w_gate_up, w_down, eps=1e-6, unit_offset=True, implementation="cuda")
    assert api.fits(64, 1024, 3584) and api.fits(8, 32, 48)
    assert not api.fits(128, 1024) and not api.fits(24, 1024) and not api.fits(8, 40)
    assert (api.block(3584, 32), api.block(48, 128), api.block(1024, 128)) == (32, 16, 128)


def _decode_step(monkeypatch, on: bool, dtype=jnp.float32, gdn_impl=GDN_IMPL):
    """A tiny Qwen3.5 decode step (4 sequences, one token each, an 8-row bucket) at widths the
    kernels take (hidden 128, MLP 256): (run(params, cache), params, cache)."""
    from configs.presets import PRESETS
    from minipic_jax.models import qwen3_5
    from minipic_jax.models import layers
    from minipic_jax.models.testing import SimplePager
    from serving.model_contract import RecurrentMetadata
    monkeypatch.setattr(layers, "MLP_ROW_KERNEL", on)
    cfg = dataclasses.replace(PRESETS["tiny_qwen3_5"], hidden_size=128, intermediate_size=256)
    rng = np.random.default_rng(SEED)
    pager = SimplePager(4, 64, 8, seed=SEED)
    pager.step([9, 5, 12, 7])
    md, logits_idx, _ = pager.step([1, 1, 1, 1], min_tokens=8)
    rec = RecurrentMetadata(state_slots=jnp.asarray([2, 0, 5, 3], jnp.int32),
                            reset=jnp.zeros(4, bool), decode=True)
    params = qwen3_5.fuse_params(qwen3_5.init_params(cfg, jax.random.key(SEED), dtype))
    cache = qwen3_5.init_cache(cfg, 160, 8, 6, dtype)
    cache = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), cache)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, md.num_tokens), jnp.int32)

    def run(p, c):
        return qwen3_5.forward_with_checkpoints(p, tokens, md, c, cfg, recurrent=rec,
                                                logits_indices=logits_idx,
                                                gdn_impl=gdn_impl)
    return run, params, cache


def test_a_decode_step_with_the_mlp_kernels_is_the_xla_step(monkeypatch):
    outs = {}
    for on in (False, True):
        run, params, cache = _decode_step(monkeypatch, on)
        text = str(jax.make_jaxpr(run)(params, cache))
        assert ("name=norm_swiglu" in text) == on and ("name=matmul_residual" in text) == on
        outs[on] = jax.jit(run)(params, cache)
    for a, b in zip(jax.tree.leaves(outs[False]), jax.tree.leaves(outs[True])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)
    logits = (np.asarray(outs[False][0]), np.asarray(outs[True][0]))
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).all()


def test_a_decode_step_lowers_its_mlps_to_the_triton_kernels(monkeypatch):
    """Lowered for an H100 on the CPU (Triton's lowering asks for the device): the step's
    program holds two Triton calls a block where the switch is on, none where it is off."""
    from tests.cuda_lowering import abstract_h100
    counts = {}
    for on in (False, True):
        run, params, cache = _decode_step(monkeypatch, on, jnp.bfloat16, "pallas_fused")
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        with abstract_h100():
            text = jax.jit(run).trace(params, cache).lower(
                lowering_platforms=("cuda",)).as_text()
        monkeypatch.undo()
        counts[on] = (text.count("call @norm_swiglu("), text.count("call @matmul_residual("),
                      text.count('xla.gpu.triton') - text.count("gdn_decode"))
    assert counts[False][:2] == (0, 0) and counts[True][:2] == (4, 4)  # a block each
    assert counts[True][2] == counts[False][2] + 2  # each function's one Triton kernel


def test_llama_with_the_mlp_kernels_matches_hf(monkeypatch):
    """The HF fixture (hidden 32, MLP 32: blocks of 16 and 32) with layers.MLP_ROW_KERNEL on:
    every step of <= 64 rows (all of them here) runs its MLPs in the kernels; prefill logits
    within test_llama_fused's tolerance of HF's, greedy tokens HF's."""
    from conftest import FIXTURES, LLAMA_FIXTURES, hf_reference

    from minipic_jax.loading import load_model
    from minipic_jax.models import layers, llama, testing
    monkeypatch.setattr(layers, "MLP_ROW_KERNEL", True)
    name = LLAMA_FIXTURES[1]
    m, ref = load_model(FIXTURES / name), hf_reference(FIXTURES / name)
    fused = llama.fuse_params(m.params)
    got = testing.prefill_logits(m.family, fused, m.cfg, ref["prompts"], page_size=4)
    for i, (g, want) in enumerate(zip(got, ref["logits"])):
        assert np.abs(g - want[:len(g)]).max() <= 1e-4, f"prompt {i}"
    max_new = max(len(g) for g in ref["greedy"])
    tokens, _ = testing.greedy_generate(m.family, fused, m.cfg, ref["prompts"], max_new,
                                        page_size=4)
    assert [tokens[i] for i in range(len(ref["greedy"]))] == list(ref["greedy"])


@pytest.mark.slow  # (CI time: 8 s) the Llama fixture's test is the fast tier's HF oracle
def test_qwen3_5_with_the_mlp_kernels_matches_hf(monkeypatch):
    """The Qwen3.5 HF fixture (hidden 32, MLP 48: blocks of 16 and 32) with the switch on: its
    greedy decode steps (3 sequences in an 8-row bucket) run the MLPs in the kernels; the tokens
    are HF's, each step's logits the XLA steps' within float32 rounding."""
    from conftest import FIXTURES
    from test_qwen3_5 import QWEN_FIXTURES, _ref

    from minipic_jax.loading import load_model
    from minipic_jax.models import layers, qwen3_5, testing
    name = QWEN_FIXTURES[0]
    m, ref = load_model(str(FIXTURES / name)), _ref(name)
    fused = qwen3_5.fuse_params(m.params)
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(layers, "MLP_ROW_KERNEL", on)
        jax.clear_caches()
        runs[on] = testing.greedy_generate(m.family, fused, m.cfg, ref["prompt"],
                                           len(ref["greedy"][0]), page_size=16,
                                           stop_on_eos=False)
    tokens, step_logits = runs[True]
    for i, (t, want) in enumerate(zip(tokens, ref["greedy"])):
        assert t == want.tolist(), f"prompt {i}"
        for a, b in zip(step_logits[i], runs[False][1][i]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)
