"""Up-front checks of what the training functions are given (`train_eagle_drafter`, `train_mtp_layers`,
`distill_drafter`): a bad value fails before any answering or training, naming the argument, its value and the fix,
instead of failing late or deep inside torch (or being silently replaced)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

STATE_NAME = "training_state.pt"  # in a `train_eagle_drafter` checkpoint folder: optimizer, step counts, target

__all__ = [
    "STATE_NAME",
    "as_dtype",
    "check_checkpoint_folder",
    "check_eval_fraction",
    "check_int",
    "check_layers",
    "check_number",
    "check_output_dir",
    "check_self_distillation",
    "check_resumed",
    "check_token_texts",
    "eval_split",
    "find_checkpoint",
    "restore_state",
    "target_fingerprint",
]


def check_int(name: str, value, *, minimum: int, example: int, optional: bool = False) -> None:
    """`value` is an int (not a bool) >= `minimum` (or None when `optional`)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        bound = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"`{name}` must be {bound}, got {value!r}. Use for example `{name}={example}`.")


def check_number(name: str, value, *, minimum: float, example, strict: bool = False, optional: bool = False) -> None:
    """`value` is a finite real number >= `minimum` (> when `strict`; None allowed when `optional`)."""
    if optional and value is None:
        return
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (value > minimum if strict else value >= minimum)
    )
    if not ok:
        bound = f"{'>' if strict else '>='} {minimum}"
        raise ValueError(
            f"`{name}` must be a finite number {bound}, got {value!r}. Use for example `{name}={example}`."
        )


def check_eval_fraction(value) -> None:
    """`eval_fraction` in [0, 1): some sequences must be left to train on."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(
            f"`eval_fraction` must be in [0, 1), got {value!r}: it is the fraction of the sequences held out to "
            "measure agreement, and the rest are trained on. Use for example `eval_fraction=0.05`."
        )


def eval_split(order: list[int], eval_fraction: float, owner: str) -> tuple[list[int], list[int]]:
    """`order` (shuffled sequence indices) cut into the held-out ones (at least one) and the training ones; fails
    when no sequence is left to train on."""
    num_eval = max(1, int(eval_fraction * len(order)))
    if num_eval >= len(order):
        raise ValueError(
            f"{owner} holds out {num_eval} of its {len(order)} usable sequences (`eval_fraction={eval_fraction}`, at "
            "least one), leaving none to train on. Give more prompts or texts, or a smaller `eval_fraction`."
        )
    return order[:num_eval], order[num_eval:]


def check_output_dir(output_dir) -> Path | None:
    """`output_dir` as a `Path`: a folder, or a path where one can be created (not a file, nor a broken link)."""
    if output_dir is None:
        return None
    path = Path(output_dir)
    if os.path.lexists(path) and not path.is_dir():
        what = "a broken link" if path.is_symlink() else "a file"
        raise ValueError(
            f"`output_dir` {str(output_dir)!r} is {what}, not a folder. Pass a folder (it is created if missing), for "
            "example `output_dir='my-drafter'`."
        )
    return path


def check_checkpoint_folder(folder: Path) -> None:
    """A `checkpoint-<step>` folder about to be written is not a link (never written through to where it points)."""
    if folder.is_symlink():
        raise OSError(
            f"{folder} is a link (to {os.readlink(folder)!r}), not a checkpoint folder this training wrote: hf_specdec "
            "does not write checkpoints through a link. Remove the link, or pass another `output_dir`."
        )


def check_token_texts(texts, vocab: int, name: str = "texts") -> None:
    """Each entry of `texts` that is not a string holds integer token ids in [0, `vocab`)."""
    for number, text in enumerate(texts or []):
        if isinstance(text, str):
            continue
        try:
            ids = torch.as_tensor(text)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(
                f"`{name}[{number}]` is neither a string nor a sequence of token ids ({error}). Pass strings (with "
                "`tokenizer=`) or lists of int token ids."
            ) from None
        check_token_ids(ids, vocab, f"{name}[{number}]")


def check_token_ids(ids: torch.Tensor, vocab: int | None, name: str) -> None:
    """`ids` holds integer token ids, in [0, `vocab`) when `vocab` is given."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(
            f"`{name}` holds {ids.dtype} values, not integer token ids (they would be truncated). Pass the token ids "
            "as ints (for example `tokenizer(text)['input_ids']`)."
        )
    if vocab is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ValueError(
            f"`{name}` holds the token id {bad}, outside the target's vocabulary [0, {vocab}). Pass ids the target's "
            "tokenizer gave."
        )


def check_layers(layers: Sequence[int] | None, num_layers: int) -> None:
    """`layers` (entries of `output_hidden_states` an EAGLE-3 head reads) is None or a non-empty list of ints in
    [0, `num_layers`]."""
    if layers is None:
        return
    if (
        isinstance(layers, (str, bytes))
        or not isinstance(layers, Sequence)
        or not layers
        or not all(type(i) is int and 0 <= i <= num_layers for i in layers)
    ):
        raise ValueError(
            f"`layers` must be a non-empty list of `output_hidden_states` entries in [0, {num_layers}] (the target "
            f"has {num_layers} layers), got {layers!r}. Leave it None for EAGLE-3's three, or use for example "
            f"`layers=[1, {max(1, num_layers // 2)}, {num_layers}]`."
        )


@torch.no_grad()
def target_fingerprint(target) -> torch.Tensor:
    """A few numbers that tell targets of the same shape apart: the float64 sum and sum of squares of the input
    embeddings and of the output head (the tensors a head is trained against)."""
    values = []
    for module in (target.get_input_embeddings(), target.get_output_embeddings()):
        weight = getattr(module, "weight", None)
        if weight is None:
            values += [0.0, 0.0]
            continue
        total = squares = 0.0
        for rows in weight.detach().split(1024):  # in float64 a block at a time: no copy of the whole table
            rows = rows.double()
            total, squares = total + float(rows.sum()), squares + float(rows.pow(2).sum())
        values += [total, squares]
    return torch.tensor(values, dtype=torch.float64)


def as_dtype(value, name: str) -> torch.dtype | None:
    """`value` (a floating torch dtype or its name, or None) as a `torch.dtype`."""
    if isinstance(value, str):
        if not isinstance(getattr(torch, value, None), torch.dtype):
            raise ValueError(f"`{name}` {value!r} is not a torch dtype; use for example `{name}='bfloat16'`.")
        value = getattr(torch, value)
    if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
        raise ValueError(
            f"`{name}` must be a floating torch.dtype or its name (the target is copied to it), got {value!r}. Use "
            f"for example `{name}=torch.bfloat16`."
        )
    return value


def check_self_distillation(
    target,
    *,
    texts,
    output_dir,
    batch_size,
    warmup_steps,
    eval_fraction,
    max_answer_tokens,
    answer_temperature,
    generation_batch_size,
    learning_rate,
    eagle: dict | None = None,
) -> Path | None:
    """The checks `train_eagle_drafter` and `train_mtp_layers` share (and, in `eagle`, `train_eagle_drafter`'s own
    `draft_vocab_size`, `save_every` and `layers`); returns `output_dir` as a `Path`."""
    if eagle is not None:
        check_int("draft_vocab_size", eagle["draft_vocab_size"], minimum=1, example=32000, optional=True)
        check_int("save_every", eagle["save_every"], minimum=0, example=200)
        check_layers(eagle["layers"], target.config.get_text_config(decoder=True).num_hidden_layers)
    check_int("batch_size", batch_size, minimum=1, example=8)
    check_int("warmup_steps", warmup_steps, minimum=0, example=20)
    check_eval_fraction(eval_fraction)
    check_int("max_answer_tokens", max_answer_tokens, minimum=1, example=256)
    check_number("answer_temperature", answer_temperature, minimum=0.0, example=0.7)
    check_int("generation_batch_size", generation_batch_size, minimum=1, example=16)
    check_number("learning_rate", learning_rate, minimum=0.0, example=1e-3, strict=True, optional=True)
    check_token_texts(texts, target.get_input_embeddings().weight.shape[0])
    return check_output_dir(output_dir)


def find_checkpoint(resume, output_dir: Path | None) -> Path | None:
    """The checkpoint folder `train_eagle_drafter` resumes from: None, the latest in `output_dir` (`resume=True`), or
    the folder `resume` names."""
    if resume in (None, False):
        return None
    if resume is True:
        if output_dir is None:
            raise ValueError("`resume_from_checkpoint=True` needs `output_dir=` (where the checkpoints are).")
        folders = sorted(
            (path for path in output_dir.glob("checkpoint-*") if path.name.removeprefix("checkpoint-").isdigit()),
            key=lambda path: int(path.name.removeprefix("checkpoint-")),
        )
        if not folders:
            raise ValueError(f"`resume_from_checkpoint=True`, but {output_dir} holds no checkpoint-<step> folder.")
        if not (folders[-1] / STATE_NAME).is_file():
            raise ValueError(
                f"`resume_from_checkpoint=True`: the latest checkpoint {folders[-1]} has no {STATE_NAME} (cut short "
                "while it was written?); delete that folder to resume from the one before it."
            )
        return folders[-1]
    path = Path(resume)
    if not (path / STATE_NAME).exists():
        raise ValueError(f"`resume_from_checkpoint` {str(resume)!r} is not a checkpoint folder (no {STATE_NAME}).")
    return path


def check_resumed(config, checkpoint: Path, *, layers, draft_vocab_size) -> None:
    """`layers` and `draft_vocab_size`, when given, are the resumed checkpoint's (never silently replaced by them)."""
    for name, asked, saved in (
        ("layers", None if layers is None else list(layers), list(config.eagle_layers)),
        ("draft_vocab_size", draft_vocab_size, config.draft_vocab_size),
    ):
        if asked is not None and asked != saved:
            raise ValueError(
                f"`{name}={asked}`, but the checkpoint {checkpoint} being resumed was trained with `{name}={saved}`. "
                f"Pass `{name}={saved}` (or leave it None) to resume it, or start over in another `output_dir` "
                "without `resume_from_checkpoint`."
            )


def restore_state(file: Path, optimizer, state: dict, target, num_steps: int | None) -> None:
    """Loads the optimizer and the step counts a checkpoint saved; a file that is not what `train_eagle_drafter`
    wrote, one saved for another target (its embeddings or head differ), or one already past `num_steps` fails
    naming it and the fix."""
    from .eagle_data import read_saved

    fix = (
        f"Resume from an earlier checkpoint-<step> folder (delete {file.parent}), or start over without "
        "`resume_from_checkpoint` (--resume)."
    )
    saved = read_saved(file, fix)
    try:
        step, seconds, tokens = int(saved["step"]), float(saved["train_seconds"]), int(saved.get("loss_tokens", 0))
        fingerprint = saved.get("target_fingerprint")  # absent from checkpoints of earlier versions: not checked
        fingerprint = None if fingerprint is None else torch.as_tensor(fingerprint, dtype=torch.float64).flatten()
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        moments = [entry.get("exp_avg") for entry in saved["optimizer"]["state"].values()]
        if len(moments) not in (0, len(parameters)) or any(
            m is not None and tuple(m.shape) != tuple(p.shape) for m, p in zip(moments, parameters)
        ):
            raise TypeError("its optimizer state does not fit the head's parameters")
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as error:
        raise OSError(f"{file} is not the training state `train_eagle_drafter` saves ({error!r}). {fix}") from None
    ours = target_fingerprint(target)
    if fingerprint is not None and (
        fingerprint.shape != ours.shape or not torch.allclose(fingerprint, ours, rtol=1e-4)
    ):
        raise ValueError(
            f"The checkpoint {file.parent} was trained for another target (its embeddings or output head differ from "
            "this one's). Resume it with the target it was trained for, or start over in another `output_dir` "
            "without `resume_from_checkpoint`."
        )
    if num_steps is not None and num_steps < step:
        raise ValueError(
            f"`num_steps={num_steps}`, but the checkpoint {file.parent} being resumed is already at step {step}. "
            f"Pass `num_steps` > {step} to train further, or resume from an earlier checkpoint."
        )
    try:
        optimizer.load_state_dict(saved["optimizer"])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise OSError(f"{file} is not the training state `train_eagle_drafter` saves ({error!r}). {fix}") from None
    state.update(step=step, train_seconds=seconds, loss_tokens=tokens)
