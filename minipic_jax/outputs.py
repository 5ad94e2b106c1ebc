"""The public path of the request output types (`from minipic_jax.outputs import RequestOutput`,
as vLLM's `vllm.outputs`). The engine produces them, so they are defined in `serving/outputs.py`."""

from serving.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

__all__ = ["CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput"]
