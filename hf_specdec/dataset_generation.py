"""Generation over a whole dataset: length-sorted batches through the batched speculative loop, data-parallel across
the processes of an `accelerate launch` (or `torchrun`), gathered in input order into one JSONL file, resumable.

Vocabulary: a **row** is one input record (a dict with a text field and optional per-row generation options); its
**index** is its position in the dataset (0-based, blank JSONL lines not counted); a **batch** is the rows generated
by one `generate` call. Batches are formed once, from the rows still missing, before they are dealt out to the
processes, so the same rows meet in the same batches whatever the number of processes.

The output file is written by the main process only, created when the first rows come back (options that fail on
the first batch leave no file behind). While the run goes on it appends each batch's rows as they come back (any
order, each line carrying its `index`); at the end it rewrites the file in input order (a new file renamed into
place; a link is never written through). After an interruption, `resume=True` reads the rows already there, drops a
last line cut short by the interruption, and generates only the rows still missing: no row is lost or written twice.
It resumes only a file this function wrote (`dataset_files.py` says how it recognises one), and refuses any other.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch

from .dataset_files import WRITTEN, load_rows, named_rows, read_done, read_jsonl, rewrite_in_order
from .file_writes import append_to

__all__ = ["generate_dataset", "load_rows", "read_jsonl"]

# set by `generate_dataset` itself (from the row's prompt): never a row's or the caller's option
_OWN_OPTIONS = ("input_ids", "inputs", "attention_mask", "return_dict_in_generate")


def _batches(
    pending: list[int], lengths: list[int], rows: list[dict], options_field: str, batch_size: int
) -> list[list[int]]:
    """Rows with the same per-row options, longest first (stable by index), in batches of at most `batch_size`."""
    groups: dict[str, list[int]] = {}
    for index in pending:
        groups.setdefault(json.dumps(rows[index].get(options_field) or {}, sort_keys=True), []).append(index)
    batches = []
    for members in groups.values():
        members.sort(key=lambda index: -lengths[index])
        batches.extend(members[start : start + batch_size] for start in range(0, len(members), batch_size))
    return batches


def _pad_id(tokenizer, model) -> int:
    for value in (
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        model.generation_config.pad_token_id,
        model.generation_config.eos_token_id,
    ):
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0  # any id: padding is masked out, and without an EOS no row finishes early


def _eos_ids(generation_config, options: dict) -> set[int]:
    eos = options.get("eos_token_id", generation_config.eos_token_id)
    return set() if eos is None else set(eos if isinstance(eos, list) else [eos])


def _generate_batch(
    model, tokenizer, rows, batch, token_ids, pad_id, device, options_field, completion_field, generate_kwargs, seed
) -> list[dict]:
    width = max(len(token_ids[index]) for index in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [rows, width]: left-padded
    attention_mask = torch.zeros(len(batch), width, dtype=torch.long)  # [rows, width]
    for r, index in enumerate(batch):
        ids = token_ids[index]
        input_ids[r, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[r, width - len(ids) :] = 1
    options = {"pad_token_id": pad_id, **generate_kwargs, **(rows[batch[0]].get(options_field) or {})}
    if seed is not None:  # the batch's own seed: the same samples whatever process generates it
        torch.manual_seed(seed + min(batch))
    out = model.generate(
        input_ids.to(device),
        attention_mask=attention_mask.to(device),
        return_dict_in_generate=True,
        **options,
    )
    sequences = out.sequences if hasattr(out, "sequences") else out  # [rows, width + new]
    if sequences.shape[0] != len(batch):
        raise ValueError(
            f"`generate_dataset` writes one completion per row, but `generate` returned "
            f"{sequences.shape[0]} sequences for {len(batch)} rows; drop `num_return_sequences`, or "
            "repeat the rows in the dataset"
        )
    stats = getattr(out, "speculative_stats", None)
    # each row's own statistics (`rows`: one entry per row of a batch; a batch of one is the call itself)
    row_stats = (
        [None] * len(batch)
        if stats is None
        else ([row.to_dict() for row in stats.rows] if len(batch) > 1 else [stats.to_dict()])
    )
    eos = _eos_ids(model.generation_config, options)
    records = []
    for r, index in enumerate(batch):
        new = sequences[r, width:].tolist()
        ends = [i for i, token in enumerate(new) if token in eos]
        new = new[: ends[0] + 1] if ends else new  # finished rows are padded after their EOS
        record = dict(rows[index])
        record.update(
            {
                "index": index,
                completion_field: tokenizer.decode(new, skip_special_tokens=True),
                "num_new_tokens": len(new),
                "speculative_stats": row_stats[r],
                "batch_size": len(batch),
            }
        )
        records.append(record)
    return records


def _check_options(model, rows, names, options_field: str, generate_kwargs: dict) -> None:
    """Fails before any work on `generate` options that could never run: one `generate_dataset` sets itself, or a
    value `GenerationConfig` refuses (`{"max_new_tokens": "5"}`); each distinct set of a row's options is checked once,
    naming the first row that carries it."""
    checked = set()
    for row, name in zip(rows, names):
        options = row.get(options_field) or {}
        key = json.dumps(options, sort_keys=True, default=repr)
        if key in checked:
            continue
        checked.add(key)
        where = f"{name}: its {options_field!r} {options!r}" if options else "`generate_kwargs`"
        own = [option for option in _OWN_OPTIONS if option in options]
        if own:
            raise ValueError(f"{where} set {own}, which `generate_dataset` sets itself (from the prompt); drop them")
        config = copy.deepcopy(model.generation_config)
        try:
            config.update(**{**generate_kwargs, **options})
            config.validate(user_set_attributes=set())  # errors only: warnings come once, from `generate`
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"{where} are not valid `generate` options ({type(error).__name__}: {error}); fix them (e.g. "
                '{"max_new_tokens": 32}, numbers as numbers)'
            ) from None


def process_state():
    """accelerate's `PartialState` for this process: the launch's processes (`accelerate launch`, `torchrun`) or a
    single one. On a machine without an accelerator, or with `ACCELERATE_USE_CPU=true` (what `accelerate launch
    --cpu` sets), it is built with `cpu=True`: `PartialState()` reads neither, and would then leave every process of
    a CPU launch on its own instead of joining them with gloo."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    if PartialState._shared_state:  # already built (by an `Accelerator` of the caller, say): use it as it is
        return PartialState()
    available = torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not available)


def _tensor_parallel(model) -> bool:
    return (getattr(model, "tp_size", None) or 1) > 1 or getattr(model, "_device_mesh", None) is not None


def generate_dataset(
    model,
    tokenizer,
    dataset,
    output_file: str | os.PathLike,
    *,
    text_field: str = "prompt",
    options_field: str = "generation_kwargs",
    completion_field: str = "completion",
    batch_size: int = 8,
    resume: bool = False,
    seed: int | None = None,
    add_special_tokens: bool = True,
    show_progress: bool = True,
    **generate_kwargs: Any,
) -> int:
    r"""
    Generates a completion for every row of a dataset into one JSONL file, data-parallel across processes.

    Run it in one process, or in every process of `accelerate launch` / `torchrun` (the rows are dealt out with
    accelerate's `split_between_processes` and gathered back with `gather_object`; each process loads its own model
    on its own device). Rows are sorted by prompt length and generated `batch_size` at a time through the batched
    speculative loop; rows whose `options_field` differs go to different batches. A tensor-parallel model
    (`tp_plan="auto"`) computes every batch in all its processes together, so its rows are not split.

    Each output line holds the input row's fields, `index` (its position in the dataset), the completion (without
    the prompt), `num_new_tokens`, `speculative_stats` (the row's own `SpeculativeStats.to_dict()`: its entry of
    `speculative_stats.rows` when it was generated in a batch; a padded batch's round counts as one target call for
    each of its rows) and `batch_size` (the rows generated together with it). The file ends in input order. An
    interrupted run continues with `resume=True`.

    Args:
        model ([`~transformers.PreTrainedModel`]):
            The target, on any device or dispatched by accelerate (`device_map=...`); `hf_specdec.enable` is applied
            to it.
        tokenizer ([`~transformers.PreTrainedTokenizerBase`]):
            Its tokenizer. It is not modified (padding is done here, on the left).
        dataset (`str`, `os.PathLike`, `datasets.Dataset` or list of dicts):
            A JSONL file (one object per line), a `datasets` dataset, or dicts. Every row needs `text_field`.
        output_file (`str` or `os.PathLike`):
            The JSONL file to write. It must not exist unless `resume=True`, and must not be a symbolic link.
        text_field (`str`, *optional*, defaults to `"prompt"`):
            The row field holding the prompt text.
        options_field (`str`, *optional*, defaults to `"generation_kwargs"`):
            An optional row field holding a dict of `generate` options for that row (e.g. `{"max_new_tokens": 16}`),
            applied over `generate_kwargs`. Options that could never run fail before any work, naming the row.
        completion_field (`str`, *optional*, defaults to `"completion"`):
            The output field holding the generated text. A row that has a field of this name (or `index`,
            `num_new_tokens`, `speculative_stats`, `batch_size`) is refused rather than overwritten.
        batch_size (`int`, *optional*, defaults to 8):
            Rows per `generate` call.
        resume (`bool`, *optional*, defaults to `False`):
            Continue a partial `output_file` written by an interrupted run of the same dataset. Any other file is
            refused, never truncated.
        seed (`int`, *optional*):
            For sampling: each batch is seeded with `seed` plus its smallest row index, so the samples do not depend
            on the number of processes.
        add_special_tokens (`bool`, *optional*, defaults to `True`):
            Passed to the tokenizer.
        show_progress (`bool`, *optional*, defaults to `True`):
            A progress bar on the main process.
        generate_kwargs:
            Everything else goes to `model.generate` (`assistant_model=`, `drafter=`, `speculative_gamma=`,
            `max_new_tokens=`, `do_sample=`, ...).

    Returns:
        `int`: the number of rows generated by this call (all processes together; rows found by `resume` are not
        counted).

    Example:

    ```python
    >>> import json, tempfile, torch, hf_specdec
    >>> from hf_specdec import zoo
    >>> target, _, tokenizer = zoo.load_default()
    >>> folder = tempfile.mkdtemp()
    >>> with open(f"{folder}/prompts.jsonl", "w") as file:
    ...     for text in ["def add(a, b):", "import os\n", "class Stack:"]:
    ...         print(json.dumps({"prompt": text}), file=file)
    >>> hf_specdec.generate_dataset(target, tokenizer, f"{folder}/prompts.jsonl", f"{folder}/out.jsonl",
    ...                             drafter="prompt_lookup", max_new_tokens=8, batch_size=2, show_progress=False)
    3
    >>> rows = [json.loads(line) for line in open(f"{folder}/out.jsonl")]
    >>> [row["index"] for row in rows], rows[0]["num_new_tokens"]
    ([0, 1, 2], 8)

    ```
    """
    from accelerate.utils import gather_object

    from .devices import execution_device
    from .mixin import enable

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"`batch_size` must be a positive int, got {batch_size!r}. Use `batch_size=8`, or 1 for one "
            "row per `generate` call."
        )
    for name, value in (
        ("text_field", text_field),
        ("options_field", options_field),
        ("completion_field", completion_field),
    ):
        if not isinstance(value, str) or not value:
            raise ValueError(f"`{name}` must be a non-empty str, got {value!r}")
    if completion_field in WRITTEN or completion_field == text_field:
        raise ValueError(
            f"`completion_field` {completion_field!r} clashes with a field this function writes; pick another name"
        )
    own = [key for key in _OWN_OPTIONS if key in generate_kwargs]
    if own:
        raise ValueError(f"`generate_dataset` sets {own} itself (from each row's prompt); drop them")
    output = Path(output_file)
    if output.is_symlink():
        raise ValueError(
            f"`output_file` {str(output_file)!r} is a symbolic link (to {os.readlink(output)!r}); "
            "`generate_dataset` never writes through a link: pass the path of the file itself"
        )
    if output.is_dir():
        raise ValueError(f"`output_file` {str(output_file)!r} is a directory; pass a file name")
    if not output.parent.is_dir():
        raise ValueError(
            f"`output_file` {str(output_file)!r}: the folder {str(output.parent)!r} does not exist; create it first"
        )
    if output.exists() and not resume:
        raise ValueError(
            f"`output_file` {str(output_file)!r} exists; pass `resume=True` (--resume) to continue it "
            "after an interruption, or choose another path"
        )
    rows, names = named_rows(dataset, text_field, options_field, completion_field)
    model = enable(model)
    _check_options(model, rows, names, options_field, generate_kwargs)

    tensor_parallel = _tensor_parallel(model)
    for options in [generate_kwargs, *(row.get(options_field) or {} for row in rows)]:
        if options.get("num_return_sequences", 1) != 1:
            raise ValueError(
                f"`generate_dataset` writes one completion per row, got num_return_sequences="
                f"{options['num_return_sequences']}; drop it, or repeat the rows in the dataset"
            )
    samples = generate_kwargs.get("do_sample") or any((row.get(options_field) or {}).get("do_sample") for row in rows)
    if tensor_parallel and samples and seed is None:
        raise ValueError(
            "sampling with a tensor-parallel model needs `seed` (--seed): every process computes the same "
            "batch and must draw the same tokens"
        )
    if tensor_parallel:  # every process computes every batch together; rank 0 writes
        state, processes, is_main = None, 1, torch.distributed.get_rank() == 0
    else:
        state = process_state()
        processes, is_main = state.num_processes, state.is_main_process

    done, keep_bytes, needs_newline = read_done(output, rows, text_field) if output.exists() else ({}, 0, False)
    _barrier(state, tensor_parallel)  # every process has read the file before the main process touches it
    token_ids = {
        index: tokenizer(rows[index][text_field], add_special_tokens=add_special_tokens)["input_ids"]
        for index in range(len(rows))
        if index not in done
    }
    for index, ids in token_ids.items():
        if not ids:
            raise ValueError(
                f"{names[index]}: its {text_field!r} is empty after tokenization; every prompt needs at least one token"
            )
    lengths = {index: len(ids) for index, ids in token_ids.items()}
    batches = _batches(sorted(token_ids), lengths, rows, options_field, batch_size)
    # dealt round-robin (long and short batches alike to every process), then padded with empty batches so that every
    # process takes the same number of steps: each step gathers once from all of them
    steps = -(-len(batches) // processes)
    dealt = [
        batches[step * processes + p] if step * processes + p < len(batches) else []
        for p in range(processes)
        for step in range(steps)
    ]
    if state is not None and processes > 1:
        with state.split_between_processes(dealt) as mine:
            mine = list(mine)
    else:
        mine = dealt

    device = execution_device(model)
    pad_id = _pad_id(tokenizer, model)
    file = None  # the output, opened (created) when the first rows come back: a failed first batch leaves none
    if is_main and output.exists():  # resumed: the last line, if cut short, is dropped
        file = append_to(output)
        os.ftruncate(file.fileno(), keep_bytes)
        file.write("\n" if needs_newline else "")
    progress = None
    if is_main and show_progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=len(rows), initial=len(done), desc="generate", unit="row", dynamic_ncols=True)
    written = 0
    try:
        for batch in mine:
            try:
                records = (
                    _generate_batch(
                        model,
                        tokenizer,
                        rows,
                        batch,
                        token_ids,
                        pad_id,
                        device,
                        options_field,
                        completion_field,
                        generate_kwargs,
                        seed,
                    )
                    if batch
                    else []
                )
            except (TypeError, ValueError) as error:  # named when the rows' own options may be the cause
                options = rows[batch[0]].get(options_field)
                if not options:
                    raise
                then = f", then go on with `resume=True` (--resume): {str(output)!r} keeps the rows written"
                raise ValueError(
                    f"{', '.join(names[index] for index in batch)}, with {options_field!r} {options!r}: `generate` "
                    f"failed ({type(error).__name__}: {error}). Fix or drop these rows' {options_field!r}"
                    + (then if written or done else "")
                ) from error
            lines = [json.dumps(record, ensure_ascii=False) for record in records]
            if processes > 1:
                lines = gather_object(lines)
            written += len(lines)
            if is_main and lines:
                file = file if file is not None else append_to(output)
                file.writelines(line + "\n" for line in lines)
                file.flush()
            if progress is not None:
                progress.update(len(lines))
    finally:
        if progress is not None:
            progress.close()
        if file is not None:
            file.close()
    if is_main:
        rewrite_in_order(output)
    _barrier(state, tensor_parallel)
    return written


def _barrier(state, tensor_parallel: bool) -> None:
    if tensor_parallel:
        torch.distributed.barrier()
    elif state is not None and state.num_processes > 1:
        state.wait_for_everyone()
