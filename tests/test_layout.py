"""The package's shape: no module over 500 lines unless its docstring says why, and no import circles."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_specdec"
LIMIT = 500


def modules():
    return sorted(path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts)


@pytest.mark.parametrize("path", modules(), ids=lambda path: str(path.relative_to(PACKAGE)))
def test_no_module_over_500_lines_without_a_reason(path):
    lines = path.read_text(encoding="utf-8").count("\n")
    if lines > LIMIT:
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        assert "over 500 lines" in docstring, (
            f"{path.relative_to(PACKAGE)} has {lines} lines: split it by what it holds, or say in its docstring why "
            "it is over 500 lines."
        )


def _module_imports(path: Path) -> set[str]:
    """The hf_specdec modules `path` imports at module level (not inside functions or `TYPE_CHECKING`)."""
    name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    found = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("hf_specdec"):
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("hf_specdec"))
    return found


def test_no_import_circles_between_modules():
    """Module-level imports between hf_specdec's modules form no cycle (a package's `__init__` re-exporting its
    submodules is not a cycle: edges into a package name are not followed back out)."""
    names = {}
    for path in modules():
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        names[name] = path
    graph = {
        name: {target for target in _module_imports(path) if target in names and target != name}
        for name, path in names.items()
    }
    packages = {name for name, path in names.items() if path.name == "__init__.py"}
    state: dict[str, int] = {}

    def visit(name, stack):
        state[name] = 1
        for target in sorted(graph[name]):
            if target in packages:  # re-exports: importing a package's name is not followed into its children
                continue
            if state.get(target) == 1:
                cycle = stack[stack.index(target) :] + [target]
                raise AssertionError(f"import circle: {' -> '.join(cycle)}")
            if target not in state:
                visit(target, [*stack, target])
        state[name] = 2

    for name in sorted(names):
        if name not in state:
            visit(name, [name])


FIRST_IMPORTS = """
import importlib, sys
import torch, transformers  # imported once: only hf_specdec's modules are imported afresh
failed = []
for name in sys.argv[1:]:
    for module in [m for m in sys.modules if m == "hf_specdec" or m.startswith("hf_specdec.")]:
        del sys.modules[module]
    try:
        importlib.import_module(name)
    except Exception as error:
        failed.append(f"{name}: {type(error).__name__}: {error}")
print("\\n".join(failed))
"""


def test_every_module_imports_first_without_a_circle():
    """Each module, imported before any other of hf_specdec's, imports: an import circle (a module importing, through
    a package's `__init__`, a module that imports it back before it is defined) fails exactly when the user happens
    to import that module first."""
    names = sorted(
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__") for path in modules()
    )
    result = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORTS, *names], capture_output=True, text=True, cwd=PACKAGE.parent, check=True
    )
    assert result.stdout.strip() == "", result.stdout
