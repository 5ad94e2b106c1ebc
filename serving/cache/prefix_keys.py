"""The prefix-cache keys of a sequence's blocks (host, plain Python): prompt blocks hashed once
(serving/cache/hashing.py chains), blocks completed during generation keyed as a prompt repeating them
would key them, and the token bytes kept with a cached block to confirm hits."""

from __future__ import annotations

import itertools
import operator

import numpy as np

from serving.cache.hashing import block_keys_and_tail, next_block_key
from serving.cache.run_memo import RunMemo
from serving.sequence import Sequence

_MEMO_LIMIT = 65536  # span-chain memo entries (it only saves hashing)


class PrefixKeys:
    def __init__(self, block_size: int, hash_fn, root_hash_fn, markers: dict, caching: bool):
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.root_hash_fn = root_hash_fn  # cache_salt -> h0
        self.markers = markers  # {"pad", "ssep", "pdep"} -> id
        self.caching = caching
        self.span_memo: dict = {}  # (h0, block size, span bytes) -> span chain keys
        self.runs = RunMemo()  # the blocks of span runs found whole (admission_plan)

    def hashes(self, seq: Sequence) -> list[int]:
        """Keys of the sequence's full prompt blocks (computed once), then of its published
        generated blocks; [] with caching off."""
        if seq.block_hashes is None:
            if not self.caching:
                seq.block_hashes = []
            else:
                lay = seq.layout
                if len(self.span_memo) > _MEMO_LIMIT:
                    self.span_memo.clear()
                raw = self.token_bytes(seq)[:8 * seq.num_prompt_tokens]
                seq.memo.span_runs = []
                seq.block_hashes, seq.chain_tail = block_keys_and_tail(
                    self.hash_fn, raw, self.block_size, lay.span_block,
                    lay.span_start, self.root_hash_fn(seq.cache_salt), self.span_memo,
                    seq.memo.span_runs)
        return seq.block_hashes

    def hit_limit(self, seq: Sequence) -> int:
        """Blocks [0, limit) may be cache hits: full blocks with a key before the one holding the
        last token to compute (the last valid prompt token, or for a preempted request its last
        generated token: at least one token is computed to produce logits)."""
        last = len(seq) - 1 if seq.num_output_tokens else seq.layout.last_valid_index
        return min(len(self.hashes(seq)), last // self.block_size)

    def admission_plan(self, seq: Sequence, bm, limit: int, offload=None):
        """(blocks, misses, host, hits): per logical block of `seq`, the cached block whose kept
        tokens match its own (a hash collision is a miss), else None; the indices of the None
        ones, ascending; those of them the host tier holds; the blocks found as an int64 array
        in block order, or None (not made: the caller converts them). Blocks [0, limit) may hit.
        Whole-request operations, not a loop per block: a cached 32K-token request has 2,000
        blocks, all hits, and this runs inside its time to first token; its spans are found
        whole where they were found before (serving/cache/run_memo.py)."""
        hashes, n = self.hashes(seq), seq.num_blocks_needed
        lim = max(0, min(limit, n))
        got, hits = [None] * lim, None
        if bm.enable_caching and lim:
            got, misses, hits = self._lookup(seq, bm, hashes, lim)
        else:
            misses = list(range(lim))
        host = set()
        if offload is not None and misses:
            host = {j for j in misses if offload.contains(hashes[j])}
        got += [None] * (n - lim)  # in place: a cached request's list is ~2,000 long
        return got, misses + list(range(lim, n)), host, hits

    def _lookup(self, seq: Sequence, bm, hashes: list, lim: int):
        """admission_plan's blocks [0, lim): the span runs remembered whole (RunMemo.known),
        the blocks between them looked up and confirmed one by one (in C: see confirm_hits);
        then the runs found whole this time are remembered. Returns (got, misses, hits array
        or None)."""
        raw, step = self.token_bytes(seq), 8 * self.block_size
        runs = [r for r in (seq.memo.span_runs or ()) if r[1] <= lim]
        known = self.runs.known(bm, runs, hashes, raw, step)
        get, got, gaps, misses = bm.table.get, [], [], []
        for first, _, blocks, _ in known + [(lim, lim, [], None)]:
            a = len(got)
            if first > a:  # a lookup's default is -1 (block ids are >= 0): list.index finds an
                # int among ints faster than None (compared as ints, not through NotImplemented)
                part = list(map(get, hashes[a:first], itertools.repeat(-1, first - a)))
                for j in indices_of(part, -1):
                    part[j] = None
                    misses.append(a + j)
                got += part
                gaps.append((a, first))
            got += blocks
        if not known:
            misses = confirm_hits(got, bm, raw, self.block_size, misses)
        else:
            misses = _confirm_gaps(got, gaps, bm, raw, self.block_size, misses)
        self.runs.remember(bm, runs, hashes, raw, step, got, known)
        return got, misses, _hits_array(got, gaps, known)

    @staticmethod
    def token_bytes(seq: Sequence) -> bytes:
        """The sequence's tokens as int64 bytes: the prompt's, plus the generated ones once a
        preempted request comes back (its generated blocks can be hits too)."""
        raw = seq.memo.token_bytes
        if raw is None or len(raw) != 8 * len(seq.token_ids):
            n, prompt = seq.num_prompt_tokens, seq.layout.tokens
            if prompt is None or len(prompt) != n:  # a layout built elsewhere: convert
                prompt = np.asarray(seq.token_ids[:n], np.int64)
            raw = prompt.tobytes() + np.asarray(seq.token_ids[n:], np.int64).tobytes()
            seq.memo.token_bytes = raw
        return raw

    def confirm(self, seq: Sequence, j: int) -> bytes:
        """Block j's tokens (int64 bytes), kept with a cached block to confirm hits."""
        step = 8 * self.block_size
        return self.token_bytes(seq)[j * step:(j + 1) * step]

    def publish_generated(self, seq: Sequence, j: int, b: int, bm) -> None:
        """Register block j (physical block b), completed during generation (the prompt's
        partial last block filled by output tokens, or a block of output tokens), under the key a
        prompt repeating these tokens would give it. A block that starts with a generated marker
        id, or holds a generated pad id, stops this: such a prompt would be laid out differently
        from here on (its pads take no slot, while the generated ones hold K/V)."""
        bs, lay = self.block_size, seq.layout
        first = seq.token_ids[j * bs]
        gen = seq.token_ids[max(j * bs, seq.num_prompt_tokens):(j + 1) * bs]
        if (j * bs >= seq.num_prompt_tokens and first in self.markers.values()) or \
                ("pad" in self.markers and self.markers["pad"] in gen):
            seq.chain_tail = None
            return
        if j < len(lay.span_block):  # the prompt's partial last block
            in_span, starts = bool(lay.span_block[j]), bool(lay.span_start[j])
        else:
            in_span, starts = bool(lay.span_block[-1]) if len(lay.span_block) else False, False
        tokens = seq.token_ids[j * bs:(j + 1) * bs]
        h, seq.chain_tail = next_block_key(self.hash_fn, seq.chain_tail, tokens, in_span, starts,
                                           self.root_hash_fn(seq.cache_salt))
        seq.block_hashes.append(h)
        bm.register(b, h, np.asarray(tokens, np.int64).tobytes(), seq.seq_id, ready=True)


def confirm_hits(got: list, bm, raw: bytes, block_size: int,
                 misses: list[int] | None = None, offset: int = 0) -> list[int]:
    """Replace by None (in place) each candidate `got[j]` whose kept tokens differ from block
    j's tokens in `raw` (int64 bytes; `got[j]` is block j + `offset` of `raw`); returns the
    ascending indices of the None entries (`misses`: those before, when the caller has them). A run
    of candidates is compared in one go, its kept bytes joined against its part of `raw`; a run
    that differs (a collision), or a pool keeping other confirms than full blocks' bytes, is
    compared block by block."""
    step, kept = 8 * block_size, bm.confirm
    joined = bm.confirms_are_blocks
    if misses is None:
        misses = indices_of_none(got)
    start, collided = 0, False
    for end in misses + [len(got)]:
        if end > start and not (joined and raw.startswith(
                _joined(kept, got[start:end]), (start + offset) * step)):
            for j in range(start, end):
                if kept[got[j]] != raw[(j + offset) * step:(j + offset + 1) * step]:
                    got[j], collided = None, True
        start = end + 1
    return indices_of_none(got) if collided else misses


def device_run(bm, hashes, raw: bytes, block_size: int, offset: int = 0):
    """(blocks, ready): the leading run of `hashes` whose blocks the pool holds with kept tokens
    equal to theirs in `raw` (`hashes[i]` is block i + `offset` of `raw`), checked as a whole
    (`confirm_hits`), and how many of those lead the run ready. A span admission and a hybrid
    prefix match read hundreds of blocks per request this way instead of a loop per block."""
    got = [bm.table.get(h) for h in hashes]
    run = got[:got.index(None)] if None in got else got
    misses = confirm_hits(run, bm, raw, block_size, offset=offset)
    run = run[:misses[0]] if misses else run
    ready = bm.ready[np.asarray(run, np.int64)]
    return run, (int(np.argmin(ready)) if not ready.all() else len(run))


def _confirm_gaps(got: list, gaps: list, bm, raw: bytes, block_size: int,
                  misses: list[int]) -> list[int]:
    """confirm_hits over the blocks [a, b) of each of `gaps` only (the rest of `got` is
    confirmed already); returns the ascending indices of the None entries of `got`."""
    collided = False
    for a, b in gaps:
        part = got[a:b]
        before = [j - a for j in misses if a <= j < b]
        if confirm_hits(part, bm, raw, block_size, before, offset=a) != before:
            got[a:b] = part
            collided = True
    return indices_of_none(got) if collided else misses


def _hits_array(got: list, gaps: list, known: list):
    """The blocks found (`got` less its None entries) as int64, in block order, from the
    known runs' arrays and the gaps' few blocks; None where no run was known (the caller
    converts the list)."""
    if not known:
        return None
    pieces = [(a, np.array([x for x in got[a:b] if x is not None], np.int64)) for a, b in gaps]
    pieces += [(first, arr) for first, _, _, arr in known]
    pieces.sort(key=lambda p: p[0])
    return np.concatenate([p[1] for p in pieces])


def _joined(kept: list, blocks: list) -> bytes:
    """The kept bytes of `blocks`, joined: one itemgetter gathers them in C (a cached span
    request's ~2,000 hits)."""
    if len(blocks) == 1:  # itemgetter of one index gives the item, not a tuple
        return kept[blocks[0]]
    return b"".join(operator.itemgetter(*blocks)(kept))


def indices_of_none(xs: list) -> list[int]:
    """Ascending indices of the None entries of `xs`, found by list.index (a scan in C): a
    cached request's 2,000 hits cost no Python per entry."""
    return indices_of(xs, None)


def indices_of(xs: list, value) -> list[int]:
    """Ascending indices of the entries of `xs` equal to `value` (list.index scans)."""
    out, j = [], -1
    try:
        while True:
            j = xs.index(value, j + 1)
            out.append(j)
    except ValueError:
        return out
