"""Span-store faults: a store that cannot be written, or whose folder is damaged, is a cache that
misses (one warning, the call's results returned, the engine keeps serving), never an error that
costs a result (docs/DESIGN.md, "One cache manager").

Oracle: the same prompts on an engine without a store. Each fault is injected in the test: the
writer made to fail with ENOSPC or EROFS (monkeypatched: tests may run as root, where chmod does
not block writes), a directory where a run file belongs, a file where a store subfolder belongs.
Each write fault uses a cache_salt of its own, so the damage stays in its namespace's folder.
"""

from __future__ import annotations

import errno
import json
import os
import warnings

import numpy as np
import pytest

from conftest import make_tiny_llm
from store_runs import random_run as _run
from store_runs import store_identity as _identity
from minipic_jax import Prompt, SamplingParams, Span, build_prompt
from serving.tiers import disk_store
from serving.tiers.disk_store import DiskStore, namespace

SP = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1)
B = 16
ONE_SHAPE = dict(max_num_batched_tokens=32, min_token_bucket=32)  # one step compile per engine


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(an engine over a store, the same engine without one, the store folder)."""
    root = tmp_path_factory.mktemp("kv_store_faults")
    llm, plain = make_tiny_llm(kv_store_dir=str(root), **ONE_SHAPE), make_tiny_llm(**ONE_SHAPE)
    for x in (llm, plain):  # compiled before any fault is injected
        x.generate([list(range(1, 40))], SP, use_tqdm=False, cache_salt="warm-up")
    return llm, plain, root


def _prompts(llm, rng, n):
    m = llm.llm_engine.markers
    docs = [[int(t) for t in rng.integers(0, 256, int(rng.integers(20, 60)))] for _ in range(n)]
    return [build_prompt([Prompt([int(t) for t in rng.integers(0, 256, 5)]), Span(d),
                          Prompt([int(t) for t in rng.integers(0, 256, 3)])], block_size=B, **m)
            for d in docs]


def _results(outs):
    """Tokens and their logprobs, for comparison with the storeless engine."""
    return [(o.outputs[0].token_ids, [round(float(next(iter(lp.values())).logprob), 5)
                                      for lp in o.outputs[0].logprobs]) for o in outs]


def _first_keys(llm, prompts, salt):
    """The first block key of each prompt: a run (file) starts there."""
    from serving.sequence import Sequence
    eng = llm.llm_engine
    return [eng.cache.keys.hashes(Sequence("probe", p, eng.validate("probe", p, SP), SP, B,
                                               seed=0, cache_salt=salt))[0] for p in prompts]


def _disk_full(monkeypatch, llm, prompts, root, salt):
    real = disk_store.write_all

    def write_some_then_fail(fd, bufs):
        real(fd, bufs[:1])
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    monkeypatch.setattr(disk_store, "write_all", write_some_then_fail)


def _read_only(monkeypatch, llm, prompts, root, salt):
    real_open = os.open

    def refuse_writes(path, flags, *args, **kw):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system (injected)", str(path))
        return real_open(path, flags, *args, **kw)

    def refuse_mkdir(path, *args, **kw):
        raise OSError(errno.EROFS, "Read-only file system (injected)", str(path))
    monkeypatch.setattr(os, "open", refuse_writes)
    monkeypatch.setattr(os, "mkdir", refuse_mkdir)


def _run_is_a_directory(monkeypatch, llm, prompts, root, salt):
    store = llm.llm_engine.kv_store.store
    for h in _first_keys(llm, prompts, salt):
        store.path(h, namespace(salt)).mkdir(parents=True)


def _subfolder_is_a_file(monkeypatch, llm, prompts, root, salt):
    (root / namespace(salt)).write_text("not a folder")


FAULTS = {"disk_full": _disk_full, "read_only": _read_only,
          "run_is_a_directory": _run_is_a_directory, "subfolder_is_a_file": _subfolder_is_a_file}


def _generate(llm, prompts, salt):
    """(outputs, the store's warnings) of one generate call."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        outs = llm.generate(prompts, SP, use_tqdm=False, cache_salt=salt)
    return outs, [w for w in seen if "kv store" in str(w.message)]


@pytest.mark.parametrize("fault", list(FAULTS))
def test_store_write_fault_costs_no_result(engines, fresh_rng, monkeypatch, fault):
    llm, plain, root = engines
    tier, salt = llm.llm_engine.kv_store, f"fault-{fault}"
    prompts, stored = _prompts(llm, fresh_rng, 3), _prompts(llm, fresh_rng, 2)
    want = _results(plain.generate(prompts, SP, use_tqdm=False, cache_salt=salt))
    readable = fault != "subfolder_is_a_file"  # that fault takes the namespace's files away
    if readable:  # on disk before the fault
        llm.generate(stored, SP, use_tqdm=False, cache_salt=salt)
    FAULTS[fault](monkeypatch, llm, prompts, root, salt)
    errors = tier.counters.get("write_errors", 0)
    outs, said = _generate(llm, prompts, salt)
    assert _results(outs) == want
    assert len(said) == 1, [str(w.message) for w in said]
    assert "could not be written" in str(said[0].message)
    assert tier.counters["write_errors"] > errors and tier.writes == []
    assert not list(root.rglob("*.tmp"))
    # the engine keeps serving: new content (written or not), and a call with nothing to write
    more = _prompts(llm, fresh_rng, 2)
    outs, said = _generate(llm, more, salt)
    assert _results(outs) == _results(plain.generate(more, SP, use_tqdm=False, cache_salt=salt))
    assert len(said) <= 1
    outs, said = _generate(llm, prompts, salt)
    assert _results(outs) == want and said == []
    assert not list(root.rglob("*.tmp"))
    if readable:  # what can still be read is read
        llm.llm_engine.reset_prefix_cache()  # the device's copies go: hits come from disk
        outs, said = _generate(llm, stored, salt)
        assert all(o.num_cached_tokens > 0 for o in outs) and said == []
        assert _results(outs) == _results(plain.generate(stored, SP, use_tqdm=False,
                                                         cache_salt=salt))


# -- the file layer alone (no engine) -----------------------------------------------------------
def _serves(store, rng) -> None:
    """The store writes and reads a run."""
    hashes, tokens, leaves = _run(rng, [21, 22])
    assert store.write("shared", hashes, tokens, leaves) == 2
    got = store.read(21, "shared")
    assert got is not None and np.array_equal(got.kv, np.stack(leaves))


def test_kv_store_dir_that_is_a_file_is_a_clear_error(tmp_path):
    path = tmp_path / "store"
    path.write_text("a file")
    with pytest.raises(ValueError, match=f"kv_store_dir {path} is not a folder"):
        make_tiny_llm(kv_store_dir=str(path), **ONE_SHAPE)
    with pytest.raises(ValueError, match=f"kv_store_dir {path / 'sub'} is not a folder"):
        DiskStore(path / "sub", _identity(), 1 << 20)


@pytest.mark.parametrize("damage", ["directory", "list", "empty", "not_json"])
def test_damaged_store_json_is_a_warning_not_an_error(tmp_path, fresh_rng, damage):
    meta = tmp_path / "STORE.json"
    if damage == "directory":
        meta.mkdir()
    else:
        meta.write_text({"list": "[1, 2]", "empty": "", "not_json": "{model"}[damage])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        store = DiskStore(tmp_path, _identity(), 1 << 20)
        _serves(store, fresh_rng)
        store.rescan()
    said = [str(w.message) for w in seen]
    assert len(said) == 1 and str(meta) in said[0], said
    if damage != "directory":  # rebuilt: the next store opens it without a word
        assert json.loads(meta.read_text())["model"] == "m0"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            DiskStore(tmp_path, _identity(), 1 << 20)


def test_symlink_loops_in_the_store_are_skipped(tmp_path, fresh_rng):
    DiskStore(tmp_path, _identity(), 1 << 20)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    sub = tmp_path / "shared" / "00"
    sub.mkdir(parents=True)
    (sub / "00000000000000aa.safetensors").symlink_to(sub / "00000000000000aa.safetensors")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        store = DiskStore(tmp_path, _identity(), 1 << 20)
        store.rescan()  # warned once per damaged path
        _serves(store, fresh_rng)
        assert store.read(0xAA, "shared") is None and not store.has(0xAA, "shared")
    said = [str(w.message) for w in seen]
    assert len(said) == 2, said
    assert any(str(tmp_path / "loop") in w for w in said) and \
        any(str(sub / "00000000000000aa.safetensors") in w for w in said), said
