"""The error messages page of the documentation site (`errors.md`), generated from the source at build time.

Every `raise SomeError("...")` in `hf_specdec/**/*.py` (and every `return SomeError("...")` of a helper that builds
one) is read with `ast`, its message rendered with f-string fields as `{name}` placeholders, deduplicated, and listed
by module with where it is raised. The messages name the argument, show its value and say the fix, so the page shows
each one whole. mkdocs-gen-files runs this file (`runpy.run_path`); run by hand, it prints the page:

    python scripts/docs_errors.py > /tmp/errors.md

`collect_errors` (source in, records out) and `errors_page` (records in, markdown out) are pure: tests call them
without mkdocs.
"""

from __future__ import annotations

import ast
import html
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DIR = REPO / "hf_specdec"
PAGE = "errors.md"

# what a placeholder for an f-string field looks like when its expression is long
LONGEST_PLACEHOLDER = 32


@dataclass
class ErrorMessage:
    """One message a user can meet: its exception class, text, module, and the functions that raise it."""

    exception: str
    message: str
    module: str
    where: list[str] = field(default_factory=list)


def _exception_name(node: ast.expr) -> str | None:
    """`ValueError` for `ValueError(...)`, `argparse.ArgumentTypeError` for that; None if not an exception class."""
    name = ast.unparse(node)
    last = name.rsplit(".", 1)[-1]
    if last.endswith(("Error", "Exception")) or last in ("NotImplementedError", "StopIteration"):
        return name
    return None


def _placeholder(node: ast.FormattedValue) -> str:
    expression = ast.unparse(node.value)
    if len(expression) > LONGEST_PLACEHOLDER:
        expression = "…"
    return "{" + expression + "}"


def render_message(node: ast.expr | None, strings: dict[str, ast.expr] | None = None) -> str | None:
    """The text of a message expression: string constants as they are, f-string fields as `{name}`, `+` joined, a
    name bound to a string in `strings` looked up. None where the message is built some other way."""
    strings = strings or {}
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue):
                parts.append(_placeholder(value))
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = render_message(node.left, strings), render_message(node.right, strings)
        if left is None and right is None:
            return None
        return (left if left is not None else "{…}") + (right if right is not None else "{…}")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        return render_message(node.func.value, strings)  # "...{}...".format(x): the template
    if isinstance(node, ast.Name) and node.id in strings:
        return render_message(strings[node.id], {k: v for k, v in strings.items() if k != node.id})
    return None


def _string_bindings(body: list[ast.stmt]) -> dict[str, ast.expr]:
    """Names assigned once in `body` (not nested functions) to a string-like expression."""
    bindings: dict[str, ast.expr] = {}
    for node in body:
        for child in ast.walk(node):
            if isinstance(child, ast.Assign) and len(child.targets) == 1 and isinstance(child.targets[0], ast.Name):
                if isinstance(child.value, (ast.Constant, ast.JoinedStr, ast.BinOp)):
                    bindings[child.targets[0].id] = child.value
    return bindings


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, constants: dict[str, ast.expr]):
        self.module = module
        self.constants = constants
        self.scope: list[str] = []
        self.strings: list[dict[str, ast.expr]] = [constants]
        self.found: list[ErrorMessage] = []

    def _visit_scope(self, node, bindings: dict[str, ast.expr] | None = None) -> None:
        self.scope.append(node.name)
        self.strings.append({**self.strings[-1], **(bindings or {})})
        self.generic_visit(node)
        self.strings.pop()
        self.scope.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._visit_scope(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._visit_scope(node, _string_bindings(node.body))

    visit_AsyncFunctionDef = visit_FunctionDef

    def _record(self, call: ast.expr | None) -> None:
        if not isinstance(call, ast.Call):
            return
        exception = _exception_name(call.func)
        if exception is None or not call.args:
            return
        message = render_message(call.args[0], self.strings[-1])
        if message and message.strip():
            where = ".".join(self.scope) or "<module>"
            self.found.append(ErrorMessage(exception, " ".join(message.split()), self.module, [where]))

    def visit_Raise(self, node: ast.Raise) -> None:
        self._record(node.exc)
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        self._record(node.value)  # a helper that builds the exception its callers raise
        self.generic_visit(node)


def module_name(path: Path, package_dir: Path) -> str:
    relative = path.relative_to(package_dir.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def collect_errors(package_dir: Path = PACKAGE_DIR) -> list[ErrorMessage]:
    """Every literal error message under `package_dir`, deduplicated per module (the raising functions merged),
    in module order and then source order."""
    package_dir = Path(package_dir)
    messages: dict[tuple[str, str, str], ErrorMessage] = {}
    for path in sorted(package_dir.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        module = module_name(path, package_dir)
        collector = _Collector(module, _string_bindings([node for node in tree.body if isinstance(node, ast.Assign)]))
        collector.visit(tree)
        for error in collector.found:
            key = (error.module, error.exception, error.message)
            if key in messages:
                messages[key].where += [where for where in error.where if where not in messages[key].where]
            else:
                messages[key] = error
    return list(messages.values())


def module_summary(module: str, package_dir: Path = PACKAGE_DIR) -> str:
    """The first sentence of a module's docstring, to say what the messages of that module are about."""
    relative = Path(*module.split(".")[1:])
    for candidate in (package_dir / relative.with_suffix(".py"), package_dir / relative / "__init__.py"):
        if candidate.is_file():
            try:
                docstring = ast.get_docstring(ast.parse(candidate.read_text(encoding="utf-8"))) or ""
            except (OSError, SyntaxError):
                return ""
            first = docstring.split("\n\n")[0].replace("\n", " ").strip()
            return first.split(". ")[0].rstrip(".") + "." if first else ""
    return ""


_MARKDOWN_ENTITIES = {
    "|": "&#124;",
    "*": "&#42;",
    "_": "&#95;",
    "[": "&#91;",
    "]": "&#93;",
    "\\": "&#92;",
    "`": "&#96;",
    "#": "&#35;",
}


def escape_markdown(text: str) -> str:
    """`text` as literal characters in a Markdown table cell: HTML special characters and the characters Markdown
    would read (pipes, emphasis, links, backslashes, backticks) as entities, line breaks as spaces."""
    text = html.escape(re.sub(r"\s+", " ", text), quote=False)
    return "".join(_MARKDOWN_ENTITIES.get(character, character) for character in text)


def message_cell(message: str) -> str:
    """A message for a table cell: its `code` spans as `<code>` (when the backticks pair up), everything else
    literal, so a pipe, an angle bracket or an unpaired backtick in a message cannot break the page."""
    pieces = message.split("`")
    if len(pieces) % 2 == 0:  # an unpaired backtick: show the message as plain text
        return escape_markdown(message)
    return "".join(
        f"<code>{escape_markdown(piece)}</code>" if index % 2 else escape_markdown(piece)
        for index, piece in enumerate(pieces)
    )


def errors_page(errors: list[ErrorMessage], package_dir: Path = PACKAGE_DIR) -> str:
    modules: dict[str, list[ErrorMessage]] = {}
    for error in errors:
        modules.setdefault(error.module, []).append(error)
    lines = [
        "# Error messages",
        "",
        "Every error hf_specdec raises with a fixed message, by module, generated from the source when the site is "
        "built. A message names the argument, shows the value it got (`{...}` below stands for that value) and "
        "says the fix.",
        "",
        f"{len(errors)} messages in {len(modules)} modules.",
        "",
    ]
    for module, module_errors in modules.items():
        lines += [f"## `{module}`", ""]
        summary = module_summary(module, package_dir)
        if summary:
            lines += [message_cell(summary), ""]
        lines += ["| message | error | raised in |", "|---|---|---|"]
        for error in module_errors:
            where = ", ".join(f"<code>{escape_markdown(name)}</code>" for name in error.where)
            lines.append(
                f"| {message_cell(error.message)} | <code>{escape_markdown(error.exception)}</code> | {where} |"
            )
        lines.append("")
    return "\n".join(lines)


def write_with_gen_files(page: str) -> None:
    import mkdocs_gen_files

    with mkdocs_gen_files.open(PAGE, "w") as handle:
        handle.write(page)
    mkdocs_gen_files.set_edit_path(PAGE, "scripts/docs_errors.py")


if __name__ == "<run_path>":  # mkdocs-gen-files: runpy.run_path(script)
    write_with_gen_files(errors_page(collect_errors()))
elif __name__ == "__main__":
    sys.stdout.write(errors_page(collect_errors()))
