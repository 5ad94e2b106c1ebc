"""Chained block hashes (DESIGN §3): h_i = H(parent, tokens_i, kind).

Two chains run over a prompt's full blocks:
  * a span chain s_i = H(s_{i-1} or h_0, tokens_i, "S") that restarts at each SSEP block, so a
    span's key depends on its own tokens only and is valid at any offset in any request;
  * the prefix chain over the whole prompt (PDEP blocks use it: their KV depends on everything
    before them): p_i = H(p_{i-1}, tokens_i, "P") at a PDEP block, and one step over a whole
    span run, p = H(p, s_last, "J") with s_last the run's last span key (it stands for the run's
    tokens), so a cached span costs one hash, not one per block.
h_0 is derived from the cache salt, which isolates tenants. Kinds keep the chains disjoint.
"""

from __future__ import annotations

import hashlib

import numpy as np
import xxhash

_SEED = 0x6D696E69706963  # "minipic"


def _to_bytes(tokens) -> bytes:
    if isinstance(tokens, (bytes, memoryview)):  # already int64 bytes (block_keys)
        return tokens
    return np.asarray(tokens, dtype=np.int64).tobytes()


def make_hash_fn(algo: str = "xxhash64"):
    """Returns H(parent: int, tokens, kind: bytes) -> int (64-bit)."""
    if algo == "xxhash64":
        digest = xxhash.xxh64_intdigest

        def h(parent: int, tokens, kind: bytes) -> int:  # one call over parent | kind | tokens
            return digest(b"".join((parent.to_bytes(8, "little"), kind, _to_bytes(tokens))),
                          _SEED)
    elif algo == "sha256":
        def h(parent: int, tokens, kind: bytes) -> int:
            x = hashlib.sha256(parent.to_bytes(8, "little"))
            x.update(kind)
            x.update(_to_bytes(tokens))
            return int.from_bytes(x.digest()[:8], "little")
    else:
        raise ValueError(f"unknown hash algo {algo!r}; use 'xxhash64' or 'sha256'")
    return h


def root_hash(hash_fn, cache_salt: str | None) -> int:
    """h_0 for a tenant: a fixed seed, or one derived from `cache_salt` and its length (so no
    two salts share a root: "a" and "a\\0" differ)."""
    salt = (cache_salt or "").encode()
    return hash_fn(_SEED, len(salt).to_bytes(8, "little") + salt if salt else b"", b"R")


def block_keys(hash_fn, tokens, block_size: int, span_block, span_start, h0: int,
               memo: dict | None = None) -> list[int]:
    """Hash of every full block of `tokens` (see `block_keys_and_tail`)."""
    return block_keys_and_tail(hash_fn, tokens, block_size, span_block, span_start, h0, memo)[0]


def block_keys_and_tail(hash_fn, tokens, block_size: int, span_block, span_start, h0: int,
                        memo: dict | None = None,
                        runs: list | None = None) -> tuple[list[int], tuple[int, int]]:
    """Hash of every full block of `tokens`, and the chains' tail (prefix, span) after them.

    Args:
      tokens: prompt token ids (pads and markers included), or their int64 bytes.
      span_block: per block, True inside an SSEP span, False inside a PDEP segment.
      span_start: per block, True where an SSEP span begins (its chain restarts from h0).
      h0: root hash (per cache salt).
      memo: optional dict reused across calls: a span's chain depends only on (h0, its tokens),
        so a span seen before (the common case for position-free reuse) is not hashed again.
        Its key holds a 128-bit digest of the span's tokens; a digest collision could only give
        wrong keys, which miss (a hit also compares the block's kept tokens).
      runs: optional list that gets (first, end, keys) of each span run (blocks [first, end) of
        one SSEP span; `keys`: its keys, the span-chain memo's list for a span seen before, the
        same object each time), ascending: admission looks a cached span up as a whole
        (run_memo.py).
    Returns:
      one int per full block (a partial last block gets none), and (prefix, span): the two
      chains after the last full block, from which `next_block_key` continues.
    """
    step = 8 * block_size
    if isinstance(tokens, (bytes, bytearray)):  # int64 bytes (PrefixKeys.token_bytes)
        n = len(tokens) // step
        raw = memoryview(tokens)[:n * step]  # slices of it copy nothing
    else:
        n = len(tokens) // block_size
        raw = np.asarray(tokens[:n * block_size], dtype=np.int64).tobytes()
    visits, in_span, restarts = _visits(span_block, span_start, n)
    keys, prefix, span = [], h0, h0
    for i, j in enumerate(visits[:-1]):
        if not in_span[i]:  # a PDEP block
            prefix = hash_fn(prefix, raw[j * step:(j + 1) * step], b"P")
            keys.append(prefix)
            continue
        # a span run: from here while blocks stay in the span (a new SSEP restarts the chain)
        end = visits[i + 1]
        got = None
        if memo is not None and restarts[i]:  # keyed by a digest: hashing 64 KB keys costs
            mk = (h0, block_size, end - j, xxhash.xxh3_128_intdigest(raw[j * step:end * step]))
            got = memo.get(mk)
        if got is None:
            got, span = [], (h0 if restarts[i] else span)
            for k in range(j, end):
                span = hash_fn(span, raw[k * step:(k + 1) * step], b"S")
                got.append(span)
            if memo is not None and restarts[i]:
                memo[mk] = got
        keys.extend(got)
        if runs is not None:
            runs.append((j, end, got))
        span = got[-1]
        prefix = hash_fn(prefix, span.to_bytes(8, "little"), b"J")  # the whole run in one step
    return keys, (prefix, span)


def _visits(span_block, span_start, n: int) -> tuple[list[int], list, list]:
    """(visits, in_span, restarts) over the first n blocks: the ascending blocks the chains stop
    at -- each PDEP block, each span run's first block (block 0, a new span's first block, a
    span block after a PDEP one) -- then n; per visit (n aside) whether it is in a span and
    whether its span starts there. Only the visits become Python values: a cached span
    request's 2,000 blocks are ~20 visits."""
    sb = np.asarray(span_block[:n], bool)
    ss = np.asarray(span_start[:n], bool)
    stop = ~sb
    stop[1:] |= ss[1:] | ~sb[:-1]
    if n:
        stop[0] = True
    at = np.flatnonzero(stop)
    return at.tolist() + [n], sb[at].tolist(), ss[at].tolist()


def next_block_key(hash_fn, tail: tuple[int, int], tokens, in_span: bool, starts_span: bool,
                   h0: int) -> tuple[int, tuple[int, int]]:
    """Key of the block after `tail` (as `block_keys` would give it) and the new tail.

    Used for blocks completed during generation: they extend the prompt's last segment, so a later
    prompt that repeats prompt + output finds them, and a preempted request finds its own."""
    prefix, span = tail
    prefix = hash_fn(prefix, tokens, b"P")
    if not in_span:
        return prefix, (prefix, span)
    span = hash_fn(h0 if starts_span else span, tokens, b"S")
    return span, (prefix, span)
