"""What a CPU engine step spends outside its matmuls (issue 31, item 6: SmolLM2-135M, batch 16
decode): the XLA attention reads key cos | sin from a host table when positions are bounded
(the engine bounds them by max_model_len) instead of computing trig per key, per layer, per
step; and the output projection and the tied LM head contract their weights as stored, so XLA
copies no weight into another order at every step."""

from __future__ import annotations

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_test_base import CASES, check, make_inputs, max_position
from configs.presets import get_preset
from jaxpr_walk import primitive_counts
from kernels_pallas.paged_attention.api import choose_attention
from kernels_pallas.paged_attention.problem import Problem
from kernels_pallas.paged_attention.reference import paged_attention_reference
from kernels_pallas.paged_attention.xla import xla_paged_attention
from minipic_jax.models import get_family

ROTATING = [c for c in CASES if c.kv_mode == "position_free"]


def _table_attention(case, inv, *, q_rotated: bool = False):
    return jax.jit(lambda q, k, v, md: xla_paged_attention(
        q, k, v, md, np.asarray(inv), kv_mode=case.kv_mode, attention_scaling=case.scaling,
        sm_scale=q.shape[-1] ** -0.5, max_position=max_position(case), q_rotated=q_rotated))


@pytest.mark.parametrize("case", ROTATING, ids=lambda c: c.name)
def test_table_rope_matches_reference(case):
    q, k, v, md, inv = make_inputs(case)
    out = _table_attention(case, inv)(q, k, v, md)
    ref = paged_attention_reference(q, k, v, md, inv, kv_mode=case.kv_mode,
                                    attention_scaling=case.scaling)
    check(out, ref, md, case.dtype, zero_pad_rows=True)


def test_table_rope_computes_no_trig():
    case = ROTATING[0]
    q, k, v, md, inv = make_inputs(case)
    attention = _table_attention(case, inv, q_rotated=True)  # the engine rotates q itself
    counts = primitive_counts(jax.make_jaxpr(attention)(q, k, v, md).jaxpr)
    assert counts["sin"] == counts["cos"] == 0, counts


def test_pages_are_gathered_apart_from_their_use():
    """An optimization barrier keeps the page gathers out of the rotation / transpose fusion
    (fused, XLA on CPU gathered element by element: 2.5x the attention's time at decode)."""
    case = ROTATING[0]
    q, k, v, md, inv = make_inputs(case)
    counts = primitive_counts(jax.make_jaxpr(_table_attention(case, inv))(q, k, v, md).jaxpr)
    assert counts["optimization_barrier"] == 1, counts


def test_engine_problem_gets_the_table_bound():
    problem = Problem(heads=9, kv_heads=3, head_dim=64, rotary_half=32, dtype=jnp.float32,
                      block_size=16, table_cols=128, max_position=2048, platform="cpu")
    impl, options = choose_attention(problem, "xla")
    assert impl.name == "xla" and options.max_position == 2048
    unbounded = choose_attention(Problem(**{**problem.__dict__, "max_position": None}), "xla")
    assert unbounded[1].max_position is None  # no bound: trig, as before


def _weight_copies(fn, *args) -> list[str]:
    """Instructions of the compiled CPU program that transpose or copy (weights, here)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return [line.strip()[:120] for line in text.splitlines()
            if re.search(r"= \S+ (copy|transpose)\(", line)]


def _abstract_model(preset: str):
    cfg = get_preset(preset)
    family = get_family(cfg.model_type)
    params = jax.eval_shape(lambda: family.init_params(cfg, jax.random.key(0)))
    return cfg, params, importlib.import_module(family.__name__ + "_modules")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's layouts")
@pytest.mark.parametrize("rows", [1, 16])
def test_llama_block_copies_no_weights(rows):
    cfg, params, modules = _abstract_model("tiny_llama3")
    x = jax.ShapeDtypeStruct((rows, cfg.hidden_size), jnp.float32)

    def block(p, x):  # attention stands in as "output = q": the projections around it remain
        return modules.bind(p, cfg).layers[0](x, cfg, lambda q, k, v, s: (q, s), None)[0]
    assert _weight_copies(block, params, x) == []


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's layouts")
@pytest.mark.parametrize("preset", ["tiny_llama3", "tiny_qwen3_5"])
def test_tied_lm_head_copies_no_weights(preset, rows=1):  # a one-row step copied the table
    cfg, params, modules = _abstract_model(preset)
    assert cfg.tie_word_embeddings
    x = jax.ShapeDtypeStruct((rows, cfg.hidden_size), jnp.float32)
    assert _weight_copies(lambda p, x: modules.bind(p, cfg).logits(x, cfg), params, x) == []


def test_greedy_index_is_argmax_on_ties_nan_and_inf():
    from serving.step.sampler import first_max_index
    x = np.random.default_rng(0).standard_normal((6, 50)).astype(np.float32)
    x[1, [3, 7]] = 9.0  # a tie: the first
    x[2, [5, 9]] = np.nan  # the first NaN, as argmax
    x[3], x[4], x[5, 10] = -np.inf, 1.0, np.inf
    x = jnp.asarray(x)
    got = first_max_index(x, jnp.max(x, axis=-1, keepdims=True))
    np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))
    assert got.dtype == jnp.int32


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's reduce")
def test_greedy_sampling_runs_no_value_index_reduce():
    """A (value, index) variadic reduce (jnp.argmax) is not vectorised on CPU: 3.5 ms a step."""
    from serving.step.sampler import SamplingMetadata, sample
    s, vocab = 16, 4096
    sm = SamplingMetadata(temperature=jnp.zeros(s), top_k=jnp.zeros(s, jnp.int32),
                          top_p=jnp.ones(s), seed=jnp.zeros(s, jnp.uint32),
                          step=jnp.zeros(s, jnp.int32))
    greedy = lambda x: sample(x, sm, all_greedy=True, use_filter=False, num_logprobs=0)  # noqa
    text = jax.jit(greedy).lower(jnp.zeros((s, vocab))).compile().as_text()
    assert not re.search(r"= \(f32\[16\]\{0\}, s32\[16\]\{0\}\) (reduce|fusion)\(", text)


def test_cpu_prefill_of_720_tokens_pads_to_768(monkeypatch):
    """A 1024-token bucket holds a 3/4 one on CPU: the bench's batch-16 prefill (720 tokens)
    padded to 1024 spent ~30% of its matmuls on padding (9% of the whole generate)."""
    import serving.config
    from serving.config import Config
    monkeypatch.setattr(serving.config, "CPU_MIN_TOKEN_BUCKET", 1)  # as shipped (conftest: 8)
    if jax.default_backend() != "cpu":
        pytest.skip("CPU default")
    cfg = Config(max_num_seqs=16, max_num_batched_tokens=1024)
    assert cfg.token_buckets[-3:] == (512, 768, 1024) and cfg.token_bucket(720) == 768
    assert Config(max_num_batched_tokens=512).token_buckets[-2:] == (256, 512)
    assert 768 not in Config(max_num_batched_tokens=1024, min_token_bucket=8).token_buckets
