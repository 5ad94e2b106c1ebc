"""Step sizes on a CPU backend: a decode of one sequence is a step of one row, not of eight
(every padded row costs its share of each matmul on CPU); an explicit min_token_bucket wins."""

from __future__ import annotations

import ast
import pathlib

import jax
import pytest

import serving.config
from serving.config import Config

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU default")


def shipped_cpu_min_token_bucket() -> int:
    """The constant as serving/config.py ships it (the suite's conftest sets its engines to 8)."""
    tree = ast.parse(pathlib.Path(serving.config.__file__).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
                "CPU_MIN_TOKEN_BUCKET"]:
            return ast.literal_eval(node.value)
    raise AssertionError("serving/config.py defines no CPU_MIN_TOKEN_BUCKET")


def test_cpu_buckets_start_at_one_row(monkeypatch):
    assert shipped_cpu_min_token_bucket() == 1
    monkeypatch.setattr(serving.config, "CPU_MIN_TOKEN_BUCKET", shipped_cpu_min_token_bucket())
    cfg = Config(max_num_seqs=16, max_num_batched_tokens=64)
    assert cfg.token_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert cfg.token_bucket(1) == 1 and cfg.seq_bucket(1) == 1


def test_explicit_min_token_bucket_wins():
    assert Config(max_num_batched_tokens=64, min_token_bucket=8).token_buckets == (8, 16, 32, 64)


def test_bad_min_token_bucket_names_the_field():
    with pytest.raises(ValueError, match="min_token_bucket"):
        Config(min_token_bucket=0)
