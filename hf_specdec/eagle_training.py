"""Training an EAGLE-3 head on its target's own hidden states (`hf_specdec.distill.train_eagle_drafter`).

The data are the target's own answers (self-distillation, as EAGLE-3 and Medusa-2 train): with `prompts`, the target
first answers them, sampling in batches; with `texts`, it reads them as they are. Each training batch first runs the
target (or its copy in `feature_dtype`) forward with `HiddenStateCapture` on the three layers the head reads: that
gives the features and the target's logits, restricted to the draft vocabulary. Nothing is kept between batches, so
the data may be far larger than memory (texts read at prefill speed, for instance).

The loss follows EAGLE-3's training-time test: the head is unrolled `ttt_steps` times, step j feeding at row t its
own output of step j - 1 and the embedding of token x_{t+1+j}, at position t + j, attending the real rows up to t
and its own earlier steps at row t, exactly the positions and keys it has when drafting the (j + 1)-th token after
a real position t. Each step's loss is the cross-entropy with the target's distribution at position t + 1 + j over
the draft vocabulary, where the target's choice lies in it, weighted 0.8^j.

Written on `accelerate.Accelerator`, so it runs on a CPU, one GPU, or under `accelerate launch` on several, with a
tqdm bar, checkpoints every `save_every` steps in `output_dir`, and `resume_from_checkpoint`.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from .drafters.eagle import EagleDrafter
from .modeling import logits_width
from .rounds import HiddenStateCapture

__all__ = ["eagle_agreement", "train_eagle_drafter"]

DATA_NAME = "eagle_data.pt"
STATE_NAME = "training_state.pt"


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
def _answer_prompts(
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
def _synthetic_prompts(
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


def _ttt_loss(model, embeddings, batch, ttt_steps: int, step_weight: float = 0.8):
    """EAGLE-3's training-time-test loss on a padded batch; returns (loss, per-step top-1 agreement counts, counts)."""
    ids, features, target_logits, target_in_draft, loss_mask = batch  # [b, T], [b, T, F], [b, T, dv], [b, T], [b, T]
    batch_size, length = ids.shape
    device = features.device
    rows = torch.arange(length, device=device)
    hidden = features
    project = True
    past_keys = past_values = None
    causal = rows[None, :] <= rows[:, None]  # [T, T]
    eye = torch.eye(length, dtype=torch.bool, device=device)
    total = features.new_zeros(())
    agree, counted = [], []
    p_all = F.softmax(target_logits.float(), dim=-1)  # [b, T, dv], once: step j reads it shifted by j
    choice_all = target_logits.argmax(-1)  # [b, T]
    for j in range(ttt_steps):
        # row t feeds x_{t+1+j} and predicts x_{t+2+j}, from the target's logits at position t + 1 + j
        source = rows + 1 + j  # [T]
        valid = source < length
        source = source.clamp(max=length - 1)
        tokens = ids[:, source]  # [b, T]
        mask = torch.cat([causal] + [eye] * j, dim=1)[None, None]  # [1, 1, T, (j + 1) T]
        positions = (rows + j)[None].expand(batch_size, -1)
        out, keys, values = model(
            embeddings(tokens).to(features.dtype),
            hidden,
            positions,
            project=project,
            past_keys=past_keys,
            past_values=past_values,
            mask=mask,
        )
        past_keys = keys if past_keys is None else torch.cat([past_keys, keys], dim=2)
        past_values = values if past_values is None else torch.cat([past_values, values], dim=2)
        hidden, project = out, False
        weight = (loss_mask[:, source] & target_in_draft[:, source] & valid[None]).float()  # [b, T]
        log_q = F.log_softmax(model.logits(out).float(), dim=-1)  # [b, T, dv]
        p = p_all[:, source]  # [b, T, dv]
        cross_entropy = -(p * log_q).sum(-1)  # [b, T]
        total = total + (step_weight**j) * (cross_entropy * weight).sum() / weight.sum().clamp(min=1)
        with torch.no_grad():
            agree.append(((log_q.argmax(-1) == choice_all[:, source]).float() * weight).sum().item())
            counted.append(weight.sum().item())
    return total, agree, counted


def _collate(reader, capture, hot_ids, loss_masks, sequences):
    """Pads the sequences `indices` on the right and runs the target (`reader`) forward over them once: (ids, the
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


def _as_dtype(value, name: str) -> torch.dtype | None:
    if isinstance(value, str):
        if not isinstance(getattr(torch, value, None), torch.dtype):
            raise ValueError(f"`{name}` {value!r} is not a torch dtype; use for example 'bfloat16'.")
        value = getattr(torch, value)
    if value is not None and not isinstance(value, torch.dtype):
        raise TypeError(f"`{name}` must be a torch.dtype or its name, got {value!r}.")
    return value


def _copy_in(target, dtype: torch.dtype | None, copies: dict):
    """`target` itself, or one shared copy of it in `dtype` (the user's model is never converted)."""
    if dtype in (None, target.dtype):
        return target
    if dtype not in copies:
        copies[dtype] = copy.deepcopy(target).to(dtype).eval()
    return copies[dtype]


def train_eagle_drafter(
    target,
    prompts: Sequence[str] | None = None,
    texts: Sequence[str] | None = None,
    *,
    tokenizer=None,
    max_minutes: float | None = None,
    num_steps: int | None = None,
    accelerator=None,
    output_dir: str | Path | None = None,
    resume_from_checkpoint: str | Path | bool | None = None,
    draft_vocab_size: int | None = None,
    layers: Sequence[int] | None = None,
    ttt_steps: int = 7,
    max_answer_tokens: int = 256,
    answer_temperature: float = 0.7,
    generation_batch_size: int = 16,
    num_synthetic_prompts: int = 0,
    answer_dtype: torch.dtype | str | None = None,
    max_answer_minutes: float | None = None,
    feature_dtype: torch.dtype | str | None = None,
    batch_size: int = 8,
    learning_rate: float = 1e-3,
    warmup_steps: int = 20,
    eval_fraction: float = 0.05,
    save_every: int = 200,
    seed: int = 0,
    show_progress: bool = True,
) -> EagleDrafter:
    r"""
    Trains an EAGLE-3 head for `target` and returns it as an `EagleDrafter` (saved to `output_dir` when given).

    Args:
        target ([`~transformers.PreTrainedModel`]):
            A decoder-only causal LM; only run forward (and `generate` to answer `prompts`), never modified.
        prompts (`list[str]`, *optional*):
            Instructions the target answers first (with the tokenizer's chat template when it has one); the head trains
            on the answers (self-distillation).
        texts (`list[str]` or `list[list[int]]`, *optional*):
            Texts (or token id sequences) to train on as they are (every position). Give `prompts`, `texts`,
            `num_synthetic_prompts`, or several.
        tokenizer ([`~transformers.PreTrainedTokenizerBase`], *optional*):
            The target's tokenizer (needed for `prompts` and for texts given as strings).
        max_minutes (`float`, *optional*):
            Wall-clock budget of the whole call (answering, features, training); training stops when it is spent. Give
            it, `num_steps`, or both (the first reached ends training).
        num_steps (`int`, *optional*):
            Optimizer steps.
        accelerator ([`~accelerate.Accelerator`], *optional*):
            Defaults to `Accelerator()`.
        output_dir (`str` or `Path`, *optional*):
            The head (EAGLE-3 layout, with a model card), the generated data, `checkpoint-<step>` folders every
            `save_every` steps and `training_log.json`.
        resume_from_checkpoint (`str`, `Path` or `True`, *optional*):
            A `checkpoint-<step>` folder, or `True` for the latest in `output_dir`; the saved data are reused (the
            target does not answer again).
        draft_vocab_size (`int`, *optional*):
            Tokens of the draft vocabulary, the most frequent in the data; defaults to every token the data contain, at
            most 32000 (EAGLE-3's size).
        layers (`list[int]`, *optional*):
            `output_hidden_states` entries read; defaults to EAGLE-3's three.
        ttt_steps (`int`, *optional*, defaults to 7):
            Training-time-test unroll (draft steps trained).
        max_answer_tokens (`int`, *optional*, defaults to 256):
            The most tokens the target writes per answer to `prompts`.
        answer_temperature (`float`, *optional*, defaults to 0.7):
            The temperature the target answers at (0: greedy).
        generation_batch_size (`int`, *optional*, defaults to 16):
            Prompts answered (and synthetic prompts written) per `generate` call.
        num_synthetic_prompts (`int`, *optional*, defaults to 0):
            Instructions the target first writes itself (Magpie, Xu et al. 2024: sampled after its chat template's
            user-turn prefix), then answers like `prompts`: diverse self-distillation data without a prompt set. Needs a
            chat template.
        answer_dtype (`torch.dtype` or `str`, *optional*):
            Answer (and write prompts) with a copy of the target in this dtype, for example `torch.bfloat16` on CPUs
            whose bfloat16 matrix kernels are several times faster. The answers are only contexts: the features and the
            target distributions the head learns come from `target` itself, in its own dtype, unless `feature_dtype`
            says otherwise.
        feature_dtype (`torch.dtype` or `str`, *optional*):
            Read the features and the target distributions the head learns with a copy of the target in this dtype (by
            default `target` itself). `torch.bfloat16` makes this ~4x faster on CPUs with bfloat16 matrix units; the
            head then learns from features rounded to bfloat16 (EAGLE trains with noise added to its features anyway)
            and drafts from the target's own at generation.
        max_answer_minutes (`float`, *optional*):
            No answering batch starts after this many minutes (by default half of `max_minutes`), so that features and
            training keep their share of the budget; prompts left unanswered are not used.
        batch_size (`int`, *optional*, defaults to 8):
            Sequences per training step and per process.
        learning_rate (`float`, *optional*, defaults to 1e-3):
            AdamW peak learning rate (linear warm-up, then cosine decay over the steps or the budget).
        warmup_steps (`int`, *optional*, defaults to 20):
            Steps of linear learning-rate warm-up.
        eval_fraction (`float`, *optional*, defaults to 0.05):
            Sequences held out to measure agreement.
        save_every (`int`, *optional*, defaults to 200):
            Steps between checkpoints (with `output_dir`).
        seed (`int`, *optional*, defaults to 0):
            Seeds the answers, the head's initialisation and the data order.
        show_progress (`bool`, *optional*, defaults to `True`):
            A tqdm bar per phase on the main process.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    started = time.perf_counter()
    if (
        isinstance(num_synthetic_prompts, bool)
        or not isinstance(num_synthetic_prompts, int)
        or num_synthetic_prompts < 0
    ):
        raise ValueError(f"`num_synthetic_prompts` must be an int >= 0, got {num_synthetic_prompts!r}.")
    if prompts is None and texts is None and not num_synthetic_prompts:
        raise ValueError(
            "train_eagle_drafter needs training data: pass `prompts=` (the target answers them), "
            "`texts=` (trained on as they are) and/or `num_synthetic_prompts=` (the target writes "
            "instructions itself, then answers them)."
        )
    if tokenizer is None and (prompts or num_synthetic_prompts or any(isinstance(text, str) for text in texts or [])):
        raise ValueError(
            "train_eagle_drafter needs `tokenizer=` (the target's) to read `prompts` or texts given as "
            "strings; without one, pass `texts=` as token id sequences."
        )
    if max_minutes is None and num_steps is None:
        raise ValueError(
            "train_eagle_drafter needs a budget: pass `max_minutes=` (wall clock of the whole call) "
            "and/or `num_steps=`."
        )
    if max_minutes is not None and not max_minutes > 0:
        raise ValueError(f"`max_minutes` must be > 0, got {max_minutes}.")
    if max_answer_minutes is not None and not max_answer_minutes > 0:
        raise ValueError(f"`max_answer_minutes` must be > 0, got {max_answer_minutes}.")
    answer_dtype = _as_dtype(answer_dtype, "answer_dtype")
    feature_dtype = _as_dtype(feature_dtype, "feature_dtype")
    if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1):
        raise ValueError(f"`num_steps` must be a positive int, got {num_steps!r}.")
    if not isinstance(ttt_steps, int) or ttt_steps < 1:
        raise ValueError(f"`ttt_steps` must be a positive int, got {ttt_steps!r}.")
    if target.config.is_encoder_decoder:
        raise ValueError(
            f"train_eagle_drafter trains heads for decoder-only targets; {type(target).__name__} is an "
            "encoder-decoder model."
        )
    accelerator = accelerator if accelerator is not None else Accelerator()
    set_seed(seed)
    show = show_progress and accelerator.is_local_main_process
    output_dir = Path(output_dir) if output_dir is not None else None
    target = target.eval()
    checkpoint = _find_checkpoint(resume_from_checkpoint, output_dir)
    copies: dict = {}  # the target in `answer_dtype` / `feature_dtype`, made once

    # 1. data: the target's answers (or the texts), tokenized; saved so that a resumed run reuses them
    data_file = output_dir / DATA_NAME if output_dir is not None else None
    if checkpoint is not None and data_file is not None and data_file.exists():
        saved = torch.load(data_file, weights_only=True)
        sequences = [(ids.tolist(), int(start)) for ids, start in zip(saved["sequences"], saved["starts"])]
        answer_seconds = float(saved["answer_seconds"])
        written = int(saved.get("written_prompts", 0))
    else:
        answer_start = time.perf_counter()
        answer_minutes = (
            max_answer_minutes if max_answer_minutes is not None else (None if max_minutes is None else max_minutes / 2)
        )
        deadline = None if answer_minutes is None else answer_start + 60.0 * answer_minutes
        sequences = []
        written = 0
        all_prompts = list(prompts or [])
        if all_prompts or num_synthetic_prompts:
            answerer = _copy_in(target, answer_dtype, copies)
            if num_synthetic_prompts:
                # writing prompts gets at most a quarter of the answering budget
                write_deadline = None if deadline is None else answer_start + 0.25 * (deadline - answer_start)
                synthetic = _synthetic_prompts(
                    answerer,
                    tokenizer,
                    num_synthetic_prompts,
                    batch_size=generation_batch_size,
                    show_progress=show,
                    deadline=write_deadline,
                )
                all_prompts += synthetic
                written = len(synthetic)
            sequences += _answer_prompts(
                answerer,
                tokenizer,
                all_prompts,
                max_answer_tokens=max_answer_tokens,
                batch_size=generation_batch_size,
                temperature=answer_temperature,
                show_progress=show,
                deadline=deadline,
                seed=seed,
            )
        for text in texts or []:
            ids = tokenizer(text)["input_ids"] if isinstance(text, str) else torch.as_tensor(text).flatten().tolist()
            if len(ids) >= 3:
                sequences.append(([int(i) for i in ids], 1))
        answer_seconds = time.perf_counter() - answer_start
        if data_file is not None and accelerator.is_main_process:
            output_dir.mkdir(parents=True, exist_ok=True)
            torch.save(
                {
                    "sequences": [torch.tensor(ids) for ids, _ in sequences],
                    "starts": torch.tensor([start for _, start in sequences]),
                    "answer_seconds": answer_seconds,
                    "written_prompts": written,
                },
                data_file,
            )
    if len(sequences) < 2:
        raise ValueError(f"train_eagle_drafter got {len(sequences)} usable sequence(s); give more prompts or texts.")
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(sequences), generator=generator).tolist()
    num_eval = max(1, int(eval_fraction * len(sequences)))
    eval_ids, train_ids = order[:num_eval], order[num_eval:]

    # 2. the draft vocabulary: the most frequent tokens the head is trained to predict
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
    if checkpoint is not None:
        drafter = EagleDrafter.from_pretrained(checkpoint, target)
    else:
        drafter = EagleDrafter.from_target(target, ranked, layers=layers, seed=seed)
    model = drafter.model.float()
    hot_ids = model.hot_ids.cpu()

    # 3. the target's features and logits: one forward per batch, as the head trains (no copy of them is kept,
    # so the data may be far larger than memory)
    for dtype in list(copies):
        if dtype != feature_dtype:
            del copies[dtype]
    reader = _copy_in(target, feature_dtype, copies)
    loss_masks = []
    for ids, start in sequences:
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[max(start - 1, 0) :] = True  # predictions of answer tokens (position s predicts x_{s+1})
        loss_masks.append(mask)
    capture = HiddenStateCapture(reader, model.config.eagle_layers, owner="train_eagle_drafter")
    try:
        read = _collate(reader, capture, hot_ids, loss_masks, sequences)
        feature_seconds = 0.0

        def collate(indices):
            nonlocal feature_seconds
            begun = time.perf_counter()
            batch = read(indices)
            feature_seconds += time.perf_counter() - begun
            return batch

        embeddings = target.get_input_embeddings()

        # 4. training-time test
        loader = torch.utils.data.DataLoader(
            train_ids,
            batch_size=batch_size,
            shuffle=True,
            generator=generator,
            collate_fn=collate,
            drop_last=len(train_ids) >= batch_size,
        )
        model.to(accelerator.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
        budget_s = None if max_minutes is None else max_minutes * 60.0
        state = {"step": 0, "train_seconds": 0.0, "loss_tokens": 0}
        train_start = time.perf_counter()

        def progress_fraction() -> float:
            fractions = [0.0]
            if num_steps is not None:
                fractions.append(state["step"] / num_steps)
            if budget_s is not None:  # the learning-rate schedule spans the training phase's share of the budget
                left = budget_s - (train_start - started)
                fractions.append(1.0 if left <= 0 else (time.perf_counter() - train_start) / left)
            return min(1.0, max(fractions))

        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda _: (
                min(1.0, (state["step"] + 1) / max(1, warmup_steps))
                * 0.5
                * (1 + math.cos(math.pi * progress_fraction()))
            ),
        )
        model.train()
        # the head is not wrapped (DDP could not see its `logits` method): its gradients are averaged by hand below
        optimizer, loader, scheduler = accelerator.prepare(optimizer, loader, scheduler)
        if checkpoint is not None:
            saved_state = torch.load(Path(checkpoint) / STATE_NAME, weights_only=True)
            optimizer.load_state_dict(saved_state["optimizer"])
            state.update(
                step=int(saved_state["step"]),
                train_seconds=float(saved_state["train_seconds"]),
                loss_tokens=int(saved_state.get("loss_tokens", 0)),
            )
        embeddings_device = next(embeddings.parameters()).device

        def embed(tokens):
            return embeddings(tokens.to(embeddings_device)).detach().float().to(accelerator.device)

        log = []
        bar = tqdm(total=num_steps, desc="training EAGLE-3 head", unit="step", disable=not show, initial=state["step"])
        done = False
        while not done:
            for batch in loader:
                step_start = time.perf_counter()
                batch = [tensor.to(accelerator.device) for tensor in batch]
                with accelerator.autocast():
                    loss, agree, counted = _ttt_loss(model, embed, batch, ttt_steps)
                accelerator.backward(loss)
                if accelerator.num_processes > 1:
                    for parameter in model.parameters():
                        if parameter.grad is not None:
                            parameter.grad = accelerator.reduce(parameter.grad, reduction="mean")
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                state["step"] += 1
                state["train_seconds"] += time.perf_counter() - step_start
                state["loss_tokens"] += int(batch[-1].sum())
                bar.update(1)
                top1 = agree[0] / max(counted[0], 1.0)
                log.append({"step": state["step"], "loss": loss.item(), "top1_step0": top1})
                bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{top1:.2f}")
                if output_dir is not None and save_every and state["step"] % save_every == 0:
                    _save_checkpoint(accelerator, model, drafter, optimizer, state, output_dir)
                finished = torch.tensor([float(progress_fraction() >= 1.0)], device=accelerator.device)
                if accelerator.num_processes > 1:  # every process stops at the same step (wall clocks differ)
                    finished = accelerator.reduce(finished, reduction="sum")
                if bool(finished.item()):
                    done = True
                    break
        bar.close()
        accelerator.wait_for_everyone()
        model = model.eval()
        agreement = eagle_agreement(model, embed, collate, eval_ids, min(ttt_steps, 4))
    finally:
        capture.close()  # the forward hooks leave the target (or its copy)
    drafter.model = model.to(dtype=target.dtype, device=target.device)
    answered = [start for _, start in sequences if start > 1]  # texts start at 1, answers after their prompt
    drafter.training_info = {
        "training data": (
            f"{len(answered)} prompts answered by the target ({len(prompts or [])} given"
            + (f", {written} it wrote itself of {num_synthetic_prompts} asked" if num_synthetic_prompts else "")
            + f"; sampling at T = {answer_temperature}, at most {max_answer_tokens} tokens"
            + (f", answered in {answer_dtype}" if answer_dtype is not None else "")
            + ")"
            if answered
            else ""
        )
        + (f"{' and ' if answered else ''}{len(texts or [])} texts" if texts else ""),
        "training tokens": sum(len(sequences[i][0]) for i in train_ids),
        "positions trained on (with repeats)": state["loss_tokens"] * accelerator.num_processes,
        "draft vocabulary": len(hot_ids),
        "steps": state["step"],
        "wall time": f"{(time.perf_counter() - started) / 60:.1f} min in all (answering {answer_seconds / 60:.1f}, "
        f"features {feature_seconds / 60:.1f}, training {state['train_seconds'] / 60:.1f})",
        "held-out top-1 agreement per draft step": [round(a, 3) for a in agreement],
        "device": f"{accelerator.device} x{accelerator.num_processes}",
    }
    if output_dir is not None and accelerator.is_main_process:
        drafter.save_pretrained(output_dir)
        (output_dir / "training_log.json").write_text(
            json.dumps({"info": drafter.training_info, "log": log}, indent=1) + "\n"
        )
    return drafter


@torch.no_grad()
def eagle_agreement(model, embed, collate, indices, steps: int, batch_size: int = 8) -> list[float]:
    """Top-1 agreement of the head with the target at each draft step (teacher features at step 0, its own after),
    over the sequences `indices`, answer positions only."""
    agree = [0.0] * steps
    counted = [0.0] * steps
    for start in range(0, len(indices), batch_size):
        batch = [t.to(next(model.parameters()).device) for t in collate(indices[start : start + batch_size])]
        _, a, c = _ttt_loss(model, embed, batch, steps)
        agree = [x + y for x, y in zip(agree, a)]
        counted = [x + y for x, y in zip(counted, c)]
    return [a / max(c, 1.0) for a, c in zip(agree, counted)]


def _save_checkpoint(accelerator, model, drafter, optimizer, state, output_dir: Path) -> None:
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    folder = output_dir / f"checkpoint-{state['step']}"
    snapshot = EagleDrafter(model, target_name=drafter.target_name)
    snapshot.save_pretrained(folder)
    torch.save(
        {
            "optimizer": optimizer.state_dict(),
            "step": state["step"],
            "train_seconds": state["train_seconds"],
            "loss_tokens": state["loss_tokens"],
        },
        folder / STATE_NAME,
    )


def _find_checkpoint(resume, output_dir: Path | None) -> Path | None:
    if resume in (None, False):
        return None
    if resume is True:
        if output_dir is None:
            raise ValueError("`resume_from_checkpoint=True` needs `output_dir=` (where the checkpoints are).")
        folders = sorted(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
        if not folders:
            raise ValueError(f"`resume_from_checkpoint=True`, but {output_dir} holds no checkpoint-<step> folder.")
        return folders[-1]
    path = Path(resume)
    if not (path / STATE_NAME).exists():
        raise ValueError(f"`resume_from_checkpoint` {str(resume)!r} is not a checkpoint folder (no {STATE_NAME}).")
    return path
