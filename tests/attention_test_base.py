"""The shared test base of the paged-attention kernels: every implementation of the registry
(kernels_pallas.paged_attention.api.ATTENTION) against the numpy reference (reference.py) on the
same cases. A kernel's test class subclasses `AttentionKernelTests`, names its implementation
and adds option runs of its own; a shared case the kernel cannot take (decode-only kernels and
prefill-shaped batches, the kernel's `limits`) is skipped with the registry's reason.

Pallas kernels run interpreted on CPU; MINIPIC_COMPILED=1 compiles them (on a GPU). Cases
marked `slow` are the expensive interpreted ones, kept out of the default CPU run (a cheap case
of each kernel stays in it); compiled, they are cheap and all run.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention.api import ATTENTION, Problem, choose_attention
from kernels_pallas.paged_attention.random_inputs import inv_freq_for, random_batch
from kernels_pallas.paged_attention.reference import paged_attention_reference

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}
MIXED = ((9, 5, 0), (0, 1, 0), (21, 1, 6), (3, 7, 2), (0, 12, 0))  # (cached, new, window)
DECODE = ((13, 1, 0), (30, 1, 9), (5, 1, 0), (1, 1, 1), (7, 0, 0))  # the last: no query


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    dtype: object
    kv_heads: int
    group: int
    head_dim: int
    rotary_dim: int
    page_size: int
    kv_mode: str
    specs: tuple
    scaling: float = 1.0
    seed: int = 0

    @property
    def decode_only(self) -> bool:
        return all(new <= 1 for _, new, _ in self.specs)


CASES = [
    Case("f32-K2G1-D64-B4-mixed", jnp.float32, 2, 1, 64, 64, 4, "position_free", MIXED),
    Case("f32-K1G4-D128R32-B8-mixed", jnp.float32, 1, 4, 128, 32, 8, "position_free", MIXED,
         seed=1),
    Case("bf16-K1G8-D256R64-B4-mixed", jnp.bfloat16, 1, 8, 256, 64, 4, "position_free", MIXED,
         seed=2),
    Case("f32-K1G4-D64-B4-rotated-mixed", jnp.float32, 1, 4, 64, 64, 4, "rotated", MIXED,
         seed=3),
    Case("f32-K2G4-D64R16-B4-decode-scaled", jnp.float32, 2, 4, 64, 16, 4, "position_free",
         DECODE, scaling=0.8, seed=4),
    Case("bf16-K2G4-D128-B16-decode", jnp.bfloat16, 2, 4, 128, 128, 16, "position_free",
         ((70, 1, 0), (5, 1, 0), (130, 1, 20), (7, 0, 0)), seed=5),
    Case("f16-K1G8-D128-B16-rotated-decode", jnp.float16, 1, 8, 128, 128, 16, "rotated",
         ((40, 1, 0), (0, 1, 0)), seed=6),
    Case("bf16-K2G2-D128-B16-mixed", jnp.bfloat16, 2, 2, 128, 128, 16, "position_free",
         ((40, 70, 17), (0, 20, 0), (130, 1, 3)), seed=7),
]


def make_inputs(case: Case, *, nan_pads: bool = True, share: bool = True):
    """(q, k_pages, v_pages, metadata, inv_freq) of a case. nan_pads: slots no sequence may
    read hold NaN (a kernel that reads them fails); else they are finite. share: a physical page
    is read by two sequences at different offsets."""
    rng = np.random.default_rng(case.seed)
    md, num_pages, tokens = random_batch(rng, list(case.specs), page_size=case.page_size,
                                         pad_prob=0.4, share=share, pad_tokens=2,
                                         shuffle_entries=case.seed % 2 == 1)
    heads = case.kv_heads * case.group
    shape = (num_pages, case.page_size, case.kv_heads, case.head_dim)
    q = jnp.asarray(rng.standard_normal((tokens, heads, case.head_dim)), case.dtype)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    if nan_pads:
        readable = np.zeros((num_pages, case.page_size), bool)
        for s in range(md.num_seqs):
            for b in range(int(md.num_blocks[s])):
                readable[int(md.block_tables[s, b]), : int(md.block_num_valid[s, b])] = True
        k[~readable], v[~readable] = np.nan, np.nan
    inv = jnp.asarray(inv_freq_for(case.head_dim, case.rotary_dim))
    return q, jnp.asarray(k, case.dtype), jnp.asarray(v, case.dtype), md, inv


def max_position(case: Case) -> int:
    """A bound on the case's positions (for the table RoPE variants)."""
    return max(cached + new for cached, new, _ in case.specs) + 1


def check(out, ref, md, dtype, *, zero_pad_rows: bool = False):
    """Rows of real queries match the reference (relative L2) and are all written (finite)."""
    n = int(md.cu_q_lens[-1])
    got = np.asarray(jnp.asarray(out, jnp.float32)).astype(np.float64)
    assert np.all(np.isfinite(got[:n])), "kernel left rows unwritten (NaN) or read a pad"
    err = float(np.linalg.norm(got[:n] - ref[:n]) / np.linalg.norm(ref[:n]))
    assert err < TOL[dtype], f"relative L2 error {err:.2e} >= {TOL[dtype]}"
    if zero_pad_rows:
        assert np.all(got[n:] == 0), "rows that are no sequence's query must be 0"


class AttentionKernelTests:
    """Subclass per implementation: set `implementation`; `option_runs` lists (case or shared
    case name, options, slow) runs beyond the shared cases at the kernel's defaults;
    `slow_cases` names shared cases too expensive to interpret by default; nan_pads: the kernel
    never reads pad slots (else they hold finite values); zero_pad_rows: rows of no query come
    back 0; `interpret_arg`: the interpret argument when interpreting."""

    implementation: str = ""
    option_runs: tuple = ()
    slow_cases: tuple = ()
    nan_pads: bool = True
    zero_pad_rows: bool = False

    @classmethod
    def interpret_arg(cls, case: Case):
        del case
        return INTERPRET

    @classmethod
    def runs(cls):
        """pytest params (case, options) of this kernel: the shared cases, then its own."""
        by_name = {c.name: c for c in CASES}
        params = []
        for case in CASES:
            slow = INTERPRET and case.name in cls.slow_cases
            params.append(pytest.param((case, None), id=case.name,
                                       marks=[pytest.mark.slow] if slow else []))
        for case, options, slow in cls.option_runs:
            case = by_name[case] if isinstance(case, str) else case
            label = "-".join(f"{k}{v}" for k, v in options.items())
            params.append(pytest.param((case, options), id=f"{case.name}-{label}",
                                       marks=[pytest.mark.slow] if slow and INTERPRET else []))
        return params

    def test_matches_reference(self, kernel_run):
        from kernels_pallas.paged_attention.api import paged_attention
        case, options = kernel_run
        impl = ATTENTION[self.implementation]
        q, k, v, md, inv = make_inputs(case, nan_pads=self.nan_pads)
        problem = Problem.of(q, k, md, inv, kv_mode=case.kv_mode, decode_only=case.decode_only,
                             max_position=max_position(case), interpret=True)
        if impl.decode_only and not case.decode_only:
            pytest.skip(f"{impl.name} is decode-only; case {case.name} is not")
        try:
            choose_attention(problem, impl.name, options)
        except ValueError as err:
            if options:  # an option run must fit the kernel
                raise
            pytest.skip(str(err))
        # under jit, as a model's step calls it: one compile per case, not one per eager op
        # (CI time; the value checks that need concrete metadata: test_validation_errors)
        run = jax.jit(lambda q, k, v, md: paged_attention(
            q, k, v, md, inv, kv_mode=case.kv_mode, attention_scaling=case.scaling,
            implementation=impl.name, kernel_options=options, decode_only=case.decode_only,
            max_position=max_position(case), interpret=self.interpret_arg(case)))
        out = run(q, k, v, md)
        ref = paged_attention_reference(q, k, v, md, inv, kv_mode=case.kv_mode,
                                        attention_scaling=case.scaling)
        check(out, ref, md, case.dtype, zero_pad_rows=self.zero_pad_rows)
        self.after_run(case)

    def after_run(self, case: Case) -> None:
        """Per-kernel checks after a run (e.g. the race detector's verdict)."""


def pytest_generate_tests(metafunc):
    """Parametrise `kernel_run` by the test class's runs (import this into a test module)."""
    if "kernel_run" in metafunc.fixturenames and metafunc.cls is not None:
        metafunc.parametrize("kernel_run", metafunc.cls.runs())
