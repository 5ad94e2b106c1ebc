"""run-batch's progress bar, which also says when the engine is compiling.

A step variant (token bucket x sampling mode x attention plan) is compiled the first time a
step needs it: seconds each on a CPU, and a cold job meets several in its first steps. Without
a word the bar would sit at 0/N for that long, so the bar's label says "compiling step variant
k" while it happens (the engine's StepExecutables tells `on_compile`); --warmup compiles every
variant first (minipic_jax/warmup.py).
"""

from __future__ import annotations

RUNNING = "Running batch"


def _steps(llm):
    # the engine's compiled-step table (serving/step/step_executables.StepExecutables)
    return llm.llm_engine.runner._step


class Progress:
    """The job's bar (None when disabled) and the engine's compile notices."""

    desc = RUNNING  # the bar's label (LLM.generate: "Processed prompts")

    def __init__(self, llm, total: int, enabled: bool, desc: str = RUNNING, unit: str = "req"):
        self.steps = _steps(llm)
        self.bar = None
        self.desc = desc
        self.compiled = 0  # variants compiled while this bar ran
        if enabled:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)
            self.steps.on_compile = self._on_compile

    def _on_compile(self, done: int, total: int) -> None:
        if done >= total:
            self.compiled += total
            label = self.desc
        else:
            first, last = self.compiled + done + 1, self.compiled + total
            label = (f"{self.desc} (compiling step variant {first}"
                     f"{f'-{last}' if last > first else ''}: a new step shape, compiled once)")
        self.bar.set_description_str(label, refresh=True)

    def update(self, n: int, postfix: str | None = None) -> None:
        if self.bar is not None and n:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix_str(postfix)

    def close(self) -> None:
        if self.bar is not None:  # a disabled bar leaves the engine's notices alone
            self.steps.on_compile = None
            self.bar.close()

