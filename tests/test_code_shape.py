"""Code shape (the project style rules, habit 10; issue 17): no source file over 400 lines and no
function over 80 lines, outside kernel bodies. A kernel body is a function in kernels_pallas/
whose name ends in `kernel` (the function handed to `pallas_call` / `plgpu.kernel`), with the
functions nested in it. Read from the source (ast); nothing imported.

EXCEPTIONS names what is over today and will be split; it may only shrink: an entry that is no
longer over the limit fails the test until it is removed."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("benchmarks", "configs", "kernels_pallas", "minipic_jax", "planner", "scripts",
            "serving", "tests")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80

# path, or path::qualified function name -> why it is still over
EXCEPTIONS: dict[str, str] = {}  # none today


def _functions(tree: ast.AST):
    """(qualified name, lines, inside a kernel body) for every function, nested ones included."""
    def walk(node, prefix, in_kernel):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if isinstance(child, ast.ClassDef):
                    yield from walk(child, name + ".", in_kernel)
                    continue
                kernel = in_kernel or child.name.endswith("kernel")
                yield name, child.end_lineno - child.lineno + 1, kernel
                yield from walk(child, name + ".", kernel)
            else:
                yield from walk(child, prefix, in_kernel)
    yield from walk(tree, "", False)


def over_limits(root: pathlib.Path = REPO, packages=PACKAGES) -> dict[str, int]:
    """Every file over MAX_FILE_LINES and every function over MAX_FUNCTION_LINES outside kernel
    bodies: key (as in EXCEPTIONS) -> lines."""
    found = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            src = path.read_text()
            if len(src.splitlines()) > MAX_FILE_LINES:
                found[rel] = len(src.splitlines())
            kernel_file = rel.startswith("kernels_pallas/")
            for name, lines, in_kernel in _functions(ast.parse(src, rel)):
                if lines > MAX_FUNCTION_LINES and not (kernel_file and in_kernel):
                    found[f"{rel}::{name}"] = lines
    return found


def test_no_long_files_or_functions_beyond_the_listed_exceptions():
    found = over_limits()
    new = {k: v for k, v in found.items() if k not in EXCEPTIONS}
    assert not new, (f"over {MAX_FILE_LINES} lines per file / {MAX_FUNCTION_LINES} per function "
                     f"(split them):\n" + "\n".join(f"  {k}: {v} lines" for k, v in new.items()))
    gone = sorted(set(EXCEPTIONS) - set(found))
    assert not gone, ("within the limits now: remove from EXCEPTIONS in tests/test_code_shape.py:\n"
                      + "\n".join(f"  {k}" for k in gone))


def test_the_checker_sees_long_functions_and_skips_kernel_bodies(tmp_path):
    """The checker itself, on made-up files."""
    def body(indent):
        return "".join(f"{' ' * indent}x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "kernels_pallas").mkdir()
    (tmp_path / "kernels_pallas" / "k.py").write_text(
        f"def _kernel(ref):\n    def inner():\n{body(8)}{body(4)}\n"
        f"class Wrapper:\n    def call(self):\n{body(8)}\n    def short(self):\n        pass\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    found = over_limits(tmp_path, ("kernels_pallas", "pkg"))
    assert set(found) == {"kernels_pallas/k.py::Wrapper.call", "pkg/long.py"}, found
