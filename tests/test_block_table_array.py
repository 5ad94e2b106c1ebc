"""A cached span request's block table (~2,000 entries at 33K tokens, issue 28) is an int64 array
once: seeded at admission from the hits' array, then read as it is by the chunk plan, the seat's
block-table rows and the release (Sequence.table_array). The table list itself is never iterated
or sliced at length on that path, and the array always equals it."""

from __future__ import annotations

import numpy as np

from minipic_jax.prompts import Prompt, Span, build_prompt
from minipic_jax.sampling_params import SamplingParams
from serving.cache.hashing import make_hash_fn, root_hash
from serving.cache.manager import CacheManager
from serving.cache.prefix_keys import PrefixKeys
from serving.config import Config
from serving.layout import build_layout
from serving.scheduler import Scheduler
from serving.sequence import Sequence, Status
from serving.step.step_inputs import SeatTables

B, PAD, SSEP, PDEP = 4, 1023, 1022, 1021
LONG = 16  # a read of this many entries or more goes through the array


class ShortReadsOnly(list):
    """A block table that refuses iteration and long slices (converting it whole)."""

    def __iter__(self):
        raise AssertionError("block table iterated")

    def __getitem__(self, k):
        if isinstance(k, slice) and len(range(*k.indices(len(self)))) >= LONG:
            raise AssertionError(f"block table sliced at length: {k}")
        return super().__getitem__(k)

    def plain(self) -> list:
        return list.copy(self)


def _engine_parts():
    cfg = Config(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=1024, block_size=B,
                 num_kv_blocks=600)
    h = make_hash_fn("xxhash64")
    keys = PrefixKeys(B, h, lambda s: root_hash(h, s), {"pad": PAD, "ssep": SSEP, "pdep": PDEP},
                      True)
    cache = CacheManager(cfg, 600, keys)
    return cfg, cache, Scheduler(cfg, cache)


def _request(name, parts):
    ids = build_prompt(parts, block_size=B, pad_token_id=PAD, ssep_token_id=SSEP,
                       pdep_token_id=PDEP)
    lay = build_layout(ids, B, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP)
    return Sequence(name, ids, lay, SamplingParams(max_tokens=1), B, seed=0)


def _run(sched, seq, tables=None):
    """Drive `seq` to its first sampled token (finished then), checking its array each step."""
    sched.add(seq)
    while seq.status is not Status.FINISHED:
        batch = sched.schedule()
        if tables is not None:
            for e in batch:
                tables.sync(e.seq)
                n = len(e.seq.block_table)
                assert tables.tables[e.seq.seat, :n].tolist() == e.seq.block_table.plain()
                assert e.seq.table_array().tolist() == e.seq.block_table.plain()
        sched.advance(batch)
        for e in batch:
            if e.sample:
                e.seq.append_token(7)
                sched.finish(e.seq)


def test_cached_request_reads_its_block_table_as_one_array(fresh_rng):
    cfg, cache, sched = _engine_parts()
    docs = [[int(t) for t in fresh_rng.integers(0, 1000, 40 * B)] for _ in range(3)]
    _run(sched, _request("cold", [Prompt([5, 6, 7])] + [Span(d) for d in docs] + [Prompt([9])]))
    seq = _request("cached", [Prompt([5, 6, 7])] + [Span(docs[k]) for k in (2, 0, 1)]
                   + [Prompt([8, 9])])
    seq.block_table = ShortReadsOnly()
    tables = SeatTables(cfg.num_seats, cfg.max_blocks_per_seq, B)
    free_before = cache.bm.num_free
    _run(sched, seq, tables)
    assert seq.num_cached_tokens >= 3 * 40 * B  # every span block a hit
    assert cache.bm.num_free == free_before  # released whole: every block back


def test_table_array_follows_appends_and_new_lists():
    ids = list(range(10, 30))
    seq = Sequence("r", ids, build_layout(ids, B, pad_id=None, ssep_id=None, pdep_id=None),
                   SamplingParams(max_tokens=4), B, seed=0)
    assert seq.table_array().tolist() == []
    seq.block_table.extend([4, 9, 2])
    first = seq.table_array()
    assert first.tolist() == [4, 9, 2] and first.dtype == np.int64
    assert seq.table_array() is first  # unchanged list: not converted again
    seq.block_table.append(7)
    assert seq.table_array().tolist() == [4, 9, 2, 7]
    seq.block_table = [1, 2]  # a new list (a release, then another admission)
    assert seq.table_array().tolist() == [1, 2]
    assert not seq.table_array().flags.writeable
