"""The files of `generate_dataset` (in `dataset_generation.py`): the rows of a JSONL dataset, checked, and its output
file, read back on `resume` and put in input order at the end.

JSONL is split on "\\n" alone, never on what `str.splitlines` also takes for a line break (U+2028, U+2029, U+0085,
...): a prompt or completion holding one is written raw by `json.dumps(..., ensure_ascii=False)`, inside its string.
An output file is resumed only when it is one this function wrote: every complete line is a row of this dataset, and
a last line cut short by an interruption is dropped only when the file is recognised as ours (a complete row before
it, or the line is the start of one of the rows still missing). Anything else is refused, never truncated.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from .file_writes import replace_file

__all__ = ["WRITTEN", "load_rows", "read_done", "read_jsonl", "rewrite_in_order"]

WRITTEN = ("index", "num_new_tokens", "speculative_stats", "batch_size")  # besides the completion field
EXAMPLE = 'each line must be one JSON object, e.g. {"prompt": "..."}'


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSONL file (one JSON object per line, blank lines skipped).

    A line that is not a JSON object (or not UTF-8) raises a `ValueError` naming the file and the line number."""
    return _read_jsonl_lines(path)[0]


def _read_jsonl_lines(path) -> tuple[list[dict], list[int]]:
    """`(rows, line_numbers)`."""
    rows, numbers = [], []
    with open(path, "rb") as file:  # binary: lines end at b"\n" only
        for number, raw in enumerate(file, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"line {number} of {str(path)!r} is not UTF-8 (byte {raw[err.start]:#04x} at column "
                    f"{err.start + 1}); save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"line {number} of {str(path)!r} is not valid JSON ({err.msg} at column {err.colno}); {EXAMPLE}"
                ) from None
            except RecursionError:
                raise ValueError(
                    f"line {number} of {str(path)!r} nests JSON too deeply to read; {EXAMPLE}, with flat fields"
                ) from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"line {number} of {str(path)!r} is a JSON {type(row).__name__}, not an object; {EXAMPLE}"
                )
            rows.append(row)
            numbers.append(number)
    return rows, numbers


def load_rows(
    dataset,
    text_field: str = "prompt",
    options_field: str = "generation_kwargs",
    completion_field: str = "completion",
) -> list[dict]:
    """The rows of `dataset` (a JSONL path, a `datasets.Dataset` or dicts) as dicts, checked: each has `text_field`
    as a string, if present `options_field` as a dict, and none of the fields `generate_dataset` writes (`index`,
    `completion_field`, ...). Errors name the row (and its line in a JSONL file)."""
    return named_rows(dataset, text_field, options_field, completion_field)[0]


def named_rows(dataset, text_field, options_field, completion_field) -> tuple[list[dict], list[str]]:
    """`load_rows`, with each row's name for errors ("row 3 (line 5 of 'data.jsonl')")."""
    if isinstance(dataset, (str, os.PathLike)):
        path = Path(dataset)
        if not path.is_file():
            raise ValueError(
                f"`dataset` {str(dataset)!r} is not a file; pass a JSONL file, a `datasets.Dataset` or a list of dicts"
            )
        rows, numbers = _read_jsonl_lines(path)
        names = [f"row {index} (line {number} of {str(dataset)!r})" for index, number in enumerate(numbers)]
    else:
        if isinstance(dataset, (Mapping, str, bytes)) or not isinstance(dataset, Iterable):
            raise TypeError(
                f"`dataset` must be a JSONL path, a `datasets.Dataset` or a list of dicts, got {type(dataset).__name__}"
            )
        rows = []
        for index, row in enumerate(dataset):
            if not isinstance(row, Mapping):
                raise TypeError(
                    f"row {index} of `dataset` is a {type(row).__name__}, not a dict; each row must be a "
                    'dict such as {"prompt": "..."}'
                )
            rows.append(dict(row))
        names = [f"row {index} of `dataset`" for index in range(len(rows))]
    for row, name in zip(rows, names):
        text = row.get(text_field)
        if not isinstance(text, str):
            found = "has no" if text_field not in row else f"has a {type(text).__name__} in its"
            raise ValueError(
                f"{name} {found} {text_field!r} field (its fields: {sorted(row)}); every row needs the "
                "prompt text there, or pass the field that holds it as `text_field` (--text-field)"
            )
        options = row.get(options_field)
        if options is not None and not isinstance(options, dict):
            raise ValueError(
                f"{name}: {options_field!r} must be a dict of `generate` options such as "
                f'{{"max_new_tokens": 32}}, got {options!r}'
            )
        clash = [field for field in (*WRITTEN, completion_field) if field in row]
        if clash:
            raise ValueError(
                f"{name} has its own {clash[0]!r} field ({row[clash[0]]!r}), which `generate_dataset` writes "
                f"(fields it writes: {[*WRITTEN, completion_field]}); rename that field in the dataset"
                + (", or pass another `completion_field` (--completion-field)" if clash[0] == completion_field else "")
            )
    return rows, names


def _row_start(row: dict, index: int) -> bytes | None:
    """How the line `generate_dataset` writes for `row` begins: its fields, then its index."""
    try:
        return (json.dumps(row, ensure_ascii=False)[:-1] + f', "index": {index}').encode("utf-8")
    except (TypeError, ValueError):
        return None


def read_done(output: Path, rows: list[dict], text_field: str) -> tuple[dict[int, str], int, bool]:
    """`(done, keep_bytes, needs_newline)`: the rows a previous run wrote (index -> line), how many bytes of the file
    to keep (a last line cut short by an interruption is dropped), and whether the kept bytes lack a final newline."""
    done, keep = {}, 0
    with open(output, "rb") as file:
        data = file.read()
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, start=1):
        last = number == len(lines)
        if not raw.strip():
            keep += len(raw) + (not last)
            continue
        try:
            line = raw.decode("utf-8")
            record = json.loads(line)
            index = record["index"]
        except (ValueError, KeyError, TypeError, RecursionError):
            if last and (done or _starts_a_missing_row(raw, rows, done)):  # cut short: generated again
                break
            raise ValueError(
                f"cannot resume: line {number} of {str(output)!r} is not a row this function wrote"
                + (" (nor the start of one)" if last else "")
                + "; pass a new output path, or remove the file to start over"
            ) from None
        known = isinstance(index, int) and 0 <= index < len(rows)
        if not known or record.get(text_field) != rows[index][text_field]:
            raise ValueError(
                f"cannot resume: line {number} of {str(output)!r} (index {index!r}) is not a row of this "
                "dataset; pass the dataset it was written for, or a new output path"
            )
        if index in done:
            raise ValueError(f"cannot resume: row {index} appears twice in {str(output)!r} (line {number})")
        done[index] = line
        keep += len(raw) + (not last)
    return done, keep, keep > 0 and data[keep - 1 : keep] != b"\n"


def _starts_a_missing_row(raw: bytes, rows: list[dict], done: dict) -> bool:
    """Whether `raw` is the beginning of the line of a row not yet written (what an interruption leaves)."""
    for index, row in enumerate(rows):
        start = None if index in done else _row_start(row, index)
        if start is not None and (start.startswith(raw) or raw.startswith(start)):
            return True
    return False


def rewrite_in_order(output: Path) -> None:
    """Sorts the finished file by row index: a new file renamed over it, so an interruption here loses nothing and
    a link planted beside it is never written through."""
    data = output.read_bytes() if output.exists() else b""
    lines = [line for line in data.decode("utf-8").split("\n") if line.strip()]
    lines.sort(key=lambda line: json.loads(line)["index"])
    ordered = "".join(line + "\n" for line in lines).encode("utf-8")
    replace_file(output, lambda temporary: temporary.write_bytes(ordered))
