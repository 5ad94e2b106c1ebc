"""SpanMapCache._span_hits: a span is skipped only when every block is a ready device hit whose
kept tokens match (one whole-span check), or sits in the KV host tier; a block not ready, a hash
collision or a block nowhere gives None. Host bookkeeping only (stubs for the block manager, the
prefix keys and the host tier)."""

from types import SimpleNamespace

import numpy as np
import pytest

from serving.hybrid.span_cache import SpanMapCache

BS = 4


def _setup(n_blocks=6, host=()):
    tokens = np.arange(100, 100 + n_blocks * BS, dtype=np.int64)
    raw = tokens.tobytes()
    hashes = [1000 + j for j in range(n_blocks)]
    step = 8 * BS
    bm = SimpleNamespace(table={h: 10 + j for j, h in enumerate(hashes) if j not in host},
                         ready=np.ones(32, bool), confirm=[None] * 32, confirms_are_blocks=True)
    for j in range(n_blocks):
        bm.confirm[10 + j] = raw[j * step:(j + 1) * step]
    keys = SimpleNamespace(hashes=lambda seq: hashes, token_bytes=lambda seq: raw,
                           confirm=lambda seq, j: raw[j * step:(j + 1) * step])
    offload = SimpleNamespace(contains=lambda h: h in {hashes[j] for j in host})
    mgr = SimpleNamespace(bm=bm, keys=keys, offload=offload)
    return SpanMapCache(store=None, block_size=BS), mgr


@pytest.mark.parametrize("case, want", [
    ("all ready", [("hit", 11), ("hit", 12), ("hit", 13)]),
    ("one not ready", None), ("one collides", None), ("one in the host tier", "host"),
    ("one nowhere", None)])
def test_span_hits(case, want):
    host = (2,) if case in ("one in the host tier", "one nowhere") else ()
    cache, mgr = _setup(host=host)
    if case == "one not ready":
        mgr.bm.ready[12] = False
    if case == "one collides":
        mgr.bm.confirm[13] = b"\0" * (8 * BS)
    if case == "one nowhere":
        mgr.offload = None
    got = cache._span_hits(mgr, None, 1 * BS, 4 * BS)
    if want == "host":
        assert got == [("hit", 11), ("host", None), ("hit", 13)]
    else:
        assert got == want
