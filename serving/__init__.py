"""serving: the engine (docs/ARCHITECTURE.md: its layers and a request's path through a step).

Records, used by every layer below (they import nothing else of serving):
  config.py          the one `Config` (vLLM option names), validated once; the shape buckets
  config_groups.py   its option groups (span store, hybrid checkpoints, span maps), flat names
  sequence.py        one request as the engine sees it: tokens, layout, blocks, progress
  layout.py          markers -> segments, pads, logical positions, attention windows
  model_contract.py  the `typing.Protocol`s a model is handed through (`EngineModel`, families)
  outputs.py         vLLM-shaped `RequestOutput`, `CompletionOutput`, `Logprob`

The engine on top (uses the sub-packages; nothing below imports it):
  llm_engine.py      `LLMEngine`: add_request / step / abort / recover; the step loop
  engine_warmup.py   its warm-up: every program compiled, then all run again last (CUDA graphs)
  scheduler.py       continuous batching: what runs this step (decodes, chunks, span jobs)
  recovery.py        an exception inside a step: abort the call's requests, keep the rest
  request_checks.py  input checks naming request, field and index, before any work
  request_output.py  a `RequestOutput` from a finished or running `Sequence`
  token_apply.py     a step's sampled tokens into their sequences; stop checks
  stop_strings.py    `SamplingParams.stop` matched on the decoded text
  metrics.py         `EngineStats`: hit rate, host share, preemptions, compiles
  step_timer.py      `StepTimer`: a step's host time by phase, adding up to its wall time

Layers (each package's docstring lists its modules): cache/ (blocks, keys, pool), tiers/
(host tier, disk span store), hybrid/ (recurrent checkpoints, span maps), step/ (the device step).
"""
