"""Kernel registry records and the one rule that picks an implementation (tokamax-style).

An op (paged_attention, write_kv, gated_delta) keeps a dict name -> `Implementation` in its
`api.py` and an ordered default list per problem (its `auto_order`). `choose` resolves the
`implementation=` argument once, before any work:

  * a name: that implementation with the caller's options (a dict or the implementation's own
    options dataclass), unset options filled with its measured defaults; ValueError naming the
    reason if it cannot take the problem;
  * "auto": the first implementation of the op's default list that takes the problem with its
    default options (each says why not; the list ends with the XLA fallback, which takes all).

Adding an implementation: a kernel file exports an `Implementation` record (its entry function,
a frozen options dataclass whose fields default to None = "use the measured default", `defaults`
filling them for a problem, `limits` saying why it cannot take one), the op's api.py adds it to
its dict and, if it should ever run unasked, to its `auto_order`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


def _no_limits(problem, options) -> str:
    del problem, options
    return ""


def _as_given(problem, options):
    del problem
    return options


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of an implementation that takes none."""


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation of an op.

    name: the `implementation=` string; run: the entry function (keyword options); options: its
    frozen options dataclass; defaults(problem, options) -> options with unset (None) fields
    filled by the measured defaults for that problem; limits(problem, options) -> '' when it
    takes the problem with those options, else the reason; backend: "xla", "triton" or "mosaic"
    (Pallas backends run only interpreted on CPU); decode_only: takes at most one query per
    sequence (the caller must know the step is decode-only)."""

    name: str
    run: Callable[..., Any]
    options: type = NoOptions
    defaults: Callable[[Any, Any], Any] = _as_given
    limits: Callable[[Any, Any], str] = _no_limits
    backend: str = "xla"
    decode_only: bool = False

    def make_options(self, given) -> Any:
        """The caller's options as this implementation's dataclass (None: all unset)."""
        if given is None:
            return self.options()
        if isinstance(given, self.options):
            return given
        if not isinstance(given, dict):
            raise ValueError(f"implementation={self.name!r}: options must be a dict or "
                             f"{self.options.__name__}, got {type(given).__name__}")
        fields = {f.name for f in dataclasses.fields(self.options)}
        unknown = sorted(set(given) - fields)
        if unknown:
            raise ValueError(f"implementation={self.name!r}: unknown options {unknown}; it takes "
                             f"{sorted(fields) or 'none'}")
        return self.options(**given)

    def kwargs(self, options) -> dict:
        """The options as keyword arguments of `run`."""
        return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


def choose(op: str, registry: dict[str, Implementation], auto: tuple[str, ...], problem,
           implementation: str, options=None) -> tuple[Implementation, Any]:
    """(implementation record, filled options) for `problem` (see the module docstring).
    auto: the op's default order for this problem, used when implementation == "auto"."""
    if implementation == "auto":
        if options:
            raise ValueError(f"{op}: kernel options {options} need a named implementation "
                             f"(implementation='auto' picks the options too)")
        reasons = []
        for name in auto:
            impl = registry[name]
            filled = impl.defaults(problem, impl.options())
            why = impl.limits(problem, filled)
            if not why:
                return impl, filled
            reasons.append(f"{name}: {why}")
        raise ValueError(f"{op}: no implementation takes this problem ({'; '.join(reasons)})")
    if implementation not in registry:
        raise ValueError(f"{op}: unknown implementation {implementation!r}; use 'auto' or one "
                         f"of {tuple(registry)}")
    impl = registry[implementation]
    filled = impl.defaults(problem, impl.make_options(options))
    why = impl.limits(problem, filled)
    if why:
        raise ValueError(f"{op}: implementation={implementation!r} {why}")
    return impl, filled
