"""Paged attention over position-free (unrotated) or rotated keys, for a ragged batch.

Cache layout (one layer): k_pages, v_pages [P, B, K, D] (vLLM's layout: a new token's K/V is one
contiguous row, so writes are a plain row scatter; a (page, head) tile is a strided 2-D box that
TMA loads directly).

`write_kv` stores new K/V rows (never rotated in `position_free` mode); `paged_attention` reads them
back through the block table. In `position_free` mode the keys are rotated at read time by their
logical position in *this* request, so one physical page can serve many requests at different
offsets. Queries are always passed unrotated and rotated by their own logical position.

Which kernel runs is decided here, once per call, by `choose_attention` over the registry
`ATTENTION` (kernels_pallas/registry.py says how to add an implementation): a named
implementation with its typed options, or "auto", the first of `auto_order`'s list that takes
the problem. The engine asks the same question once at start (serving/step/model_runner.py).
"""

from __future__ import annotations

from kernels_pallas import registry
import functools

import jax

from kernels_pallas.paged_attention import (mosaic_decode, mosaic_mixed, triton_decode,
                                            triton_ragged, xla)
from kernels_pallas.paged_attention.metadata import AttentionMetadata
from kernels_pallas.paged_attention.mosaic_prefill import (mosaic_prefill_limits,
                                                           prefill_attention_mosaic)
from kernels_pallas.paged_attention.problem import Problem
from kernels_pallas.paged_attention.validation import (KV_MODES, check_decode_only, validate,
                                                       validate_values)
from kernels_pallas.paged_attention.write import WRITE_IMPLEMENTATIONS, write_kv  # noqa: F401
from kernels_pallas.registry import Implementation
from kernels_pallas.rope import apply_rope

__all__ = ["KV_MODES", "IMPLEMENTATIONS", "Problem", "choose_attention", "paged_attention",
           "step_options", "write_kv", "write_kv_and_attend"]


def _mosaic_prefill_limits(problem: Problem, options) -> str:
    del options
    q, k_pages = problem.stand_ins()
    return mosaic_prefill_limits(q, k_pages)


ATTENTION: dict[str, Implementation] = {
    "xla": xla.IMPLEMENTATION,
    "triton": triton_ragged.IMPLEMENTATION,
    "triton_decode": triton_decode.IMPLEMENTATION,
    "mosaic_decode": mosaic_decode.IMPLEMENTATION,
    "mosaic_prefill": Implementation("mosaic_prefill", prefill_attention_mosaic,
                                     limits=_mosaic_prefill_limits, backend="mosaic"),
}


def _mixed_run(q_rot, k_pages, v_pages, metadata, inv_freq, *, rotate_keys, attention_scaling,
               sm_scale, interpret, prefill_seqs, splits, max_position, overflow, prefill_fits,
               decode_rows, direct_v=False, skip_idle=False, paged_k=False):
    """implementation="mixed" (mosaic_mixed.py): its decode rows and overflow steps run the
    registry's choices for those problems."""
    kv_mode = "position_free" if rotate_keys else "rotated"
    common = dict(rotate_keys=rotate_keys, attention_scaling=attention_scaling,
                  sm_scale=sm_scale, interpret=interpret)

    def part(name: str, decode_only: bool):
        def run(x, md):
            problem = Problem.of(x, k_pages, md, inv_freq, kv_mode=kv_mode,
                                 decode_only=decode_only, max_position=max_position,
                                 interpret=interpret)
            impl, options = choose_attention(problem, name)
            return impl.run(x, k_pages, v_pages, md, inv_freq, **common, **impl.kwargs(options))
        return run

    return mosaic_mixed.mixed_attention(
        q_rot, k_pages, v_pages, metadata, inv_freq, decode=part("auto", True),
        overflow=part(overflow, False), prefill_seqs=prefill_seqs, splits=splits,
        prefill_fits=prefill_fits, decode_rows=decode_rows, direct_v=direct_v,
        skip_idle=skip_idle, paged_k=paged_k, max_position=max_position if paged_k else None,
        **common)


ATTENTION["mixed"] = Implementation("mixed", _mixed_run, mosaic_mixed.MixedOptions,
                                    defaults=mosaic_mixed.mixed_defaults,
                                    limits=mosaic_mixed.mixed_limits, backend="mosaic")
IMPLEMENTATIONS = ("auto",) + tuple(ATTENTION)


def step_options(name: str, options, *, tokens: int, seqs: int, prefill_count: int,
                 decode_count: int | None = None):
    """The options of implementation `name` for one step whose shape the caller knows on the host
    before launch: `tokens` query rows, `seqs` sequence rows, `prefill_count` sequences with two
    or more query rows, `decode_count` (None: unknown) with one. For "mixed" this fixes which of
    its paths runs (mosaic_mixed.plan_step), so the compiled step holds no per-layer conditional
    and, when it holds no decode row, no decode kernel; the others take every step as is."""
    if name == "mixed":
        return mosaic_mixed.plan_step(options, tokens, seqs, prefill_count, decode_count)
    return options


def auto_order(problem: Problem) -> tuple[str, ...]:
    """The default list, best first (each is skipped where it cannot take the problem):
    on CPU (not interpreting), XLA; decode-only steps: the Mosaic decode kernel for head_dim
    128 (the one compiled and measured on the H200: RESULTS.md, Attention: decode), then
    triton_decode; other steps on a GPU: the Mosaic mixed path (prefill sequences on the Mosaic
    prefill kernel, decode rows on the decode kernel; RESULTS.md, RAG headline), then the ragged
    Triton kernel; XLA last, as it takes everything."""
    if problem.platform != "gpu" and not problem.interpret:
        return ("xla",)
    if problem.decode_only:
        measured = ("mosaic_decode",) if problem.head_dim == 128 else ()
        return measured + ("triton_decode", "xla")
    if problem.platform == "gpu" and not problem.interpret:
        return ("mixed", "triton", "xla")
    return ("triton", "xla")


def choose_attention(problem: Problem, implementation: str | None = "auto", options=None):
    """(Implementation, filled options) that runs `problem`; ValueError naming why not."""
    return registry.choose("paged_attention", ATTENTION, auto_order(problem), problem,
                           implementation or "auto", options)


def paged_attention(q, k_pages, v_pages, metadata: AttentionMetadata, inv_freq, *,
                    kv_mode: str = "position_free", attention_scaling: float = 1.0,
                    sm_scale: float | None = None, implementation: str | None = "auto",
                    kernel_options=None, decode_only: bool = False,
                    max_position: int | None = None, interpret: bool = False):
    """Causal, window-limited attention of a ragged batch over a paged cache.

    Args:
      q: [T, H, D] unrotated queries.
      k_pages, v_pages: [P, B, K, D] (H % K == 0).
      metadata: AttentionMetadata for this batch.
      inv_freq: [R/2] float32 RoPE inverse frequencies (R <= D; dims past R are not rotated).
      kv_mode: "position_free" (keys stored unrotated, rotated here) or "rotated".
      attention_scaling: RoPE cos/sin scale (1.0 for default, llama3 and linear scaling).
      sm_scale: softmax scale, default 1/sqrt(D).
      implementation: "auto" (None: the same; see `auto_order`) or a name of `ATTENTION`:
        "xla" (gather + dense), "triton" (ragged prefill + decode; triton_ragged.py),
        "triton_decode" (decode-only, split-K; triton_decode.py), "mosaic_decode" (decode-only,
        Mosaic GPU, warp-level MMA; mosaic_decode.py), "mosaic_prefill" (Mosaic GPU flash
        attention for prefill-shaped batches; mosaic_prefill.py) or "mixed" (engine steps:
        prefill sequences on the Mosaic prefill kernel, decode rows on the decode kernel;
        mosaic_mixed.py). The Pallas ones run
        interpreted on CPU (forced there when named).
      kernel_options: a named implementation's options: its options dataclass (e.g.
        triton_decode.TritonDecodeOptions) or a dict of its fields; unset ones take the
        implementation's measured defaults.
      decode_only: every sequence has at most one query token (lets "auto" pick a decode kernel).
      max_position: a bound on every position (lets the decode kernels read key cos | sin from
        a table of that many rows).
      interpret: run Pallas kernels in interpret mode (CPU).
    Returns:
      [T, H, D] in q's dtype. A query attends to the valid keys of its own sequence whose logical
      position p satisfies window_start <= p <= query position.
    """
    validate(q, k_pages, v_pages, metadata, inv_freq, kv_mode)
    validate_values(q, k_pages, metadata)
    problem = Problem.of(q, k_pages, metadata, inv_freq, kv_mode=kv_mode,
                         decode_only=decode_only, max_position=max_position,
                         interpret=interpret)
    impl, options = choose_attention(problem, implementation, kernel_options)
    if impl.decode_only:
        check_decode_only(metadata, impl.name)
    if impl.backend != "xla" and problem.platform == "cpu":
        interpret = True  # a Pallas kernel can only run interpreted on CPU
    kw = dict(rotate_keys=problem.rotate_keys, attention_scaling=attention_scaling,
              sm_scale=q.shape[-1] ** -0.5 if sm_scale is None else sm_scale)
    if problem.platform == "gpu" and not interpret:
        return _run_once(q, k_pages, v_pages, metadata, inv_freq, name=impl.name,
                         options=options, **kw)
    return _run(impl, options, q, k_pages, v_pages, metadata, inv_freq, interpret=interpret, **kw)


def _run(impl, options, q, k_pages, v_pages, metadata, inv_freq, *, rotate_keys,
         attention_scaling, sm_scale, interpret):
    q_rot = apply_rope(q, metadata.q_positions, inv_freq, attention_scaling)
    return impl.run(q_rot, k_pages, v_pages, metadata, inv_freq, rotate_keys=rotate_keys,
                    attention_scaling=attention_scaling, sm_scale=sm_scale, interpret=interpret,
                    **impl.kwargs(options))


@functools.partial(jax.jit, static_argnames=("name", "options", "rotate_keys",
                                             "attention_scaling", "sm_scale"))
def _run_once(q, k_pages, v_pages, metadata, inv_freq, *, name, options, rotate_keys,
              attention_scaling, sm_scale):
    """A compiled kernel under its own jit: a model's layers call it with the same shapes, so it
    is traced and lowered once per step variant and each layer calls that one function. Lowering
    a Mosaic GPU kernel takes seconds per call site (32 per step variant without this;
    RESULTS.md, RAG headline: engine warm-up)."""
    return _run(ATTENTION[name], options, q, k_pages, v_pages, metadata, inv_freq,
                rotate_keys=rotate_keys, attention_scaling=attention_scaling, sm_scale=sm_scale,
                interpret=False)


def write_kv_and_attend(q, k, v, k_pages, v_pages, metadata: AttentionMetadata, inv_freq, *,
                        write_impl: str | None = "auto", interpret: bool = False,
                        **attention):
    """A layer's cache step: `write_kv` this step's K/V rows (k as stored: rotated by the caller
    in "rotated" mode), then `paged_attention` (its keyword arguments in `attention`).
    Returns (out [T, H, D], k_pages, v_pages)."""
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, metadata.slot_mapping,
                                implementation=write_impl, interpret=interpret)
    out = paged_attention(q, k_pages, v_pages, metadata, inv_freq, interpret=interpret,
                          **attention)
    return out, k_pages, v_pages
