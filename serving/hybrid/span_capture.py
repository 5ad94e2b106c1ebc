"""Which computed spans a hybrid step captures the map of (Config.span_maps.capture).

A captured span map is not free the way a cached attention block is: the step that computes the
span runs its local pass as well (the span's rows from a zero state, the map's products, the
pool store). On an H100 rag's capturing step costs 1.32x a plain one for 4 captures, ~0.6 ms a
map, about what computing a 128-token span costs (~0.9 ms): a map pays for itself only when
another request enters it. On rag's zipf workload (24 requests x 10 passages drawn from 1,255)
~155 distinct passages are computed and ~120 of them occur in one request only.

The engine knows the requests it was given: every request's span keys are counted when it is
added (the queue is the lookahead an offline batch gives), and

  * "always": every computed span is captured (while a slot and a capture are left);
  * "shared": only a span that another request known to the engine holds (queued, running or
    earlier, within the last HOLDERS_LIMIT span keys);
  * "auto" (default): "shared", and a span no other request holds (yet) is captured while the
    spans seen so far mostly recur: the share of span keys held by >= 2 requests, with
    REUSE_PRIOR keys counted as recurring (a fresh engine captures: a user who sends spans and
    then the same spans reordered gets the hit), at least CAPTURE_MIN_REUSE.

LLM.cache_spans captures every span it computes (`capture_all`); long spans computed in pieces
always capture (span_partial carries the map across steps). Only the choice of capture changes:
outputs are the same whichever spans are captured (a span without a map is computed, as any
prompt rows). Rag at 16 seats on an H100 (benchmarks/RESULTS.md, Position-independent spans on
hybrid models): zipf 0.946x -> 1.083x prefix caching in one run, captures 165 -> 35, multi's
work unchanged.
"""

from __future__ import annotations

import contextlib

from serving.config_groups import check_capture

CAPTURE_MIN_REUSE = 0.5  # a map costs about what its span costs to compute (module doc)
REUSE_PRIOR = 8  # recurring span keys assumed before any is seen
HOLDERS_LIMIT = 1 << 16  # span keys counted before the count starts over


class CapturePolicy:
    def __init__(self, policy: str = "auto"):
        check_capture(policy)
        self.policy = policy
        self.holders: dict[int, int] = {}  # span key -> requests added that hold it
        self.recurring = 0  # keys of `holders` held by >= 2 requests
        self.declined = 0  # computed spans not captured by this policy
        self.forced = False  # every computed span captured (`capture_all`)

    @contextlib.contextmanager
    def capture_all(self):
        """Every span computed inside the block is captured whatever the policy (LLM.cache_spans:
        the caller says the spans will be reused)."""
        before, self.forced = self.forced, True
        try:
            yield
        finally:
            self.forced = before

    def note(self, keys) -> None:
        """A request was added holding the spans keyed `keys` (each counted once)."""
        if self.policy == "always":
            return
        if len(self.holders) > HOLDERS_LIMIT:
            self.holders.clear()
            self.recurring = 0
        for k in set(keys):
            n = self.holders.get(k, 0) + 1
            self.holders[k] = n
            self.recurring += n == 2

    def reuse(self) -> float:
        """The share of span keys seen that recur (REUSE_PRIOR of them assumed)."""
        return (self.recurring + REUSE_PRIOR) / (len(self.holders) + REUSE_PRIOR)

    def worth(self, key: int) -> bool:
        """Whether the computed span keyed `key` is captured; counts a decline."""
        take = (self.forced or self.policy == "always" or self.holders.get(key, 1) >= 2
                or self.policy == "auto" and self.reuse() >= CAPTURE_MIN_REUSE)
        self.declined += not take
        return take
