"""The kernel registry: every attention implementation has a test class over the shared cases,
"auto" follows the one default list, and options are typed and checked; gated delta resolves
its implementation through the same rule."""

import dataclasses
import importlib

import jax.numpy as jnp
import numpy as np
import pytest

from attention_test_base import AttentionKernelTests
from kernels_pallas.gated_delta import api as gdn_api
from kernels_pallas.paged_attention import api
from kernels_pallas.paged_attention.problem import Problem
from kernels_pallas.paged_attention.triton_decode import TritonDecodeOptions

KERNEL_TEST_MODULES = ("test_paged_attention", "test_paged_attention_decode",
                       "test_paged_attention_mgpu", "test_paged_attention_mgpu_prefill",
                       "test_paged_attention_mixed")
GPU_DECODE = Problem(heads=32, kv_heads=8, head_dim=128, rotary_half=64,
                     dtype=jnp.dtype(jnp.bfloat16), block_size=16, table_cols=128,
                     decode_only=True, max_position=2048, platform="gpu")


def test_every_implementation_runs_the_shared_cases():
    for name in KERNEL_TEST_MODULES:
        importlib.import_module(name)
    tested = {cls.implementation for cls in AttentionKernelTests.__subclasses__()}
    assert set(api.ATTENTION) <= tested, f"no shared-case tests for {set(api.ATTENTION) - tested}"


@pytest.mark.parametrize("problem,order", [
    (GPU_DECODE, ("mosaic_decode", "triton_decode", "xla")),
    (dataclasses.replace(GPU_DECODE, head_dim=64, rotary_half=32), ("triton_decode", "xla")),
    (dataclasses.replace(GPU_DECODE, decode_only=False), ("mixed", "triton", "xla")),
    (dataclasses.replace(GPU_DECODE, decode_only=False, platform="cpu", interpret=True),
     ("triton", "xla")),
    (dataclasses.replace(GPU_DECODE, platform="cpu"), ("xla",)),
    (dataclasses.replace(GPU_DECODE, platform="cpu", interpret=True),
     ("mosaic_decode", "triton_decode", "xla")),
])
def test_auto_order(problem, order):
    assert api.auto_order(problem) == order


def test_auto_falls_through_to_what_takes_the_problem():
    impl, _ = api.choose_attention(dataclasses.replace(GPU_DECODE, dtype=jnp.dtype(jnp.float32)))
    assert impl.name == "triton_decode"  # Mosaic needs bf16/f16
    odd = dataclasses.replace(GPU_DECODE, head_dim=96, rotary_half=48, decode_only=False)
    assert api.choose_attention(odd)[0].name == "xla"  # Triton needs power-of-2 tiles


def test_options_are_typed_and_checked():
    impl, options = api.choose_attention(GPU_DECODE, "triton_decode", {"splits": 3})
    assert isinstance(options, TritonDecodeOptions) and options.splits == 3
    assert api.choose_attention(GPU_DECODE, "triton_decode", options)[1] == options
    with pytest.raises(ValueError, match="unknown options \\['splitz'\\]"):
        api.choose_attention(GPU_DECODE, "triton_decode", {"splitz": 3})
    with pytest.raises(ValueError, match="need a named implementation"):
        api.choose_attention(GPU_DECODE, "auto", {"splits": 3})
    with pytest.raises(ValueError, match="unknown implementation 'mosaic'"):
        api.choose_attention(GPU_DECODE, "mosaic")
    with pytest.raises(ValueError, match="options must be a dict or TritonDecodeOptions"):
        api.choose_attention(GPU_DECODE, "triton_decode", ["splits"])


def test_mixed_reads_values_from_the_pages_where_its_table_fits():
    """direct_v and skip_idle are measured defaults of the mixed path (on; RESULTS.md, Attention:
    prefill); a table wider than the kernel's SMEM copy keeps the mixed path, gathering values."""
    prefill = dataclasses.replace(GPU_DECODE, decode_only=False)
    impl, options = api.choose_attention(prefill)
    assert impl.name == "mixed" and options.direct_v and options.skip_idle
    wide = dataclasses.replace(prefill, table_cols=8193, max_position=8193 * 16)
    impl, options = api.choose_attention(wide)
    assert impl.name == "mixed" and not options.direct_v and options.skip_idle
    _, options = api.choose_attention(prefill, "mixed", {"direct_v": False, "skip_idle": False})
    assert not options.direct_v and not options.skip_idle


GDN_GPU = gdn_api.Problem(platform="gpu")


@pytest.mark.parametrize("problem,order", [
    (GDN_GPU, ("pallas_fused", "xla")),
    (gdn_api.Problem(platform="cpu", interpret=True), ("pallas_fused", "xla")),
    (gdn_api.Problem(platform="cpu"), ("xla",)),
])
def test_gated_delta_auto_order(problem, order):
    assert gdn_api.auto_order(problem) == order


def test_gated_delta_auto_picks_the_first_that_takes_the_problem():
    """Gated delta resolves `implementation=` through the one registry rule, like attention."""
    assert gdn_api.choose_gated_delta(GDN_GPU)[0].name == "pallas_fused"
    transitions = dataclasses.replace(GDN_GPU, ragged_transition=True)
    assert gdn_api.choose_gated_delta(transitions)[0].name == "xla"  # fused: no ragged A_span
    blocked = dataclasses.replace(GDN_GPU, scan="blocked")
    assert gdn_api.choose_gated_delta(blocked, None)[0].name == "pallas_fused"
    with pytest.raises(ValueError, match="no implementation takes this problem.*blocked"):
        gdn_api.choose_gated_delta(dataclasses.replace(blocked, platform="cpu"))
    assert set(gdn_api.GATED_DELTA) == {"xla", "pallas_fused", "mosaic", "mosaic_intra"}
    assert gdn_api.IMPLEMENTATIONS == ("auto", "xla", "pallas_fused", "mosaic", "mosaic_intra")


def test_gated_delta_bad_names_and_problems_are_clear_errors():
    with pytest.raises(ValueError, match="gated_delta: unknown implementation 'cuda'; use "
                                         "'auto' or one of \\('xla', 'pallas_fused', "
                                         "'mosaic', 'mosaic_intra'\\)"):
        gdn_api.choose_gated_delta(GDN_GPU, "cuda")
    with pytest.raises(ValueError, match="implementation='pallas_fused' needs a GPU"):
        gdn_api.choose_gated_delta(gdn_api.Problem(platform="cpu"), "pallas_fused")
    with pytest.raises(ValueError, match="implementation='mosaic_intra' needs a GPU"):
        gdn_api.choose_gated_delta(gdn_api.Problem(platform="cpu"), "mosaic_intra")
    with pytest.raises(ValueError, match="implementation='xla' cannot take scan='blocked'"):
        gdn_api.choose_gated_delta(dataclasses.replace(GDN_GPU, scan="blocked"), "xla")
    with pytest.raises(ValueError, match="unknown options \\['splits'\\]; it takes none"):
        gdn_api.choose_gated_delta(GDN_GPU, "xla", {"splits": 3})
    with pytest.raises(ValueError, match="gated_delta.ragged_prefill: implementation="
                                         "'pallas_fused' cannot return a ragged batch's"):
        x = np.zeros((4, 1, 8), np.float32)
        gdn_api.ragged_prefill(x, x, x, x[..., 0], x[..., 0], np.array([0, 4], np.int32),
                               np.zeros(1, np.int32), np.zeros((1, 1, 8, 8), np.float32),
                               chunk=4, implementation="pallas_fused", interpret=True,
                               return_transition=True)
