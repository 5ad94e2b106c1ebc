"""`minipic run-batch` faults (issue 12 items 5-8, 10 and the CLI list): paths and numbers refused
before the model is built, lone surrogates, duplicate custom_ids after a kill, Ctrl-C,
--retry-errors, and what the progress bar says while step variants compile.

Oracle: the records the job writes (tests/test_run_batch.py's helpers); the in-process engine is
test_run_batch's shape (one step bucket, T = 32), so it compiles once.
"""

from __future__ import annotations

import json
import os

import pytest

from minipic_jax.batch.run_batch import main
from test_run_batch import ENGINE, _line, _records


@pytest.fixture(scope="module")
def llm():
    from minipic_jax import LLM
    return LLM("tiny_llama", dtype="float32", seed=0, max_num_seqs=4, max_num_batched_tokens=32,
               min_token_bucket=32, max_model_len=256, num_kv_blocks=128)


@pytest.fixture
def no_model(monkeypatch):
    """Building a model fails the test: the checks must come first."""
    import minipic_jax

    def refuse(*a, **k):
        raise AssertionError("the model was built before the check")
    monkeypatch.setattr(minipic_jax, "LLM", refuse)


def _ok(cid, text="a good line"):
    return _line(cid, {"prompt": text, "max_tokens": 2, "temperature": 0})


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(inp, out, *extra, llm=None):
    return main(["-i", str(inp), "-o", str(out), *extra] + ENGINE, llm=llm)


def test_output_equal_to_input_is_refused_also_through_links(tmp_path, no_model, capsys):
    """Item 6: -o equal to -i (or a link to it) reported "already in the output file", exited 0
    and cut the input's unterminated last line."""
    inp = tmp_path / "in.jsonl"
    body = _ok("a") + "\n" + _ok("b")  # no newline at the end
    inp.write_text(body)
    (tmp_path / "sym.jsonl").symlink_to(inp)
    os.link(inp, tmp_path / "hard.jsonl")
    for out in (inp, tmp_path / "sym.jsonl", tmp_path / "hard.jsonl", tmp_path / "." / "in.jsonl"):
        assert _run(inp, out) == 2
        assert "is the input file" in capsys.readouterr().err
    assert inp.read_text() == body


def test_bad_paths_are_reported_before_the_model_is_built(tmp_path, no_model, capsys):
    """Item 10: folders skipped the error handler (a traceback); a missing input file was
    reported only after the model was built."""
    inp = _write(tmp_path / "in.jsonl", [_ok("a")])
    cases = [(tmp_path / "missing.jsonl", tmp_path / "o.jsonl", "does not exist"),
             (tmp_path, tmp_path / "o.jsonl", "is a folder"),
             (inp, tmp_path, "is a folder"),
             (inp, tmp_path / "nowhere" / "o.jsonl", "does not exist")]
    for i, o, needle in cases:
        assert _run(i, o) == 2
        err = capsys.readouterr().err
        assert err.startswith("minipic run-batch: error:") and needle in err, err
    assert _run(inp, tmp_path / "o.jsonl", "--output-json", str(tmp_path)) == 2
    assert "--output-json" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--max-inflight", "-1"), ("--max-inflight", "0"),
                                        ("--max-num-seqs", "0"), ("--seed", "-1"),
                                        ("--num-kv-blocks", "1"), ("--cpu-offload-gb", "nan"),
                                        ("--kv-store-gb", "0"), ("--max-model-len", "0")])
def test_every_cli_number_is_checked(tmp_path, no_model, capsys, flag, value):
    """Item 8: --max-inflight -1 busy-looped silently."""
    inp = _write(tmp_path / "in.jsonl", [_ok("a")])
    with pytest.raises(SystemExit) as ex:
        _run(inp, tmp_path / "o.jsonl", flag, value)
    assert ex.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_engine_options_are_checked_before_the_model(tmp_path, no_model, capsys):
    inp = _write(tmp_path / "in.jsonl", [_ok("a")])
    assert main(["-i", str(inp), "-o", str(tmp_path / "o.jsonl"), "--max-num-seqs", "64",
                 "--max-num-batched-tokens", "32"]) == 2
    assert "max_num_batched_tokens" in capsys.readouterr().err


def test_lone_surrogate_custom_id_is_answered_and_resumable(tmp_path, llm):
    """Item 5: a lone-surrogate custom_id (valid JSON) stopped the job with UnicodeEncodeError on
    every rerun; the lines after it were never answered."""
    cid = "cid\ud800"
    inp = _write(tmp_path / "in.jsonl", [_ok(cid), _ok("after"),
                                         _line("salt", {"prompt": "x", "max_tokens": 2,
                                                        "cache_salt": "t\udfff"})])
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, llm=llm) == 0
    recs = _records(out)
    assert recs[cid]["error"] is None and recs["after"]["error"] is None
    assert "cache_salt holds a lone surrogate at index 1" in recs[3]["error"]
    size = out.stat().st_size
    assert _run(inp, out, llm=llm) == 0
    assert out.stat().st_size == size  # resumed: all answered, nothing twice


def test_duplicate_error_record_does_not_answer_the_original(tmp_path, llm):
    """Item 7: the duplicate's error record is written when its line is read; after a kill
    before the original finished, a rerun counted the original as answered."""
    inp = _write(tmp_path / "in.jsonl", [_ok("x"), _ok("y"), _ok("x", "again")])
    ref = tmp_path / "ref.jsonl"
    assert _run(inp, ref, llm=llm) == 0
    full = _records(ref)
    assert set(full) == {"x", "y", 3}
    out = tmp_path / "out.jsonl"  # what a kill -9 left: the duplicate's error record only
    out.write_text(json.dumps(full[3]) + "\n")
    assert _run(inp, out, llm=llm) == 0
    assert set(_records(out)) == {"x", "y", 3}
    out.write_text(json.dumps(full["x"]) + "\n")  # killed before the duplicate's error record
    assert _run(inp, out, llm=llm) == 0
    recs = _records(out)
    assert set(recs) == {"x", "y", 3} and "duplicate custom_id 'x'" in recs[3]["error"]


def test_retry_errors_answers_error_lines_again(tmp_path, llm):
    inp = _write(tmp_path / "in.jsonl", [_ok("a"), _ok("b")])
    out = tmp_path / "out.jsonl"
    from minipic_jax.batch.records import error_record
    out.write_text(json.dumps(error_record(2, "b", "line 2: a transient failure")) + "\n")
    assert _run(inp, out, llm=llm) == 0
    assert _records(out)[2]["error"] == "line 2: a transient failure"  # errors count as answered
    assert _run(inp, out, "--retry-errors", llm=llm) == 0
    recs = _records(out)
    assert set(recs) == {"a", "b"} and all(r["error"] is None for r in recs.values())


def test_ctrl_c_says_interrupted_and_a_rerun_resumes(tmp_path, llm, monkeypatch, capsys):
    inp = _write(tmp_path / "in.jsonl", [_ok(f"q{i}", f"line {i}") for i in range(6)])
    out = tmp_path / "out.jsonl"
    engine = llm.llm_engine
    step, calls = engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return step()
    monkeypatch.setattr(engine, "step", interrupted_step)
    assert _run(inp, out, "--max-inflight", "2", llm=llm) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "rerun the same command to resume" in err
    assert "Traceback" not in err
    assert not engine.has_unfinished() and engine.bm.num_free == engine.num_blocks
    monkeypatch.undo()
    assert _run(inp, out, llm=llm) == 0
    assert set(_records(out)) == {f"q{i}" for i in range(6)}


def test_empty_stop_string_is_refused_as_in_sampling_params():
    from minipic_jax.batch.reading import LineError, parse_line
    from minipic_jax import SamplingParams
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="")
    for stop in ("", [""]):
        with pytest.raises(LineError, match="body.stop must be a non-empty string"):
            parse_line(1, _line("s", {"prompt": "x", "stop": stop}).encode(), render_chat=None)
    for none in (None, []):
        assert parse_line(1, _line("s", {"prompt": "x", "stop": none}).encode(),
                          render_chat=None).stop == []


def test_out_of_range_numbers_are_line_errors():
    """Item 4 in a batch file: values the device arrays cannot hold are the line's error."""
    from minipic_jax.batch.reading import LineError, parse_line
    for field, value in (("top_k", 2**31), ("temperature", 10**400), ("top_p", 10**400),
                         ("temperature", 1e-45)):
        raw = _line("n", {"prompt": "x", field: value}).encode()
        with pytest.raises(LineError, match=field):
            parse_line(1, raw, render_chat=None)


def test_step_compiles_are_announced():
    """The progress bar says "compiling step variant k/n" while a step variant compiles (the
    engine's StepExecutables tells on_compile)."""
    import jax.numpy as jnp
    from serving.step.step_executables import StepExecutables

    def fun(x, *, scale=2):
        return x * scale
    steps = StepExecutables(fun, signature_of=fun, donate_argnums=())
    told = []
    steps.on_compile = lambda done, total: told.append((done, total))
    steps.prepare([((jnp.ones(3),), {"scale": 2}), ((jnp.ones(3),), {"scale": 3})])
    assert told == [(0, 2), (1, 2), (2, 2)]

    from minipic_jax.batch.progress import Progress

    class Bar:
        def set_description_str(self, text, refresh):
            told.append(text)
    progress = Progress.__new__(Progress)
    progress.bar, progress.compiled = Bar(), 0
    for done, total in ((0, 2), (2, 2), (0, 1), (1, 1)):
        progress._on_compile(done, total)
    assert told[-4:] == ["Running batch (compiling step variant 1-2: a new step shape, compiled "
                         "once)", "Running batch",
                         "Running batch (compiling step variant 3: a new step shape, compiled "
                         "once)", "Running batch"]
