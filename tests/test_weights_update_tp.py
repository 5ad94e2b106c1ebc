"""LLM.update_weights under tensor parallelism (2 forced host devices, in a subprocess:
tests/tp_weights_write_run.py): the new weights are written into the served shards by write
programs compiled for the mesh ahead of the update, the engine then serves what a fresh engine
of the new weights serves, and bad params are refused with the leaf named while the old weights
keep serving. The subprocess runs once for the module (the tests/tp_runs.py engine shape)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, once_per_run


def _subprocess() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-m", "tests.tp_weights_write_run"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The subprocess's results, once per test run (tests/conftest.once_per_run)."""
    return once_per_run(tmp_path_factory, "tp_weights_write_run", _subprocess)


def _part(got):
    assert "error" not in got, got["error"]
    return got


def _same(got, want, tol=1e-5):
    assert got["tokens"] == want["tokens"]
    np.testing.assert_allclose(np.concatenate(got["logprobs"]),
                               np.concatenate(want["logprobs"]), atol=tol)


def test_tp_update_writes_into_the_served_shards(run):
    """Every served shard keeps its buffer through updates from host arrays, from the caller's
    arrays placed by the rules table (taken without a copy, left to the caller), from donated
    single-device arrays (deleted once written) and from arrays replicated over the mesh;
    shardings unchanged."""
    e = _part(run["engine"])
    assert e["kept"] == [True, True, True]
    assert e["placement_kept"] and e["theirs_kept"] and e["donated_deleted"]


def test_tp_update_serves_the_new_weights(run):
    """Greedy tokens and logprobs after an update equal a fresh TP=2 engine loaded with the new
    weights (and the old ones again after updating back); the step never re-traces."""
    e = _part(run["engine"])
    assert e["before"]["tokens"] != e["fresh"]["tokens"]  # the new weights differ
    _same(e["after"], e["fresh"])
    _same(e["back"], e["before"])
    _same(e["final"], e["fresh"])
    assert e["step_retraces"] == 0
    # arrays on the mesh in another layout: resharded inside their own write programs
    _same(e["other_layout"], e["before"])
    assert e["other_layout_programs"] == 4


def test_tp_write_programs_are_prepared_and_the_update_compiles_nothing(run):
    """`weights_update.prepare` (the warm-up's) compiles the mesh's write programs (the top-level
    leaves' and the layers'); updates from host arrays and from arrays placed by the rules table
    then run no XLA compile at all (backend compile events, jit's own included)."""
    e = _part(run["engine"])
    assert e["prepared"] == [2, 0]
    assert e["update_compiles"] == [0, 0]
    assert e["write_programs"] == 2


def test_tp_bad_params_name_the_leaf_and_keep_serving(run):
    """Wrong shape, wrong dtype, a missing leaf, a deleted array: a ValueError naming the leaf,
    before anything changes (served buffers and generation kept, same outputs)."""
    e = _part(run["engine"])
    bad = _part(e["bad"])
    errors = bad["errors"]
    assert errors[0].startswith("ValueError: update_weights: leaf params['layers'][1]['wq'] "
                                "has shape (32, 4)"), errors[0]
    assert errors[1].startswith("ValueError: update_weights: leaf params['final_norm'] has "
                                "shape (32,), dtype float16"), errors[1]
    assert errors[2].startswith("ValueError: update_weights: leaf params['lm_head'] is "
                                "missing"), errors[2]
    assert errors[3].startswith("ValueError: update_weights: leaf params['layers'][1]['wk'] "
                                "is a deleted array"), errors[3]
    assert bad["kept"]
    _same(bad["outputs"], e["other_layout"])


def test_tp_write_programs_at_the_8b_shape_hold_no_more_than_one_layer(run):
    """The llama3_8b bf16 shape over TP 2, compiled from shapes alone (and with one KV head, so
    the program repeats it for both devices): every output written in place, no temporaries
    beyond one layer's shard per device."""
    for got, copies in zip(run["memory"], (1, 2)):
        got = _part(got)
        assert got["copies"] == copies
        # 436_224_000 / 2 (rl_measure's "one layer: 416 MiB"), the norms whole on each device
        layer = got["layer_bytes_per_device"]
        assert layer <= 436_224_000 // 2 + 4096 * 2 * 2
        for program in got["programs"]:
            assert program["not_aliased"] <= 8 * 16  # the output tuple's pointer table
            assert program["temp"] <= layer, (program, layer)


def test_tp_write_repeats_kv_heads_as_the_load_does(run):
    """One KV head over 2 devices (mistral_gqa4): the write program's result equals the load's
    placement of the new weights (the head copied to each device), in the served buffers."""
    got = _part(run["replicated"])
    assert got == {"copies": 2, "same_buffers": True, "equal": True}


def test_rl_measure_update_timing_under_tensor_parallelism(run):
    """`minipic-bench rl --update-timing --tensor-parallel 2`'s measurement: the weight sets
    arrive placed by the rules table, no update compiles, and "one layer" is one layer's shards
    on a device (the fixture's layer: 6144 floats split, 64 norm floats on each device)."""
    got = _part(run["bench"])
    assert got["tensor_parallel_size"] == 2 and got["write_programs_prepared"] == 2
    assert got["compiles"] == [0, 0] and got["step_retraces"] == [0, 0]
    assert got["generate_compiles_after"] == 0
    assert got["layer_bytes"] == (6144 // 2 + 64) * 4
