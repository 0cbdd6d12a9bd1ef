"""argparse pieces the commands share: number types whose errors say what is expected, the help formatter, and the
option groups several commands take (threads, training, target and drafter)."""

from __future__ import annotations

import argparse


def int_at_least(minimum: int, wording: str):
    """An argparse `type` accepting ints >= `minimum`, with errors that say what is expected."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wording}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {wording}, got {value} (for example {minimum})")
        return value

    return parse


positive_int = int_at_least(1, "a positive int")
non_negative_int = int_at_least(0, "an int >= 0")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every default, and `--drafter KIND [PATH]` as one kind with an optional path (argparse would print
    `KIND [PATH] [KIND [PATH] ...]`, as if the option repeated)."""

    def _format_args(self, action, default_metavar):
        if action.metavar == "KIND [PATH]":
            return action.metavar
        return super()._format_args(action, default_metavar)

    def _get_help_string(self, action):
        if action.default is None or action.default is argparse.SUPPRESS or action.default is False:
            return action.help
        return super()._get_help_string(action)


def add_threads(sub) -> None:
    """`--threads N`, which every command that runs a model takes."""
    sub.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="torch CPU threads (default: no more than the idle cores, from the load average)",
    )


def add_training(sub) -> None:
    """The options of the commands that train (`distill`, `train-drafter`): learning rate, seed, precision, device."""
    sub.add_argument("--lr", type=positive_float, default=1e-3, help="learning rate")
    sub.add_argument("--seed", type=int, default=0, help="torch seed")
    sub.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"], help="accelerate's setting")
    sub.add_argument("--cpu", action="store_true", help="force the CPU even when an accelerator is present")
    add_threads(sub)


def add_model_args(sub, gamma_nargs: str | None = None) -> None:
    """The target, drafter, prompt and dtype options of `generate` and `bench`; `gamma_nargs="+"`: several γs."""
    sub.add_argument(
        "--target",
        default=None,
        metavar="PATH",
        help="local directory or Hub id of a causal LM, safetensors only (default: the embedded zoo model)",
    )
    sub.add_argument(
        "--drafter",
        nargs="+",
        metavar="KIND [PATH]",
        default=None,
        help="prompt_lookup | ngram [PATH] | model [PATH]: PATH is a local directory or Hub id, "
        "optional with the embedded target (default: model, the embedded distilled drafter)",
    )
    if gamma_nargs:
        sub.add_argument(
            "--gamma",
            type=positive_int,
            nargs=gamma_nargs,
            default=[4],
            metavar="N",
            help="one or more draft lengths, each measured at a constant γ",
        )
    else:
        sub.add_argument(
            "--gamma",
            type=positive_int,
            default=None,
            metavar="N",
            help="draft length (default: the drafter's own, as in `generate`: 10 for prompt lookup, else 5)",
        )
    sub.add_argument(
        "--max-new-tokens", type=positive_int, default=128, metavar="N", help="tokens to generate per prompt"
    )
    sub.add_argument(
        "--prompt", default=None, metavar="TEXT", help="the prompt text (default: a short Python function header)"
    )
    sub.add_argument("--prompt-file", default=None, metavar="FILE", help="read the prompt from this UTF-8 text file")
    sub.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype the models are loaded in",
    )
    add_threads(sub)
