"""`minipic run-batch` (minipic_jax/batch/): error records, resume after a kill, and a second
process reading the span store the first one filled.

Oracle: an uninterrupted in-process run of the same file on an empty store. One subprocess
(JAX start-up costs ~10 s): it reads the store, is killed mid-file, and the job is resumed.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from conftest import REPO
from minipic_jax.batch.run_batch import main

# one step shape (T = 32) so the in-process engine and the subprocess compile once each
ENGINE = ["--model", "tiny_llama", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
          "--min-token-bucket", "32", "--max-model-len", "256", "--num-kv-blocks", "128",
          "--no-progress"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("run_batch_store")


@pytest.fixture(scope="module")
def job_llm(store):
    from minipic_jax import LLM
    return LLM("tiny_llama", dtype="float32", seed=0, max_num_seqs=4, max_num_batched_tokens=32,
               min_token_bucket=32, max_model_len=256, num_kv_blocks=128, kv_store_dir=str(store))


def _line(cid, body, url="/v1/completions"):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def _records(path) -> dict:
    """Output records keyed by custom_id (results) or input line (errors)."""
    out = {}
    for raw in open(path, encoding="utf-8"):
        if not raw.endswith("\n"):
            break  # a record the kill cut short
        rec = json.loads(raw)
        key = rec["custom_id"] if rec["error"] is None else rec["line"]
        assert key not in out, f"{key} answered twice"
        out[key] = rec
    return out


def _comparable(rec):
    rec = json.loads(json.dumps(rec))
    body = (rec.get("response") or {}).get("body")
    if body:
        body.pop("created")
        body["usage"]["prompt_tokens_details"].pop("cached_tokens")
    return rec


def test_malformed_lines_become_error_records(tmp_path, job_llm):
    lines = [
        "{not json",
        "[1, 2]",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        json.dumps({"custom_id": "c3", "url": "/v1/completions", "body": {}, "extra": 1}),
        _line("c4", {"prompt": "x"}, url="/v1/embeddings"),
        _line("c5", {"prompt": "x", "max_tokens": 2, "frobnicate": True}),
        _line("c6", {"prompt": "x", "max_tokens": "two"}),
        _line("c7", {"prompt": "x " * 300, "max_tokens": 2}),
        _line("c8", {"segments": [{"kind": "span"}], "max_tokens": 2}),
        _line("c9", {"messages": [{"role": "user", "content": "hi"}]}, url="/v1/chat/completions"),
        _line("ok1", {"prompt": "a good line", "max_tokens": 2, "temperature": 0}),
        _line("ok1", {"prompt": "the same custom_id again", "max_tokens": 2}),
        "",
        _line("ok2", {"segments": [{"kind": "prompt", "text": "sys"},
                                   {"kind": "span", "token_ids": [5, 6, 7]},
                                   {"kind": "prompt", "text": "q"}],
                      "max_tokens": 2, "temperature": 0, "stop": ["\x00never"]}),
    ]
    expect = {1: "not valid JSON", 2: "expected a JSON object", 3: "'custom_id'",
              4: "unknown field(s) ['extra']", 5: "'url'", 6: "['frobnicate']",
              7: "body.max_tokens must be an integer", 8: "too long for max_model_len=256",
              9: "body.segments[0]", 10: "chat template",
              12: "duplicate custom_id 'ok1' (first at line 11)"}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert main(["-i", str(inp), "-o", str(out)] + ENGINE, llm=job_llm) == 0
    recs = _records(out)
    assert len(recs) == len(expect) + 2
    for line, needle in expect.items():
        err = recs[line]["error"]
        assert needle in err and err.startswith(f"line {line}:"), (line, err)
        assert recs[line]["response"]["status_code"] == 400
    assert recs[3]["custom_id"] is None and recs[4]["custom_id"] == "c3"
    for key in ("ok1", "ok2"):
        assert recs[key]["error"] is None and recs[key]["response"]["status_code"] == 200
        body = recs[key]["response"]["body"]
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 2
    size = out.stat().st_size
    assert main(["-i", str(inp), "-o", str(out)] + ENGINE, llm=job_llm) == 0
    assert out.stat().st_size == size  # a rerun answers nothing twice


def _rag_file(path, rng, n=16):
    docs = [" ".join(f"w{int(t)}" for t in rng.integers(0, 99, int(rng.integers(8, 20))))
            for _ in range(5)]
    lines = []
    for i in range(n):
        picked = rng.choice(len(docs), size=2, replace=False)
        segs = [{"kind": "prompt", "text": "Answer from the passages."}]
        segs += [{"kind": "span", "text": docs[d]} for d in picked]
        segs.append({"kind": "prompt", "text": f"question {i}?"})
        lines.append(_line(f"q{i}", {"segments": segs, "max_tokens": 4, "temperature": 0}))
    path.write_text("\n".join(lines) + "\n")
    return n


def test_second_process_reads_store_then_resume_after_kill_matches(tmp_path, store, job_llm,
                                                                   fresh_rng):
    inp, ref_out, out = tmp_path / "in.jsonl", tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    n = _rag_file(inp, fresh_rng)
    assert main(["-i", str(inp), "-o", str(ref_out)] + ENGINE, llm=job_llm) == 0  # cold
    ref = _records(ref_out)
    assert len(ref) == n and all(r["error"] is None for r in ref.values())

    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "minipic_jax", "run-batch", "-i", str(inp), "-o", str(out),
           "--kv-store-dir", str(store), "--max-inflight", "1"] + ENGINE
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.02)
    proc.kill()
    log = proc.communicate()[0].decode(errors="replace")
    done = _records(out)
    assert 3 <= len(done) < n, (len(done), log[-2000:])
    for key, rec in done.items():  # the second process: spans from the first one's store
        assert rec["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert _comparable(rec) == _comparable(ref[key]), key

    with open(out, "a") as f:
        f.write('{"id": "minipic-a record cut by the kill')
    assert main(["-i", str(inp), "-o", str(out)] + ENGINE, llm=job_llm) == 0
    final = _records(out)
    assert {k: _comparable(r) for k, r in final.items()} == \
        {k: _comparable(r) for k, r in ref.items()}


def test_job_finishes_when_the_store_cannot_be_written(tmp_path, store, job_llm, fresh_rng,
                                                       monkeypatch):
    """A span store whose writes fail (a full disk, injected in its writer) is a cache that
    misses: the job answers every line, exits 0, and says so in one warning; no temp file
    stays behind."""
    from serving.tiers import disk_store

    def disk_full(fd, bufs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    monkeypatch.setattr(disk_store, "write_all", disk_full)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    n = _rag_file(inp, fresh_rng, n=4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["-i", str(inp), "-o", str(out)] + ENGINE, llm=job_llm) == 0
    recs = _records(out)
    assert len(recs) == n and all(r["error"] is None for r in recs.values())
    said = [str(w.message) for w in seen if "kv store" in str(w.message)]
    assert len(said) == 1 and "could not be written" in said[0], said
    assert not list(store.rglob("*.tmp"))


def test_result_record_logprobs_and_stop_strings():
    from minipic_jax.batch.reading import parse_line
    from minipic_jax.batch.records import result_record
    from serving.outputs import CompletionOutput, Logprob, RequestOutput

    class Tok:
        def decode(self, ids):
            return "".join(chr(97 + i) for i in ids)
    raw = _line("x", {"prompt": [1, 2], "logprobs": 1, "stop": ["c"], "temperature": 0}).encode()
    req = parse_line(1, raw, render_chat=None)
    lps = [{0: Logprob(-0.5, 1, "a"), 1: Logprob(-1.5, 2, "b")}, {2: Logprob(-0.1, 1, "c")}]
    out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "ac", [0, 2], -0.6, lps,
                                                             "length")], True, 0)
    body = result_record(req, out, "m", Tok())["response"]["body"]
    choice = body["choices"][0]
    assert choice["text"] == "a" and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == "c"
    assert choice["logprobs"]["tokens"] == ["a", "c"]
    assert np.allclose(choice["logprobs"]["token_logprobs"], [-0.5, -0.1])
    assert choice["logprobs"]["top_logprobs"][0] == {"a": -0.5, "b": -1.5}
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_module_entry_dispatches_subcommands(capsys):
    from minipic_jax.__main__ import SUBCOMMANDS, main as entry
    assert set(SUBCOMMANDS) == {"generate", "run-batch", "train"}
    assert entry(["frobnicate"]) == 2
    assert "unknown subcommand 'frobnicate'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # run-batch's own parser: -i/-o are required
        entry(["run-batch"])
