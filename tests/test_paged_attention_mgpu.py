"""The Mosaic GPU decode kernel (warp-level MMA, keys rotated in registers) on the shared kernel
cases and its option runs, what it rejects, and the "auto" policy's choice of it.

On CPU it runs under the Mosaic GPU interpreter, whose buffers start as NaN (unwritten outputs
show) and which checks for races here; MINIPIC_COMPILED=1 compiles it for the GPU instead.
"""

import dataclasses

import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from attention_test_base import (INTERPRET, AttentionKernelTests, Case, check, make_inputs,
                                 pytest_generate_tests)  # noqa: F401 (the hook)
from kernels_pallas.paged_attention import api
from kernels_pallas.paged_attention.api import paged_attention
from kernels_pallas.paged_attention.reference import paged_attention_reference


def _case(i, dtype, kv_heads, group, page_size, kv_mode, specs):
    return Case(f"mma{i}-{jnp.dtype(dtype).name}-K{kv_heads}G{group}-B{page_size}-{kv_mode}",
                dtype, kv_heads, group, 128, 128, page_size, kv_mode, tuple(specs), seed=20 + i)


# (case, options, slow): kv heads per CTA, key steps of 32 and 64 keys, explicit splits and
# ring depths, packed (16-bit) rotation, the cos | sin table's bound.
RUNS = (
    (_case(0, jnp.bfloat16, 2, 4, 16, "position_free", [(200, 1, 0), (5, 1, 0), (130, 1, 20)]),
     {"max_position": 256, "splits": 2, "kv_group": 2, "stages": 2, "pages_per_step": 4,
      "packed": False}, False),
    (_case(1, jnp.float16, 1, 12, 16, "position_free", [(300, 1, 0), (64, 1, 60)]),
     {"max_position": 320, "splits": 3, "stages": 2, "pages_per_step": 4, "packed": False},
     True),
    (_case(2, jnp.bfloat16, 1, 16, 32, "position_free", [(90, 1, 7), (3, 1, 0)]),
     {"pages_per_step": 2, "max_position": 128, "stages": 4, "packed": True}, True),
    (_case(3, jnp.bfloat16, 4, 4, 16, "position_free", [(100, 1, 0), (37, 1, 5)]),
     {"pages_per_step": 2, "max_position": 160, "kv_group": 4, "packed": True, "stages": 2},
     True),
    (_case(4, jnp.bfloat16, 2, 8, 16, "rotated", [(150, 1, 0), (0, 1, 0)]),
     {"kv_group": 2, "pages_per_step": 2, "stages": 3, "packed": False}, True),
    (_case(5, jnp.bfloat16, 1, 8, 16, "rotated", [(150, 1, 0), (0, 1, 0)]),
     {"pages_per_step": 4, "stages": 3, "kv_group": 1, "packed": False}, True),
)


class TestMosaicDecode(AttentionKernelTests):
    """Pad slots hold finite values: the kernel's contract (see mosaic_decode.py), which the
    engine guarantees by zeroing pages on allocation (serving/cache/page_zeroing.py)."""

    implementation = "mosaic_decode"
    option_runs = RUNS
    nan_pads = False
    zero_pad_rows = True
    slow_cases = ("f16-K1G8-D128-B16-rotated-decode",)

    @classmethod
    def interpret_arg(cls, case):
        return plgpu.InterpretGPUParams(detect_races=True) if INTERPRET else False

    def after_run(self, case):
        if INTERPRET:
            from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
            assert not ipc.get_races().races_found, "race detector found a data race"


def _inputs(dtype, kv_heads, group, head_dim, page_size, specs, rotary_dim=None):
    return make_inputs(Case("reject", dtype, kv_heads, group, head_dim, rotary_dim or head_dim,
                            page_size, "position_free", tuple(specs)), nan_pads=False)


def test_mosaic_rejects_what_it_cannot_run():
    call = lambda *a, **kw: paged_attention(*a, implementation="mosaic_decode", interpret=True,
                                            **kw)
    q, k, v, md, inv = _inputs(jnp.bfloat16, 1, 4, 128, 16, [(20, 3, 0)])
    with pytest.raises(ValueError, match="decode-only"):
        call(q, k, v, md, inv, kernel_options={"max_position": 64})
    with pytest.raises(ValueError, match="full rotary"):
        call(q, k, v, md, inv[:16], kernel_options={"max_position": 64})
    q1, k1, v1, md1, inv1 = _inputs(jnp.bfloat16, 1, 4, 128, 16, [(20, 1, 0)])
    with pytest.raises(ValueError, match="max_position"):  # position_free: table only
        call(q1, k1, v1, md1, inv1)
    with pytest.raises(ValueError, match="kv_group"):  # one kv head
        call(q1, k1, v1, md1, inv1, kernel_options={"max_position": 64, "kv_group": 2})
    with pytest.raises(ValueError, match="unknown options"):  # options of the removed kernels
        call(q1, k1, v1, md1, inv1, kernel_options={"max_position": 64, "consumers": 1})
    with pytest.raises(ValueError, match="bf16/f16"):
        call(q1.astype(jnp.float32), k1.astype(jnp.float32), v1.astype(jnp.float32), md1, inv1,
             kernel_options={"max_position": 64})
    q2, k2, v2, md2, inv2 = _inputs(jnp.bfloat16, 1, 2, 256, 32, [(20, 1, 0)])
    with pytest.raises(ValueError, match="shared memory"):  # D = 256 needs too much SMEM
        call(q2, k2, v2, md2, inv2, kernel_options={"max_position": 64, "stages": 4,
                                                    "pages_per_step": 4})


@pytest.mark.slow  # ~14 s interpreted; the choice itself: tests/test_kernel_registry.py
def test_auto_takes_the_mosaic_kernel_where_it_fits(monkeypatch):
    """implementation="auto" for a decode-only step (on a GPU, or interpreting): the Mosaic
    kernel with its measured defaults for D = 128 and a position bound; triton_decode for a
    problem it does not take (no bound in position_free, head_dim 64)."""
    calls = []
    for name in ("mosaic_decode", "triton_decode"):
        impl = api.ATTENTION[name]
        monkeypatch.setitem(api.ATTENTION, name, dataclasses.replace(
            impl, run=lambda *a, _run=impl.run, _n=name, **kw: (
                calls.append((_n, kw.get("kv_group"))), _run(*a, **kw))[1]))
    q, k, v, md, inv = _inputs(jnp.bfloat16, 2, 4, 128, 16, [(90, 1, 0), (33, 1, 4)])
    out = paged_attention(q, k, v, md, inv, decode_only=True, max_position=128,
                          interpret=True if INTERPRET else False)
    assert calls == [("mosaic_decode", 2)], calls
    check(out, paged_attention_reference(q, k, v, md, inv, kv_mode="position_free"), md,
          jnp.bfloat16)
    for max_position, inputs in ((None, (q, k, v, md, inv)),
                                 (128, _inputs(jnp.bfloat16, 2, 4, 64, 16, [(40, 1, 0)]))):
        calls.clear()
        paged_attention(*inputs, decode_only=True, max_position=max_position,
                        interpret=True if INTERPRET else False)
        assert [c[0] for c in calls] == ["triton_decode"], (max_position, calls)
