"""What model code each kernel of a compiled step comes from: an optimized HLO module (XLA's dump,
`*after_optimizations.txt`, or `jax.jit(f).lower(...).compile().as_text()`) read as the kernels
its entry computation launches, grouped by the `jax.named_scope` path in their metadata.

A GPU profile names kernels by their HLO instruction (`loop_select_fusion_1` is
`%loop_select_fusion.1`), which says nothing of the layer or op behind it; the module's metadata
does (`op_name="jit(_step_impl)/.../layer_3/..."`). Launches are the instructions of the entry
computation and of the while bodies / conditions, conditional branches and calls it reaches,
less those that run no kernel (parameters, tuples, bitcasts, control flow itself); fused
computations are inside their fusion's kernel and not counted again.

    python3 -m benchmarks.hlo_kernels MODULE.txt [--top 30] [--name loop_select_fusion_1 ...]

prints the kernel count, the count per layer, and the scopes with most kernels with layer
numbers folded (`layer_*`), each with its kernel kinds; `--name` prints what each named kernel
(a profile's spelling or the HLO's) computes and where.
"""

from __future__ import annotations

import argparse
import collections
import re

# opcodes that launch nothing on their own
NO_KERNEL = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
    "call", "after-all", "opt-barrier", "add-dependency", "domain", "partition-id", "replica-id",
    "async-start", "async-update", "async-done", "copy-done", "send-done", "recv-done"})
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\) -> .*\{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*? ([a-z][a-z\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLED = re.compile(r"(?:body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_LAYER = re.compile(r"layer_(\d+)")


def computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    """{computation name: its instruction lines} and the entry computation's name."""
    comps, entry, name = {}, None, None
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head:
            name = head.group(2)
            comps[name] = []
            if head.group(1):
                entry = name
        elif line.startswith("}"):
            name = None
        elif name is not None and line.strip():
            comps[name].append(line)
    return comps, entry


def kernels(text: str) -> list[dict]:
    """The launches of the module (module doc): [{name, opcode, op_name}] in program order."""
    comps, entry = computations(text)
    out, seen = [], set()

    def walk(comp: str) -> None:
        if comp in seen or comp not in comps:
            return
        seen.add(comp)
        for line in comps[comp]:
            m = _INSTR.match(line)
            if not m:
                continue
            name, opcode = m.groups()
            if opcode in ("while", "conditional", "call"):
                for callee in _CALLED.findall(line):
                    walk(callee)
                for group in _BRANCHES.findall(line):
                    for callee in re.findall(r"%([\w.\-]+)", group):
                        walk(callee)
                continue
            if opcode in NO_KERNEL:
                continue
            op = _OP_NAME.search(line)
            out.append({"name": name, "opcode": opcode, "op_name": op.group(1) if op else ""})
    if entry is not None:
        walk(entry)
    return out


def scope(op_name: str, depth: int = 3) -> str:
    """The named-scope path of an op_name from its first `layer_N` on (N folded to *), `depth`
    components; without a layer, the last `depth` components."""
    parts = [p for p in op_name.split("/") if p and not p.startswith(("jit(", "pjit("))]
    for i, p in enumerate(parts):
        if _LAYER.fullmatch(p):
            return "/".join(["layer_*"] + parts[i + 1:i + depth])
    return "/".join(parts[-depth:])


def summary(ks: list[dict], top: int = 30, depth: int = 3) -> list[str]:
    """The printed report (module doc)."""
    per_layer = collections.Counter()
    for k in ks:
        m = _LAYER.search(k["op_name"])
        per_layer[int(m.group(1)) if m else -1] += 1
    by_scope = collections.defaultdict(collections.Counter)
    for k in ks:
        by_scope[scope(k["op_name"], depth)][k["opcode"]] += 1
    lines = [f"{len(ks)} kernels; per layer: " + ", ".join(
        f"{'-' if i < 0 else i}: {n}" for i, n in sorted(per_layer.items()))]
    ranked = sorted(by_scope.items(), key=lambda kv: -sum(kv[1].values()))
    for where, kinds in ranked[:top]:
        what = ", ".join(f"{op} {n}" for op, n in kinds.most_common())
        lines.append(f"  {sum(kinds.values()):5d}  {where or '(no scope)'}: {what}")
    return lines


def find(ks: list[dict], name: str) -> list[dict]:
    """Kernels named `name`, spelled as the HLO does (`a.1`) or as a profile does (`a_1`)."""
    want = name.lstrip("%")
    return [k for k in ks if k["name"] == want or k["name"].replace(".", "_") == want]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("module", help="optimized HLO text (XLA's *after_optimizations.txt)")
    ap.add_argument("--top", type=int, default=30, help="scopes printed (default: 30)")
    ap.add_argument("--depth", type=int, default=3, help="scope components kept (default: 3)")
    ap.add_argument("--name", nargs="*", default=[], help="kernel names to explain")
    a = ap.parse_args(argv)
    with open(a.module) as f:
        ks = kernels(f.read())
    if not ks:
        raise SystemExit(f"{a.module}: no entry computation or no kernel found (an optimized "
                         f"HLO module's text is expected)")
    print("\n".join(summary(ks, a.top, a.depth)))
    for name in a.name:
        hits = find(ks, name)
        print(f"{name}: " + ("; ".join(f"{k['opcode']} {k['op_name']}" for k in hits)
                             if hits else "not in the module"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
