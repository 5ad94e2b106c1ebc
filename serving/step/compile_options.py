"""XLA compiler options of the engine's step programs (Config.compilation, issue 28).

XLA's GPU runtime launches each kernel of a step from the calling thread, so a step of many
kernels (a cached-span step runs hundreds) takes milliseconds to return before the device has
done anything (benchmarks/RESULTS.md, "RAG headline": the step call). A command buffer (a CUDA graph) records runs of kernels once and
launches each run as one graph. `step_command_buffer` asks for them per compiled step, through
`Lowered.compile(compiler_options=...)`, so only the engine's steps get them (process-wide
XLA_FLAGS would change every program, and every key of JAX's compilation cache).

Settings (serving/config_groups.py COMMAND_BUFFER_SETTINGS, or a comma list of its
COMMAND_BUFFER_TYPES, XLA's command-buffer types; checked there):
  * None: the platform default below (`DEFAULT_SETTING`: "xla", measured best on the cached-span
    step: XLA's default returned from the call in 1.30 ms against 1.52 for "on" and 5.25 for
    "off", device time equal within 0.2 ms; benchmarks/RESULTS.md, "RAG headline", H100 row);
  * "xla": pass nothing (XLA's own default set and minimum graph size);
  * "off": no command buffers (`xla_gpu_enable_command_buffer=""`), every kernel launched alone;
  * "on": `ON_TYPES` with graphs of any size (`xla_gpu_graph_min_graph_size=1`), what the
    process-wide XLA_FLAGS run of benchmarks/RESULTS.md used;
  * "FUSION,CUBLAS,...": exactly those types (names of `COMMAND_BUFFER_TYPES`), any graph size.
Off a GPU nothing is passed (XLA:CPU accepts these names but ignores them; passing them would
only change the CPU programs' cache keys).
"""

from __future__ import annotations

from serving.config_groups import COMMAND_BUFFER_SETTINGS, COMMAND_BUFFER_TYPES  # noqa: F401

ON_TYPES = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN")
# what None means per platform ("on" measured no better than "xla", issue 28)
DEFAULT_SETTING = {"gpu": "xla"}
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def resolve(setting: str | None, platform: str) -> str | None:
    """The setting in force on `platform` (None: nothing to pass there)."""
    kind = "gpu" if platform in GPU_PLATFORMS else platform
    if kind != "gpu":
        return None
    return DEFAULT_SETTING.get(kind) if setting is None else setting


def step_compiler_options(setting: str | None, platform: str) -> dict:
    """`Lowered.compile`'s compiler_options for Config.compilation.command_buffer `setting` on
    `platform` (jax.default_backend()); {} where nothing is passed (see the module doc)."""
    setting = resolve(setting, platform)
    if setting in (None, "xla"):
        return {}
    if setting == "off":
        return {"xla_gpu_enable_command_buffer": ""}
    types = ON_TYPES if setting == "on" else [n.strip() for n in setting.split(",")]
    return {"xla_gpu_enable_command_buffer": ",".join(types),
            "xla_gpu_graph_min_graph_size": 1}


def for_config(config) -> dict:
    """The step compiler options of an engine Config on this process's default backend."""
    import jax
    return step_compiler_options(config.compilation.command_buffer, jax.default_backend())
