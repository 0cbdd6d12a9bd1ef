"""Generation over a whole dataset: length-sorted batches through the batched speculative loop, data-parallel across
the processes of an `accelerate launch` (or `torchrun`), gathered in input order into one JSONL file, resumable.

Vocabulary: a **row** is one input record (a dict with a text field and optional per-row generation options); its
**index** is its position in the dataset (0-based, blank JSONL lines not counted); a **batch** is the rows generated
by one `generate` call. Batches are formed once, from the rows still missing, before they are dealt out to the
processes, so the same rows meet in the same batches whatever the number of processes.

The output file is written by the main process only. While the run goes on it appends each batch's rows as they
come back (any order, each line carrying its `index`); at the end it rewrites the file in input order (a temporary
file moved into place). After an interruption, `resume=True` reads the rows already there, drops a last line cut
short by the interruption, and generates only the rows still missing: no row is lost or written twice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["generate_dataset", "load_rows", "read_jsonl"]

_WRITTEN = ("index", "num_new_tokens", "speculative_stats", "batch_size")  # besides the completion field


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSONL file (one JSON object per line, blank lines skipped).

    A line that is not a JSON object raises a `ValueError` naming the file and the line number."""
    return _read_jsonl_lines(path)[0]


def _read_jsonl_lines(path) -> tuple[list[dict], list[int]]:
    """`(rows, line_numbers)`."""
    rows, numbers = [], []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"line {number} of {str(path)!r} is not valid JSON ({err.msg} at column {err.colno}); "
                    'each line must be one JSON object, e.g. {"prompt": "..."}'
                ) from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"line {number} of {str(path)!r} is a JSON {type(row).__name__}, not an object; "
                    'each line must be one JSON object, e.g. {"prompt": "..."}'
                )
            rows.append(row)
            numbers.append(number)
    return rows, numbers


def load_rows(dataset, text_field: str = "prompt", options_field: str = "generation_kwargs") -> list[dict]:
    """The rows of `dataset` (a JSONL path, a `datasets.Dataset` or dicts) as dicts, checked: each has `text_field`
    as a string and, if present, `options_field` as a dict. Errors name the row (and its line in a JSONL file)."""
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
    return rows


def _read_done(output: Path, rows: list[dict], text_field: str) -> tuple[dict[int, str], int]:
    """`(done, keep_bytes)`: the rows a previous run wrote (index -> line) and how many bytes of the file to keep
    (the last line, when cut short by an interruption, is dropped)."""
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
            record = json.loads(raw)
            index = record["index"]
        except (ValueError, KeyError, TypeError):
            if last:  # cut short by the interruption: generated again
                break
            raise ValueError(
                f"cannot resume: line {number} of {str(output)!r} is not a row this function wrote; "
                "pass a new output path, or remove the file to start over"
            ) from None
        known = isinstance(index, int) and 0 <= index < len(rows)
        if not known or record.get(text_field) != rows[index][text_field]:
            raise ValueError(
                f"cannot resume: line {number} of {str(output)!r} (index {index!r}) is not a row of this "
                "dataset; pass the dataset it was written for, or a new output path"
            )
        if index in done:
            raise ValueError(f"cannot resume: row {index} appears twice in {str(output)!r} (line {number})")
        done[index] = raw.decode("utf-8")
        keep += len(raw) + (not last)
    return done, keep


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
    options = {**generate_kwargs, **(rows[batch[0]].get(options_field) or {})}
    if seed is not None:  # the batch's own seed: the same samples whatever process generates it
        torch.manual_seed(seed + min(batch))
    out = model.generate(
        input_ids.to(device),
        attention_mask=attention_mask.to(device),
        pad_token_id=pad_id,
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
            The JSONL file to write. It must not exist unless `resume=True`.
        text_field (`str`, *optional*, defaults to `"prompt"`):
            The row field holding the prompt text.
        options_field (`str`, *optional*, defaults to `"generation_kwargs"`):
            An optional row field holding a dict of `generate` options for that row (e.g. `{"max_new_tokens": 16}`),
            applied over `generate_kwargs`.
        completion_field (`str`, *optional*, defaults to `"completion"`):
            The output field holding the generated text.
        batch_size (`int`, *optional*, defaults to 8):
            Rows per `generate` call.
        resume (`bool`, *optional*, defaults to `False`):
            Continue a partial `output_file` written by an interrupted run of the same dataset.
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
    if completion_field in _WRITTEN or completion_field == text_field:
        raise ValueError(
            f"`completion_field` {completion_field!r} clashes with a field this function writes; pick another name"
        )
    if "return_dict_in_generate" in generate_kwargs or "attention_mask" in generate_kwargs:
        raise ValueError("`generate_dataset` sets `return_dict_in_generate` and `attention_mask` itself; drop them")
    output = Path(output_file)
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
    rows = load_rows(dataset, text_field, options_field)
    model = enable(model)

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

    done, keep_bytes = _read_done(output, rows, text_field) if output.exists() else ({}, 0)
    _barrier(state, tensor_parallel)  # every process has read the file before the main process touches it
    token_ids = {
        index: tokenizer(rows[index][text_field], add_special_tokens=add_special_tokens)["input_ids"]
        for index in range(len(rows))
        if index not in done
    }
    for index, ids in token_ids.items():
        if not ids:
            raise ValueError(
                f"row {index} of `dataset`: its {text_field!r} is empty after tokenization; every prompt "
                "needs at least one token"
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
    file = None
    if is_main:
        if output.exists():
            os.truncate(output, keep_bytes)
            if keep_bytes and not output.read_bytes().endswith(b"\n"):
                with open(output, "a", encoding="utf-8") as tail:
                    tail.write("\n")
        file = open(output, "a", encoding="utf-8")
    progress = None
    if is_main and show_progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=len(rows), initial=len(done), desc="generate", unit="row", dynamic_ncols=True)
    written = 0
    try:
        for batch in mine:
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
            lines = [json.dumps(record, ensure_ascii=False) for record in records]
            if processes > 1:
                lines = gather_object(lines)
            written += len(lines)
            if file is not None:
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
        _rewrite_in_order(output)
    _barrier(state, tensor_parallel)
    return written


def _barrier(state, tensor_parallel: bool) -> None:
    if tensor_parallel:
        torch.distributed.barrier()
    elif state is not None and state.num_processes > 1:
        state.wait_for_everyone()


def _rewrite_in_order(output: Path) -> None:
    """Sorts the finished file by row index: a temporary file moved into place, so an interruption here loses
    nothing."""
    lines = [line for line in output.read_text(encoding="utf-8").splitlines() if line.strip()]
    lines.sort(key=lambda line: json.loads(line)["index"])
    temporary = output.with_name(output.name + ".sorting")
    temporary.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(temporary, output)
