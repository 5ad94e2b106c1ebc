"""A sequence's block-level layout (valid tokens per block, each block's first logical position)
reads the prompt's blocks from its layout and keeps lists only from the prompt's last block on
(a cached 33K-token prompt's ~2,000 blocks are not made lists inside its time to first token,
issue 28); through appends, placeholders and dropped placeholders it equals the layout of all
tokens computed again from scratch."""

from __future__ import annotations

import numpy as np

from minipic_jax.sampling_params import SamplingParams
from serving.layout import build_layout
from serving.sequence import Sequence

PAD, SSEP, PDEP = 0, 1, 2


def _reference(seq) -> tuple[list, list]:
    """(valid tokens per block, first position per block) over all tokens: the prompt's from
    its layout, generated tokens all valid."""
    bs, n_p = seq.block_size, seq.num_prompt_tokens
    valid = list(~seq.layout.is_pad) + [True] * (len(seq.token_ids) - n_p)
    counts = [sum(valid[j:j + bs]) for j in range(0, len(valid), bs)]
    return counts, [sum(counts[:j]) for j in range(len(counts))]


def test_block_counts_equal_a_fresh_layout_through_appends_and_drops(fresh_rng):
    for _ in range(200):
        bs = int(fresh_rng.choice([1, 2, 4]))
        ids = [int(t) for t in fresh_rng.integers(3, 9, int(fresh_rng.integers(1, 30)))]
        for k in fresh_rng.integers(0, len(ids), 3):  # pads and markers here and there
            ids[k] = int(fresh_rng.choice([PAD, SSEP, PDEP]))
        ids[-1] = 5  # a valid last token
        lay = build_layout(ids, bs, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP)
        seq = Sequence("r", ids, lay, SamplingParams(max_tokens=50), bs, seed=0)
        for _ in range(int(fresh_rng.integers(0, 12))):
            u = fresh_rng.random()
            if u < 0.4:
                seq.append_token(7)
            elif u < 0.7 and not seq.num_pending:
                seq.append_placeholder()
            elif seq.num_pending:
                seq.drop_placeholder()
            counts, starts = _reference(seq)
            assert seq.num_counted_blocks == len(counts)
            assert [seq.block_valid_at(j) for j in range(len(counts))] == counts
            assert seq.block_pos_starts().tolist() == starts
            assert seq.block_pos_starts().dtype == np.int32
            assert len(seq.tail_valid) <= 1 + seq.num_output_tokens  # no prompt block lists
