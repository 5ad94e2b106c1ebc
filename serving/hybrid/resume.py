"""What a hybrid admission planned, kept on its AdmissionPlan (serving/cache/admission.py) from
the plan to its commit or cancel (serving/hybrid/hybrid_prefix.py, span_cache.py)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class Resume:
    kinds: list  # per block from the start: ("hit", block) / ("host", None) while they match
    kc: int  # blocks below the checkpoint the sequence resumes at
    shared: int  # blocks it shares with cached and in-flight prompts (the placement's statistic)
    entry: object  # the pinned checkpoint entry, or None (resume at 0)
    skips: list | None = None  # span prompts: [(start, end, pinned map entry)] of skipped spans
