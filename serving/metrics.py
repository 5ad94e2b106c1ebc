"""Engine statistics: cache hit rate, blocks, offload, preemptions, host time share, compiles."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    step_time: float = 0.0
    device_wait: float = 0.0
    query_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0

    def record_step(self, batch, *, total: float, device_wait: float) -> None:
        self.steps += 1
        self.step_time += total
        self.device_wait += device_wait
        self.query_tokens += sum(e.token_idx.size for e in batch)

    def record_finish(self, seq) -> None:
        self.finished += 1
        self.prompt_tokens += seq.num_prompt_tokens
        self.cached_prompt_tokens += seq.num_cached_tokens
        self.generated_tokens += seq.num_output_tokens

    def summary(self, engine) -> dict:
        off = engine.offload
        host = self.step_time - self.device_wait
        return {
            "steps": self.steps,
            "finished_requests": self.finished,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefix_cache_hit_rate": self.cached_prompt_tokens / max(self.prompt_tokens, 1),
            "computed_query_tokens": self.query_tokens,
            "generated_tokens": self.generated_tokens,
            "blocks_total": engine.num_blocks,
            "blocks_used": engine.bm.num_used,
            "blocks_evicted": engine.bm.num_evicted,
            "blocks_offloaded": off.num_offloaded if off else 0,
            "blocks_restored": off.num_restored if off else 0,
            "host_blocks": len(off.entries) if off else 0,
            "preemptions": engine.scheduler.num_preemptions,
            "step_time_s": self.step_time,
            "host_time_share": host / self.step_time if self.step_time else 0.0,
            "num_compiles": engine.runner.num_compiles,
        }
