"""The benchmark CLI and the generate CLI: every option says what it does (issue 15, item 6)."""

from __future__ import annotations

import argparse
import importlib

import pytest

from benchmarks.cli import COMMANDS


def options_without_help(parser: argparse.ArgumentParser) -> list[str]:
    return [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions
            if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_bench_option_has_help(name):
    p = argparse.ArgumentParser()
    importlib.import_module(COMMANDS[name][0]).add_parser(p)
    assert options_without_help(p) == [], f"minipic-bench {name}: options without help"


def test_every_generate_option_has_help(monkeypatch):
    from minipic_jax import cli
    seen = {}
    real = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        seen["parser"] = self
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        cli.main([])
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", real)
    assert options_without_help(seen["parser"]) == []
