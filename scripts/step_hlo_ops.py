"""The engine step's compiled CPU HLO as a multiset of instructions, to show that a refactor of a
model family keeps the same ops (e.g. the Flax ports: same instructions and shapes before/after).

    PYTHONPATH=<tree> python scripts/step_hlo_ops.py dump OUT.json [FIXTURE] [TP] [DECODE]
    python scripts/step_hlo_ops.py compare BEFORE.json AFTER.json

`dump` builds an LLM over tests/fixtures/FIXTURE (default qwen3_5_gva2), with and without prefix
caching, lowers and compiles every warm-up variant of the runner's jitted step (prefill per token
bucket; decode-only with the DECODE kernel, default triton_decode, "none" for no decode-only
variant) and keeps each instruction as text without its name, operand names and metadata. `compare` reports, per variant, whether the multisets agree with parameter numbers
ignored (a params pytree whose leaves flatten in another order numbers its arguments anew).
TP > 1 needs XLA_FLAGS=--xla_force_host_platform_device_count=TP (JAX_PLATFORMS=cpu).
"""

from __future__ import annotations

import collections
import json
import pathlib
import re
import sys

_NAME = re.compile(r"%[\w.\-]+")
_META = re.compile(r",? ?metadata=\{[^}]*\}")
_PARAM = re.compile(r"parameter\(\d+\)")


def instructions(hlo_text: str) -> list[str]:
    out = []
    for line in hlo_text.splitlines():
        line = _META.sub("", line.strip()).removeprefix("ROOT ")
        if line.startswith("%") and "=" in line:
            out.append(_NAME.sub("%", line))
    return sorted(out)


def dump(path: str, fixture: str = "qwen3_5_gva2", tp: int = 1,
         decode: str = "triton_decode") -> None:
    root = pathlib.Path(__file__).resolve().parents[1]
    from minipic_jax import LLM
    from serving.step import model_runner
    captured = []

    def capture(self, steps):  # stands in for the runner's parallel compile: lower, keep, stop
        prev = self._prev() if self.config.async_scheduling else None
        for ints, floats, kw in steps:
            low = self._step.lower(self.params, self.cache, ints, floats, prev, self.ck_pool, **kw)
            captured.append((f"caching={caching} t={kw['t']} decode_only={kw['decode_only']}",
                             low.compile().as_text()))
        raise StopIteration

    model_runner.ModelRunner._compile_in_parallel = capture
    for caching in (False, True):
        llm = LLM(str(root / "tests" / "fixtures" / fixture), max_num_seqs=2, warmup=False,
                  max_num_batched_tokens=64, max_model_len=192, attn_impl="xla",
                  decode_attn_impl=None if decode == "none" else decode,
                  enable_prefix_caching=caching,
                  tensor_parallel_size=tp)
        try:
            llm.llm_engine.warmup()
        except StopIteration:
            pass
    json.dump({key: instructions(text) for key, text in captured}, open(path, "w"))
    print(f"{len(captured)} step variants -> {path}")


def compare(before: str, after: str) -> bool:
    a, b = json.load(open(before)), json.load(open(after))
    same_all = a.keys() == b.keys()
    for key in a.keys() & b.keys():
        ca = collections.Counter(_PARAM.sub("parameter()", op) for op in a[key])
        cb = collections.Counter(_PARAM.sub("parameter()", op) for op in b[key])
        same_all &= ca == cb
        print(f"{key}: {len(a[key])} vs {len(b[key])} instructions, "
              f"{'same' if ca == cb else 'DIFFERENT'}")
        if ca != cb:
            print("  only before:", list((ca - cb).items())[:5])
            print("  only after:", list((cb - ca).items())[:5])
    print("same ops and shapes" if same_all else "DIFFERENT")
    return same_all


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "dump":
        dump(args[0], *(args[1:2]), *(int(x) for x in args[2:3]), *(args[3:4]))
    else:
        sys.exit(0 if compare(*args) else 1)
