"""The module switches that change a step's program (serving/step/program_switches.py) are all
listed, and a stored step executable is keyed by their values: a flipped switch compiles its own
program instead of loading the other form's (session 25: an engine test with a switch flipped
loaded the executable stored with it off)."""

from __future__ import annotations

import ast
import importlib
import pathlib

from serving.step import program_switches

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("kernels_pallas", "serving", "minipic_jax")


def _module_booleans():
    """(module, name) of every module-level `NAME = True / False` of the engine's packages."""
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for node in tree.body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                        and isinstance(node.value.value, bool):
                    for target in node.targets:
                        if isinstance(target, ast.Name) and target.id.isupper():
                            yield module, target.id


def test_every_module_switch_is_listed():
    found = set(_module_booleans())
    listed = set(program_switches.SWITCHES) | set(program_switches.NOT_SWITCHES)
    assert found - listed == set(), "list these in program_switches.SWITCHES or NOT_SWITCHES"
    assert listed - found == set(), "listed switches that no longer exist"
    for module, name in program_switches.SWITCHES:
        assert isinstance(getattr(importlib.import_module(module), name), bool)


def test_a_flipped_switch_changes_the_program_context(monkeypatch):
    from benchmarks.lower_time import build_runner
    from minipic_jax.models import qwen3_5
    r = build_runner("tiny_qwen3_5", "float32", max_num_seqs=2, max_num_batched_tokens=32,
                     min_token_bucket=32, max_model_len=128, block_size=16, num_kv_blocks=16)
    before = r._program_context()
    on = qwen3_5.GDN_DECODE_IN_PLACE
    assert ("minipic_jax.models.qwen3_5", "GDN_DECODE_IN_PLACE", on) in program_switches.values()
    monkeypatch.setattr(qwen3_5, "GDN_DECODE_IN_PLACE", not on)
    assert r._program_context() != before
    monkeypatch.setattr(qwen3_5, "GDN_DECODE_IN_PLACE", on)
    assert r._program_context() == before


def test_switch_names_are_unique():
    """Benchmarks name a switch by its bare name (`--forms NAME=0|1`, benchmarks/program_forms.py
    maps names to modules): two switches of one name would make a form set only one of them
    (session 32's checkpoint store was first called STORE_STACKED, as span_maps' is)."""
    names = [name for _, name in program_switches.SWITCHES]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
