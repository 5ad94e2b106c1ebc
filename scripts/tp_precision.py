"""Where Qwen3.5's logprobs under tensor parallelism part from TP=1, measured against float64.

    JAX_PLATFORMS=cpu PYTHONPATH=. python scripts/tp_precision.py [PROMPT] [DEPTHS]

For the first d layers of the qwen3_5_gva2 fixture (then its final norm and head), one forward
over the fixture's prompt PROMPT (default 1) and its HF greedy continuation, at TP=1, 2 and 4
(forced host devices), and the same model in two independent numpy references: float64 and
float32 (tests/hybrid_span_reference.py, token by token). Per depth, the largest |logprob - f64|
over all rows / the generated rows, and the differences TP4 - TP1 and np32 - TP1: if TP=4 is
no farther from float64 than TP=1, and two float32 implementations differ as much as TP=4 and
TP=1 do, the TP difference is float32 rounding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from minipic_jax.loading import load_model  # noqa: E402
from minipic_jax.models import testing  # noqa: E402
from serving.step import sharding  # noqa: E402
from tests import hybrid_span_reference as hsr  # noqa: E402
from tests.conftest import FIXTURES  # noqa: E402
from tests.float32_reference import float32_reference, log_softmax  # noqa: E402

NAME = "qwen3_5_gva2"


def truncated(depth: int):
    lm = load_model(str(FIXTURES / NAME))
    lm.cfg = dataclasses.replace(lm.cfg, num_layers=depth, layer_types=lm.cfg.layer_types[:depth])
    lm.params = dataclasses.replace(lm.params, layers=lm.params.layers[:depth])
    return lm


def ours(depth: int, tp: int, tokens: np.ndarray) -> np.ndarray:
    """Our forward (as the engine places it at `tp`) over `tokens`: log-softmax [n, V]."""
    lm = truncated(depth)
    cfg, mesh, n = lm.cfg, None, len(tokens)
    if tp > 1:
        mesh, cfg = sharding.place_model(lm, tp)
    pager = testing.SimplePager(1, n + 8, 16, seed=1)

    def make():
        return lm.family.init_cache(cfg, pager.num_pages, 16, 1, jnp.float32)
    cache = make() if mesh is None else sharding.init_sharded(make, lm.family.cache_axes(cfg),
                                                              mesh)
    md, _, total = pager.step([n])
    padded = np.zeros(md.num_tokens, np.int32)
    padded[:total] = tokens

    def fwd(params, toks, md, cache):
        ctx = (contextlib.nullcontext() if mesh is None
               else jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
        with ctx:
            return lm.family.forward(params, toks, md, cache, cfg)[0]
    return log_softmax(np.asarray(jax.jit(fwd)(lm.params, jnp.asarray(padded), md, cache))[:n])


def main(prompt: int, depths: list[int]) -> None:
    ref = np.load(FIXTURES / NAME / "reference.npz")
    tokens = np.concatenate([ref[f"prompt_{prompt}"], ref[f"greedy_{prompt}"][:-1]])
    tokens = tokens.astype(np.int32)
    kept, seg, span = hsr.segments(tokens.tolist(), 16, -1, -2, -3)  # plain text: no markers
    rows = slice(len(ref[f"prompt_{prompt}"]) - 1, len(tokens))  # the generated tokens' rows
    h32 = float32_reference()
    print(f"prompt_{prompt}: {len(tokens)} tokens; max |difference| over all rows / generated rows")
    for depth in depths:
        lm = truncated(depth)
        r64 = hsr.reference_logprobs(lm.params, lm.cfg, kept, seg, span)
        r32 = log_softmax(h32.reference_logprobs(lm.params, lm.cfg, kept, seg, span))
        got = {tp: ours(depth, tp, tokens) for tp in (1, 2, 4)}
        cols = {"np32-f64": r32 - r64, **{f"TP{tp}-f64": got[tp] - r64 for tp in got},
                "TP4-TP1": got[4] - got[1], "np32-TP1": r32 - got[1]}
        line = "  ".join(f"{k} {np.abs(v).max():.1e}/{np.abs(v)[rows].max():.1e}"
                         for k, v in cols.items())
        print(f"depth {depth} ({lm.cfg.layer_types[-1]}): {line}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1,
         [int(d) for d in (sys.argv[2] if len(sys.argv) > 2 else "1,2,3,4").split(",")])
