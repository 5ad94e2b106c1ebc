"""Host side of a step's sampled tokens, one row at a time: the token (or an async placeholder's
value) and its logprobs appended to the sequence, then the stop checks. Plain Python over the
step's read-back arrays; the engine owns the loop, finishing and the discarded async rows."""

from __future__ import annotations

from serving.outputs import Logprob
from serving.stop_strings import find_stop_string


def step_num_logprobs(batch, max_logprobs: int) -> int:
    """How many top logprobs the step computes: the largest any sampling row asks for, rounded
    up to a power of two (a few compiled variants), at most `max_logprobs`."""
    num_lp = 0
    for e in batch:
        if e.sample and e.seq.sampling_params.logprobs is not None:
            num_lp = max(num_lp, e.seq.sampling_params.logprobs)
    if num_lp:
        num_lp = min(1 << (num_lp - 1).bit_length() if num_lp > 1 else 1, max_logprobs)
    return num_lp


def append_row(seq, out, i: int, tok: int, logprob: float, *, pending: bool, now: float) -> None:
    """Row i's token into `seq`: logprobs (when asked), cumulative logprob, the token appended
    (sync) or filling the placeholder (`pending`), and the first-token time."""
    sp = seq.sampling_params
    if sp.logprobs is not None:
        # rank only for logprobs >= 1 (the step computes ranks when any row asks for top
        # logprobs; with logprobs=0 it would depend on the batch's other rows)
        d = {tok: Logprob(logprob, int(out["rank"][i]) if sp.logprobs else None)}
        if sp.logprobs:
            for r in range(sp.logprobs):
                tid = int(out["top_ids"][i, r])
                if tid not in d:
                    d[tid] = Logprob(float(out["top_logprobs"][i, r]), r + 1)
        seq.output_logprobs.append(d)
    seq.cum_logprob += logprob
    if pending:
        seq.resolve_placeholder(tok)
    else:
        seq.append_token(tok)
    if seq.first_token_time is None:
        seq.first_token_time = now


def finish_reason(seq, tok: int, eos_ids, max_model_len: int, tokenizer) -> str | None:
    """Why `seq` stops after `tok` ("stop", "length") or None: stop ids / EOS / length first,
    then stop strings (armed once min_tokens are out)."""
    sp = seq.sampling_params
    reason = seq.stop_check(tok, eos_ids, max_model_len)
    if sp.stop and reason != "stop" and find_stop_string(
            seq, tokenizer, armed=seq.num_output_tokens >= sp.min_tokens):
        reason = "stop"
    return reason
