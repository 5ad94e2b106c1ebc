"""Data parallelism on Ray Data: `LLM` replicas as an actor pool over a dataset of prompts.

Needs the optional extra: `pip install -e ".[ray]"`. The recipe (vLLM's for offline batch jobs),
with span-aware routing (prompts: token ids with markers and pads placed, e.g. `build_prompt`;
markers: the engine's `llm_engine.markers`, `serving.config.default_marker_ids` for a vocabulary):

    import ray
    from minipic_jax.distributed import routing
    from minipic_jax.distributed.ray_data import generate_dataset, prompts_dataset
    ray.init()
    spans = [routing.span_keys(p, block_size=16, markers=markers) for p in prompts]
    routes = routing.route_by_spans(spans, 4, loads=[len(p) for p in prompts])
    ds = prompts_dataset(prompts, replicas=routes, order=routing.affinity_order(spans, routes))
    out = generate_dataset(ds, model="llama3_8b", num_replicas=4, num_gpus=1,
                           llm_kwargs={"block_size": 16}, sampling={"max_tokens": 32})
    rows = sorted(out.take_all(), key=lambda r: r["id"])

Every actor builds one `LLM` once (Ray Data's callable-class actor pool, `concurrency` actors)
and runs `LLM.generate` on each batch it is handed. Without routes the prompts are plain rows that
`map_batches` cuts into `batch_size` batches for whichever actor is free. With routes (a replica
per prompt), each replica's prompts form one block, in the given order, and `map_batches` takes
whole blocks as batches: a block is one `generate` call on one actor, so the prompts the router
put together share that actor's prefix cache (no shuffle: groupby/map_groups would hash-shuffle
the rows, and its aggregators compete with the replicas for CPUs). Compute routes with
`minipic_jax.distributed.routing` (`route_by_spans` over `span_keys`, then `affinity_order`)
on the driver: plain ints, no model. Prompts are token ids with markers and pads placed
(`LLM.to_token_ids` / `build_prompt`). Each actor asks for `num_cpus` / `num_gpus` (one GPU
per replica on a GPU cluster).
"""

from __future__ import annotations

from typing import Any

import numpy as np


class LLMReplica:
    """Ray Data callable class: one `LLM` per actor; a batch of prompts in, its outputs out."""

    def __init__(self, model: str, llm_kwargs: dict | None = None, sampling: dict | None = None):
        from minipic_jax import LLM, SamplingParams
        self.llm = LLM(model, **(llm_kwargs or {}))
        self.sampling = SamplingParams(**(sampling or {}))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        prompts = [[int(t) for t in p] for p in batch["prompt_token_ids"]]
        outs = self.llm.generate(prompts, self.sampling, use_tqdm=False)
        tokens = np.empty(len(outs), dtype=object)
        tokens[:] = [np.asarray(o.outputs[0].token_ids, np.int64) for o in outs]
        return {
            "id": np.asarray(batch["id"]),
            "generated_token_ids": tokens,
            "cumulative_logprob": np.asarray([o.outputs[0].cumulative_logprob for o in outs],
                                             np.float64),
            "num_prompt_tokens": np.asarray([len(p) for p in prompts], np.int64),
            "num_cached_tokens": np.asarray([o.num_cached_tokens for o in outs], np.int64),
        }


def prompts_dataset(prompt_token_ids, *, replicas=None, order=None):
    """A Ray Dataset with columns id (the prompt's index) and prompt_token_ids.

    Args:
      replicas: optional replica per prompt: then one block per replica (plus a replica column).
      order: optional processing order (a permutation, e.g. `routing.affinity_order`); the
        rows of each block follow it.
    """
    import pyarrow as pa
    import ray.data
    n = len(prompt_token_ids)
    order = np.arange(n) if order is None else np.asarray(order)
    if sorted(order.tolist()) != list(range(n)):
        raise ValueError(f"order must be a permutation of range({n})")
    if replicas is None:
        return ray.data.from_items([{"id": int(i), "prompt_token_ids": list(prompt_token_ids[i])}
                                    for i in order])
    replicas = np.asarray(replicas)
    if replicas.shape != (n,):
        raise ValueError(f"{replicas.size} replica routes for {n} prompts")
    tables = []
    for r in np.unique(replicas):
        rows = [int(i) for i in order if replicas[i] == r]
        tables.append(pa.table({
            "id": pa.array(rows, pa.int64()),
            "prompt_token_ids": pa.array([[int(t) for t in prompt_token_ids[i]] for i in rows],
                                         pa.list_(pa.int64())),
            "replica": pa.array([int(r)] * len(rows), pa.int64())}))
    return ray.data.from_arrow(tables)


def generate_dataset(ds, *, model: str, num_replicas: int, llm_kwargs: dict | None = None,
                     sampling: dict | None = None, batch_size: int | None = 64,
                     num_cpus: float = 1, num_gpus: float = 0, **ray_remote_args: Any):
    """Lazily map `ds` (see `prompts_dataset`) through `num_replicas` LLM actors.

    Args:
      model, llm_kwargs: each actor's `LLM(model, **llm_kwargs)`.
      sampling: `SamplingParams` keywords, the same for every prompt.
      batch_size: prompts per `generate` call without routes (routed: one call per replica
        block).
    Returns:
      a Dataset with id, generated_token_ids, cumulative_logprob, num_prompt_tokens and
      num_cached_tokens per prompt (in no particular order: sort by id).
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    kw = dict(fn_constructor_kwargs={"model": model, "llm_kwargs": llm_kwargs,
                                     "sampling": sampling},
              concurrency=num_replicas, num_cpus=num_cpus, batch_format="numpy",
              **ray_remote_args)
    if num_gpus:
        kw["num_gpus"] = num_gpus
    routed = "replica" in ds.columns()
    return ds.map_batches(LLMReplica, batch_size=None if routed else batch_size, **kw)
