"""The engine Config's option groups, and the two things read off their field metadata.

`Config` (serving/config.py) keeps the engine's core options flat, as vLLM does, and holds each
subsystem's options as one group: `config.kv_store` (the persistent span store),
`config.hybrid_cache` (recurrent checkpoints of hybrid models), `config.span_maps` (their SSEP
span maps), `config.gdn` (their gated delta kernel), `config.compilation` (the step's compiler). Groups are frozen, so a copy of a Config (dataclasses.replace) never shares anything
mutable with the caller's.

Field metadata says, per field:
  * "flat": the vLLM-style keyword that sets it (`kv_store_dir` for kv_store.dir), so
    `Config.from_flat(kv_store_dir=...)` and `LLM(model, kv_store_dir=...)` keep working;
  * "host_only": True when the compiled step never reads it (the scheduler, hashing, pool sizing
    and the host tiers do): `step_key_fields` leaves it out of the key of stored step
    executables, so e.g. fcfs and barrier share programs. A field's effect on shapes (a pool's
    size) is in the argument shapes, which the key holds anyway.
"""

from __future__ import annotations

import dataclasses
import difflib

from kernels_pallas.gated_delta.api import COMPOSE_PRECISIONS
from kernels_pallas.gated_delta.api import IMPLEMENTATIONS as GATED_DELTA_IMPLEMENTATIONS

CHECKPOINT_STRATEGIES = ("none", "last", "block", "balanced", "dp")
# Config.compilation.command_buffer: these settings or a comma list of COMMAND_BUFFER_TYPES,
# the xla_gpu_enable_command_buffer values this jaxlib's XLA knows (an unknown one is an
# INVALID_ARGUMENT at compile; tests/test_step_compile_options.py compiles each on CPU).
# serving/step/compile_options.py turns a setting into compiler options.
COMMAND_BUFFER_SETTINGS = ("xla", "off", "on")
COMMAND_BUFFER_TYPES = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "COLLECTIVES",
                        "CONDITIONAL", "WHILE", "DYNAMIC_SLICE_FUSION")


# Former options that nothing ever set, now constants where they are used (a keyword naming one
# is a TypeError that says where it went)
REMOVED_OPTIONS = {"checkpoint_block_tokens": "serving/hybrid/checkpoint_plan.py BLOCK_TOKENS",
                   "checkpoint_replan_every": "serving/hybrid/checkpoint_plan.py REPLAN_EVERY",
                   "checkpoint_replan_tv": "serving/hybrid/checkpoint_plan.py REPLAN_TV",
                   "span_map_dtype": "serving/hybrid/span_maps.py STATE_DTYPE"}


def option(default=dataclasses.MISSING, *, flat: str | None = None, host_only: bool = False,
           default_factory=dataclasses.MISSING):
    """A dataclass field with the metadata above (`flat` keyword, `host_only`)."""
    meta = {"host_only": host_only}
    if flat is not None:
        meta["flat"] = flat
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVStoreConfig:
    """Persistent span store (serving/tiers/disk_store.py): a folder under the host tier where
    cached blocks are written once and read back by any later process of the same model and
    settings. Every field is host-only."""

    # the folder; None = off
    dir: str | None = option(None, flat="kv_store_dir", host_only=True)
    # its size (every file in the folder), least recently used runs deleted past it
    gb: float = option(64.0, flat="kv_store_gb", host_only=True)
    # store SSEP span blocks only (not the prompt parts around them, e.g. one-off questions)
    spans_only: bool = option(False, flat="kv_store_spans_only", host_only=True)
    # device memory for runs read ahead of their copy-in (staged runs and reads in flight,
    # serving/tiers/kv_store_staging.py); None = min(16 GiB, 16% of the device's memory limit),
    # 4 GiB without memory stats (CPU). A default-sized KV pool (num_kv_blocks=None) leaves it
    # free. More staging lets a warm job overlap more reads (benchmarks/RESULTS.md, "Span store
    # and run-batch").
    staging_gb: float | None = option(None, flat="kv_store_staging_gb", host_only=True)
    # read runs into pinned host buffers (serving/tiers/kv_store_buffers.py; was the
    # MINIPIC_KV_STORE_PINNED=1 environment variable). Off by default: alone on the H200 pinned
    # reads were faster than plain ones, but inside an engine process the H200 refused the
    # allocations (benchmarks/history/span_store.md). True where the backend has no pinned
    # memory: plain buffers.
    pinned: bool = option(False, flat="kv_store_pinned", host_only=True)

    def __post_init__(self):
        if not self.gb > 0:
            raise ValueError(f"kv_store_gb (Config.kv_store.gb) must be > 0, got {self.gb}")
        if self.staging_gb is not None and not self.staging_gb > 0:
            raise ValueError(f"kv_store_staging_gb (Config.kv_store.staging_gb) must be None or "
                             f"> 0, got {self.staging_gb}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridCacheConfig:
    """Hybrid models' prefix caching with recurrent checkpoints (serving/hybrid/hybrid_prefix.py).
    Every field is host-only (the checkpoint pool's size reaches the step as its shape)."""

    # where a prefill takes checkpoints ("none", "last", "block", "balanced", "dp":
    # serving/hybrid/checkpoint_plan.py)
    strategy: str = option("dp", flat="checkpoint_strategy", host_only=True)
    # what a second checkpoint in one prefill chunk costs (the chunk is split: about one more
    # engine step), in prompt tokens of compute; dp places a prompt's checkpoints beyond one per
    # chunk only where they save more (the default is about what the H200 measured at the
    # Qwen3.5-0.8B shape: benchmarks/RESULTS.md, "Hybrid prefix caching"). 0: no price. It is also the least
    # saving for which a new request waits (a few steps at most) for a checkpoint that a running
    # prefill of its prefix is about to store, rather than recompute behind it.
    step_tokens: float = option(1024.0, flat="checkpoint_step_tokens", host_only=True)
    # at most this many checkpoints per prompt (None: min(4, device slots / (2 max_num_seqs)), at
    # least 1, so the tier holds twice as many prompts as run)
    per_prompt: int | None = option(None, flat="checkpoints_per_prompt", host_only=True)
    # device tier bytes (None: 5% of the device's memory limit, or 64 checkpoints without memory
    # stats); half of Config.cpu_offload_gb holds the host tier
    budget_gb: float | None = option(None, flat="checkpoint_gb", host_only=True)
    # the overlap estimates (serving/hybrid/overlap_estimate.py) halve a request's weight every
    # half_life requests
    half_life: float = option(256.0, flat="checkpoint_half_life", host_only=True)
    # a plain hybrid prompt's chunk that overflows a token bucket by at most (smallest bucket -
    # seats) tokens stops at that bucket; the overflow rides on the next step
    # (serving/hybrid/bucket_fit.py). Off by default: on the H200 a prefill step costs more than a
    # decode step of the same bucket, more than the padding the cut saves (benchmarks/RESULTS.md,
    # "Hybrid prefix caching").
    bucket_fit: bool = option(False, flat="checkpoint_bucket_fit", host_only=True)
    # while the device tier has free slots, a prefill chunk that holds no planned checkpoint
    # takes one at the deepest candidate it passes, and a prefill also takes 64, 128, 256... from
    # where it resumed, so every later request sharing >= 64 tokens resumes at >= half of them
    # (serving/hybrid/hybrid_prefix.py); they ride in the chunk's step (up to
    # checkpoint_plan.CHECKPOINTS_PER_STEP per sequence: no extra step); the store evicts such
    # entries by their value once it is full, and a full store takes the DP's placement alone.
    # On by default: host only (the step program and the [Lg, S, M] checkpoint states are the same
    # either way), no extra step on CPU; off tests the DP's placement alone (the budgeted case)
    free_room: bool = option(True, flat="checkpoint_free_room", host_only=True)

    def __post_init__(self):
        if self.strategy not in CHECKPOINT_STRATEGIES:
            raise ValueError(f"checkpoint_strategy (Config.hybrid_cache.strategy) must be one of "
                             f"{CHECKPOINT_STRATEGIES}, got {self.strategy!r}")
        if self.per_prompt is not None and self.per_prompt < 0:
            raise ValueError(f"checkpoints_per_prompt (Config.hybrid_cache.per_prompt) must be "
                             f"None or >= 0, got {self.per_prompt}")
        if not self.half_life > 0:
            raise ValueError(f"checkpoint_half_life (Config.hybrid_cache.half_life) must be > 0, "
                             f"got {self.half_life}")
        if not self.step_tokens >= 0:
            raise ValueError(f"checkpoint_step_tokens (Config.hybrid_cache.step_tokens) must be "
                             f">= 0, got {self.step_tokens}")
        if self.budget_gb is not None and not self.budget_gb >= 0:
            raise ValueError(f"checkpoint_gb (Config.hybrid_cache.budget_gb) must be None or "
                             f">= 0, got {self.budget_gb}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpanMapConfig:
    """Hybrid models' cached SSEP span maps (serving/hybrid/span_cache.py; one map: A and B of
    every recurrent layer, plus a conv tail). Host-only (the pool's size is its shape) but for
    the composition's precision."""

    # device bytes of cached maps (None: 2% of the device's memory limit, or 64 maps without
    # memory stats; 0: spans always recomputed)
    budget_gb: float | None = option(None, flat="span_map_gb", host_only=True)
    # host bytes where evicted maps wait (0: none)
    host_gb: float = option(0.0, flat="span_map_host_gb", host_only=True)
    # the dots that apply cached maps to a request's state (serving/hybrid/chain_compose.py): on
    # a GPU a tensor-core emulation of float32 on the chain kernel, "bf16_x6" (the default: six
    # bf16 products; in the engine on an H100, 30 Qwen3.5-0.8B maps: 1.31 ms at one stage, rel.
    # 9.9e-7 from IEEE float32), "tf32_x3" (1.51 ms, 1.8e-6) or "bf16_x3" (1.07 ms, 1.4e-4),
    # each within its bar of tests/test_span_maps.py PRECISION_BARS, or "highest" (IEEE
    # float32, on the XLA loop: 2.92 ms); off a GPU every name is plain float32
    # (kernels_pallas/gated_delta/affine.py compose_precision). Read by the compose program, so
    # it keys stored executables.
    compose_precision: str = option("bf16_x6", flat="span_map_compose_precision")
    # which computed spans have their map captured (serving/hybrid/span_capture.py): "auto"
    # (those another request holds, and the rest while spans mostly recur), "shared" (only
    # those another request holds) or "always"; outputs are the same either way
    capture: str = option("auto", flat="span_map_capture", host_only=True)

    def __post_init__(self):
        check_capture(self.capture)
        if self.compose_precision not in COMPOSE_PRECISIONS:
            raise ValueError(f"span_map_compose_precision (Config.span_maps.compose_precision) "
                             f"must be one of {tuple(COMPOSE_PRECISIONS)}, "
                             f"got {self.compose_precision!r}")
        if self.budget_gb is not None and not self.budget_gb >= 0 or not self.host_gb >= 0:
            raise ValueError(f"span_map_gb (Config.span_maps.budget_gb) must be None or >= 0 and "
                             f"span_map_host_gb (Config.span_maps.host_gb) >= 0, "
                             f"got {self.budget_gb} and {self.host_gb}")


SPAN_CAPTURE_POLICIES = ("always", "shared", "auto")  # serving/hybrid/span_capture.py


def check_capture(policy: str) -> None:
    """A ValueError naming Config.span_maps.capture for a policy it does not know."""
    if policy not in SPAN_CAPTURE_POLICIES:
        raise ValueError(f"span_map_capture (Config.span_maps.capture) must be one of "
                         f"{SPAN_CAPTURE_POLICIES}, got {policy!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedDeltaConfig:
    """Hybrid models' Gated DeltaNet layers: which prefill kernel the step runs (the engine
    resolves it once at start, serving/step/model_runner.py gdn_choice). Read by the step, so it
    keys stored executables."""

    # the prefill kernel (kernels_pallas.gated_delta.api.IMPLEMENTATIONS): "auto" lets the
    # registry's policy pick (on a GPU the Triton kernels, "pallas_fused"; elsewhere "xla"); the
    # Mosaic GPU ones ("mosaic", "mosaic_intra": bf16 / f16, Dk and Dv 64 or 128) are opt-in
    # until timed (docs/DESIGN.md, "Gated DeltaNet on Mosaic GPU"). Decode-only steps run the
    # one-step recurrence whatever the name.
    impl: str = option("auto", flat="gdn_impl")

    def __post_init__(self):
        if self.impl not in GATED_DELTA_IMPLEMENTATIONS:
            raise ValueError(f"gdn_impl (Config.gdn.impl) must be one of "
                             f"{GATED_DELTA_IMPLEMENTATIONS}, got {self.impl!r}")


XLA_MEMORY_LIMITS = ("xla", "exact")


def check_command_buffer(setting: str | None, where: str) -> None:
    """ValueError naming `where` (the option) unless `setting` is None, one of
    COMMAND_BUFFER_SETTINGS or a comma list of COMMAND_BUFFER_TYPES."""
    if setting is None or setting in COMMAND_BUFFER_SETTINGS:
        return
    if isinstance(setting, str):
        names = [n.strip() for n in setting.split(",")]
        bad = [n for n in names if n not in COMMAND_BUFFER_TYPES]
        if not bad:
            return
        why = f"unknown command-buffer type(s) {bad}"
    else:
        why = f"not a string: {setting!r}"
    raise ValueError(f"{where} must be None, one of {COMMAND_BUFFER_SETTINGS} or a comma list "
                     f"of {COMMAND_BUFFER_TYPES}; {why}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompilationConfig:
    """How the engine's step programs are compiled (vLLM's `compilation_config`; flat keywords
    here). Read by the compiler, so every field keys stored executables."""

    # XLA command buffers (CUDA graphs) per step executable on a GPU (issue 28: each kernel
    # launched alone cost a cached-span step ~3.3 ms of host time): None = the platform default,
    # "xla" = XLA's own, "off", "on", or a comma list of XLA command-buffer types
    # (serving/step/compile_options.py). Off a GPU nothing is passed.
    command_buffer: str | None = option(None, flat="step_command_buffer")
    # the memory limit XLA holds each step program to on a GPU (issue 28: XLA rematerialised
    # steps that fit, counting the weights twice; serving/cache/xla_limit.py): "xla" = its own
    # rule; "exact" = temporaries within 95% of what the program's buffers leave, set per engine
    # from its traced top-bucket steps, explicit pools too (kv_pool.size_pool); where nothing is
    # traced (no device memory limit: CPU; tensor parallelism) XLA's rule. The hybrid span
    # composition program keeps XLA's rule (small: its maps and states only). Default "exact"
    # since its H100 check (benchmarks/RESULTS.md, Engine: no remat at 40,960 or 33,792)
    xla_memory_limit: str = option("exact", flat="xla_memory_limit")

    def __post_init__(self):
        check_command_buffer(self.command_buffer,
                             "step_command_buffer (Config.compilation.command_buffer)")
        if self.xla_memory_limit not in XLA_MEMORY_LIMITS:
            raise ValueError(f"xla_memory_limit (Config.compilation.xla_memory_limit) must be "
                             f"one of {XLA_MEMORY_LIMITS}, got {self.xla_memory_limit!r}")


def _groups(cls) -> dict[str, type]:
    """{field name: group class} of a Config class's group fields."""
    return {f.name: f.default_factory for f in dataclasses.fields(cls)
            if dataclasses.is_dataclass(f.default_factory)}


def flat_names(cls) -> dict[str, tuple[str, str]]:
    """{flat keyword: (group field, field in the group)} of a Config class."""
    return {f.metadata["flat"]: (group, f.name) for group, gcls in _groups(cls).items()
            for f in dataclasses.fields(gcls) if "flat" in f.metadata}


def grouped_kwargs(cls, kw: dict) -> dict:
    """`kw` (core fields, group objects and flat keywords, mixed) as `cls`'s own keywords: flat
    keywords are gathered into their groups (over a group object given too). An unknown keyword
    is a TypeError naming it and the closest known name."""
    own = {f.name for f in dataclasses.fields(cls)}
    flat = flat_names(cls)
    out, per_group = {}, {}
    for key, value in kw.items():
        if key in own:
            out[key] = value
        elif key in flat:
            group, name = flat[key]
            per_group.setdefault(group, {})[name] = value
        elif key in REMOVED_OPTIONS:
            raise TypeError(f"{cls.__name__}: {key!r} is no longer an option (a constant: "
                            f"{REMOVED_OPTIONS[key]})")
        else:
            close = difflib.get_close_matches(key, sorted(own | set(flat)), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{cls.__name__}: unknown option {key!r}{hint}")
    groups = _groups(cls)
    for group, values in per_group.items():
        base = out.get(group)
        out[group] = groups[group](**values) if base is None else \
            dataclasses.replace(base, **values)
    return out


def to_flat(config) -> dict:
    """The Config's options as flat keywords (core fields and each group field's flat name):
    `Config.from_flat(**to_flat(c)) == c`."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update({g.metadata["flat"]: getattr(value, g.name)
                        for g in dataclasses.fields(value)})
        else:
            out[f.name] = value
    return out


def step_key_fields(config, prefix: str = "") -> dict:
    """{dotted field name: value} of every field not marked host_only, groups included: the
    options that can reach the compiled step (ModelRunner._program_context keys stored
    executables by them)."""
    out = {}
    for f in dataclasses.fields(config):
        if f.metadata.get("host_only"):
            continue
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update(step_key_fields(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out
