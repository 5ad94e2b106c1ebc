"""kernels_pallas/row_matmul: a decode step's MLP in two kernels (the norm with the gate/up
product and SwiGLU, the down product with the residual add), interpreted on the CPU:

- the kernels against reference.mlp (float32 and bf16, both norm forms, 8-64 rows): within the
  float32 accumulation's order (the kernels sum BLOCK_K-row blocks; every rounding to the model
  dtype as the XLA form rounds, so a bf16 value differs only where a float32 sum straddles a
  rounding boundary, by a unit or two in the last place); reference.mlp against the model's own XLA
  MLP (qwen3_5_modules.Qwen35Block), bit for bit;
- shapes the kernels do not take raise errors naming them;
- a Qwen3.5 decode step with layers.MLP_ROW_KERNEL, MIXER_ROW_KERNELS or both on: the kernels
  in its program, its logits and caches those of the XLA step within float32 rounding; lowered
  for CUDA, the kernels' calls a block; the HF fixtures' tokens with them (Llama, Qwen3.5).
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
    proj = api.norm_matmul(x, norm_w, w_gate_up, interpret=INTERPRET, **kw)  # a plain product
    for a, b in ((got, want), (act, jax.nn.silu(gu[:, :384]) * gu[:, 384:]), (proj, gu)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if dtype == jnp.float32:
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
            continue
        # a unit or two of bf16 (2^-8 relative) at the value or at the output's scale (a
        # difference of products near 0)
        np.testing.assert_allclose(a, b, rtol=2.0 ** -7, atol=2.0 ** -7 * np.abs(b).max())
        assert np.mean(a != b) < 0.05  # only values near a rounding boundary differ


@pytest.mark.parametrize("option", [
    dict(block_n=16, block_k=64, num_warps=8, num_stages=3, split_k=1),
    dict(block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=2),
    dict(block_n=32, block_k=128, num_warps=4, num_stages=3, split_k=8)])
def test_every_launch_option_is_the_reference(monkeypatch, option):
    """api.OPTIONS change how the kernels split the work, not the result: split-K's float32
    partials summed by XLA, other blocks and pipelines, against the XLA form (float32 IEEE)."""
    monkeypatch.setitem(api.OPTIONS, "matmul_residual", option)
    norm = {k: v for k, v in option.items() if k != "split_k"}
    monkeypatch.setitem(api.OPTIONS, "norm_swiglu", norm)
    x, norm_w, w_gate_up, w_down = _mlp_inputs(8, 256, 384, jnp.float32)
    with jax.default_matmul_precision("highest"):
        want = reference.mlp(x, norm_w, w_gate_up, w_down, eps=1e-6, unit_offset=True)
    got = api.mlp(x, norm_w, w_gate_up, w_down, eps=1e-6, unit_offset=True,
                  interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    # split-K slices: the most that leave whole 16-column dots (384 = 8 x 48; 24 / 16 no)
    assert (api.split_k(384, 8), api.split_k(384, 16), api.split_k(3584, 8),
            api.split_k(40, 4)) == (8, 8, 8, 1)


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
    with pytest.raises(ValueError, match=r"norm_swiglu: x \(8, 256\), norm_w \(255,\), w \(256, 768\)"):
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


# the switch sets the model tests run: each fusion alone, both
SWITCH_SETS = [("MLP_ROW_KERNEL",), ("MIXER_ROW_KERNELS",), ("MLP_ROW_KERNEL", "MIXER_ROW_KERNELS")]


def _switches(monkeypatch, on=()):
    from minipic_jax.models import layers
    for name in ("MLP_ROW_KERNEL", "MIXER_ROW_KERNELS"):
        monkeypatch.setattr(layers, name, name in on)


def _decode_step(monkeypatch, on=(), dtype=jnp.float32, gdn_impl=GDN_IMPL, seqs=4):
    """A tiny Qwen3.5 decode step in an 8-row bucket (4 sequences with a token each, or 8 of
    which the last has none: as many sequences as rows) at widths the kernels take (hidden 128,
    MLP 256, GDN projection 336), with the layers switches `on`: (run(params, cache), params,
    cache)."""
    from configs.presets import PRESETS
    from minipic_jax.models import qwen3_5
    from minipic_jax.models.testing import SimplePager
    from serving.model_contract import RecurrentMetadata
    _switches(monkeypatch, on)
    # 8 value heads: the GDN projection's 336 columns (C + Hv Dv + 2 Hv) whole blocks of 16
    cfg = dataclasses.replace(PRESETS["tiny_qwen3_5"], hidden_size=128, intermediate_size=256,
                              linear_num_value_heads=8)
    rng = np.random.default_rng(SEED)
    pager = SimplePager(seqs, 64, 8, seed=SEED)
    pager.step([9, 5, 12, 7, 3, 8, 4, 6][:seqs])
    md, logits_idx, _ = pager.step([1] * 4 if seqs == 4 else [1] * 7 + [0], min_tokens=8)
    rec = RecurrentMetadata(state_slots=jnp.asarray(rng.permutation(10)[:seqs], jnp.int32),
                            reset=jnp.zeros(seqs, bool), decode=True)
    params = qwen3_5.fuse_params(qwen3_5.init_params(cfg, jax.random.key(SEED), dtype))
    cache = qwen3_5.init_cache(cfg, 160, 8, 10, dtype)
    cache = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), cache)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, md.num_tokens), jnp.int32)

    def run(p, c):
        return qwen3_5.forward_with_checkpoints(p, tokens, md, c, cfg, recurrent=rec,
                                                logits_indices=logits_idx,
                                                gdn_impl=gdn_impl)
    return run, params, cache


# Triton calls a block of the tiny step (3 GDN + 1 attention layer) per switch: the MLP's two; the
# mixer's norm with its projection and its output projection with the residual
CALLS = {"MLP_ROW_KERNEL": (4, 4), "MIXER_ROW_KERNELS": (4, 4)}


@pytest.mark.parametrize("on, seqs", [(on, 4) for on in SWITCH_SETS] + [(SWITCH_SETS[1], 8)])
def test_a_decode_step_with_the_row_kernels_is_the_xla_step(monkeypatch, on, seqs):
    outs = {}
    for form in ((), on):
        run, params, cache = _decode_step(monkeypatch, form, seqs=seqs)
        text = str(jax.make_jaxpr(run)(params, cache))
        assert ("name=rows_norm_swiglu" in text) == ("MLP_ROW_KERNEL" in form)
        assert ("name=rows_norm_matmul" in text) == ("MIXER_ROW_KERNELS" in form)
        residual = ("name=rows_matmul_residual" in text or  # (partial: api.OPTIONS' split-K)
                    "name=rows_matmul_partial" in text)
        assert residual == bool(form)
        outs[form] = jax.jit(run)(params, cache)
    for a, b in zip(jax.tree.leaves(outs[()]), jax.tree.leaves(outs[on])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)
    logits = (np.asarray(outs[()][0]), np.asarray(outs[on][0]))
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).all()


def test_a_decode_step_lowers_to_the_triton_kernels(monkeypatch):
    """Lowered for an H100 on the CPU (Triton's lowering asks for the device): the step's
    program calls the norm kernels and matmul_residual once a block for each switch on, none
    with both off (a function each, with its one Triton kernel)."""
    from tests.cuda_lowering import abstract_h100
    counts = {}
    for on in [()] + SWITCH_SETS:
        run, params, cache = _decode_step(monkeypatch, on, jnp.bfloat16, "pallas_fused")
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        with abstract_h100():
            text = jax.jit(run).trace(params, cache).lower(
                lowering_platforms=("cuda",)).as_text()
        monkeypatch.undo()
        counts[on] = (text.count("call @norm_matmul"), text.count("call @matmul_residual"))
    for on, got in counts.items():
        assert got == tuple(sum(CALLS[n][i] for n in on) for i in (0, 1)), (on, got)


@pytest.mark.parametrize("on", [SWITCH_SETS[-1]] + [  # (CI time: each alone in the slow tier)
    pytest.param(on, marks=pytest.mark.slow) for on in SWITCH_SETS[:-1]])
def test_llama_with_the_row_kernels_matches_hf(monkeypatch, on):
    """The HF fixture (hidden 32, MLP 32: blocks of 16 and 32) with the switches `on`: every
    step of <= 64 rows (all of them here) runs its MLPs / mixers' norms and output projections
    in the kernels; prefill logits within test_llama_fused's tolerance of HF's, greedy tokens
    HF's."""
    from conftest import FIXTURES, LLAMA_FIXTURES, hf_reference

    from minipic_jax.loading import load_model
    from minipic_jax.models import llama, testing
    name = LLAMA_FIXTURES[1]
    m, ref = load_model(FIXTURES / name), hf_reference(FIXTURES / name)
    fused = llama.fuse_params(m.params)
    max_new = max(len(g) for g in ref["greedy"])
    runs = {}
    for form in ((), on):
        _switches(monkeypatch, form)
        jax.clear_caches()
        got = testing.prefill_logits(m.family, fused, m.cfg, ref["prompts"], page_size=4)
        for i, (g, want) in enumerate(zip(got, ref["logits"])):
            assert np.abs(g - want[:len(g)]).max() <= 1e-4, f"prompt {i}"
        runs[form] = testing.greedy_generate(m.family, fused, m.cfg, ref["prompts"], max_new,
                                             page_size=4)
    tokens, step_logits = runs[on]
    assert [tokens[i] for i in range(len(ref["greedy"]))] == list(ref["greedy"])
    for got, want in zip(step_logits, runs[()][1]):  # each decode step's, the XLA step's
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)


@pytest.mark.slow  # (CI time: 8 s) the Llama fixture's test is the fast tier's HF oracle
def test_qwen3_5_with_the_row_kernels_matches_hf(monkeypatch):
    """The Qwen3.5 HF fixture (hidden 32, MLP 48: blocks of 16 and 32) with both switches on:
    its greedy decode steps (3 sequences in an 8-row bucket) run the MLPs and the mixers' norms
    and output projections in the kernels; the tokens are HF's, each step's logits the XLA
    steps' within float32 rounding."""
    from conftest import FIXTURES
    from test_qwen3_5 import QWEN_FIXTURES, _ref

    from minipic_jax.loading import load_model
    from minipic_jax.models import qwen3_5, testing
    name = QWEN_FIXTURES[0]
    m, ref = load_model(str(FIXTURES / name)), _ref(name)
    fused = qwen3_5.fuse_params(m.params)
    runs = {}
    for on in (False, True):
        _switches(monkeypatch, SWITCH_SETS[-1] if on else ())
        jax.clear_caches()
        runs[on] = testing.greedy_generate(m.family, fused, m.cfg, ref["prompt"],
                                           len(ref["greedy"][0]), page_size=16,
                                           stop_on_eos=False)
    tokens, step_logits = runs[True]
    for i, (t, want) in enumerate(zip(tokens, ref["greedy"])):
        assert t == want.tolist(), f"prompt {i}"
        for a, b in zip(step_logits[i], runs[False][1][i]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)


def test_a_training_forward_keeps_xla_with_the_switches_on(monkeypatch):
    """The row kernels have no gradient: a training forward (unfused weights, 2 x 8 = 16 rows,
    a size the kernels take) runs the XLA blocks whatever the switches say, so its loss and
    gradients are those with the switches off, bit for bit."""
    from conftest import FIXTURES, LLAMA_FIXTURES

    from minipic_jax.loading import load_model
    from minipic_jax.models import llama
    m = load_model(FIXTURES / LLAMA_FIXTURES[1])
    rng = np.random.default_rng(SEED)
    tokens = jnp.asarray(rng.integers(0, m.cfg.vocab_size, (2, 8)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    valid = jnp.ones((2, 8), bool)

    def loss(p):
        logits = llama.training_forward(p, tokens, positions, jnp.zeros_like(tokens), valid,
                                        m.cfg, remat=False)
        return jnp.mean(jax.nn.logsumexp(logits, -1))
    got = {}
    for on in ((), SWITCH_SETS[-1]):
        _switches(monkeypatch, on)
        jax.clear_caches()
        got[on] = jax.jit(jax.value_and_grad(loss))(m.params)  # eagerly: a program an op
    for a, b in zip(jax.tree.leaves(got[()]), jax.tree.leaves(got[SWITCH_SETS[-1]])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
