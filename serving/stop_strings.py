"""Stop strings (`SamplingParams.stop`): after each sampled token the output text is decoded and
searched for a stop string that ends in the text this token added (an earlier occurrence, held
back by min_tokens, does not count later). The last character of the previous text counts as
new when it was a replacement character: a multi-byte character may have completed since."""

from __future__ import annotations


def find_stop_string(seq, tokenizer, armed: bool = True) -> bool:
    """Whether this token completed one of the request's stop strings (only while `armed`:
    min_tokens reached). On a hit, sets `seq.stop_reason` to the string and `seq.text_end` to
    where the reported text ends (before the stop string, or after it with
    include_stop_str_in_output)."""
    sp = seq.sampling_params
    text = tokenizer.decode(seq.output_token_ids)
    prev = seq.stop_text
    seq.stop_text = text
    if not armed:
        return False
    old = len(prev) - (prev.endswith("\ufffd"))  # text[:old] was there before this token
    best = None
    for s in sp.stop:
        k = text.find(s, max(0, old - len(s) + 1))
        if k >= 0 and (best is None or k < best[0]):
            best = (k, s)
    if best is None:
        return False
    k, s = best
    seq.stop_reason = s
    seq.text_end = k + len(s) if sp.include_stop_str_in_output else k
    return True
