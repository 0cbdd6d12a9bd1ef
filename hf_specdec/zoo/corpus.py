"""The zoo's corpus: the running interpreter's standard library `.py` files, split by module into train and test.

Decisions (each one recorded in the manifest so every number can be reproduced):

- Source: `sysconfig.get_paths()["stdlib"]`, every `*.py` below it, minus `site-packages` / `dist-packages`.
- Test suites are **excluded** (`test/`, `tests/`, `idle_test/`, `test_*.py`): they are 60% of the bytes, full of
  generated data and fixtures, and would make the held-out set leak through copied snippets. Files over
  `MAX_FILE_BYTES` (generated tables such as `pydoc_data/topics.py`) are excluded too.
- The unit of the split is the **top-level module** (`json/decoder.py` and `json/__init__.py` go together,
  `textwrap.py` alone), so a package never has files on both sides. A module is held out when the first 8 hex
  digits of sha256 of its name, read as an integer, fall below `test_fraction * 16**8`: deterministic, and
  independent of the interpreter's file list.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ..file_writes import write_text

__all__ = ["CorpusFile", "build_manifest", "load_manifest", "read_split", "stdlib_root", "write_manifest"]

MAX_FILE_BYTES = 200_000
TEST_FRACTION = 0.1
_TEST_DIRS = {"test", "tests", "idle_test"}
_SITE_DIRS = {"site-packages", "dist-packages"}


@dataclass(frozen=True)
class CorpusFile:
    path: str  # relative to the stdlib root, posix separators
    sha256: str
    num_bytes: int
    module: str  # top-level module: the split unit
    split: str  # "train" or "test"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def module_split(module: str, test_fraction: float = TEST_FRACTION) -> str:
    """`"test"` or `"train"` from the hash of the top-level module name alone."""
    bucket = int(hashlib.sha256(module.encode()).hexdigest()[:8], 16)
    return "test" if bucket < test_fraction * 16**8 else "train"


def _excluded(relative: Path) -> bool:
    parts = relative.parts
    if any(part in _SITE_DIRS or part in _TEST_DIRS or part == "__pycache__" for part in parts[:-1]):
        return True
    return parts[-1].startswith("test_")


def build_manifest(root: str | Path | None = None, *, test_fraction: float = TEST_FRACTION) -> list[CorpusFile]:
    """Every kept `.py` file under `root` (default: the stdlib), sorted by path, with its hash and split."""
    root = Path(root).resolve() if root is not None else stdlib_root()
    if not root.is_dir():
        raise ValueError(f"`root` must be a directory of Python sources, got {str(root)!r}.")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"`test_fraction` must be in (0, 1), got {test_fraction}.")
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _excluded(relative) or not path.is_file():
            continue
        data = path.read_bytes()
        if len(data) > MAX_FILE_BYTES or not data.strip():
            continue
        module = relative.parts[0].removesuffix(".py")
        files.append(
            CorpusFile(
                relative.as_posix(),
                hashlib.sha256(data).hexdigest(),
                len(data),
                module,
                module_split(module, test_fraction),
            )
        )
    if not files:
        raise ValueError(f"No usable `.py` files under {str(root)!r}.")
    return files


def write_manifest(
    files: list[CorpusFile], path: str | Path, *, root: str | Path | None = None, test_fraction: float = TEST_FRACTION
) -> dict:
    manifest = {
        "source": "python stdlib (sysconfig.get_paths()['stdlib'])",
        "python_version": sys.version.split()[0],
        "root": str(Path(root).resolve() if root is not None else stdlib_root()),
        "split_rule": "test iff int(sha256(top_level_module)[:8], 16) < test_fraction * 16**8",
        "test_fraction": test_fraction,
        "excluded": "site-packages, dist-packages, test/, tests/, idle_test/, test_*.py, "
        f"files over {MAX_FILE_BYTES} bytes, empty files",
        "num_files": {split: sum(f.split == split for f in files) for split in ("train", "test")},
        "num_bytes": {split: sum(f.num_bytes for f in files if f.split == split) for split in ("train", "test")},
        "files": [f.__dict__ for f in files],
    }
    write_text(path, json.dumps(manifest, indent=1) + "\n")  # never through a link
    return manifest


def load_manifest(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def read_split(manifest: dict, split: str, *, root: str | Path | None = None, verify: bool = True) -> list[str]:
    """The texts of one split, in manifest order; with `verify`, a file whose sha256 differs is an error."""
    if split not in ("train", "test"):
        raise ValueError(f"`split` must be 'train' or 'test', got {split!r}.")
    root = Path(root if root is not None else manifest["root"])
    texts = []
    for entry in manifest["files"]:
        if entry["split"] != split:
            continue
        data = (root / entry["path"]).read_bytes()
        if verify and hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ValueError(
                f"{entry['path']} differs from the manifest (sha256 mismatch): a different Python "
                f"than {manifest['python_version']}? Rebuild the manifest or use that interpreter."
            )
        texts.append(data.decode("utf-8", errors="replace"))
    return texts
