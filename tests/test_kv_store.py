"""Persistent span store (serving/tiers/disk_store.py, kv_store_tier.py, LLM.cache_spans).

Oracle: the same prompts run cold (no store) on a fresh engine; a store hit must give the same
tokens, and every corruption must be caught by its checksum or header and the block recomputed.
The cross-process case (a second process reading what the first stored) is in test_run_batch.py.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import make_tiny_llm
from store_runs import random_run as _run
from store_runs import store_identity as _identity
from minipic_jax import Prompt, SamplingParams, Span, build_prompt
from serving.tiers.disk_store import DiskStore, StoreMismatch, namespace

SP = SamplingParams(temperature=0.0, max_tokens=4)
B = 16
ONE_SHAPE = dict(max_num_batched_tokens=32, min_token_bucket=32)  # one step compile per engine


def _ids(llm, segs):
    return build_prompt(segs, block_size=B, **llm.llm_engine.markers)


def _docs(rng, n):
    return [[int(t) for t in rng.integers(0, 256, int(rng.integers(20, 60)))] for _ in range(n)]


def _prompts(llm, rng, docs):
    return [_ids(llm, [Prompt([int(t) for t in rng.integers(0, 256, 5)]), Span(d),
                       Prompt([int(t) for t in rng.integers(0, 256, 3)])]) for d in docs]


@pytest.fixture(scope="module")
def store_pair(tmp_path_factory):
    """A writer engine and a reader engine over one store folder (the writer's first run on an
    empty store is the cold run)."""
    root = tmp_path_factory.mktemp("kv_store")
    return (make_tiny_llm(kv_store_dir=str(root), **ONE_SHAPE),
            make_tiny_llm(kv_store_dir=str(root), **ONE_SHAPE), root)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _stored_blocks(store, ns="shared") -> int:
    return sum(len(store.fmt.stored_hashes(f)) for f in (store.root / ns).rglob("*.safetensors"))


def _span_run(llm, prompt, cache_salt=None):
    """(block keys of the prompt, index of its span's first block)."""
    from serving.sequence import Sequence
    eng = llm.llm_engine
    lay = eng.validate("probe", prompt, SP)
    hashes = eng.cache.keys.hashes(Sequence("probe", prompt, lay, SP, B, seed=0,
                                                            cache_salt=cache_salt))
    return hashes, int(np.flatnonzero(lay.span_start)[0])


def test_stored_blocks_hit_in_another_engine_and_corrupt_files_are_recomputed(store_pair,
                                                                              fresh_rng):
    writer, reader, root = store_pair
    docs = _docs(fresh_rng, 4)
    prompts = _prompts(writer, fresh_rng, docs)
    ref = writer.generate(prompts, SP, use_tqdm=False)  # cold: the store is empty
    assert all(o.num_cached_tokens == 0 for o in ref)
    blocks = [(len(p) - 1) // B for p in prompts]  # full blocks before the last one
    store = reader.llm_engine.kv_store.store
    assert _stored_blocks(store) == sum(blocks) == \
        writer.llm_engine.get_stats()["kv_store"]["blocks_written"]
    # damage the first run (file) of the spans of prompts 0 and 1: one truncated, one with a
    # flipped byte at the end; a span computed over several steps is several runs
    lost = []
    for k, damage in ((0, lambda d: d[:len(d) // 2]),
                      (1, lambda d: d[:-7] + bytes([d[-7] ^ 0x10]) + d[-6:])):
        hashes, j = _span_run(reader, prompts[k])
        victim = store.path(hashes[j], "shared")
        lost.append(len(store.fmt.stored_hashes(victim)))
        victim.write_bytes(damage(victim.read_bytes()))

    with pytest.warns(RuntimeWarning, match="corrupt"):
        warm = reader.generate(prompts, SP, use_tqdm=False)
    assert _tokens(warm) == _tokens(ref)
    kv = reader.llm_engine.get_stats()["kv_store"]
    assert kv["corrupt"] == 2, kv
    for k, (o, n) in enumerate(zip(warm, blocks)):
        assert o.num_cached_tokens == (n - (lost[k] if k < 2 else 0)) * B, (k, o.num_cached_tokens)
    for k in (0, 1):  # recomputed and written again, whole
        hashes, j = _span_run(reader, prompts[k])
        assert store.read(hashes[j], "shared") is not None


def test_spans_only_stores_span_blocks_alone(store_pair, fresh_rng):
    writer, reader, root = store_pair
    tier = writer.llm_engine.kv_store
    docs = _docs(fresh_rng, 2)
    prompts = _prompts(writer, fresh_rng, docs)
    tier.spans_only = True
    try:
        writer.generate(prompts, SP, use_tqdm=False, cache_salt="spans-only")
    finally:
        tier.spans_only = False
    ns = namespace("spans-only")
    span_blocks = [-(-(len(d) + 1) // B) for d in docs]  # SSEP + doc, padded to full blocks
    assert _stored_blocks(tier.store, ns) == sum(span_blocks)
    for p in prompts:  # no file for the question or the header
        hashes, j = _span_run(writer, p, "spans-only")
        assert not tier.store.has(hashes[0], ns) and tier.store.has(hashes[j], ns)
    out = reader.generate(_prompts(reader, fresh_rng, docs), SP, use_tqdm=False,
                          cache_salt="spans-only")
    assert [o.num_cached_tokens for o in out] == [n * B for n in span_blocks]


def test_request_is_ready_once_its_reads_are_harvested(store_pair, fresh_rng):
    """The scheduler holds a request back (when the step has other work) while `ready` is
    False: from its scan until every read it waits for is staged."""
    from serving.sequence import Sequence
    writer, reader, _ = store_pair
    docs = _docs(fresh_rng, 1)
    writer.cache_spans(docs)
    prompt = _prompts(reader, fresh_rng, docs)[0]
    eng = reader.llm_engine
    seq = Sequence("probe", prompt, eng.validate("probe", prompt, SP), SP, B, seed=0)
    tier = eng.kv_store
    assert tier.ready(seq)  # not scanned: nothing to wait for
    tier.prefetch([seq], eng.bm, None)
    assert seq.store.wants and not tier.ready(seq)
    while tier.reads or tier.queue:
        for fut, _ in list(tier.reads.values()):
            fut.result()
        tier.begin_step([], eng.bm, None)
    assert tier.ready(seq)
    hashes, j = _span_run(reader, prompt)
    assert all(h in tier.staged for h in hashes[j:j + -(-(len(docs[0]) + 1) // B)])
    tier.staged.clear()


def test_reads_start_when_a_batch_job_queues_the_request(store_pair, fresh_rng):
    """prefetch_stored (run-batch calls it after each add_request) starts the reads before any
    step; the request then runs to the same tokens as a cold run."""
    from serving.tiers.engine_tiers import prefetch_stored
    writer, reader, _ = store_pair
    docs = _docs(fresh_rng, 1)
    writer.cache_spans(docs)
    prompt = _prompts(reader, fresh_rng, docs)[0]
    eng = reader.llm_engine
    eng.add_request("early", prompt, SP)
    prefetch_stored(eng)
    assert eng.kv_store.reads or eng.kv_store.queue
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[0].num_cached_tokens > 0
    assert _tokens(outs) == _tokens(writer.generate([prompt], SP, use_tqdm=False))


def test_cache_spans_prewarms_per_cache_salt_namespace(store_pair, fresh_rng):
    writer, reader, root = store_pair
    docs = _docs(fresh_rng, 2)
    got = writer.cache_spans(docs + docs[:1], cache_salt="tenant-a")
    assert got["spans"] == 2 and got["blocks_written"] == sum(-(-(len(d) + 1) // B) for d in docs)
    assert (root / namespace("tenant-a")).is_dir()
    p = _prompts(reader, fresh_rng, docs)
    assert reader.generate(p, SP, use_tqdm=False, cache_salt="tenant-b")[0].num_cached_tokens == 0
    # a new reader-side prompt with tenant-a's salt hits tenant-a's blocks on disk
    before = reader.llm_engine.get_stats()["kv_store"]["staged_hits"]
    q = _prompts(reader, fresh_rng, docs)
    assert reader.generate(q, SP, use_tqdm=False, cache_salt="tenant-a")[0].num_cached_tokens > 0
    assert reader.llm_engine.get_stats()["kv_store"]["staged_hits"] > before


@pytest.mark.parametrize("change", [dict(block_size=32), dict(dtype="bfloat16"), dict(seed=1)],
                         ids=["block_size", "dtype", "weights"])
def test_store_of_other_model_or_settings_is_rejected(store_pair, change):
    root = store_pair[2]
    with pytest.raises(ValueError, match="another setup") as err:
        make_tiny_llm(kv_store_dir=str(root), **change)
    field = {"block_size": "block_size", "dtype": "model", "seed": "model"}[next(iter(change))]
    assert f"{field}: store has" in str(err.value)


# -- the file layer alone (no engine) -----------------------------------------------------------
def test_two_writers_one_store(tmp_path, fresh_rng):
    a = DiskStore(tmp_path, _identity(), 1 << 30)
    b = DiskStore(tmp_path, _identity(), 1 << 30)
    runs = {10 * k: _run(fresh_rng, list(range(10 * k, 10 * k + 3))) for k in range(1, 21)}

    def fill(store, order):
        for h in order:
            store.write("shared", *runs[h])
    hs = list(runs)
    threads = [threading.Thread(target=fill, args=(s, o)) for s, o in
               ((a, hs), (b, hs[::-1]), (a, hs[::2]), (b, hs[1::2]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not list(tmp_path.rglob("*.tmp"))
    fresh = DiskStore(tmp_path, _identity(), 1 << 30)
    assert fresh.stats()["runs_stored"] == len(runs)
    for h, (hashes, tokens, leaves) in runs.items():
        got = fresh.read(h, "shared")
        assert got.hashes.tolist() == hashes and got.tokens.tobytes() == tokens, h
        assert np.array_equal(got.kv, np.stack(leaves)), h
    # a plain safetensors file: the reference reader sees the same pages, tokens and keys
    import safetensors.numpy
    ref = safetensors.numpy.load((fresh.path(50, "shared")).read_bytes())
    assert np.array_equal(ref["kv"].view(np.float32), np.stack(runs[50][2]))
    assert ref["tokens"].tobytes() == runs[50][1] and ref["hashes"].tolist() == [50, 51, 52]


def test_runs_extend_as_a_prefix_tree_and_reads_pad_rows(tmp_path, fresh_rng):
    store = DiskStore(tmp_path, _identity(), 1 << 30)
    assert store.write("shared", *_run(fresh_rng, [1, 2, 3])) == 3
    assert store.write("shared", *_run(fresh_rng, [1, 2, 3])) == 0  # all there
    longer = _run(fresh_rng, [1, 2, 3, 4, 5])
    assert store.write("shared", *longer) == 2  # only past the common prefix, under key 4
    assert store.write("shared", *_run(fresh_rng, [1, 2, 9])) == 1  # a branch at block 2
    got = store.read(4, "shared", pad=lambda n: 8)
    assert got.hashes.tolist() == [4, 5] and got.kv.shape == (2, 8, 4, 2, 8)
    assert np.array_equal(got.kv[:, :2], np.stack(longer[2])[:, 3:])
    assert store.read(9, "shared").hashes.tolist() == [9]
    assert not store.has(2, "shared") and store.read(2, "shared") is None


def test_matched_prefix_needs_same_keys_and_tokens(tmp_path, fresh_rng):
    from serving.tiers.kv_store_tier import _matched, _Want
    store = DiskStore(tmp_path, _identity(), 1 << 30)
    hashes, tokens, leaves = _run(fresh_rng, [1, 2, 3])
    store.write("shared", hashes, tokens, leaves)
    run = store.read(1, "shared")
    assert _matched(run, _Want("shared", [1, 2, 3, 4], tokens + bytes(32)), 32) == 3
    assert _matched(run, _Want("shared", [1, 2, 7], tokens), 32) == 2
    other = bytearray(tokens)
    other[40] ^= 1  # block 1's tokens differ under the same key: a collision, not a hit
    assert _matched(run, _Want("shared", [1, 2, 3], bytes(other)), 32) == 1


def test_truncated_or_flipped_file_is_a_miss_and_removed(tmp_path, fresh_rng):
    store = DiskStore(tmp_path, _identity(), 1 << 30)
    for h in (1, 5):
        store.write("shared", *_run(fresh_rng, [h, h + 1]))
    p1, p5 = store.path(1, "shared"), store.path(5, "shared")
    p1.write_bytes(p1.read_bytes()[:-3])
    data = bytearray(p5.read_bytes())
    data[-200] ^= 0x01
    p5.write_bytes(bytes(data))
    for h in (1, 5):
        with pytest.warns(RuntimeWarning, match="corrupt"):
            assert store.read(h, "shared") is None
        assert not store.has(h, "shared")
    assert store.stats()["corrupt"] == 2


def test_lru_eviction_to_capacity(tmp_path, fresh_rng):
    probe = DiskStore(tmp_path / "probe", _identity(), 1 << 30)
    probe.write("shared", *_run(fresh_rng, [1]))
    size = probe.stats()["bytes_stored"]
    store = DiskStore(tmp_path / "s", _identity(), int(3.5 * size))
    for h in (1, 2, 3):
        store.write("shared", *_run(fresh_rng, [h]))
    assert store.read(1, "shared") is not None  # 1 is now the most recently used
    store.write("shared", *_run(fresh_rng, [4]))
    assert not store.has(2, "shared") and all(store.has(h, "shared") for h in (1, 3, 4))
    assert store.stats()["evicted"] == 1


def test_capacity_counts_every_process_files(tmp_path, fresh_rng):
    """kv_store_gb bounds the folder, not one process's share of it."""
    probe = DiskStore(tmp_path / "probe", _identity(), 1 << 30)
    probe.write("shared", *_run(fresh_rng, [1]))
    size = probe.stats()["bytes_stored"]
    a = DiskStore(tmp_path / "s", _identity(), int(3.5 * size), rescan_s=0.0)
    b = DiskStore(tmp_path / "s", _identity(), int(3.5 * size), rescan_s=0.0)
    for h in (1, 2):
        a.write("shared", *_run(fresh_rng, [h]))
    for h in (3, 4):
        b.write("shared", *_run(fresh_rng, [h]))
    files = list((tmp_path / "s").rglob("*.safetensors"))
    assert len(files) == 3 and sum(f.stat().st_size for f in files) <= 3.5 * size
    assert b.stats()["bytes_stored"] == 3 * size and b.stats()["evicted"] == 1


def test_bfloat16_blocks_round_trip_bit_exact(tmp_path, fresh_rng):
    import ml_dtypes
    ident = _identity(leaves=(((4, 2, 8), "bfloat16"),) * 2)
    store = DiskStore(tmp_path, ident, 1 << 30)
    hashes, tokens, leaves = _run(fresh_rng, [7, 8])
    leaves = [x.astype(ml_dtypes.bfloat16) for x in leaves]
    store.write("shared", hashes, tokens, leaves)
    got = DiskStore(tmp_path, ident, 1 << 30).read(7, "shared")
    assert got.kv.dtype == leaves[0].dtype and got.kv.tobytes() == np.stack(leaves).tobytes()


def test_identity_mismatch_names_the_field(tmp_path):
    DiskStore(tmp_path, _identity(), 1 << 20)
    with pytest.raises(StoreMismatch, match=r"kv_mode: store has 'position_free', this engine "
                                            r"'rotated'"):
        DiskStore(tmp_path, _identity(kv_mode="rotated"), 1 << 20)
    DiskStore(tmp_path, _identity(model_name="renamed"), 1 << 20)  # a name alone is no change


@pytest.mark.parametrize("pinned", [True, False])
def test_run_buffers_send_read_bytes_and_reuse_the_buffer(tmp_path, fresh_rng, pinned):
    """A run read into a pooled buffer (pinned host memory, or plain numpy) reaches the device
    bit-exact; the buffer is reused and a later write to it does not change what was sent."""
    import ml_dtypes
    from serving.tiers.kv_store_buffers import RunBuffers, pinned_shardings
    if pinned and pinned_shardings() is None:
        pytest.skip("no pinned host memory on this backend")
    bufs = RunBuffers(per_shape=2, pinned=pinned)
    ident = _identity(leaves=(((4, 2, 8), "bfloat16"),) * 2)
    store = DiskStore(tmp_path, ident, 1 << 30)
    hashes, tokens, leaves = _run(fresh_rng, [7, 8, 9])
    leaves = [x.astype(ml_dtypes.bfloat16) for x in leaves]
    store.write("shared", hashes, tokens, leaves)
    run = store.read(7, "shared", pad=lambda n: 4, alloc=bufs.take)
    assert bufs.pinned == pinned and run.kv.shape == (2, 4, 4, 2, 8)
    ptr = run.kv.ctypes.data
    dev, keep = bufs.send(run.kv)
    assert np.asarray(dev)[:, :3].tobytes() == np.stack(leaves).tobytes()
    if not keep:
        again = bufs.take(run.kv.shape, run.kv.dtype)
        assert again.ctypes.data == ptr  # the pooled buffer, not a fresh one
        again[:] = 0
        assert np.asarray(dev)[:, :3].tobytes() == np.stack(leaves).tobytes()


def test_a_failed_transfer_is_a_miss_not_a_stall(store_pair, fresh_rng, monkeypatch):
    """A reader thread whose transfer to the device fails (on the H200 an engine process was
    refused the allocation) turns that run into a miss: a warning, the blocks recomputed, the
    same tokens; the job goes on."""
    writer, reader, _ = store_pair
    docs = _docs(fresh_rng, 2)
    writer.cache_spans(docs)
    prompts = _prompts(reader, fresh_rng, docs)
    tier = reader.llm_engine.kv_store

    def refuse(a):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory (injected)")
    monkeypatch.setattr(tier.buffers, "send", refuse)
    errors = tier.counters["read_errors"]
    with pytest.warns(RuntimeWarning, match="injected"):
        out = reader.generate(prompts, SP, use_tqdm=False)
    assert tier.counters["read_errors"] > errors
    assert all(o.num_cached_tokens == 0 for o in out)
    assert _tokens(out) == _tokens(writer.generate(prompts, SP, use_tqdm=False))
