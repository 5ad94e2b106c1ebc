"""`minipic-bench cpu-vs-hf`: a missing transformers interpreter is named before any work, and
both sides get the same seeded prompts."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import cpu_vs_hf


def _args(*argv):
    p = argparse.ArgumentParser()
    cpu_vs_hf.add_parser(p)
    return p.parse_args(list(argv))


def test_missing_hf_python_is_named_before_any_work(tmp_path, monkeypatch):
    def no_export(*a, **k):
        raise AssertionError("exported the model before checking the interpreter")
    monkeypatch.setattr(cpu_vs_hf, "_export_preset", no_export)
    with pytest.raises(ValueError, match="--hf-python .*nope"):
        cpu_vs_hf.run(_args("--hf-python", str(tmp_path / "nope")))


def test_prompts_are_seeded_and_in_range():
    a = cpu_vs_hf.make_prompts(0, 16, (30, 60), 49152)
    assert a == cpu_vs_hf.make_prompts(0, 16, (30, 60), 49152)
    assert len(a) == 16 and all(30 <= len(p) <= 60 for p in a)
    assert all(3 <= t < 49152 for p in a for t in p)
