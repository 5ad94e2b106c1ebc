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
    dispatch: float = 0.0  # inside the jitted call (argument handling, launch)
    schedule: float = 0.0  # host: scheduler, hashing, block manager
    build: float = 0.0  # host: metadata packing
    post: float = 0.0  # host: sampled tokens, finishing
    overlap: float = 0.0  # host work done while the device computes (frontiers): not in post

    def record_step(self, batch, *, total: float, device_wait: float, dispatch: float = 0.0,
                    schedule: float = 0.0, build: float = 0.0, post: float = 0.0,
                    overlap: float = 0.0) -> None:
        self.steps += 1
        self.step_time += total
        self.device_wait += device_wait
        self.dispatch += dispatch
        self.schedule += schedule
        self.build += build
        self.post += post
        self.overlap += overlap
        self.query_tokens += sum(e.token_idx.size for e in batch)

    def record_finish(self, seq) -> None:
        self.finished += 1
        self.prompt_tokens += seq.num_prompt_tokens
        self.cached_prompt_tokens += seq.num_cached_tokens
        self.generated_tokens += seq.num_output_tokens

    def summary(self, engine) -> dict:
        """The engine's stats (LLMEngine.get_stats). With async scheduling the host works while
        the device computes: host_time_share (1 - wait / wall) is then the host's busy share,
        not device idle time; host_work_share stays host work / step time."""
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
            **engine.cache.stats(),  # blocks, lower tiers (kv_store), checkpoints and span maps
            "preemptions": engine.scheduler.num_preemptions,
            "step_time_s": self.step_time,
            "host_time_share": host / self.step_time if self.step_time else 0.0,
            "host_work_share": ((self.schedule + self.build + self.post) / self.step_time
                                if self.step_time else 0.0),
            "host_ms_per_step": {k: 1e3 * getattr(self, k) / max(self.steps, 1)
                                 for k in ("schedule", "build", "dispatch", "post", "overlap")},
            "num_compiles": engine.runner.num_compiles,
            "async_scheduling": engine.config.async_scheduling,
            "sync_fallbacks": engine.num_sync_fallbacks,
            "discarded_rows": engine.num_discarded_rows,
        }

    def record_read_back(self, total: float, device_wait: float) -> None:
        """An async engine step that only read back the step in flight: its time counts, it
        is no device step."""
        self.step_time += total
        self.device_wait += device_wait
        self.post += total - device_wait
