"""The `hf-specdec` command line: `demo`, `generate`, `bench`, `serve`, `build-ngram`, `distill`, `train-drafter`.

Every user error (missing file, drafter whose vocabulary does not fit the target, empty corpus, corrupt checkpoint,
a number out of range) ends as one line `hf-specdec: error: ...` on stderr and exit status 2, without a traceback.
Models are loaded from safetensors only (`use_safetensors=True`): a directory holding only a pickle checkpoint is
refused before anything is unpickled. A GGUF file (`--gguf-file`, read by transformers' GGUF loader with the `gguf`
package) holds no pickle either.

One module per command (`demo`, `generate`, `bench`, `serve`; `training` for the three that build drafters), each with its
options (`add_parser`); `common`, `loading` and `arguments` hold what they share. `python -m hf_specdec.cli` and
`python -m hf_specdec` run `main`, as the `hf-specdec` script does.
"""

from __future__ import annotations

import argparse
import sys

from . import bench, demo, generate, serve, training
from .arguments import Formatter
from .common import CLIError, one_line

__all__ = ["main"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from hf_specdec import __version__

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"hf-specdec {__version__} (torch {installed('torch')}, transformers {installed('transformers')})"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-specdec", description=__doc__.splitlines()[0], formatter_class=Formatter)
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, help):
        return commands.add_parser(name, help=help, description=help, formatter_class=Formatter)

    for module in (demo, generate, bench, serve, training):  # the order of `hf-specdec --help`
        module.add_parser(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    threads = torch.get_num_threads()  # the commands set their own; a caller in the same process keeps its own
    # weight-loading bars would bury the one line that matters (the commands' own bars use tqdm directly)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    try:
        return args.func(args)
    except (CLIError, ValueError, TypeError, OSError) as err:
        print(f"hf-specdec: error: {one_line(err)}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
