"""`LLM`: the vLLM-shaped batch API over the paged engine."""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp

from minipic_jax.loading import load_model
from minipic_jax.prompts import build_prompt, is_structured
from minipic_jax.sampling_params import SamplingParams
from serving.config import Config
from serving.llm_engine import LLMEngine


def _host_device_if_sharded(tensor_parallel_size: int):
    """Under tensor parallelism the weights load into host memory; the engine then sends each
    device only its shards (no full copy of the model on one accelerator)."""
    if tensor_parallel_size <= 1:
        return contextlib.nullcontext()
    try:
        return jax.default_device(jax.devices("cpu")[0])
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS without cpu): load on the default
        return contextlib.nullcontext()


class LLM:
    """Batch generation.

    Args:
      model: an HF folder (config.json + safetensors) or a preset name (configs/presets.py).
      dtype: "float32" or "bfloat16". seed: preset weights and unseeded sampling.
      **engine_args: `serving.config.Config` options (vLLM names): max_num_seqs,
        max_num_batched_tokens, max_model_len, block_size, num_kv_blocks, enable_prefix_caching,
        kv_mode ("position_free" | "rotated" | "pic_off"), scheduling_policy ("fcfs" | "barrier" |
        "isps"), cpu_offload_gb, pad_token_id / ssep_token_id / pdep_token_id (defaults: Llama-3
        vocab -> 128004 / 128002 / 128003; any other vocab: its three highest non-BOS/EOS ids),
        hash_algo, tensor_parallel_size (split the model over that many devices:
        serving/sharding.py).
    """

    def __init__(self, model: str, *, dtype: str = "float32", seed: int = 0, **engine_args: Any):
        with _host_device_if_sharded(engine_args.get("tensor_parallel_size", 1)):
            loaded = load_model(model, dtype=dtype, seed=seed)
        if "max_model_len" not in engine_args:
            engine_args["max_model_len"] = min(loaded.cfg.max_position_embeddings, 2048)
        self.config = Config(**engine_args)
        self.llm_engine = LLMEngine(loaded, self.config, dtype=jnp.dtype(dtype), seed=seed)
        self.tokenizer = loaded.tokenizer
        self._next_id = 0

    def get_tokenizer(self):
        return self.tokenizer

    def to_token_ids(self, prompt, index: int = 0) -> tuple[list[int], str | None]:
        """A prompt (str, token ids, {"prompt_token_ids"}/{"prompt"} dict, or segments) -> ids."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"request {index}: dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {index}: text prompt but the model has no tokenizer")
            return list(self.tokenizer.encode(prompt)), prompt
        if is_structured(prompt):
            m = self.llm_engine.markers
            try:
                ids = build_prompt(prompt, block_size=self.config.block_size,
                                   tokenizer=self.tokenizer, **m)
            except ValueError as err:
                raise ValueError(f"request {index}: {err}") from None
            return ids, None
        if isinstance(prompt, (list, tuple)):
            return [t if isinstance(t, int) else int(t) for t in prompt], None
        raise ValueError(f"request {index}: unsupported prompt type {type(prompt).__name__}")

    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = True,
                 cache_salt: str | None = None):
        """Generate for every prompt; returns RequestOutputs in input order.

        Every request is validated before any work starts (a bad one raises a ValueError naming
        it, and nothing runs).
        """
        if isinstance(prompts, (str, dict)) or is_structured(prompts) or (
                isinstance(prompts, (list, tuple)) and prompts and
                all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        sps = (sampling_params if isinstance(sampling_params, (list, tuple))
               else [sampling_params] * len(prompts))
        if len(sps) != len(prompts):
            raise ValueError(f"{len(sps)} sampling params for {len(prompts)} prompts")
        engine = self.llm_engine
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            ids, text = self.to_token_ids(p, i)
            rid = str(self._next_id + i)
            layout = engine.validate(rid, ids, sp, label=f"request {i}")
            reqs.append((rid, ids, text, sp, layout))
        self._next_id += len(prompts)
        for rid, ids, text, sp, layout in reqs:
            engine._enqueue(rid, ids, sp, layout, cache_salt=cache_salt, prompt=text)
        order = {rid: i for i, (rid, *_rest) in enumerate(reqs)}
        results: list = [None] * len(reqs)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(reqs), desc="Processed prompts", dynamic_ncols=True)
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id in order:
                    results[order[out.request_id]] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return results
