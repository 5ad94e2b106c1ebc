"""minipic-jax: a JAX/Pallas LLM inference engine with position-independent caching.

    from minipic_jax import LLM, SamplingParams, Prompt, Span
"""

from minipic_jax.llm import LLM
from serving.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from minipic_jax.prompts import Prompt, Span, build_prompt
from minipic_jax.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestMetrics", "Prompt", "Span", "build_prompt"]
