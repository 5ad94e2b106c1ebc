"""A Sequence declares all its state in serving/sequence.py (STYLE 14): other modules cannot add
attributes to it, and nobody reads its state through getattr/hasattr with a default."""

from __future__ import annotations

import pathlib
import re

import pytest

from minipic_jax.sampling_params import SamplingParams
from serving.layout import build_layout
from serving.sequence import Sequence

B = 4
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _seq() -> Sequence:
    ids = [5, 6, 7, 8, 9]
    return Sequence("r", ids, build_layout(ids, B, pad_id=0, ssep_id=1, pdep_id=2), SamplingParams(max_tokens=2), B,
                    seed=0)


def test_a_sequence_refuses_an_undeclared_attribute():
    seq = _seq()
    seq.ready_ptr = 3  # declared fields and sub-records take assignments
    seq.span.skips = [(0, 4)]
    seq.memo.final_start = 0
    for obj in (seq, seq.hybrid, seq.span, seq.store, seq.memo):
        with pytest.raises(AttributeError):
            obj.some_undeclared_field = 1
    assert not hasattr(seq, "__dict__")


def test_no_module_reads_sequence_state_through_getattr():
    pattern = re.compile(r"\b(getattr|hasattr|setattr)\((seq|own|e\.seq|s|q)\b")
    hits = [f"{p.relative_to(ROOT)}:{n}" for folder in ("serving", "minipic_jax", "benchmarks")
            for p in sorted((ROOT / folder).rglob("*.py"))
            for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits
