"""Block tables kept on the device (serving/step/resident_tables.py): after every step the device
array equals the host SeatTables (admissions, span skips, appends, preemptions, releases, seats
reused), the outputs equal the earlier path's (each step carrying its seats' [S, NB] rows) token
for token, a step whose changes do not fit uploads the whole array and stays exact, and a
cached request's step carries KB, not its [S, NB] rows. The hybrid model's span and compose
steps: tests/test_engine_hybrid_spans.py::test_cached_spans_are_skipped_and_match_the_reference
watches its engine's tables with _watch (below)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from minipic_jax import Prompt, SamplingParams, Span, build_prompt
from serving.step import resident_tables
from tests.conftest import make_tiny_llm


def _watch(runner) -> dict:
    """Check the device tables against the host's after every step; count steps and whole
    uploads (the first step's, and those of steps whose changes did not fit)."""
    seen = {"steps": 0, "uploads": 0, "mismatch": []}
    dispatch, upload = runner._dispatch, resident_tables.upload

    def checked(*args, **kw):
        out = dispatch(*args, **kw)
        dev = runner.dev_tables
        if dev.on and not kw and "compose" not in args[3]:
            seen["steps"] += 1
            if not np.array_equal(np.asarray(dev.array), runner.tables.stack):
                seen["mismatch"].append(seen["steps"])
        return out

    def counted(stack, mesh=None):
        seen["uploads"] += 1
        return upload(stack, mesh)
    runner._dispatch = checked
    return seen, counted


def _workload(llm, n: int = 6):
    rng = np.random.default_rng(0)
    docs = [rng.integers(5, 250, 40).tolist() for _ in range(3)]
    markers = llm.llm_engine.markers
    prompts = [build_prompt([Prompt([1, 2, 3]), Span(docs[i % 3]), Span(docs[(i + 1) % 3]),
                             Prompt(rng.integers(5, 250, 5).tolist())], block_size=16, **markers)
               for i in range(n)]
    sps = [SamplingParams(temperature=0.0, max_tokens=60 + 7 * i, ignore_eos=True, logprobs=1)
           for i in range(n)]
    return prompts, sps


def test_device_tables_follow_the_host_and_outputs_equal_the_rows_path(monkeypatch):
    """Sync then async engines on the resident tables, each against the async rows path (the
    engine default, as the tests below), token for token and logprob for logprob: this workload
    has no stop ids, so the async loop's batches equal the sync loop's, and one rows reference
    spares compiling the sync rows path's step variants (CI time)."""
    runs = {}
    for mode in ("sync", "async"):
        # 20 blocks for 4 seats of up to 13 blocks each: preemptions, releases and reused seats;
        # one token bucket (each further one compiled its own variants: CI time)
        llm = make_tiny_llm(num_kv_blocks=20, async_scheduling=mode == "async",
                            min_token_bucket=64)
        eng = llm.llm_engine
        seen, counted = _watch(eng.runner)
        monkeypatch.setattr(resident_tables, "upload", counted)
        prompts, sps = _workload(llm)
        runs[mode] = llm.generate(prompts, sps, use_tqdm=False)
        assert seen["mismatch"] == [], f"{mode}: device tables differ from the host's {seen}"
        assert seen["steps"] > 40 and seen["uploads"] == 1, (mode, seen)  # first step's only
        assert eng.scheduler.num_preemptions > 0, mode
        assert sum(o.num_cached_tokens for o in runs[mode]) > 0, mode  # span skips taken
    eng.runner.dev_tables.set(False)
    eng.reset_prefix_cache()
    rows = llm.generate(prompts, sps, use_tqdm=False)
    for mode, resident in runs.items():
        assert [o.num_cached_tokens for o in rows] == [o.num_cached_tokens for o in resident]
        for i, (a, b) in enumerate(zip(resident, rows)):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"{mode} {i}: tokens differ"
            assert a.outputs[0].logprobs == b.outputs[0].logprobs, f"{mode} {i}: logprobs differ"


def test_changes_that_do_not_fit_upload_the_whole_tables(monkeypatch):
    llm = make_tiny_llm(num_kv_blocks=20, min_token_bucket=64)
    eng = llm.llm_engine
    seen, counted = _watch(eng.runner)
    monkeypatch.setattr(resident_tables, "upload", counted)
    real_pack, calls = resident_tables.pack, [0]

    def every_third_overflows(stack, runs, v):
        calls[0] += 1
        return calls[0] % 3 != 0 and real_pack(stack, runs, v)
    monkeypatch.setattr(resident_tables, "pack", every_third_overflows)
    prompts, sps = _workload(llm, 4)
    got = llm.generate(prompts, sps, use_tqdm=False)
    assert seen["mismatch"] == [] and seen["uploads"] >= calls[0] // 3 > 3
    eng.runner.dev_tables.set(False)
    eng.reset_prefix_cache()
    want = llm.generate(prompts, sps, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_a_cached_request_step_carries_kilobytes_not_its_rows():
    # 64 seats and 2,048 tokens a sequence (NB 128): the earlier path's step carried
    # 3 x S x NB table entries whatever the batch
    llm = make_tiny_llm(max_num_seqs=64, max_model_len=2048, num_kv_blocks=400,
                        max_num_batched_tokens=256, min_token_bucket=256)
    runner = llm.llm_engine.runner
    rng = np.random.default_rng(1)
    doc = rng.integers(5, 250, 1500).tolist()
    markers = llm.llm_engine.markers
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    prompt = build_prompt([Prompt([1, 2]), Span(doc), Prompt([7, 8, 9])], block_size=16,
                          **markers)
    llm.generate([prompt], sp, use_tqdm=False)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]  # its span's ~94 blocks cached
    assert out.num_cached_tokens >= 1500
    ints, _, kw = runner.last_inputs
    rows_bytes = 3 * kw["s"] * runner.nb * 4
    assert ints.nbytes < 40_000 < rows_bytes, (ints.nbytes, rows_bytes)


def test_packed_runs_rebuild_the_host_tables_on_device():
    rng = np.random.default_rng(2)
    seats, nb = 5, 9
    host = np.zeros((3, seats + 1, nb), np.int32)
    dev = jnp.asarray(host)
    for _ in range(20):
        runs = []
        for _ in range(int(rng.integers(0, 6))):
            field, seat = int(rng.integers(0, 3)), int(rng.integers(0, seats))
            lo = int(rng.integers(0, nb))
            hi = int(rng.integers(lo, nb + 1))
            host[field, seat, lo:hi] = rng.integers(0, 1000, hi - lo)
            runs.append(((field * (seats + 1) + seat) * nb + lo, hi - lo))
        spec = dict(resident_tables.layout_fields(8, 3, nb, 16))
        v = {k: np.zeros(shape, np.int32) for k, shape in spec.items()}
        v["table_seat"][:] = [int(rng.integers(0, seats)), 0, seats]
        assert resident_tables.pack(host, runs, v)
        dev, rows = resident_tables.apply(dev, {k: jnp.asarray(x) for k, x in v.items()})
        np.testing.assert_array_equal(np.asarray(dev), host)
        for got, want in zip(rows, host[:, v["table_seat"]]):
            np.testing.assert_array_equal(np.asarray(got), want)
        assert not np.asarray(rows[0])[2].any()  # the scratch seat's row stays zero


def test_a_step_that_raises_after_its_changes_were_packed_leaves_the_tables_exact():
    """The step's changes were taken from the host log but never reached the device: the next
    step uploads the whole host array (DeviceTables.pending), so nothing is lost."""
    llm = make_tiny_llm(num_kv_blocks=20, min_token_bucket=64)
    eng = llm.llm_engine
    runner = eng.runner
    prompts, sps = _workload(llm, 4)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
    eng.reset_prefix_cache()
    real_step, calls = runner._step, [0]

    def failing(*args, **kw):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected into the step call")
        return real_step(*args, **kw)
    runner._step = failing
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(prompts, sps, use_tqdm=False)
    runner._step = real_step
    seen, _ = _watch(runner)
    eng.reset_prefix_cache()
    got = llm.generate(prompts, sps, use_tqdm=False)
    assert seen["mismatch"] == [], seen
    assert [o.outputs[0].token_ids for o in got] == want


def test_the_update_has_no_while_loop():
    """A while loop (jnp.searchsorted's default) costs a GPU step a host round trip per level."""
    import jax
    spec = dict(resident_tables.layout_fields(128, 64, 2112, 16))
    f = {k: jnp.zeros(shape, jnp.int32) for k, shape in spec.items()}
    text = jax.jit(resident_tables.apply).lower(jnp.zeros((3, 65, 2112), jnp.int32), f).as_text()
    assert "stablehlo.while" not in text and "stablehlo.scatter" in text


def test_few_long_runs_are_copied_by_slices_and_many_by_one_gather(monkeypatch):
    """A cached admission logs a few ~2,000-entry runs: copied slice by slice (the one gather's
    index cost ~23 us of issue 28's host time), many short runs (decodes) by the gather; both
    write each run's entries in order."""
    rng = np.random.default_rng(5)
    host = rng.integers(0, 1000, (3, 5, 40)).astype(np.int32)
    flat = host.reshape(-1)
    spec = dict(resident_tables.layout_fields(512, 64, 40, 16))
    repeats = []
    real_repeat = np.repeat
    monkeypatch.setattr(resident_tables.np, "repeat",
                        lambda *a, **k: repeats.append(1) or real_repeat(*a, **k))
    for count in (3, resident_tables.FEW_RUNS, resident_tables.FEW_RUNS + 1, 60):
        starts = np.sort(rng.choice(flat.size - 40, count, replace=False))
        runs = [(int(a), int(rng.integers(0, 12))) for a in starts]
        v = {k: np.zeros(shape, np.int32) for k, shape in spec.items()}
        repeats.clear()
        assert resident_tables.pack(host, runs, v)
        want = np.concatenate([flat[a:a + k] for a, k in runs])
        np.testing.assert_array_equal(v["tbl_val"][:want.size], want)
        assert v["tbl_start"][:count].tolist() == [a for a, _ in runs]
        assert v["tbl_len"][:count].tolist() == [k for _, k in runs]
        assert bool(repeats) == (count > resident_tables.FEW_RUNS)
