"""The import graph keeps docs/DESIGN.md's layering: arrows between top-level packages point one
way (the table below), and no module imports itself back through others (no cycle). Every
import counts, including those inside functions. Read from the source (ast); nothing imported."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]

# package -> the first-party packages it may import (docs/DESIGN.md, section 2)
MAY_IMPORT = {
    "configs": set(),
    "kernels_pallas": set(),
    "planner": set(),
    "serving": {"kernels_pallas", "planner", "configs"},
    "minipic_jax": {"serving", "kernels_pallas", "planner", "configs"},
    "benchmarks": {"minipic_jax", "serving", "kernels_pallas", "planner", "configs"},
    "scripts": {"minipic_jax", "serving", "kernels_pallas", "planner", "configs", "benchmarks"},
}


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py file of the packages above."""
    mods = {}
    for pkg in MAY_IMPORT:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: pathlib.Path, known: set[str]):
    """(imported first-party module, line) pairs of one file; `from pkg import sub` names the
    submodule when sub is one, the package otherwise."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, level - 1 steps up
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a non-module attribute
                target = target.rpartition(".")[0]
            if target and target.split(".")[0] in MAY_IMPORT:
                yield target, node.lineno


def _graph():
    mods = _modules()
    return mods, {m: sorted(set(_imports(m, p, set(mods)))) for m, p in mods.items()}


def test_arrows_between_packages_point_down():
    mods, graph = _graph()
    upward = [f"{mods[m].relative_to(REPO)}:{line} imports {t}"
              for m, edges in graph.items() for t, line in edges
              if t.split(".")[0] != m.split(".")[0]
              and t.split(".")[0] not in MAY_IMPORT[m.split(".")[0]]]
    assert not upward, "imports against docs/DESIGN.md section 2:\n" + "\n".join(upward)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        comp.append(member)
                        if member == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def test_no_import_cycles():
    _, graph = _graph()
    modules = {m: {t for t, _ in e if t != m} for m, e in graph.items()}
    packages: dict[str, set[str]] = {}
    for m, targets in modules.items():
        packages.setdefault(m.split(".")[0], set()).update(
            t.split(".")[0] for t in targets if t.split(".")[0] != m.split(".")[0])
    assert not _cycles(packages), f"top-level packages import each other: {_cycles(packages)}"
    assert not _cycles(modules), f"modules import each other: {_cycles(modules)}"


def test_the_checks_catch_a_cycle_and_an_upward_arrow():
    """The checkers themselves, on a made-up graph."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert "minipic_jax" not in MAY_IMPORT["serving"]
    assert "serving" not in MAY_IMPORT["kernels_pallas"]


# serving/'s layers (docs/ARCHITECTURE.md): its sub-packages, and the records at its top that
# every layer may use; the engine's modules at the top (llm_engine, scheduler, recovery, ...) use
# the sub-packages, never the other way round
SERVING_RECORDS = {"config", "config_groups", "layout", "sequence", "model_contract", "outputs"}
SERVING_MAY_IMPORT = {
    "cache": set(),  # blocks, prefix keys, hashing, the KV pool and its page zeroing
    "tiers": {"cache"},  # the host tier and the disk span store under the pool
    "hybrid": {"cache", "tiers"},  # recurrent checkpoints, span maps and their placement
    "step": {"cache", "hybrid"},  # the device step: runner, inputs, executables, sampler
}


def _serving_layer(module: str) -> str:
    """serving.cache.x -> "cache"; a record at serving's top -> "records"; the engine's own
    top-level modules -> "engine"."""
    parts = module.split(".")
    if len(parts) >= 3:
        return parts[1]
    return "records" if parts[-1] in SERVING_RECORDS else "engine"


def test_serving_layers_import_down_only():
    mods, graph = _graph()
    wrong = []
    for m, edges in graph.items():
        if not m.startswith("serving.") or m.count(".") == 1 and m.endswith("__init__"):
            continue
        have = _serving_layer(m)
        allowed = {"records", have} | SERVING_MAY_IMPORT.get(have, set())
        if have == "engine":
            allowed |= set(SERVING_MAY_IMPORT) | {"engine"}
        if have == "records":
            allowed = {"records"}
        wrong += [f"{mods[m].relative_to(REPO)}:{line} imports {t}" for t, line in edges
                  if t.startswith("serving.") and _serving_layer(t) not in allowed]
    assert not wrong, "imports against serving/'s layers:\n" + "\n".join(wrong)


def _same_kernel(a: str, b: str) -> bool:
    """Files of one kernel share a stem (mosaic_prefill.py, mosaic_prefill_prep.py)."""
    a, b = a.rpartition(".")[2], b.rpartition(".")[2]
    return a.startswith(b) or b.startswith(a)


def test_kernels_import_no_private_names_across_files():
    """A kernel file uses another kernel's public names only (shared helpers live in
    *_common.py); the files of one kernel (a shared stem) may share private ones."""
    mods = _modules()
    private = []
    for name, path in mods.items():
        if not name.startswith("kernels_pallas"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "kernels_pallas") and not _same_kernel(name, node.module):
                private += [f"{path.relative_to(REPO)}:{node.lineno} imports {node.module}.{a.name}"
                            for a in node.names if a.name.startswith("_")]
    assert not private, "private names imported across kernel files:\n" + "\n".join(private)


def _attributes(path: pathlib.Path):
    """(attribute name, line, whether it is called on something other than self / cls) of
    every attribute access in a file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            other = not (isinstance(owner, ast.Name) and owner.id in ("self", "cls"))
            yield node.func.attr, node.lineno, other


# what only the cache manager (serving/cache/manager.py) touches
CACHE_INTERNALS = {"bm", "keys", "offload", "pending_copy_in", "hybrid_cache", "kv_store",
                   "unregister", "_unregister", "_match", "_deepest", "admission_plan"}


def test_the_scheduler_sees_only_the_cache_managers_interface():
    """serving/scheduler.py decides what runs; what is cached is the cache manager's: it imports
    no module of serving.hybrid or serving.tiers (of serving.cache at most the manager), and
    reaches no block pool, prefix keys, lower tier or hybrid cache."""
    mods, graph = _graph()
    wrong = [f"serving/scheduler.py:{line} imports {t}" for t, line in graph["serving.scheduler"]
             if t.startswith(("serving.hybrid", "serving.tiers"))
             or t.startswith("serving.cache") and t != "serving.cache.manager"]
    tree = ast.parse(mods["serving.scheduler"].read_text())
    wrong += [f"serving/scheduler.py:{n.lineno} uses .{n.attr}" for n in ast.walk(tree)
              if isinstance(n, ast.Attribute) and n.attr in CACHE_INTERNALS]
    assert not wrong, "\n".join(wrong)


# jax's jitted functions count their compiled variants only through `_cache_size`, and
# StepExecutables (serving/step/step_executables.py) mirrors that name
PRIVATE_CALLS_ALLOWED = {"_cache_size"}


def test_serving_calls_no_private_method_of_another_object():
    """Across serving/, a `_method` is called on self (or cls) only: another object's private
    method (BlockManager._unregister, HybridPrefixCache._match / _deepest, ...) is reached
    through a public one."""
    mods = _modules()
    wrong = [f"{path.relative_to(REPO)}:{line} calls .{name}"
             for m, path in mods.items() if m.startswith("serving")
             for name, line, other in _attributes(path)
             if other and name.startswith("_") and not name.startswith("__")
             and name not in PRIVATE_CALLS_ALLOWED]
    assert not wrong, "private methods called on another object:\n" + "\n".join(wrong)
