"""Writing files that never follow a link: every file hf_specdec saves (heads, tables, training data and state,
logs, a dataset's ordered output) is written to a new temporary file beside it, created here (`O_EXCL`: never a link
someone planted) and then renamed over the destination. A link standing at the destination is replaced by the file,
never written through to whatever it points at, and an interruption leaves the old file whole. A file appended to
line by line (a dataset's output while it is generated) is opened with `O_NOFOLLOW`: a link there is refused."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["append_to", "replace_file", "save_into", "write_text"]

_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)  # not on Windows, where O_EXCL already refuses an existing link


def _new_file_beside(path: Path) -> Path:
    """A new, empty regular file in `path`'s folder, created by this call (mode 0666 less the umask)."""
    while True:
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o666))
        except FileExistsError:
            continue
        return temporary


def replace_file(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Writes `path` by calling `write(temporary)` on a new file beside it, then renaming that over `path`."""
    path = Path(path)
    temporary = _new_file_beside(path)
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """`Path(path).write_text(text, encoding="utf-8")`, through a new file (see the module docstring)."""
    replace_file(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def append_to(path: str | os.PathLike):
    """`path` opened to append text (created when missing), refusing a link (`O_NOFOLLOW`): for a file written a
    line at a time, which cannot go through a new file."""
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NO_FOLLOW, 0o666)
    return os.fdopen(descriptor, "a", encoding="utf-8", newline="")


def save_into(directory: str | os.PathLike, save: Callable[[Path], None]) -> list[str]:
    """Runs `save(folder)` (a `save_pretrained` of another library, which opens its files by name) on a new folder
    inside `directory`, then renames each file it wrote over the file of that name in `directory`; returns their
    names."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=directory, prefix=".saving-"))
    try:
        save(folder)
        names = []
        for written in sorted(folder.iterdir()):
            if written.is_dir() or written.is_symlink():
                raise OSError(f"saving into {directory} wrote {written.name!r}, which is not a plain file")
            os.replace(written, directory / written.name)
            names.append(written.name)
        return names
    finally:
        shutil.rmtree(folder, ignore_errors=True)
