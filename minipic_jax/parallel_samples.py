"""`SamplingParams.n > 1`: one prompt sampled n times, run as n engine requests over the same
token ids (the prefix cache shares the prompt's full blocks: the first sample computes them, the
others wait for them), completions merged into one RequestOutput as vLLM returns them."""

from __future__ import annotations

import dataclasses

from serving.outputs import RequestOutput
from minipic_jax.sampling_params import SamplingParams


def fan_out(sp: SamplingParams) -> list[SamplingParams]:
    """The n single-sample params of `sp` (sample k seeded `seed + k` when `seed` is set)."""
    if sp.n == 1:
        return [sp]
    return [dataclasses.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + k)
            for k in range(sp.n)]


def merge_samples(request_id: str, outs: list[RequestOutput]) -> RequestOutput:
    """The samples' outputs as one RequestOutput: completion k has index k; prompt, cached
    tokens and metrics are the first sample's."""
    first = outs[0]
    comps = []
    for k, o in enumerate(outs):
        comps.append(dataclasses.replace(o.outputs[0], index=k))
    return dataclasses.replace(first, request_id=request_id, outputs=comps,
                               finished=all(o.finished for o in outs))
