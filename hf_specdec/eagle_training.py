"""Training an EAGLE-3 head on its target's own hidden states (`hf_specdec.distill.train_eagle_drafter`).

The data (the target's own answers, or texts as they are) and each batch's target features and logits come from
`eagle_data.py`.

The loss follows EAGLE-3's training-time test: the head is unrolled `ttt_steps` times, step j feeding at row t its
own output of step j - 1 and the embedding of token x_{t+1+j}, at position t + j, attending the real rows up to t
and its own earlier steps at row t, exactly the positions and keys it has when drafting the (j + 1)-th token after
a real position t. Each step's loss is the cross-entropy with the target's distribution at position t + 1 + j over
the draft vocabulary, where the target's choice lies in it, weighted 0.8^j.

Written on `accelerate.Accelerator`, so it runs on a CPU, one GPU, or under `accelerate launch` on several, with a
tqdm bar, checkpoints every `save_every` steps in `output_dir`, and `resume_from_checkpoint`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from .capture import HiddenStateCapture
from .drafters.eagle import EagleDrafter
from .eagle_data import (
    DATA_NAME,
    answer_loss_masks,
    batch_reader,
    draft_vocabulary,
    gather_sequences,
    load_sequences,
    save_sequences,
    target_copy,
)
from .file_writes import replace_file, write_text
from .training_checks import (
    STATE_NAME,
    as_dtype,
    check_checkpoint_folder,
    check_resumed,
    check_self_distillation,
    eval_split,
    find_checkpoint,
    restore_state,
    target_fingerprint,
)

__all__ = ["eagle_agreement", "train_eagle_drafter"]


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
            Texts (or token id sequences) to train on as they are (every position); one longer than 1024 tokens
            (or than the target's `max_position_embeddings`) is split into consecutive pieces. Give `prompts`,
            `texts`, `num_synthetic_prompts`, or several.
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
            target does not answer again). `layers` and `draft_vocab_size`, when given, must be the checkpoint's; a
            target whose embeddings or head differ from the one it was trained for, and a `num_steps` below its step,
            are refused.
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
            Sequences held out to measure agreement (at least one), in [0, 1).
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
    answer_dtype = as_dtype(answer_dtype, "answer_dtype")
    feature_dtype = as_dtype(feature_dtype, "feature_dtype")
    output_dir = check_self_distillation(
        target,
        texts=texts,
        output_dir=output_dir,
        batch_size=batch_size,
        warmup_steps=warmup_steps,
        eval_fraction=eval_fraction,
        max_answer_tokens=max_answer_tokens,
        answer_temperature=answer_temperature,
        generation_batch_size=generation_batch_size,
        learning_rate=learning_rate,
        eagle={"draft_vocab_size": draft_vocab_size, "save_every": save_every, "layers": layers},
    )
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
    target = target.eval()
    checkpoint = find_checkpoint(resume_from_checkpoint, output_dir)
    copies: dict = {}  # the target in `answer_dtype` / `feature_dtype`, made once

    # 1. data: the target's answers (or the texts), tokenized; saved so that a resumed run reuses them
    data_file = output_dir / DATA_NAME if output_dir is not None else None
    if checkpoint is not None and data_file is not None and data_file.exists():
        sequences, answer_seconds, written = load_sequences(data_file)
    else:
        answer_start = time.perf_counter()
        answer_minutes = (
            max_answer_minutes if max_answer_minutes is not None else (None if max_minutes is None else max_minutes / 2)
        )
        deadline = None if answer_minutes is None else answer_start + 60.0 * answer_minutes
        sequences, written = gather_sequences(
            target,
            tokenizer,
            prompts,
            texts,
            num_synthetic_prompts=num_synthetic_prompts,
            answer_dtype=answer_dtype,
            copies=copies,
            max_answer_tokens=max_answer_tokens,
            answer_temperature=answer_temperature,
            generation_batch_size=generation_batch_size,
            answer_start=answer_start,
            deadline=deadline,
            seed=seed,
            show_progress=show,
        )
        answer_seconds = time.perf_counter() - answer_start
        if data_file is not None and accelerator.is_main_process:
            output_dir.mkdir(parents=True, exist_ok=True)
            save_sequences(data_file, sequences, answer_seconds, written)
    if len(sequences) < 2:
        raise ValueError(f"train_eagle_drafter got {len(sequences)} usable sequence(s); give more prompts or texts.")
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(sequences), generator=generator).tolist()
    eval_ids, train_ids = eval_split(order, eval_fraction, "train_eagle_drafter")

    # 2. the draft vocabulary: the most frequent tokens the head is trained to predict
    ranked = draft_vocabulary(target, sequences, train_ids, draft_vocab_size)
    if checkpoint is not None:
        drafter = EagleDrafter.from_pretrained(checkpoint, target)
        check_resumed(drafter.model.config, checkpoint, layers=layers, draft_vocab_size=draft_vocab_size)
    else:
        drafter = EagleDrafter.from_target(target, ranked, layers=layers, seed=seed)
    model = drafter.model.float()
    hot_ids = model.hot_ids.cpu()

    # 3. the target's features and logits: one forward per batch, as the head trains (no copy of them is kept,
    # so the data may be far larger than memory)
    for dtype in list(copies):
        if dtype != feature_dtype:
            del copies[dtype]
    reader = target_copy(target, feature_dtype, copies)
    loss_masks = answer_loss_masks(sequences)
    capture = HiddenStateCapture(reader, model.config.eagle_layers, owner="train_eagle_drafter")
    try:
        read = batch_reader(reader, capture, hot_ids, loss_masks, sequences)
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
            restore_state(Path(checkpoint) / STATE_NAME, optimizer, state, target, num_steps)
        embeddings_device = next(embeddings.parameters()).device

        def embed(tokens):
            return embeddings(tokens.to(embeddings_device)).detach().float().to(accelerator.device)

        fingerprint = target_fingerprint(target) if output_dir is not None else None  # recorded in checkpoints
        log = []
        bar = tqdm(total=num_steps, desc="training EAGLE-3 head", unit="step", disable=not show, initial=state["step"])
        done = num_steps is not None and state["step"] >= num_steps  # resumed at its last step: nothing to train
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
                    _save_checkpoint(accelerator, model, drafter, optimizer, state, output_dir, fingerprint)
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
        record = json.dumps({"info": drafter.training_info, "log": log}, indent=1)
        write_text(output_dir / "training_log.json", record + "\n")
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


def _save_checkpoint(accelerator, model, drafter, optimizer, state, output_dir: Path, fingerprint) -> None:
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    folder = output_dir / f"checkpoint-{state['step']}"
    check_checkpoint_folder(folder)  # a link planted there is refused, never written through
    snapshot = EagleDrafter(model, target_name=drafter.target_name)
    snapshot.save_pretrained(folder)
    saved = {
        "optimizer": optimizer.state_dict(),
        "target_fingerprint": fingerprint,
        **{key: state[key] for key in ("step", "train_seconds", "loss_tokens")},
    }
    replace_file(folder / STATE_NAME, lambda file: torch.save(saved, file))
