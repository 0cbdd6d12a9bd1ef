"""Held-out code prompts for the zoo's demo and benchmarks, cut from the test split of the corpus.

Three tasks (paper Table 3 style, on code):

- `completion`: a function's context, signature and docstring; the model writes the body.
- `editing`: copy-heavy editing; the prompt holds a whole function, then the same signature with the function
  renamed (`name` -> `name_v2`); the model's natural continuation repeats the body.
- `continuation`: free continuation of a window of a held-out file, cut at a line boundary.

Every prompt ends at the end of a line, before its newline (see `_at_token_boundary`).

Everything is chosen deterministically (sorted files, sha256-ordered candidates), so the prompt file is reproducible.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
from pathlib import Path

__all__ = ["TASKS", "build_prompts", "editing_documents", "load_prompts"]

TASKS = ("completion", "editing", "continuation")
_CONTEXT_CHARS = 600


def _functions(source: str):
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
            yield node


def _lines(source: str) -> list[str]:
    """`source`'s lines as Python's parser counts them (ends kept): broken at "\n", "\r\n" and "\r" only, not at
    the form feeds, U+2028 and other separators `str.splitlines` also breaks at."""
    return io.StringIO(source, newline="").readlines()


def _line_offsets(source: str) -> list[int]:
    offsets, total = [0], 0
    for line in _lines(source):
        total += len(line)
        offsets.append(total)
    return offsets


def _at_token_boundary(key: str, prompt: str, reference: str) -> dict:
    """A prompt never ends in the newline its last line ends with: the byte-level BPE merges a newline with the next
    line's indentation (`"\\n" + "    "` is one token), so a prompt ending in a bare newline token is a context the
    model has rarely seen, and it derails. The newline moves to the start of the reference instead."""
    cut = len(prompt.rstrip("\n"))
    return {"id": key, "prompt": prompt[:cut], "reference": prompt[cut:] + reference}


def _candidates(path: str, source: str) -> dict[str, list[dict]]:
    offsets = _line_offsets(source)
    found = {task: [] for task in TASKS}
    for node in _functions(source):
        start, end = offsets[node.lineno - 1], offsets[node.end_lineno]
        function = source[start:end]
        body_start = node.body[0]
        has_doc = (
            isinstance(body_start, ast.Expr)
            and isinstance(getattr(body_start, "value", None), ast.Constant)
            and isinstance(body_start.value.value, str)
        )
        key = f"{path}:{node.lineno}"
        if has_doc and len(node.body) > 1 and body_start.end_lineno is not None:
            doc_end = offsets[body_start.end_lineno]
            context_start = source.rfind("\n", 0, max(0, start - _CONTEXT_CHARS)) + 1
            body = source[doc_end:end]
            if 150 <= len(body) <= 3000:
                found["completion"].append(_at_token_boundary(key, source[context_start:doc_end], body))
        if 300 <= len(function) <= 1500 and function.lstrip().startswith(("def ", "async def ")):
            first, _, rest = function.partition("\n")
            renamed = first.replace(f"def {node.name}(", f"def {node.name}_v2(", 1)
            if renamed != first:
                found["editing"].append(_at_token_boundary(key, f"{function}\n\n{renamed}\n", rest))
    lines = _lines(source)
    if len(lines) > 120:
        for first_line in range(20, len(lines) - 60, 150):
            window = "".join(lines[first_line : first_line + 40])
            if len(window) > 600:
                found["continuation"].append(
                    _at_token_boundary(
                        f"{path}:{first_line + 1}", window, "".join(lines[first_line + 40 : first_line + 80])
                    )
                )
    return found


def editing_documents(files: list[tuple[str, str]]) -> list[str]:
    """Whole copy-heavy editing documents (a function, then the same function renamed), in the benchmark's format,
    from `(relative_path, text)` pairs; the build uses the train split to teach the target the task."""
    return [
        item["prompt"] + item["reference"]
        for path, source in sorted(files)
        for item in _candidates(path, source)["editing"]
    ]


def build_prompts(files: list[tuple[str, str]], *, per_task: int = 16) -> dict[str, list[dict]]:
    """`per_task` prompts per task from `(relative_path, text)` pairs of held-out files.

    Candidates are ordered by sha256 of their id (a deterministic shuffle) and at most 2 are taken per file, so
    the prompts spread over many modules.
    """
    candidates = {task: [] for task in TASKS}
    for path, source in sorted(files):
        for task, items in _candidates(path, source).items():
            candidates[task].extend(items)
    prompts = {}
    for task in TASKS:
        ordered = sorted(candidates[task], key=lambda item: hashlib.sha256(item["id"].encode()).hexdigest())
        chosen, per_file = [], {}
        for item in ordered:
            path = item["id"].rsplit(":", 1)[0]
            if per_file.get(path, 0) < 2:
                chosen.append(item)
                per_file[path] = per_file.get(path, 0) + 1
            if len(chosen) == per_task:
                break
        prompts[task] = chosen
    return prompts


def load_prompts(path: str | Path | None = None) -> dict[str, list[dict]]:
    """The shipped held-out prompts (`hf_specdec/zoo_models/heldout_prompts.json`), by task."""
    from . import ZOO_DIR

    return json.loads(Path(path or ZOO_DIR / "heldout_prompts.json").read_text())["tasks"]
