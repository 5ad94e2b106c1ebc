"""RequestOutput (serving.outputs, vLLM-shaped) from an engine Sequence."""

from __future__ import annotations

from serving.outputs import CompletionOutput, RequestMetrics, RequestOutput
from serving.sequence import Sequence


def request_output(seq: Sequence, tokenizer) -> RequestOutput:
    """The vLLM-shaped RequestOutput of a finished (or running) sequence; text and logprob
    tokens decoded with `tokenizer` when there is one. A finished sequence hands its token list
    over as the output's prompt ids (Sequence.hand_over_prompt_ids): made once per sequence."""
    sp = seq.sampling_params
    ids = seq.output_token_ids
    text = tokenizer.decode(ids) if tokenizer is not None else ""
    if seq.text_end is not None:  # a stop string ended the request
        text = text[:seq.text_end]
    lps = None
    if sp.logprobs is not None:
        lps = seq.output_logprobs
        if tokenizer is not None:
            for d in lps:
                for tid, lp in d.items():
                    lp.decoded_token = tokenizer.decode([tid])
    comp = CompletionOutput(0, text, list(ids), seq.cum_logprob, lps,
                            seq.finish_reason, seq.stop_reason)
    metrics = RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time,
                             seq.finished_time, seq.num_preemptions)
    # a finished sequence's own list is the prompt's (uncopied: its output ids are read above)
    prompt = seq.hand_over_prompt_ids() if seq.is_finished else seq.prompt_token_ids
    return RequestOutput(seq.request_id, seq.prompt_text, prompt, [comp], seq.is_finished,
                         seq.num_cached_tokens, metrics)
