"""The cache manager's one admission routine (serving/cache/manager.py, admission.py) on plain
ints: a recurrent part's plan (hybrid resume) against the Llama plan over the same lower tier,
and an allocation fault part way through a recurrent plan."""

from __future__ import annotations

import pytest

from minipic_jax.prompts import Prompt, Span, build_prompt
from minipic_jax.sampling_params import SamplingParams
from serving.cache.admission import AdmissionPlan
from serving.layout import build_layout
from serving.sequence import Sequence, Status
from test_scheduler import B, PAD, PDEP, SSEP, make


class LowerTier:
    def __init__(self, hashes):
        self.hashes = set(hashes)

    def contains(self, h):
        return h is not None and h in self.hashes


class ResumePart:
    """A recurrent part that resumes every sequence after its first `depth` blocks, all of them
    copied in from the lower tier."""
    caches = True

    def __init__(self, depth: int):
        self.depth, self.committed, self.cancelled = depth, [], 0

    def plan_admission(self, mgr, seq):
        planned = {j: ("host", None) for j in range(self.depth)}
        return AdmissionPlan.from_kinds(seq.num_blocks_needed, planned, self.depth * B, "pins")

    def commit(self, mgr, seq, plan):
        self.committed.append(plan.detail)

    def cancel(self, plan):
        self.cancelled += 1

    def release(self, seq):
        pass


def _twice_the_same_span():
    """8 blocks: a prompt (2), the same span twice (2 + 2: the same keys), the question (2)."""
    doc = list(range(10, 17))
    ids = build_prompt([Prompt(list(range(100, 108))), Span(doc), Span(doc), Prompt([5, 6, 7, 8, 9])],
                       block_size=B, pad_token_id=PAD, ssep_token_id=SSEP, pdep_token_id=PDEP)
    lay = build_layout(ids, B, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP)
    return Sequence("r", ids, lay, SamplingParams(max_tokens=2), B, seed=0)


def _manager(part=None):
    _, _, sched = make("fcfs", 32)
    cache = sched.cache
    if part is not None:
        cache.recurrent = part
    return cache


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_lower_tier_block_whose_key_repeats(hybrid):
    """Llama: the second copy of a repeated span cannot register its key, so it is computed.
    Hybrid: every block below the resume point is copied in all the same (the state resumes
    after it: its KV is needed), none of them is computed."""
    part = ResumePart(6) if hybrid else None
    cache, seq = _manager(part), _twice_the_same_span()
    hashes = cache.keys.hashes(seq)
    assert hashes[2:4] == hashes[4:6]
    cache.offload = LowerTier(hashes[:6])  # the prompt and both spans
    assert cache.admit(seq, [0])
    copied = [h for _, h in cache.pending_copy_in]
    published = [cache.bm.hash[b] for b, _ in cache.pending_copy_in]
    if hybrid:  # the repeat's blocks hold the copy unpublished (the first copy has the key)
        assert copied == hashes[:6] and sorted(seq.owned) == [6, 7]
        assert published == hashes[:4] + [-1, -1]
        assert seq.num_cached_tokens == seq.num_computed == 6 * B and not seq.needs_reset
        assert part.committed == ["pins"]
    else:
        assert copied == published == hashes[:4] and sorted(seq.owned) == [4, 5, 6, 7]
        assert seq.num_cached_tokens == 4 * B and seq.num_computed == 0 and seq.needs_reset
    assert len(seq.block_table) == 8 and seq.status is Status.RUNNING and seq.seat == 0


@pytest.mark.parametrize("fault_at", [1, 3, 7])
def test_a_fault_part_way_through_a_recurrent_plan_undoes_it(fault_at):
    """An allocation that raises part way: every block taken goes back, the copy-ins queued go
    (unpublished), the part's pins are released, and the sequence is as it was in the queue."""
    part = ResumePart(6)
    cache, seq = _manager(part), _twice_the_same_span()
    cache.offload = LowerTier(cache.keys.hashes(seq))
    bm = cache.bm
    before = (list(bm.ref), set(bm.free), dict(bm.table), list(bm.hash))
    real, calls = bm.allocate, [0]

    def allocate():
        calls[0] += 1
        if calls[0] == fault_at:
            raise RuntimeError("injected")
        return real()
    bm.allocate = allocate
    with pytest.raises(RuntimeError, match="injected"):
        cache.admit(seq, [0])
    assert (list(bm.ref), set(bm.free), dict(bm.table), list(bm.hash)) == before
    assert cache.pending_copy_in == [] and part.cancelled == 1 and part.committed == []
    assert seq.block_table == [] and not seq.owned and seq.num_cached_tokens == 0
    assert seq.seat == -1 and not seq.ever_admitted
