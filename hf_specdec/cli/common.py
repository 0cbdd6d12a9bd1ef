"""What every command shares: the user error and its one line, CPU threads, progress bars, output paths checked
before any work, and prompts and text files read from disk."""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEFAULT_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
TASK_PROMPTS = 16  # held-out prompts per task in the embedded zoo (hf_specdec/zoo_models/heldout_prompts.json)
TASKS = ["completion", "editing", "continuation"]  # the kinds of held-out prompt


class CLIError(Exception):
    """A user error, printed as one line."""


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def set_threads(threads: int | None) -> str:
    """Sets torch's CPU threads and says what was used. By default no more threads than cores are idle (from the
    load average): with another process on the machine, torch's default of one thread per core oversubscribes the
    cores, and a benchmark then measures the scheduler (10-100x slower, and noisy)."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
        return f"{threads} thread(s) (--threads)"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        load = 0.0
    chosen = max(1, min(torch.get_num_threads(), cores, int(cores - load + 0.5)))
    torch.set_num_threads(chosen)
    return f"{chosen} thread(s) ({cores} cores, load {load:.1f}; pass --threads N to choose)"


def progress(total: int, description: str):
    """A progress bar on stderr that shows up only when the work takes longer than a couple of seconds."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, delay=2.0, file=sys.stderr, leave=False, unit="run")


def check_output_file(flag: str, name: str | None) -> None:
    """Fails before any work when a result file could not be written at the end."""
    if name is None:
        return
    path = Path(name).expanduser()
    folder = path.parent
    if not folder.is_dir():
        raise CLIError(
            f"{flag} {name!r}: the folder {str(folder)!r} does not exist; create it first or pick another path"
        )
    if path.is_dir():
        raise CLIError(f"{flag} {name!r} is a directory; pass a file name")
    if not os.access(folder, os.W_OK):
        raise CLIError(f"{flag} {name!r}: the folder {str(folder)!r} is not writable")


def check_output_dir(flag: str, name: str) -> None:
    path = Path(name).expanduser()
    if path.exists() and not path.is_dir():
        raise CLIError(f"{flag} {name!r} is a file; pass a directory (it is created if missing)")


def read_text_file(path: Path) -> str | None:
    """The file's text, or None when it is binary (NUL bytes, or not UTF-8)."""
    data = path.read_bytes()
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def read_prompt(args) -> str:
    if args.prompt_file is not None:
        try:
            text = read_text_file(Path(args.prompt_file))
        except OSError as err:
            raise CLIError(f"cannot read --prompt-file {args.prompt_file!r}: {err.strerror or err}") from None
        if text is None:
            raise CLIError(
                f"--prompt-file {args.prompt_file!r} is not a UTF-8 text file (binary data); pass a text file"
            )
        if not text:
            raise CLIError(f"--prompt-file {args.prompt_file!r} is empty")
        return text
    if args.prompt is not None and not args.prompt:
        raise CLIError("--prompt is empty; pass some text, or drop --prompt for the default prompt")
    return args.prompt if args.prompt is not None else DEFAULT_PROMPT


def read_texts(files: list[str]) -> list[str]:
    """The texts of `files` (directories: their *.py files). A binary file named on the command line is an error;
    binary files found inside a directory are skipped, and said so on stderr."""
    texts, skipped = [], []
    for name in files:
        path = Path(name)
        paths = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in paths:
            try:
                text = read_text_file(file)
            except OSError as err:
                raise CLIError(f"cannot read {str(file)!r}: {err.strerror or err}") from None
            if text is None:
                if not path.is_dir():
                    raise CLIError(f"{str(file)!r} is not a UTF-8 text file (binary data); drop it from the corpus")
                skipped.append(str(file))
                continue
            texts.append(text)
    if skipped:
        print(
            f"hf-specdec: warning: skipped {len(skipped)} binary or non-UTF-8 file(s): {', '.join(skipped[:5])}"
            f"{' ...' if len(skipped) > 5 else ''}",
            file=sys.stderr,
        )
    if not any(text.strip() for text in texts):
        raise CLIError(f"the corpus is empty: {' '.join(files)} holds no text")
    return texts
