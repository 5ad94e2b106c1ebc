"""The static facts of a gated delta call that decide which implementation can run it.

Built by the api entry points (`Problem.here`) from their arguments and the backend, so every
entry asks the registry (api.py, `choose_gated_delta`) the same question.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
    """platform ("gpu" | "cpu"), interpret (Pallas kernels interpreted, on CPU), scan (the
    inter-chunk scan asked for, after tree_scan.choose_scan: "sequential", "tree" or
    "blocked"; None where the entry has no choice), ragged_transition (a ragged batch whose
    per-sequence transitions are asked for: ragged_prefill's return_transition).

    The model facts, None where the caller does not know them (the entry points, whose operands
    the kernels check when they run): dtype (the values' dtype name), key_dim / value_dim (Dk,
    Dv) and chunk. An engine fills them at start, so a kernel that cannot take the model is
    refused before any work (serving/step/model_runner.py gdn_choice)."""

    platform: str = "cpu"
    interpret: bool = False
    scan: str | None = None
    ragged_transition: bool = False
    dtype: str | None = None
    key_dim: int | None = None
    value_dim: int | None = None
    chunk: int | None = None

    @classmethod
    def here(cls, interpret: bool = False, **facts) -> Problem:
        """The problem on this process's default backend."""
        return cls(platform=jax.default_backend(), interpret=interpret, **facts)
