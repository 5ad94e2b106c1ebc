"""Stop strings (`SamplingParams.stop`): the output text is decoded after each sampled token and
searched for the stop strings, from a little before where the previous search ended (a token may
complete a stop string begun by earlier tokens, and the last characters of a decoded text may
change when a multi-byte character completes)."""

from __future__ import annotations


def find_stop_string(seq, tokenizer) -> bool:
    """Whether the output text now holds one of the request's stop strings. On a hit, sets
    `seq.stop_reason` to the string and `seq.text_end` to where the reported text ends (before
    the stop string, or after it with include_stop_str_in_output)."""
    sp = seq.sampling_params
    text = tokenizer.decode(seq.output_token_ids)
    start = max(0, getattr(seq, "stop_scan_from", 0))
    best = None
    for s in sp.stop:
        k = text.find(s, start)
        if k >= 0 and (best is None or k < best[0]):
            best = (k, s)
    longest = max(len(s) for s in sp.stop)
    seq.stop_scan_from = max(0, len(text) - longest - 4)  # 4: a partial UTF-8 tail
    if best is None:
        return False
    k, s = best
    seq.stop_reason = s
    seq.text_end = k + len(s) if sp.include_stop_str_in_output else k
    return True
