"""The docs as entry points (issue 27): the README stays short and runnable, its commands are the
ones CI runs, every relative link in the docs resolves, each serving/ sub-package's docstring
lists exactly its modules, and the benchmark table script reads only what it is given."""

import ast
import importlib.util
import json
import re

import pytest

from conftest import REPO

README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "RESULTS.md",
        REPO / "benchmarks" / "history" / "README.md"]


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_readme_is_short_and_holds_the_two_commands_ci_runs():
    text = README.read_text()
    assert len(text.splitlines()) <= 120, "README.md: keep it an entry point (<= 120 lines)"
    assert "./minipic generate" in text and "./minipic test" in text
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^\./minipic test\b", ci, re.M), ".ci/run no longer runs `./minipic test`"
    assert "## Status" not in text, "status lives in benchmarks/RESULTS.md only"


def test_readme_python_blocks_parse_and_name_real_entry_points():
    blocks = _python_blocks(README.read_text())
    assert len(blocks) >= 2, "README.md: the API in ten lines and the real-model example"
    import minipic_jax
    import minipic_jax.loading
    for i, block in enumerate(blocks):
        tree = ast.parse(block, f"README.md python block {i}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mod = {"minipic_jax": minipic_jax, "minipic_jax.loading": minipic_jax.loading}
                assert node.module in mod, f"README block {i} imports {node.module}"
                for alias in node.names:
                    assert hasattr(mod[node.module], alias.name), \
                        f"README block {i}: {node.module} has no {alias.name}"
    assert len(blocks[0].strip().splitlines()) <= 10, "the API in ten lines"


@pytest.mark.slow
def test_readme_api_snippet_runs():
    """The README's first block as a user pastes it (a tiny preset: seconds once compiled)."""
    code = _python_blocks(README.read_text())[0]
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
        if "://" in target:
            continue
        if not (doc.parent / target).exists():
            missing.append(target)
    assert not missing, f"{doc.relative_to(REPO)}: links to missing files {missing}"


@pytest.mark.parametrize("package", ["cache", "tiers", "hybrid", "step"])
def test_serving_subpackage_docstring_lists_its_modules(package):
    folder = REPO / "serving" / package
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    listed = set(re.findall(r"^\s*([a-z_0-9]+\.py)\s", doc, re.M))
    present = {p.name for p in folder.glob("*.py")} - {"__init__.py"}
    assert listed == present, (f"serving/{package}/__init__.py docstring: unlisted "
                               f"{sorted(present - listed)}, gone {sorted(listed - present)}")


def _rag_table():
    spec = importlib.util.spec_from_file_location(
        "rag_table", REPO / "benchmarks" / "runs" / "rag_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rag_table_reads_only_the_root_it_is_given(tmp_path, capsys):
    mod = _rag_table()
    assert capsys.readouterr().out == "", "importing rag_table must read and print nothing"
    run = dict(workload="multi", requests_per_second=2.0, prefix_cache_hit_rate=0.5,
               computed_prompt_tokens_per_second=100.0, elapsed_time=3.0, steps=6,
               median_tpot_ms=4.0, median_ttft_ms=5.0)
    (tmp_path / "rag_fcfs").mkdir()
    (tmp_path / "rag_fcfs" / "rag_bench.json").write_text(json.dumps({"results": [{"runs": [run]}]}))
    lines = mod.table_lines(tmp_path, ["fcfs", "pic_off"])
    assert lines[0].split()[:3] == ["fcfs", "multi", "2.00"] and "computed     300" in lines[0]
    assert lines[1].startswith("pic_off no result") and str(tmp_path) in lines[1]
    mod.main(["--root", str(tmp_path), "fcfs"])
    assert capsys.readouterr().out.startswith("fcfs     multi")
