"""Span-aware routing for data-parallel replicas (host only, plain Python over ints).

Each replica is an independent engine with its own prefix cache. An SSEP span's KV depends on its
own tokens only (DESIGN §3), so a span computed once on a replica is a hit there for every later
request that carries it, at any offset. Spreading requests that share spans over replicas at random
recomputes each span on up to every replica; routing them to one replica computes it once.

`span_keys` names a prompt's spans by the serving/cache/hashing.py key of each span's last full block
(the span chain, so equal keys mean equal span tokens: what the engine's cache would hit).
`route_by_spans` assigns requests greedily: a request goes to the replica that already owns the
most of its span blocks, among replicas whose load stays under a cap ((1 + slack) x an even
share), else to the least loaded one. `affinity_order` then puts requests that share spans next
to each other on their replica, so a finite LRU pool still holds a span when it is needed again.
`route_random` is the baseline (dataset order).
"""

from __future__ import annotations

import numpy as np

from serving.cache.hashing import block_keys, make_hash_fn, root_hash
from serving.layout import build_layout


def span_keys(token_ids, *, block_size: int, markers: dict, hash_algo: str = "xxhash64",
              cache_salt: str | None = None, memo: dict | None = None) -> list[tuple[int, int]]:
    """(key, full blocks) of every SSEP span of a prompt whose markers and pads are placed.

    Args:
      token_ids: the prompt (as `LLM.to_token_ids` or `build_prompt` gives it).
      markers: {"pad_token_id", "ssep_token_id", "pdep_token_id"} (the engine's `markers`).
      memo: optional dict reused across prompts (a span seen before is not hashed again).
    Returns:
      one (key, number of full blocks) per span with at least one full block, in prompt order.
    """
    hash_fn = make_hash_fn(hash_algo)
    lay = build_layout(token_ids, block_size, pad_id=markers["pad_token_id"],
                       ssep_id=markers["ssep_token_id"], pdep_id=markers["pdep_token_id"])
    keys = block_keys(hash_fn, token_ids, block_size, lay.span_block, lay.span_start,
                      root_hash(hash_fn, cache_salt), memo)
    out, start = [], None
    for j in range(len(keys) + 1):
        ends = j == len(keys) or not lay.span_block[j] or lay.span_start[j]
        if ends and start is not None:
            out.append((keys[j - 1], j - start))
            start = None
        if j < len(keys) and lay.span_start[j]:
            start = j
    return out


def route_by_spans(spans: list[list[tuple[int, int]]], num_replicas: int, *,
                   loads=None, slack: float = 0.1) -> np.ndarray:
    """Replica index per request, keeping requests that share spans on one replica.

    Args:
      spans: per request, its (span key, blocks) list (`span_keys`).
      loads: per request, its cost (default: 1 each; prompt tokens is a good choice).
      slack: a replica takes a request by affinity only while its load stays under
        (1 + slack) x total / num_replicas (plus the request), so no replica runs far longer.
    Returns:
      [R] int64 replica of each request. Deterministic: depends only on the inputs' order.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    n = len(spans)
    cost = np.ones(n) if loads is None else np.asarray(loads, np.float64)
    if cost.shape != (n,) or (cost < 0).any():
        raise ValueError(f"loads must be {n} non-negative numbers, got shape {cost.shape}")
    cap = (1.0 + slack) * cost.sum() / num_replicas
    load = np.zeros(num_replicas)
    holders: dict[int, set] = {}  # span key -> replicas that will have computed it
    out = np.zeros(n, np.int64)
    for i, req in enumerate(spans):
        affinity = np.zeros(num_replicas)
        for key, blocks in req:
            for r in holders.get(key, ()):
                affinity[r] += blocks
        fits = (load + cost[i] <= cap) | (load == 0)
        score = np.where(fits & (affinity > 0), affinity, -1.0)
        r = int(np.argmax(score)) if score.max() > 0 else int(np.argmin(load))
        out[i] = r
        load[r] += cost[i]
        for key, _ in req:
            holders.setdefault(key, set()).add(r)
    return out


def route_random(num_requests: int, num_replicas: int, seed: int = 0) -> np.ndarray:
    """Baseline: a seeded random permutation dealt round-robin (balanced counts)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    return np.random.default_rng(seed).permutation(num_requests) % num_replicas


def affinity_order(spans: list[list[tuple[int, int]]], routes) -> np.ndarray:
    """A processing order: by replica, then requests linked by shared spans (connected
    components, union-find) next to each other, in dataset order otherwise.

    Routing decides where a span is computed; the order decides whether it is still cached when
    the next request that needs it arrives (a replica's pool is finite and LRU-evicted).
    Returns a permutation of range(R).
    """
    n = len(spans)
    parent = list(range(n))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[int, int] = {}  # span key -> first request holding it
    for i, req in enumerate(spans):
        for key, _ in req:
            j = first.setdefault(key, i)
            a, b = find(i), find(j)
            if a != b:
                parent[max(a, b)] = min(a, b)  # a root is its component's first request
    comp = [find(i) for i in range(n)]
    return np.asarray(sorted(range(n), key=lambda i: (int(routes[i]), comp[i], i)), np.int64)
