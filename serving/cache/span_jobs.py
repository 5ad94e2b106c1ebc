"""isps span jobs: span-only prefills of a waiting request's SSEP spans (docs/DESIGN.md, ISPS).
Position-free KV does not care where a span is computed, so a job computes one span at offset 0
in a span seat, and the request finds it cached when it is admitted."""

from __future__ import annotations

import numpy as np

from serving.layout import build_layout
from serving.sequence import Sequence


def jobs_for(seq: Sequence, block_size: int, keys, bm, offload, markers: dict) -> list[Sequence]:
    """Span jobs for `seq`'s SSEP spans that nobody has cached (device or host tier) or is
    computing; none once the request was admitted or scanned before (it is scanned once)."""
    if seq.ever_admitted or seq.span.jobs_scanned:
        return []
    seq.span.jobs_scanned = True
    lay, bs = seq.layout, block_size
    hashes = keys.hashes(seq)
    limit = keys.hit_limit(seq)
    jobs, starts = [], np.flatnonzero(lay.seg_start)
    for k, j0 in enumerate(starts):
        j1 = int(starts[k + 1]) if k + 1 < len(starts) else len(lay.block_valid)
        if not lay.span_start[j0] or j1 > limit:
            continue
        last = j1 - 1
        if bm.lookup(hashes[last], keys.confirm(seq, last)) is not None:
            continue
        if offload is not None and offload.contains(hashes[last]):
            continue
        toks = seq.token_ids[j0 * bs:j1 * bs]  # prompt blocks (j1 <= limit): no whole copy
        job_layout = build_layout(toks, bs, pad_id=markers.get("pad"),
                                  ssep_id=markers.get("ssep"), pdep_id=markers.get("pdep"))
        job = Sequence(f"span:{seq.request_id}:{j0}", toks, job_layout, None, bs, seed=0,
                       cache_salt=seq.cache_salt, is_span_job=True)
        job.block_hashes = hashes[j0:j1]
        jobs.append(job)
    return jobs
