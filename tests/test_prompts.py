"""Prompt layout (positions, windows, slots) and structured prompt building, vs brute force."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from minipic_jax.prompts import Prompt, Span, build_prompt
from serving.layout import build_layout

PAD, SSEP, PDEP = 99, 98, 97


def brute(tokens, bs):
    pos, win, slot, span = [], [], [], None
    n_valid = 0
    for i, t in enumerate(tokens):
        if i % bs == 0 and t in (SSEP, PDEP):
            span = n_valid if t == SSEP else None
        if i % bs == 0:
            in_block = 0
        pos.append(n_valid)
        win.append(0 if span is None else span)
        slot.append(in_block)
        if t != PAD:
            n_valid += 1
            in_block += 1
    return pos, win, slot


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, PAD, SSEP, PDEP]), min_size=1, max_size=70),
       st.sampled_from([4, 8]))
def test_layout_matches_brute_force(tokens, bs):
    lay = build_layout(tokens, bs, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP)
    pos, win, slot = brute(tokens, bs)
    valid = np.asarray(tokens) != PAD
    assert lay.pos.tolist() == pos
    assert lay.pos_at(np.arange(len(tokens))).tolist() == pos
    assert lay.pos_at(slice(0, len(tokens))).tolist() == pos
    assert lay.win[valid].tolist() == np.asarray(win)[valid].tolist()
    assert lay.slot_off[valid].tolist() == np.asarray(slot)[valid].tolist()
    for j in range(len(lay.block_valid)):
        blk = valid[j * bs:(j + 1) * bs]
        assert lay.block_valid[j] == blk.sum()
        assert lay.block_pos_start[j] == valid[:j * bs].sum()
    assert lay.num_valid == valid.sum()
    assert lay.last_valid_index == (np.flatnonzero(valid)[-1] if valid.any() else -1)
    assert lay.last_win == win[-1]
    assert {a.dtype for a in (lay.pos, lay.win, lay.slot_off, lay.block_valid,
                              lay.block_pos_start)} == {np.dtype(np.int32)}


def test_markers_off_block_start_are_text_and_pic_off_ignores_all():
    toks = [1, SSEP, 2, 3, SSEP, 4, PAD, PAD]
    lay = build_layout(toks, 4, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP)
    assert lay.win.tolist()[:4] == [0, 0, 0, 0]  # SSEP at index 1 is plain text
    assert lay.win[4:6].tolist() == [4, 4] and lay.span_start.tolist() == [False, True]
    off = build_layout(toks, 4, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP, markers=False)
    assert off.num_valid == 8 and not off.has_markers and off.win.max() == 0


def test_build_prompt_places_markers_and_pads():
    ids = build_prompt([Prompt([1, 2, 3]), Span([4, 5]), Span([6] * 4), Prompt([7]), Prompt([8])],
                       block_size=4, pad_token_id=PAD, ssep_token_id=SSEP, pdep_token_id=PDEP)
    assert ids == [1, 2, 3, PAD, SSEP, 4, 5, PAD, SSEP, 6, 6, 6, 6, PAD, PAD, PAD, PDEP, 7, 8]
    lead = build_prompt([Span([4]), Prompt([5])], block_size=4, pad_token_id=PAD,
                        ssep_token_id=SSEP, pdep_token_id=PDEP)
    assert lead == [SSEP, 4, PAD, PAD, PDEP, 5]


class _Tok:
    bos_token_id = 0

    def encode(self, text):
        return [0] + [ord(c) for c in text]


def test_build_prompt_from_text_keeps_bos_only_first():
    ids = build_prompt([Prompt("ab"), Span("cd")], block_size=4, pad_token_id=PAD,
                       ssep_token_id=SSEP, pdep_token_id=PDEP, tokenizer=_Tok())
    assert ids == [0, 97, 98, PAD, SSEP, 99, 100]


def test_a_layout_keeps_two_token_arrays_and_gives_positions_windows_slots_by_index(fresh_rng):
    """A cached 33K-token prompt computes a few dozen tokens (issue 28): its layout holds per
    token only the ids and pads; positions (from the pads' indices), window starts and slots
    (per block) are read for the indices a step asks (`pos_at`, `win_at`, `slot_off_at`),
    equal to the whole-prompt arrays."""
    import dataclasses
    ids = [int(t) for t in fresh_rng.integers(3, 50, 90)]
    for k in fresh_rng.integers(0, 90, 12):
        ids[k] = int(fresh_rng.choice([0, 1, 2]))  # pads and markers
    lay = build_layout(ids, 4, pad_id=0, ssep_id=1, pdep_id=2)
    per_token = {f.name for f in dataclasses.fields(lay)
                 if isinstance(getattr(lay, f.name), np.ndarray)
                 and getattr(lay, f.name).shape == (len(ids),)}
    assert per_token == {"is_pad", "tokens"}  # positions too per index (`pos_at`, issue 28)
    idx = np.sort(fresh_rng.choice(len(ids), 30, replace=False))
    assert lay.pos_at(idx).tolist() == lay.pos[idx].tolist()
    assert lay.pos_at(slice(7, 40)).tolist() == lay.pos[7:40].tolist()
    assert lay.pos_at(idx).dtype == np.int32
    assert lay.win_at(idx).tolist() == lay.win[idx].tolist()
    assert lay.slot_off_at(idx).tolist() == lay.slot_off[idx].tolist()
    assert lay.win_at(slice(7, 40)).tolist() == lay.win[7:40].tolist()
    assert lay.slot_off_at(slice(7, 40)).dtype == np.int32


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([1, 2, PAD, SSEP, PDEP]), min_size=1, max_size=70),
       st.sampled_from([2, 4]))
def test_layout_block_fields_match_brute_force(tokens, bs):
    """Per block: in a span, a span's first block, a segment's first block, the window start
    (the segments' values repeated over their blocks); a last block of pads only included."""
    lay = build_layout(tokens, bs, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP)
    starts = [j for j in range(0, len(tokens), bs) if j == 0 or tokens[j] in (SSEP, PDEP)]
    _, win, _ = brute(tokens, bs)
    span = [tokens[max(s for s in starts if s <= j)] == SSEP for j in range(0, len(tokens), bs)]
    assert lay.span_block.tolist() == span
    assert lay.seg_start.tolist() == [j in starts for j in range(0, len(tokens), bs)]
    assert lay.span_start.tolist() == [j in starts and tokens[j] == SSEP
                                       for j in range(0, len(tokens), bs)]
    assert lay.block_win.tolist() == [win[j] for j in range(0, len(tokens), bs)]
    assert lay.block_win.dtype == np.int32 and lay.span_block.dtype == bool
