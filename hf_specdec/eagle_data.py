"""The data an EAGLE-3 head trains on (`train_eagle_drafter`, in `eagle_training.py`).

The data are the target's own answers (self-distillation, as EAGLE-3 and Medusa-2 train): with `prompts`, the target
first answers them, sampling in batches; with `num_synthetic_prompts`, it first writes the instructions itself (Magpie);
with `texts`, it reads them as they are. The draft vocabulary is the data's most frequent tokens. Each training batch
runs the target (or its copy in `feature_dtype`) forward with `HiddenStateCapture` on the three layers the head reads:
that gives the features and the target's logits, restricted to the draft vocabulary. Nothing is kept between
batches, so the data may be far larger than memory (texts read at prefill speed, for instance).
"""

from __future__ import annotations

import copy
import math
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from .file_writes import replace_file
from .modeling import logits_width

__all__ = [
    "DATA_NAME",
    "answer_loss_masks",
    "answer_prompts",
    "batch_reader",
    "draft_vocabulary",
    "gather_sequences",
    "load_sequences",
    "read_saved",
    "save_sequences",
    "synthetic_prompts",
    "target_copy",
]

DATA_NAME = "eagle_data.pt"


def gather_sequences(
    target,
    tokenizer,
    prompts: Sequence[str] | None,
    texts: Sequence | None,
    *,
    num_synthetic_prompts: int,
    answer_dtype: torch.dtype | None,
    copies: dict,
    max_answer_tokens: int,
    answer_temperature: float,
    generation_batch_size: int,
    answer_start: float,
    deadline: float | None,
    seed: int,
    show_progress: bool,
) -> tuple[list[tuple[list[int], int]], int]:
    """The sequences to train on, `(ids, where the answer starts)` each, and how many prompts the target wrote itself:
    its answers (by its copy in `answer_dtype`, kept in `copies`) to `prompts` and to the `num_synthetic_prompts`
    instructions it writes first, then `texts` as they are (tokenized when strings). No answering batch starts after
    `deadline` (`time.perf_counter()`), and writing prompts gets at most a quarter of the time from `answer_start` to it."""
    sequences = []
    written = 0
    all_prompts = list(prompts or [])
    if all_prompts or num_synthetic_prompts:
        answerer = target_copy(target, answer_dtype, copies)
        if num_synthetic_prompts:
            # writing prompts gets at most a quarter of the answering budget
            write_deadline = None if deadline is None else answer_start + 0.25 * (deadline - answer_start)
            synthetic = synthetic_prompts(
                answerer,
                tokenizer,
                num_synthetic_prompts,
                batch_size=generation_batch_size,
                show_progress=show_progress,
                deadline=write_deadline,
            )
            all_prompts += synthetic
            written = len(synthetic)
        sequences += answer_prompts(
            answerer,
            tokenizer,
            all_prompts,
            max_answer_tokens=max_answer_tokens,
            batch_size=generation_batch_size,
            temperature=answer_temperature,
            show_progress=show_progress,
            deadline=deadline,
            seed=seed,
        )
    piece = text_piece_length(target)
    for text in texts or []:
        ids = tokenizer(text)["input_ids"] if isinstance(text, str) else torch.as_tensor(text).flatten().tolist()
        for start in range(0, len(ids), piece):  # a long text in consecutive pieces the target's positions cover
            if len(ids) - start >= 3:
                sequences.append(([int(i) for i in ids[start : start + piece]], 1))
    return sequences, written


TEXT_PIECE = 1024  # the most tokens of a text trained on as one sequence


def text_piece_length(target) -> int:
    """The most tokens of a text that one training sequence holds: `TEXT_PIECE`, or fewer if the target's
    `max_position_embeddings` is smaller (a longer text is split into consecutive pieces)."""
    config = getattr(target.config, "get_text_config", lambda: target.config)()
    limit = getattr(config, "max_position_embeddings", None)
    return min(TEXT_PIECE, limit) if isinstance(limit, int) and limit > 0 else TEXT_PIECE


def save_sequences(
    data_file: Path, sequences: list[tuple[list[int], int]], answer_seconds: float, written: int
) -> None:
    """Saves the sequences (and what gathering them cost) so that a resumed run reuses them (through a new file
    renamed into place: a link standing there is replaced, never written through)."""
    saved = {
        "sequences": [torch.tensor(ids) for ids, _ in sequences],
        "starts": torch.tensor([start for _, start in sequences]),
        "answer_seconds": answer_seconds,
        "written_prompts": written,
    }
    replace_file(data_file, lambda file: torch.save(saved, file))


def read_saved(file: Path, fix: str) -> dict:
    """A dict of plain tensors and numbers saved with `torch.save` (read with `weights_only=True`: no code is ever
    unpickled); anything else fails naming the file and `fix`."""
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # corrupt, truncated, or pickled objects other than tensors and numbers
        # torch's first sentence only: the rest of its message suggests `weights_only=False`, which would run the code
        reason = " ".join(str(error).split()).split(". ")[0][:200]
        raise OSError(
            f"Could not read {file} ({type(error).__name__}: {reason}): it is corrupt, "
            "truncated, or holds more than tensors and numbers (hf_specdec reads it with `weights_only=True` and "
            f"never unpickles code). {fix}"
        ) from None
    if not isinstance(saved, dict):
        raise OSError(f"{file} holds a {type(saved).__name__}, not the dict hf_specdec saves. {fix}")
    return saved


def load_sequences(data_file: Path) -> tuple[list[tuple[list[int], int]], float, int]:
    """What `save_sequences` saved: the sequences, the seconds gathering them took, the prompts the target wrote."""
    fix = f"Delete {data_file}: the resumed run then gathers its data again."
    saved = read_saved(data_file, fix)
    try:
        sequences = [(ids.tolist(), int(start)) for ids, start in zip(saved["sequences"], saved["starts"], strict=True)]
        if not all(isinstance(ids, list) and all(type(i) is int for i in ids) for ids, _ in sequences):
            raise TypeError("its sequences are not lists of token ids")
        answer_seconds = float(saved["answer_seconds"])
        written = int(saved.get("written_prompts", 0))
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise OSError(f"{data_file} is not the data `train_eagle_drafter` saves ({error!r}). {fix}") from None
    return sequences, answer_seconds, written


def draft_vocabulary(target, sequences, train_ids: list[int], draft_vocab_size: int | None) -> list[int]:
    """The draft vocabulary, most useful first: the target's end-of-sequence tokens, then the tokens of the training
    sequences (answers only), most frequent first; `draft_vocab_size` of them (filled up with the lowest other ids),
    or every token the data contain, at most 32000 (EAGLE-3's size)."""
    counts = Counter(token for i in train_ids for token in sequences[i][0][max(sequences[i][1], 1) :])
    vocab = logits_width(target)
    size = min(draft_vocab_size or 32000, vocab)
    eos = target.generation_config.eos_token_id
    must = [t for t in (eos if isinstance(eos, list) else [eos]) if t is not None and 0 <= t < vocab]
    ranked = must + [token for token, _ in counts.most_common() if token not in must]
    if draft_vocab_size is None:
        ranked = ranked[:size]
    else:
        ranked = (ranked + [t for t in range(vocab) if t not in set(ranked)])[:size]
    return ranked


def answer_loss_masks(sequences: list[tuple[list[int], int]]) -> list[torch.BoolTensor]:
    """Per sequence, `[len]`: the positions whose prediction is trained (those that predict an answer token)."""
    loss_masks = []
    for ids, start in sequences:
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[max(start - 1, 0) :] = True  # predictions of answer tokens (position s predicts x_{s+1})
        loss_masks.append(mask)
    return loss_masks


def target_copy(target, dtype: torch.dtype | None, copies: dict):
    """`target` itself, or one shared copy of it in `dtype` (the user's model is never converted)."""
    if dtype in (None, target.dtype):
        return target
    if dtype not in copies:
        copies[dtype] = copy.deepcopy(target).to(dtype).eval()
    return copies[dtype]


def _chat_prompt(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


@torch.no_grad()
def answer_prompts(
    target,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_answer_tokens: int,
    batch_size: int,
    temperature: float,
    show_progress: bool,
    deadline: float | None = None,
    seed: int = 0,
) -> list[tuple[list[int], int]]:
    """The target's own answers: `(prompt + answer ids, prompt length)` per prompt, sampled in left-padded batches
    (in a seeded random order, prompts of similar length sharing a batch). No batch starts after `deadline`
    (`time.perf_counter()`), so a budget may leave later prompts unanswered."""
    from tqdm.auto import tqdm

    encoded = [_chat_prompt(tokenizer, prompt) for prompt in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(
            "The `tokenizer` has neither a pad token nor an eos token, so prompts cannot be batched to be answered. "
            "Set one, for example `tokenizer.pad_token = tokenizer.unk_token`, or pass `texts=` instead."
        )
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    shuffled = torch.randperm(len(encoded), generator=torch.Generator().manual_seed(seed)).tolist()
    block = 4 * batch_size  # sorted by length within blocks of 4 batches: little padding, no bias to short prompts
    order = [
        i
        for start in range(0, len(shuffled), block)
        for i in sorted(shuffled[start : start + block], key=lambda i: len(encoded[i]))
    ]
    sequences: list[tuple[list[int], int] | None] = [None] * len(encoded)
    for start in tqdm(range(0, len(order), batch_size), desc="answering prompts", disable=not show_progress):
        if deadline is not None and time.perf_counter() > deadline:
            break
        rows = order[start : start + batch_size]
        width = max(len(encoded[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):
            ids[r, width - len(encoded[i]) :] = torch.tensor(encoded[i])
            mask[r, width - len(encoded[i]) :] = 1
        generation = dict(do_sample=temperature > 0, max_new_tokens=max_answer_tokens, pad_token_id=pad)
        if temperature > 0:
            generation.update(temperature=temperature, top_k=0, top_p=1.0)
        out = target.generate(input_ids=ids.to(target.device), attention_mask=mask.to(target.device), **generation)
        for r, i in enumerate(rows):
            answer = out[r, width:].tolist()
            for position, token in enumerate(answer):
                if token in eos:
                    answer = answer[: position + 1]
                    break
            sequences[i] = (encoded[i] + answer, len(encoded[i]))
    return [s for s in sequences if s is not None]


@torch.no_grad()
def synthetic_prompts(
    target,
    tokenizer,
    count: int,
    *,
    batch_size: int,
    show_progress: bool,
    deadline: float | None = None,
    max_tokens: int = 64,
) -> list[str]:
    """Instructions the target writes itself (Magpie, Xu et al. 2024): sampled after the user-turn prefix of its
    chat template, up to the template's end-of-turn token; unfinished or very short ones are dropped."""
    from tqdm.auto import tqdm

    marker = "\ue000hf_specdec\ue000"
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "`num_synthetic_prompts` needs a tokenizer with a chat template (the target writes "
            "instructions after its user-turn prefix); pass `prompts=` or `texts=` instead."
        )
    template = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
    )
    if marker not in template:
        raise ValueError(
            "`num_synthetic_prompts`: the tokenizer's chat template does not show the user's message "
            "verbatim; pass `prompts=` or `texts=` instead."
        )
    prefix, suffix = template.split(marker, 1)
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    end_ids = tokenizer(suffix, add_special_tokens=False)["input_ids"]
    if not prefix_ids or not end_ids:
        raise ValueError(
            "`num_synthetic_prompts`: could not find the chat template's user-turn prefix and "
            "end-of-turn token; pass `prompts=` or `texts=` instead."
        )
    end = end_ids[0]
    found: list[str] = []
    seen = set()
    ids = torch.tensor([prefix_ids] * batch_size, device=target.device)
    bar = tqdm(total=count, desc="writing prompts", disable=not show_progress)
    for _ in range(4 * math.ceil(count / batch_size)):  # bounded: a model that never ends its turns stops here
        if len(found) >= count or (deadline is not None and time.perf_counter() > deadline):
            break
        out = target.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=0.95,
            max_new_tokens=max_tokens,
            eos_token_id=end,
            pad_token_id=end,
        )
        for row in out[:, len(prefix_ids) :].tolist():
            if end not in row:
                continue
            text = tokenizer.decode(row[: row.index(end)], skip_special_tokens=True).strip()
            if len(text) >= 12 and text not in seen and len(found) < count:
                seen.add(text)
                found.append(text)
                bar.update(1)
    bar.close()
    return found


def batch_reader(reader, capture, hot_ids, loss_masks, sequences):
    """A collate function: pads the sequences `indices` on the right and runs the target (`reader`) forward over them once: (ids, the
    features `[b, T, 3h]` and the target's logits over the draft vocabulary `[b, T, dv]` in float32, whether its
    argmax lies in the draft vocabulary, loss mask)."""
    device = next(reader.parameters()).device
    hot_ids = hot_ids.to(device)
    in_draft = torch.zeros(logits_width(reader), dtype=torch.bool, device=device)
    in_draft[hot_ids] = True

    @torch.no_grad()
    def collate(indices):
        length = max(len(sequences[i][0]) for i in indices)
        b = len(indices)
        ids = torch.zeros(b, length, dtype=torch.long)
        attention = torch.zeros(b, length, dtype=torch.long)
        mask = torch.zeros(b, length, dtype=torch.bool)
        for r, i in enumerate(indices):
            n = len(sequences[i][0])
            ids[r, :n] = torch.tensor(sequences[i][0])
            attention[r, :n] = 1
            mask[r, :n] = loss_masks[i]
        logits = reader(input_ids=ids.to(device), attention_mask=attention.to(device), use_cache=False).logits
        features = capture.take().float()  # [b, T, 3h]
        return ids, features, logits[..., hot_ids].float(), in_draft[logits.argmax(-1)], mask

    return collate
