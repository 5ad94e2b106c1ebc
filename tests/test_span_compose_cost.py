"""benchmarks/span_compose_cost.py: the capture keeps the compose call with the most cached maps
as it was, though the composer refills the same buffer every step (span_compose.ComposeInputs),
and its plan counts what chain_compose runs."""

from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks import span_compose_cost
from serving.hybrid import span_compose


class _Runner:
    ck_pool = None

    def _dispatch(self, ints, floats, use_prev, kw):
        return None


def test_capture_keeps_the_chains_of_its_compose_call():
    runner = _Runner()
    capture = span_compose_cost.WarmStepCapture(runner)
    spec, size = span_compose.layout(4, 16, False)
    ints = np.zeros(size, np.int32)
    off, shape = spec["chain"]
    chain = ints[off:off + 64].reshape(shape)
    kw = {"compose": (4, 16)}
    chain[:] = -1
    chain[0, :12], chain[1, :10], chain[2, :8] = 1, 2, 3  # 30 maps
    runner._dispatch(ints, None, False, kw)
    runner._dispatch(np.zeros(8, np.int32), np.zeros(2, np.float32), False, {"t": 64})  # its step
    chain[:] = -1
    chain[0, :1] = 5  # the next step's compose call, one map, same buffer
    runner._dispatch(ints, None, False, kw)
    capture.close()
    f = capture.best[4]
    assert capture.maps == 30 and int((f["chain"] >= 0).sum()) == 30
    shape = SimpleNamespace(shape=(6, 18, 16, 128, 128))  # _plan reads the pool's shapes only
    pool = SimpleNamespace(a=shape, b=shape)
    plan = span_compose_cost._plan(pool, f["chain"])  # Qwen3.5-0.8B: 1.208 GFLOP a map
    assert (plan["maps"], plan["applications"], plan["applications_before"]) == (30, 30, 48)
    assert round(plan["gflop"], 1) == 36.2


def test_tflop_rate_is_gflop_per_ms():
    """36.239 GFLOP in 2.897 ms is 12.5 TFLOP/s (the report printed 0.01: one 1e3 too many)."""
    assert abs(span_compose_cost.tflops(36.239, 2.897) - 12.51) < 0.01
    res = dict(plan=dict(gflop=36.239), precisions={}, forms={"xla": 2.897}, step_ms=15.13,
               a_zero=1.0)
    lines = [x for x in _report_tail(res).splitlines() if x.startswith("compose form xla")]
    assert lines and lines[0].split("|")[3].strip() == "12.51", lines


def _report_tail(res):
    """report() from its form lines on (the summary fields are not under test here)."""
    full = dict(tokens=1024, maps_in_step=30, chain_rows=3, chain_shape=[4, 256], compose_ms=1.0,
                compose_share=0.1, per_span_ms=0.1, per_span_share=0.01, reset_skipped=0.5,
                probe_compose_ms=2.0, synthetic_compose_ms={1: 1.0}, **res)
    full["plan"] = dict(maps=30, applications=30, applications_before=40,
                        gflop_per_application=1.208, **res["plan"])
    return span_compose_cost.report(full)


def test_probe_pool_keeps_the_chained_maps_with_a_nonzero_a(fresh_rng):
    """The random presets' captured A are 0 (every precision composes them to the same bits, so
    the report's rel. diff. was 0 for all four): the probe keeps the chained slots' B, tails
    and counts in a compact pool, chains remapped, with a random A of unit column norm."""
    import jax.numpy as jnp

    from serving.hybrid import span_maps
    pool = span_maps.allocate(9, 2, 2, 8, 8, 3, 2)
    pool = span_maps.pool_of(a=pool.a, b=jnp.asarray(fresh_rng.standard_normal(pool.b.shape),
                                                     jnp.float32),
                             tail=pool.tail, count=jnp.arange(9, dtype=jnp.int32))
    chains = np.array([[7, 2, 7, -1], [5, -1, -1, -1]], np.int32)
    assert span_compose_cost._a_zero(pool, chains) == 1.0
    # every map's A is zero: each head starts at its chain's last map (its B read, no dot), so
    # every A S dot is skipped; with row 0's last map nonzero, 2 of row 0's 3 are
    assert span_compose_cost._reset_skipped(pool, chains) == 1.0
    nonzero = span_maps.pool_of(pool.a.at[7].set(1.0), pool.b, pool.tail, pool.count)
    assert span_compose_cost._reset_skipped(nonzero, np.array([[2, 7, -1, -1]], np.int32)) == 0.5
    probe, remapped = span_compose_cost.probe_pool(pool, chains)
    assert remapped.tolist() == [[2, 0, 2, -1], [1, -1, -1, -1]]
    np.testing.assert_array_equal(np.asarray(probe.b), np.asarray(pool.b)[[2, 5, 7]])
    assert probe.count.tolist() == [2, 5, 7] and span_compose_cost._a_zero(probe, remapped) == 0
    norms = np.linalg.norm(np.asarray(probe.a), axis=-2)
    assert 0.5 < norms.mean() < 1.5


# ~20 s on CPU (a hybrid rag run): slow tier for CI time; run it before a device call that times
# `rag --compose-cost` (MINIPIC_RUN_SLOW=1 ./minipic test tests/test_span_compose_cost.py)
@pytest.mark.slow
def test_rag_compose_cost_measures_a_hybrid_run(tmp_path, capsys):
    """`rag --compose-cost 1` end to end on a tiny hybrid (CPU): `measure` ran (a local import
    inside it once shadowed the module its jitted closure composes with: a NameError on the
    device, caught only there), its figures are in the JSON and the report lines printed."""
    import json

    from benchmarks import cli
    argv = ["rag", "--model", "tiny_qwen3_5", "--dtype", "float32", "--num-requests", "4",
            "--passage-tokens", "32", "--max-num-batched-tokens", "256", "--min-token-bucket",
            "256", "--max-num-seqs", "8", "--max-model-len", "1024", "--num-kv-blocks", "256",
            "--workloads", "multi", "--modes", "offline", "--max-tokens", "2", "--configs",
            "fcfs", "--compose-cost", "1", "--questions-per-set", "4", "--in-process",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    cost = json.loads((tmp_path / "rag_bench.json").read_text())["results"][0]["compose_cost"]
    assert "error" not in cost, cost
    assert cost["maps_in_step"] > 0 and cost["step_ms"] > 0 and cost["compose_ms"] > 0
    assert set(cost["synthetic_compose_ms"]) == {"1", "4", "16"}  # JSON keys
    pipe = cost["program"]["pipelined"]  # the compose program dispatched ahead of its step
    assert pipe["pair_ms"] > 0 and pipe["step_ms"] > 0
    out = capsys.readouterr().out
    assert "[fcfs] compose cost (" in out and "[fcfs] compose program pipelined: " in out
