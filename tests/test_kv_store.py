"""Persistent span store (serving/disk_store.py, kv_store_tier.py, LLM.cache_spans).

Oracle: the same prompts run cold (no store) on a fresh engine; a store hit must give the same
tokens, and every corruption must be caught by its checksum or header and the block recomputed.
The cross-process case (a second process reading what the first stored) is in test_run_batch.py.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import make_tiny_llm
from minipic_jax import Prompt, SamplingParams, Span, build_prompt
from serving.disk_store import DiskStore, StoreIdentity, StoreMismatch, namespace

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


def test_stored_blocks_hit_in_another_engine_and_corrupt_files_are_recomputed(store_pair,
                                                                              fresh_rng):
    writer, reader, root = store_pair
    docs = _docs(fresh_rng, 4)
    prompts = _prompts(writer, fresh_rng, docs)
    ref = writer.generate(prompts, SP, use_tqdm=False)  # cold: the store is empty
    assert all(o.num_cached_tokens == 0 for o in ref)
    blocks = [(len(p) - 1) // B for p in prompts]  # full blocks before the last one
    files = sorted((root / "shared").rglob("*.safetensors"))
    assert len(files) == sum(blocks) == writer.llm_engine.get_stats()["kv_store"]["blocks_stored"]
    # damage two blocks of prompt 0's span: one truncated, one with a flipped byte at the end
    store = reader.llm_engine.kv_store.store
    from serving.sequence import Sequence
    lay = reader.llm_engine.validate("probe", prompts[0], SP)
    hashes = reader.llm_engine.scheduler.keys.hashes(Sequence("probe", prompts[0], lay, SP, B,
                                                              seed=0))
    victims = [store.path(h, "shared") for h in hashes[1:3]]
    data = victims[0].read_bytes()
    victims[0].write_bytes(data[:len(data) // 2])
    data = bytearray(victims[1].read_bytes())
    data[-7] ^= 0x10
    victims[1].write_bytes(bytes(data))

    with pytest.warns(RuntimeWarning, match="corrupt"):
        warm = reader.generate(prompts, SP, use_tqdm=False)
    assert _tokens(warm) == _tokens(ref)
    kv = reader.llm_engine.get_stats()["kv_store"]
    assert kv["corrupt"] == 2, kv
    for k, (o, n) in enumerate(zip(warm, blocks)):
        assert o.num_cached_tokens == (n - (2 if k == 0 else 0)) * B, (k, o.num_cached_tokens)
    assert all(v.exists() for v in victims)  # recomputed and written again, whole
    assert all(store.read(h, "shared") is not None for h in hashes[1:3])


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
def _identity(**kw):
    base = dict(model="m0", model_name="test", block_size=4, kv_mode="position_free",
                hash_algo="xxhash64", markers=(1, 2, 3), leaves=(((4, 2, 8), "float32"),) * 2)
    base.update(kw)
    return StoreIdentity(**base)


def _block(rng):
    return [rng.standard_normal((4, 2, 8)).astype(np.float32) for _ in range(2)]


def test_two_writers_one_store(tmp_path, fresh_rng):
    a = DiskStore(tmp_path, _identity(), 1 << 30)
    b = DiskStore(tmp_path, _identity(), 1 << 30)
    blocks = {h: (_block(fresh_rng), np.arange(h, h + 4, dtype=np.int64).tobytes())
              for h in range(1, 41)}

    def fill(store, order):
        for h in order:
            store.write(h, "shared", *blocks[h])
    hs = list(blocks)
    threads = [threading.Thread(target=fill, args=(s, o)) for s, o in
               ((a, hs), (b, hs[::-1]), (a, hs[::2]), (b, hs[1::2]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not list(tmp_path.rglob("*.tmp"))
    fresh = DiskStore(tmp_path, _identity(), 1 << 30)
    assert fresh.stats()["blocks_stored"] == len(blocks)
    for h, (leaves, tokens) in blocks.items():
        got = fresh.read(h, "shared", tokens)
        assert got is not None and np.array_equal(got, np.stack(leaves)), h
    # a plain safetensors file: the reference reader sees the same pages and tokens
    import safetensors.numpy
    ref = safetensors.numpy.load((fresh.path(5, "shared")).read_bytes())
    assert np.array_equal(ref["kv"].view(np.float32), np.stack(blocks[5][0]))
    assert ref["tokens"].tobytes() == blocks[5][1]
    assert fresh.read(1, "shared", blocks[2][1]) is None  # other tokens: a miss, not a hit


def test_lru_eviction_to_capacity(tmp_path, fresh_rng):
    probe = DiskStore(tmp_path / "probe", _identity(), 1 << 30)
    probe.write(1, "shared", _block(fresh_rng), bytes(32))
    size = probe.stats()["bytes_stored"]
    store = DiskStore(tmp_path / "s", _identity(), int(3.5 * size))
    for h in (1, 2, 3):
        store.write(h, "shared", _block(fresh_rng), bytes(32))
    assert store.read(1, "shared") is not None  # 1 is now the most recently used
    store.write(4, "shared", _block(fresh_rng), bytes(32))
    assert not store.has(2, "shared") and all(store.has(h, "shared") for h in (1, 3, 4))
    assert store.stats()["evicted"] == 1


def test_bfloat16_blocks_round_trip_bit_exact(tmp_path, fresh_rng):
    import ml_dtypes
    ident = _identity(leaves=(((4, 2, 8), "bfloat16"),) * 2)
    store = DiskStore(tmp_path, ident, 1 << 30)
    leaves = [x.astype(ml_dtypes.bfloat16) for x in _block(fresh_rng)]
    store.write(7, "shared", leaves, bytes(32))
    got = DiskStore(tmp_path, ident, 1 << 30).read(7, "shared", bytes(32))
    assert got.dtype == leaves[0].dtype and got.tobytes() == np.stack(leaves).tobytes()


def test_identity_mismatch_names_the_field(tmp_path):
    DiskStore(tmp_path, _identity(), 1 << 20)
    with pytest.raises(StoreMismatch, match=r"kv_mode: store has 'position_free', this engine "
                                            r"'rotated'"):
        DiskStore(tmp_path, _identity(kv_mode="rotated"), 1 << 20)
    DiskStore(tmp_path, _identity(model_name="renamed"), 1 << 20)  # a name alone is no change
