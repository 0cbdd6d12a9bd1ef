"""Distilling a drafter from its target (DistillSpec, Zhou et al. 2024), on `accelerate.Accelerator`.

The drafter M_q is trained to match the target M_p on the target's own soft labels p(x | prefix), position by
position. Two objectives:

- `"kl"`: forward KL(p || q), the classic distillation loss (cross-entropy with the target's distribution).
- `"tv"`: total variation TV(p, q) = 1/2 sum |p - q|. For one position the acceptance probability of
  speculative sampling is beta = sum min(p, q) = 1 - TV(p, q) (paper, section 3.3), so minimising TV maximises
  alpha directly (DistillSpec, section 4).

Because the loop is written on `Accelerator` (prepare, backward, gather, main-process printing), the same call
runs on a CPU, on one GPU, or under `accelerate launch` on many.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel

from .drafters.mtp_checkpoint import save_mtp_layers
from .eagle_training import eagle_agreement, train_eagle_drafter
from .file_writes import save_into, write_text
from .mtp_training import mtp_agreement, train_mtp_layers
from .training_checks import check_int, check_number, check_output_dir, check_token_ids

__all__ = [
    "OBJECTIVES",
    "distill_drafter",
    "drafter_agreement",
    "eagle_agreement",
    "mtp_agreement",
    "save_mtp_layers",
    "train_eagle_drafter",
    "train_mtp_layers",
]

OBJECTIVES = ("kl", "tv")
"""The losses `distill_drafter` takes as `objective`: forward KL(p || q), and total variation (1 - expected
acceptance)."""


def _distillation_loss(
    target_logits: torch.Tensor, draft_logits: torch.Tensor, objective: str, temperature: float
) -> torch.Tensor:
    """Mean per-position loss; both logits `[tokens, vocab]`."""
    target_log_p = F.log_softmax(target_logits.float() / temperature, dim=-1)  # [tokens, vocab]
    draft_log_q = F.log_softmax(draft_logits.float() / temperature, dim=-1)  # [tokens, vocab]
    if objective == "kl":
        return (target_log_p.exp() * (target_log_p - draft_log_q)).sum(-1).mean()
    return 0.5 * (target_log_p.exp() - draft_log_q.exp()).abs().sum(-1).mean()


def _as_blocks(data, tokenizer, seq_len: int) -> torch.Tensor:
    """Texts, token-id sequences or a `[num_blocks, seq_len]` tensor -> `[num_blocks, seq_len]` long tensor.

    Sequences are joined with the tokenizer's eos (when known) and cut into non-overlapping windows.
    """
    if isinstance(data, torch.Tensor) and data.dim() == 2:
        check_token_ids(data, None, "texts_or_token_ids")  # integer ids only: never truncated
        blocks = data.long()
    else:
        data = list(data)
        if data and isinstance(data[0], str):
            if tokenizer is None:
                raise ValueError("`texts_or_token_ids` holds texts: pass `tokenizer=` to tokenize them.")
            eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
            data = [
                tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"] + eos for text in data if text
            ]
        for number, seq in enumerate(data):
            check_token_ids(torch.as_tensor(seq), None, f"texts_or_token_ids[{number}]")
        ids = [int(token) for seq in data for token in torch.as_tensor(seq).flatten().tolist()]
        if len(ids) < seq_len + 1 and ids:
            seq_len = len(ids)
        num_blocks = len(ids) // seq_len if seq_len else 0
        blocks = torch.tensor(ids[: num_blocks * seq_len], dtype=torch.long).view(num_blocks, seq_len)
    if blocks.numel() == 0 or blocks.shape[1] < 2:
        raise ValueError(
            "The distillation corpus is empty: `texts_or_token_ids` yields no block of at least 2 "
            "tokens. Pass non-empty texts (with `tokenizer=`) or token id sequences."
        )
    return blocks


def _build_drafter(target: PreTrainedModel, drafter, init_from_target: bool) -> PreTrainedModel:
    if isinstance(drafter, PreTrainedModel):
        return drafter
    if not isinstance(drafter, PretrainedConfig):
        raise TypeError(f"`drafter` must be a `PreTrainedModel` or a `PretrainedConfig`, got {type(drafter).__name__}.")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(drafter, dtype=torch.float32)
    if init_from_target:
        # early-exit start: every tensor the target has under the same name and shape (embeddings, the first
        # layers, the final norm, the head)
        target_state = target.state_dict()
        state = {
            name: target_state[name].float()
            for name, tensor in model.state_dict().items()
            if name in target_state and target_state[name].shape == tensor.shape
        }
        model.load_state_dict(state, strict=False)
    return model


def _check_vocabularies(target: PreTrainedModel, drafter: PreTrainedModel) -> None:
    target_vocab = target.get_output_embeddings().weight.shape[0]
    draft_vocab = drafter.get_output_embeddings().weight.shape[0]
    if target_vocab != draft_vocab:
        raise ValueError(
            f"The drafter has a vocabulary of {draft_vocab} tokens but the target has {target_vocab}. "
            "A drafter must share the target's tokenizer; build its config with "
            f"`vocab_size={target_vocab}`."
        )


def distill_drafter(
    target: PreTrainedModel,
    texts_or_token_ids,
    drafter: PreTrainedModel | PretrainedConfig,
    *,
    objective: str = "kl",
    tokenizer=None,
    temperature: float = 1.0,
    seq_len: int = 256,
    batch_size: int = 8,
    num_steps: int | None = None,
    num_epochs: float = 1.0,
    max_minutes: float | None = None,
    learning_rate: float = 1e-3,
    weight_decay: float = 0.0,
    warmup_ratio: float = 0.02,
    init_from_target: bool = True,
    seed: int = 0,
    accelerator=None,
    output_dir: str | Path | None = None,
    show_progress: bool = True,
    log_every: int = 10,
) -> PreTrainedModel:
    r"""
    Trains a drafter to match `target` on a corpus and returns it (and saves it to `output_dir`).

    Args:
        target ([`~transformers.PreTrainedModel`]):
            The causal LM to imitate; only run forward, in eval mode, never modified.
        texts_or_token_ids (`list[str]`, `list[list[int]]` or `torch.LongTensor` of shape `[blocks, seq_len]`):
            The corpus. Texts need `tokenizer`; sequences are joined with eos and cut into `seq_len` windows.
        drafter ([`~transformers.PreTrainedModel`] or [`~transformers.PretrainedConfig`]):
            A model (trained in place) or a config to build one from. It must have the target's vocabulary.
        objective (`str`, *optional*, defaults to `"kl"`):
            `"kl"` (forward KL(p || q)) or `"tv"` (total variation, 1 - expected acceptance).
        tokenizer ([`~transformers.PreTrainedTokenizerBase`], *optional*):
            Tokenizes `texts_or_token_ids` when it holds texts.
        temperature (`float`, *optional*, defaults to 1.0):
            Softmax temperature of both p and q in the loss.
        seq_len (`int`, *optional*, defaults to 256):
            Tokens per training window.
        batch_size (`int`, *optional*, defaults to 8):
            Windows per step and per process.
        num_steps (`int`, *optional*):
            Optimizer steps; defaults to `num_epochs` passes over the corpus.
        num_epochs (`float`, *optional*, defaults to 1.0):
            Passes over the corpus, when `num_steps` is not given.
        max_minutes (`float`, *optional*):
            A wall-clock budget for training; it stops when the budget or the steps run out, whichever comes first (the
            learning-rate schedule follows the nearer of the two).
        learning_rate (`float`, *optional*, defaults to 1e-3):
            AdamW peak learning rate (linear warm-up, cosine decay).
        weight_decay (`float`, *optional*, defaults to 0.0):
            AdamW weight decay.
        warmup_ratio (`float`, *optional*, defaults to 0.02):
            Fraction of the steps spent warming up.
        init_from_target (`bool`, *optional*, defaults to `True`):
            When `drafter` is a config, copy every tensor the target has under the same name and shape (embeddings,
            first layers, final norm) before training.
        seed (`int`, *optional*, defaults to 0):
            Seeds the drafter's initialisation and the data order.
        accelerator ([`~accelerate.Accelerator`], *optional*):
            Defaults to `Accelerator()`; pass one to choose mixed precision, gradient accumulation or a distributed
            setup.
        output_dir (`str` or `Path`, *optional*):
            Where the main process saves the drafter and `distill_log.json`.
        show_progress (`bool`, *optional*, defaults to `True`):
            A tqdm bar on the main process.
        log_every (`int`, *optional*, defaults to 10):
            Steps between loss updates in the bar and the log.

    Returns:
        [`~transformers.PreTrainedModel`]: the distilled drafter, unwrapped, in eval mode. Its training log (loss per
        logged step) is in `output_dir/distill_log.json` when `output_dir` is given.

    Example:

    ```python
    >>> import torch
    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> from hf_specdec.distill import distill_drafter
    >>> config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> target = AutoModelForCausalLM.from_config(config)
    >>> drafter_config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    >>> ids = torch.randint(0, 64, (16, 32), generator=torch.Generator().manual_seed(0))
    >>> drafter = distill_drafter(target, ids, drafter_config, objective="tv", num_steps=2, show_progress=False)
    >>> drafter.config.num_hidden_layers
    1

    ```
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    if objective not in OBJECTIVES:
        raise ValueError(f"`objective` must be one of {OBJECTIVES}, got {objective!r}.")
    if not temperature > 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature}.")
    if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1):
        raise ValueError(f"`num_steps` must be a positive int, got {num_steps!r}. Leave it None to use `num_epochs`.")
    if max_minutes is not None and not max_minutes > 0:
        raise ValueError(f"`max_minutes` must be > 0, got {max_minutes}. Leave it None for no time limit.")
    check_number("num_epochs", num_epochs, minimum=0.0, example=1.0, strict=True)
    check_int("seq_len", seq_len, minimum=2, example=256)
    check_int("batch_size", batch_size, minimum=1, example=8)
    check_int("log_every", log_every, minimum=1, example=10)
    check_number("warmup_ratio", warmup_ratio, minimum=0.0, example=0.02)
    check_number("learning_rate", learning_rate, minimum=0.0, example=1e-3, strict=True)
    check_number("weight_decay", weight_decay, minimum=0.0, example=0.0)
    output_dir = check_output_dir(output_dir)
    started = time.perf_counter()
    accelerator = accelerator if accelerator is not None else Accelerator()
    set_seed(seed)
    blocks = _as_blocks(texts_or_token_ids, tokenizer, seq_len)  # [num_blocks, seq_len]
    check_token_ids(blocks, target.get_input_embeddings().weight.shape[0], "texts_or_token_ids")
    drafter = _build_drafter(target, drafter, init_from_target)
    _check_vocabularies(target, drafter)

    generator = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(
        blocks, batch_size=batch_size, shuffle=True, generator=generator, drop_last=len(blocks) >= batch_size
    )
    steps_per_epoch = math.ceil(len(loader) / accelerator.num_processes)
    total_steps = num_steps if num_steps is not None else max(1, math.ceil(num_epochs * steps_per_epoch))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=learning_rate, weight_decay=weight_decay)
    budget_s = None if max_minutes is None else 60.0 * max_minutes
    warmup = max(1, int(warmup_ratio * total_steps)) if budget_s is None else 20

    def done_fraction(step: int) -> float:
        fraction = step / total_steps
        if budget_s is not None:
            fraction = max(fraction, (time.perf_counter() - started) / budget_s)
        return min(1.0, fraction)

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * done_fraction(step)))
    )
    drafter.train()
    drafter, optimizer, loader, scheduler = accelerator.prepare(drafter, optimizer, loader, scheduler)
    target = target.to(accelerator.device).eval()

    log: list[dict[str, Any]] = []
    progress = tqdm(
        total=total_steps,
        desc=f"distilling ({objective})",
        unit="step",
        disable=not (show_progress and accelerator.is_local_main_process),
    )
    step, running = 0, []
    while step < total_steps:
        for batch in loader:  # [batch, seq_len]
            with torch.no_grad(), accelerator.autocast():
                target_logits = target(batch).logits  # [batch, seq_len, vocab]
            with accelerator.autocast():
                draft_logits = drafter(batch).logits  # [batch, seq_len, vocab]
            vocab = target_logits.shape[-1]
            loss = _distillation_loss(
                target_logits.reshape(-1, vocab), draft_logits.reshape(-1, vocab), objective, temperature
            )
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(drafter.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            running.append(accelerator.gather(loss.detach()[None]).mean().item())
            step += 1
            progress.update(1)
            if step % log_every == 0 or step == total_steps:
                log.append({"step": step, objective: sum(running) / len(running), "lr": scheduler.get_last_lr()[0]})
                progress.set_postfix({objective: f"{log[-1][objective]:.4f}"})
                running = []
            if step >= total_steps or (budget_s is not None and done_fraction(step) >= 1.0):
                total_steps = step
                break
    progress.close()
    accelerator.wait_for_everyone()
    # without the mixed-precision forward wrapper: the returned model behaves like a freshly loaded one
    drafter = accelerator.unwrap_model(drafter, keep_fp32_wrapper=False).eval()
    if output_dir is not None and accelerator.is_main_process:
        save_into(output_dir, drafter.save_pretrained)  # never through a link standing in the folder
        record = {
            "objective": objective,
            "temperature": temperature,
            "steps": total_steps,
            "seq_len": blocks.shape[1],
            "batch_size": batch_size,
            "processes": accelerator.num_processes,
            "seed": seed,
            "log": log,
        }
        write_text(output_dir / "distill_log.json", json.dumps(record, indent=1) + "\n")
    return drafter


@torch.no_grad()
def drafter_agreement(
    target: PreTrainedModel, drafter: PreTrainedModel, blocks: torch.Tensor, batch_size: int = 16
) -> dict[str, float]:
    """How well `drafter` matches `target` on teacher-forced `[num_blocks, seq_len]` windows.

    Returns `kl` (mean KL(p || q)), `tv` (mean total variation; `1 - tv` is the mean acceptance probability beta
    at temperature 1 on these prefixes) and `top1` (how often both argmaxes agree: beta at temperature 0).
    """
    _check_vocabularies(target, drafter)
    totals = {"kl": 0.0, "tv": 0.0, "top1": 0.0}
    count = 0
    for start in range(0, len(blocks), batch_size):
        batch = blocks[start : start + batch_size].long()  # [batch, seq_len]
        target_logits = target(batch.to(target.device)).logits.float().flatten(0, 1)  # [tokens, vocab]
        draft_logits = drafter(batch.to(drafter.device)).logits.float().flatten(0, 1).to(target_logits.device)
        tokens = target_logits.shape[0]
        totals["kl"] += _distillation_loss(target_logits, draft_logits, "kl", 1.0).item() * tokens
        totals["tv"] += _distillation_loss(target_logits, draft_logits, "tv", 1.0).item() * tokens
        totals["top1"] += (target_logits.argmax(-1) == draft_logits.argmax(-1)).float().sum().item()
        count += tokens
    return {name: value / count for name, value in totals.items()}
