"""The n-gram table behind `NGramDrafter`: counting a corpus's k-grams into sparse top-k tables, checking a table's
tensors, and reading one back from its files (`config.json` and `model.safetensors`, in a directory or a Hub repo).

A table of order n holds, for each k = 1 ... n, three tensors: `order_k.contexts` `[contexts, k - 1]` (each context
seen), `order_k.tokens` `[contexts, top_k]` (its most frequent continuations, -1 past the last) and `order_k.probs`
`[contexts, top_k]` (their empirical probabilities).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

__all__ = [
    "CONFIG_NAME",
    "DRAFT_MODES",
    "OVERRIDABLE",
    "WEIGHTS_NAME",
    "check_positive",
    "count_table",
    "describe",
    "local_directory",
    "read_table",
    "shareable_name",
    "tokenize_texts",
    "validated_tables",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DRAFT_MODES = ("greedy", "sample")
OVERRIDABLE = ("n", "top_k", "draft_mode", "tokenizer_name", "target_name", "corpus_description", "alpha")


def count_table(
    sequences: Iterable[Sequence[int] | torch.Tensor], *, n: int, vocab_size: int, top_k: int
) -> dict[str, torch.Tensor]:
    """The tables of every k-gram (k = 1 ... `n`) of `sequences` (lists or 1-D tensors of token ids)."""
    check_positive("n", n)
    check_positive("vocab_size", vocab_size)
    check_positive("top_k", top_k)
    sequences = [torch.as_tensor(seq, dtype=torch.long).flatten() for seq in sequences]
    sequences = [seq for seq in sequences if seq.numel() > 0]
    if not sequences:
        raise ValueError("The corpus is empty: `sequences` holds no token ids. Pass at least one non-empty sequence.")
    low = min(int(seq.min()) for seq in sequences)
    high = max(int(seq.max()) for seq in sequences)
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"The corpus holds token ids outside [0, vocab_size={vocab_size}): min {low}, max {high}. "
            "Pass the vocabulary size of the tokenizer/target the ids come from."
        )
    tables = {}
    for k in range(1, n + 1):
        windows = [seq.unfold(0, k, 1) for seq in sequences if seq.numel() >= k]  # each [len - k + 1, k]
        windows = torch.cat(windows) if windows else torch.empty(0, k, dtype=torch.long)
        tables.update(_top_continuations(windows, k, top_k))
    return tables


def tokenize_texts(texts: Iterable[str], tokenizer, *, show_progress: bool | None, batch_size: int) -> list[list[int]]:
    """`texts` tokenized without special tokens, in batches of `batch_size` (a progress bar by default from 1000)."""
    from tqdm.auto import tqdm

    texts = list(texts)
    if not texts or not any(texts):
        raise ValueError("The corpus is empty: `texts` holds no text. Pass at least one non-empty string.")
    if show_progress is None:
        show_progress = len(texts) >= 1000
    sequences = []
    for start in tqdm(range(0, len(texts), batch_size), desc="tokenizing", disable=not show_progress, unit="batch"):
        # verbose=False: a corpus file longer than the tokenizer's model_max_length is fine here (we count
        # n-grams, nothing runs a model on it), so transformers' "sequence length is longer" warning would mislead
        encoded = tokenizer(texts[start : start + batch_size], add_special_tokens=False, verbose=False)["input_ids"]
        sequences.extend(encoded)
    return sequences


def read_table(
    model_id: str, fetch: Callable[[str], Path], overrides: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tables and the `NGramDrafter` arguments saved as `model_id`, whose files `fetch(filename)` returns, with
    `overrides` applied (a smaller `n` or `top_k` cuts the stored tables)."""
    config_path = fetch(CONFIG_NAME)
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:  # RecursionError: too deep
        raise OSError(
            f"{describe(config_path)} is not a readable JSON file ({type(err).__name__}: {err}); it is corrupt or "
            "truncated: save the drafter again with `save_pretrained`, or download it again."
        ) from None
    if not isinstance(config, dict) or config.get("drafter_type") != "ngram":
        found = config.get("drafter_type") if isinstance(config, dict) else type(config).__name__
        raise ValueError(
            f"{config_path} has drafter_type={found!r}, expected 'ngram': this is not an NGramDrafter checkpoint."
        )
    weights_path = fetch(WEIGHTS_NAME)
    try:
        tables = load_file(str(weights_path))  # safetensors: tensors only, never pickle
    except Exception as err:
        raise OSError(
            f"{describe(weights_path)} is not a readable safetensors file ({_one_line(err)}); it is "
            "corrupt or truncated: save the drafter again with `save_pretrained`, or download it "
            "again."
        ) from None
    kwargs = {key: config.get(key) for key in ("n", "vocab_size", "top_k", *OVERRIDABLE)}
    kwargs["draft_mode"] = kwargs["draft_mode"] or "greedy"
    stored_n, stored_top_k = kwargs["n"], kwargs["top_k"]
    try:
        for name in ("n", "vocab_size", "top_k"):
            check_positive(name, kwargs[name])
        orders = sorted(int(key.split(".")[0][len("order_") :]) for key in tables if key.endswith(".contexts"))
        if orders != list(range(1, stored_n + 1)):
            raise ValueError(
                f"config.json says n={stored_n}, but {WEIGHTS_NAME} holds the tables of orders {orders}: the two "
                "files do not belong together. Save the drafter again with `save_pretrained`."
            )
        tables = validated_tables(tables, n=stored_n, vocab_size=kwargs["vocab_size"], top_k=stored_top_k)
    except ValueError as err:
        raise ValueError(f"The n-gram drafter in {model_id} is invalid: {err}") from None
    kwargs.update(overrides)  # explicit user overrides win
    for name, stored in (("n", stored_n), ("top_k", stored_top_k)):
        check_positive(name, kwargs[name])
        if kwargs[name] > stored:
            raise ValueError(
                f"`{name}={kwargs[name]}` is larger than the stored table's {name}={stored} ({model_id}): a "
                f"table keeps only what it counted. Pass `{name}` <= {stored}, or rebuild the table."
            )
    # a smaller n drops the longest contexts; a smaller top_k keeps each context's most frequent continuations
    tables = {
        key: tensor[:, : kwargs["top_k"]] if key.endswith((".tokens", ".probs")) else tensor
        for key, tensor in tables.items()
        if int(key.split(".")[0][len("order_") :]) <= kwargs["n"]
    }
    return tables, kwargs


def local_directory(model_id: str) -> Path | None:
    """The directory `model_id` names, None for a Hub repo id; a local path that is no directory fails here,
    rather than as an invalid repo id."""
    path = Path(model_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise OSError(
            f"{model_id!r} is a file; `NGramDrafter.from_pretrained` takes the directory written by "
            "`save_pretrained` (holding config.json and model.safetensors), or a Hub repo id."
        )
    parts = model_id.split("/")
    if model_id.startswith((".", "/", "~", "\\")) or "\\" in model_id or len(parts) != 2 or not all(parts):
        raise OSError(
            f"No such directory: {model_id!r} (and it is not a Hub repo id of the form 'user/name'). "
            "Pass the directory written by `save_pretrained`."
        )
    return None


def describe(path: Path) -> str:
    """The file, and where it leads when it is a link (a Hub cache links snapshots to blobs)."""
    return f"{path} (a link to {path.resolve()})" if path.is_symlink() else str(path)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def shareable_name(name: str | None) -> str | None:
    """A tokenizer's `name_or_path` fit for a model card: a Hub id as is, a local path by its directory name only."""
    if not name:
        return None
    path = Path(name).expanduser()
    return f"{path.resolve().name} (a local tokenizer)" if path.exists() else name


def check_positive(name: str, value) -> None:
    """Fails unless `value` (the argument `name`) is a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")


def _top_continuations(windows: torch.LongTensor, k: int, top_k: int) -> dict[str, torch.Tensor]:
    """From all k-grams (`[count, k]`), the `top_k` most frequent continuations of each (k-1)-token context."""
    if windows.shape[0] == 0:
        return {
            f"order_{k}.contexts": torch.empty(0, k - 1, dtype=torch.int64),
            f"order_{k}.tokens": torch.empty(0, top_k, dtype=torch.int64),
            f"order_{k}.probs": torch.empty(0, top_k, dtype=torch.float32),
        }
    grams, counts = torch.unique(windows, dim=0, return_counts=True)  # sorted: equal contexts are adjacent
    if k == 1:  # one empty context for all unigrams
        contexts = torch.empty(1, 0, dtype=torch.int64)
        group, group_sizes = torch.zeros(len(grams), dtype=torch.long), torch.tensor([len(grams)])
    else:
        contexts, group, group_sizes = torch.unique_consecutive(
            grams[:, : k - 1], dim=0, return_inverse=True, return_counts=True
        )
    totals = torch.zeros(len(contexts), dtype=torch.long).index_add_(0, group, counts)
    # order by (context, count descending, token): a stable sort on count, then on context
    order = torch.sort(-counts, stable=True).indices
    order = order[torch.sort(group[order], stable=True).indices]
    group_start = torch.cumsum(group_sizes, 0) - group_sizes
    rank = torch.arange(len(order)) - group_start[group[order]]
    keep = order[rank < top_k]
    rank = rank[rank < top_k]
    tokens = torch.full((len(contexts), top_k), -1, dtype=torch.int64)
    probs = torch.zeros(len(contexts), top_k, dtype=torch.float32)
    tokens[group[keep], rank] = grams[keep, k - 1]
    probs[group[keep], rank] = counts[keep].float() / totals[group[keep]].float()
    return {f"order_{k}.contexts": contexts, f"order_{k}.tokens": tokens, f"order_{k}.probs": probs}


def validated_tables(tables: dict[str, torch.Tensor], *, n: int, vocab_size: int, top_k: int):
    """Checks every tensor a table needs: present, well-shaped, token ids in range, probabilities in [0, 1]."""
    checked = {}
    for k in range(1, n + 1):
        names = [f"order_{k}.{part}" for part in ("contexts", "tokens", "probs")]
        missing = [name for name in names if name not in tables]
        if missing:
            raise ValueError(
                f"The n-gram table (n={n}) is missing tensors {missing}; it may be corrupt or for another n."
            )
        contexts, tokens, probs = (tables[name] for name in names)
        rows = contexts.shape[0] if contexts.dim() == 2 else -1
        expected = {names[0]: (rows, k - 1), names[1]: (rows, top_k), names[2]: (rows, top_k)}
        for name, tensor in zip(names, (contexts, tokens, probs)):
            if tuple(tensor.shape) != expected[name] or rows < 0:
                raise ValueError(
                    f"Tensor {name} has shape {tuple(tensor.shape)}, expected {expected[name]} (contexts x {k - 1}, "
                    f"contexts x top_k={top_k}); the table is corrupt or its config does not match it."
                )
        if k == 1 and rows != 1:
            raise ValueError(f"Tensor order_1.contexts must have exactly one (empty) row, got {rows}.")
        for name, tensor, low in ((names[0], contexts, 0), (names[1], tokens, -1)):
            if tensor.numel() and (int(tensor.min()) < low or int(tensor.max()) >= vocab_size):
                raise ValueError(
                    f"Tensor {name} holds token ids outside [0, vocab_size={vocab_size}) (min {int(tensor.min())}, "
                    f"max {int(tensor.max())}): the table was built for another vocabulary."
                )
        if probs.numel() and (not torch.isfinite(probs).all() or float(probs.min()) < 0 or float(probs.max()) > 1):
            raise ValueError(f"Tensor {names[2]} holds values outside [0, 1]; the table is corrupt.")
        empty = ((probs * (tokens >= 0)).sum(dim=-1) <= 0).nonzero()[:, 0]  # contexts with no usable continuation
        if len(empty):
            raise ValueError(
                f"Tensor {names[2]} has {len(empty)} context row(s) whose continuations all have probability 0 "
                f"(rows {empty[:5].tolist()}{'...' if len(empty) > 5 else ''}); such a context could never draft: "
                "the table is corrupt. Rebuild it with `NGramDrafter.from_corpus` or `from_texts`."
            )
        checked.update({names[0]: contexts.long(), names[1]: tokens.long(), names[2]: probs.float()})
    return checked
