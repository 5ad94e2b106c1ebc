"""benchmarks/cached_span_attention.py's host side: its variants and its profile reading."""

from benchmarks.cached_span_attention import PAGED, VARIANTS, _kernel_ms
from kernels_pallas.paged_attention.mosaic_prefill_paged import PagedOptions


def test_paged_sweep_variants_are_valid_options():
    """Every pk:* entry is paged_k plus PagedOptions fields that exist (a typo would cost a
    device call)."""
    for name, fields in PAGED.items():
        assert VARIANTS[name]["paged_k"] and VARIANTS[name]["paged"] == fields
        PagedOptions(**{k: v for k, v in fields.items() if k != "kv_mode"})


def test_kernel_time_counts_the_bound_paged_kernel():
    """The paged-keys kernel is named wrapped_mosaic_gpu_kernel (its bound body): its time
    counts as the attention kernel's (it read 0 ms, call 2 of 2026-12-05)."""
    prof = {"top": [{"name": "wrapped_mosaic_gpu_kernel", "ms_per_step": 0.2},
                    {"name": "anonymous_mosaic_gpu_kernel", "ms_per_step": 0.1},
                    {"name": "loop_concatenate_fusion", "ms_per_step": 0.04}]}
    assert abs(_kernel_ms(prof, "mosaic_gpu_kernel") - 0.3) < 1e-12
