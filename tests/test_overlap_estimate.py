"""serving/hybrid/overlap_estimate.OverlapEstimate.prompt_pmf against its definition written out
per block: the probability mass at each full-block boundary is the drop in the (decayed) share of
requests whose match went through that block, the rest an extension's tail past the deepest
shared block, and the pmf sums to 1. Randomized prompts, most extending a prefix of an earlier
one, so matches recur (seeded: MINIPIC_TEST_SEED replays)."""

import numpy as np

from serving.hybrid.overlap_estimate import OverlapEstimate


def _reference_pmf(est: OverlapEstimate, n: int, blocks, shared: int) -> np.ndarray:
    """The same quantity block by block, each stored weight divided by the scale on its own."""
    bs, total = est.block_size, est.weight(est.requests)
    ge = [est.weight(est.through.get(h, 0.0)) for h in blocks] + [0.0]
    for j in range(1, len(ge)):  # a match through block j went through every block before it
        ge[j] = min(ge[j], ge[j - 1])
    pmf = np.zeros(n + 1)
    k = sum(1 for g in ge if g != 0.0)
    for j in range(k):
        pmf[bs * (j + 1)] = (ge[j] - ge[j + 1]) / total
    d = max(shared, k) * bs
    tails = est.tails.pmf()[:n - d]
    if tails.sum() > 0:
        pmf[d + 1:] += est.weight(est.extensions) / total * tails[::-1] / tails.sum()
    pmf[0] = max(0.0, 1.0 - pmf.sum()) + 1e-12
    return pmf


def test_prompt_pmf_is_its_block_by_block_definition(fresh_rng):
    est = OverlapEstimate(max_len=2048, block_size=16, chunk=64, half_life=8.0)
    seen: list[list[int]] = []
    held: set[int] = set()  # every earlier prompt's blocks (the prefix cache, never evicted)
    checked = 0
    for _ in range(60):
        n = int(fresh_rng.integers(16, 1500))
        # a prefix of an earlier prompt (or none), then fresh blocks
        base = seen[int(fresh_rng.integers(len(seen)))] if seen and fresh_rng.random() < 0.7 \
            else []
        keep = int(fresh_rng.integers(0, len(base) + 1))
        blocks = base[:keep] + [int(x) for x in fresh_rng.integers(1, 1 << 40, n // 16 - keep)] \
            if n // 16 > keep else base[:n // 16]
        shared = 0
        while shared < len(blocks) and blocks[shared] in held:
            shared += 1
        got = est.prompt_pmf(n, blocks, shared)
        want = _reference_pmf(est, n, blocks, shared)
        np.testing.assert_array_equal(got, want)
        assert abs(got.sum() - 1.0) < 1e-9
        est.observe(blocks, shared, n if shared else None)
        seen.append(blocks)
        held.update(blocks)
        checked += int(np.count_nonzero(got[1:]))
    assert checked > 100  # the cases reached shared blocks and tails
