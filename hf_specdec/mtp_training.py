"""`train_mtp_layers`: fits multi-token-prediction layers to any decoder-only target, on its own outputs, in the form
transformers runs them (`MtpModel`): every model gets an MTP drafter (`MtpDrafter`, `drafter="mtp"`).

MTP layer k at slot i reads the previous stage's hidden state at i (stage 0: the target's last hidden state, after its
final norm) and the embedding of token x_{i+1+k}, at position i+1+k, and predicts x_{i+2+k}: it is trained to match
the target's own next-token distribution at position i+1+k (self-distillation; the loss is the cross-entropy from the
target's distribution, the KL divergence up to a constant), every layer fed the one before it on the same sequence, as
`MtpModel.forward` chains them. Only the MTP layers learn: the embeddings and head are the target's, read and never
changed.

With `init_from_target` (the default), each MTP layer starts as the target's first decoder layer reading the token's
embedding (its `eh_proj` passes the embedding half through and ignores the hidden state), with the target's final norm
as its post norm: before any step it drafts what the target's own first layer, final norm and head (a LayerSkip early
exit) would predict one position further on, and training teaches it to use the hidden state. A mixture-of-experts
block after dense layers (DeepSeek-V3's, GLM-4 MoE's) takes the first layer's MLP as its shared expert, its routed
experts' outputs zeroed. A hybrid's MTP block, an attention layer after recurrent ones (Qwen3.5's), takes its
attention from the target's first attention layer and its MLP and norms from the first layer. A block that no decoder
layer fits starts from the model class's initialization.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .drafters.mtp_checkpoint import build_mtp_layers, save_mtp_layers
from .eagle_data import gather_sequences
from .file_writes import write_text
from .training_checks import as_dtype, check_self_distillation, eval_split

__all__ = ["mtp_agreement", "train_mtp_layers"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _in_eval_mode(model):
    """`model` in eval mode for the block, then in the mode it was in."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def _embedding_rms(target) -> float:
    """The mean RMS of the target's token embeddings: the size of what its first layer reads."""
    return float(target.get_input_embeddings().weight.detach().float().pow(2).mean(-1).sqrt().mean())


def _identity_weight(norm: torch.nn.Module) -> float:
    """The weight at which `norm` only normalizes: 1, or 0 for a norm that scales by `1 + weight` (Qwen3.5's, Gemma's),
    found by running it: at weight 0, does it give back its input divided by its RMS?"""
    weight = norm.weight
    saved = weight.detach().clone()
    try:
        weight.zero_()
        x = torch.randn(2, weight.shape[-1], generator=torch.Generator().manual_seed(0)).to(weight)
        normalized = x.float() * x.float().pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
        try:
            out = norm(x)
        except TypeError:  # a norm that reads more than its input (a gated one) scales by its weight
            return 1.0
        return 0.0 if torch.allclose(out.float(), normalized, rtol=2e-2, atol=2e-2) else 1.0
    finally:
        weight.copy_(saved)


def _initialize(model, target, init_from_target: bool, seed: int) -> None:
    """Seeded weights for every MTP parameter (norms at the weight where they only normalize, biases of expert routing
    0, the rest normal with the config's `initializer_range`), then, with `init_from_target`, the target's first layer
    as each block (see the module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    std = getattr(model.config, "initializer_range", 0.02)
    hidden = model.config.hidden_size
    with torch.no_grad():
        identity = {
            f"{name}.weight": _identity_weight(module)
            for name, module in model.layers.named_modules()
            if "norm" in name.rsplit(".", 1)[-1] and isinstance(getattr(module, "weight", None), torch.nn.Parameter)
        }
        for name, weight in model.layers.named_parameters():
            if "norm" in name.rsplit(".", 2)[-2]:
                weight.fill_(identity.get(name, 1.0))
            elif name.endswith(("bias", "e_score_correction_bias")):
                weight.zero_()
            else:
                weight.copy_(torch.randn(weight.shape, generator=generator) * std)
        if not init_from_target:
            return
        decoder_layers = [layer.state_dict() for layer in target.get_decoder().layers]
        final_norm = getattr(target.get_decoder(), "norm", None)
        scale = _embedding_rms(target)  # eh_proj sees the embedding after `enorm`: scaled back to its size
        for layer in model.layers:
            # the first decoder layer the block can hold: a hybrid's first layer is a recurrent one, its MTP block an
            # attention one (Qwen3.5's), which starts as the first attention layer, then takes every weight the first
            # layer has too (its MLP and norms): as much of the first layer as the block can compute
            if any(_first_layer_as_block(layer.mtp_block, weights) for weights in decoder_layers):
                _take_matching(layer.mtp_block, decoder_layers[0])
            projection = torch.zeros_like(layer.eh_proj.weight)
            projection[:, :hidden] = torch.eye(hidden) * scale
            layer.eh_proj.weight.copy_(projection)
            if layer.post_norm is not None and final_norm is not None and hasattr(final_norm, "weight"):
                layer.post_norm.weight.copy_(final_norm.weight)


def _first_layer_as_block(block: torch.nn.Module, first: dict) -> bool:
    """Loads the target's first decoder layer (`first`, its state dict) into an MTP block when every weight of it
    has a place there: the same name and shape, or, for a mixture-of-experts block after dense layers (DeepSeek-V3,
    GLM-4 MoE), its MLP as the block's shared expert with the routed experts' outputs zeroed, so that the block
    computes what the layer does. Returns whether it did."""
    state = block.state_dict()
    loaded = {}
    for key, tensor in first.items():
        places = (key, key.replace("mlp.", "mlp.shared_experts.", 1))
        place = next((k for k in places if k in state and state[k].shape == tensor.shape), None)
        if place is None:
            return False
        loaded[place] = tensor
    for key in state:
        if (
            key.startswith("mlp.experts.")
            and "down" in key
            and any(k.startswith("mlp.shared_experts.") for k in loaded)
        ):
            loaded[key] = torch.zeros_like(state[key])
    block.load_state_dict(loaded, strict=False)
    return True


def _take_matching(block: torch.nn.Module, weights: dict) -> None:
    """Loads into `block` every tensor of `weights` (a decoder layer's state dict) whose name and shape it has."""
    state = block.state_dict()
    block.load_state_dict(
        {key: tensor for key, tensor in weights.items() if key in state and state[key].shape == tensor.shape},
        strict=False,
    )


def _padded(sequences: list[list[int]], indices: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `[batch, length]` ids and their mask (padding after the tokens never reaches a real slot through
    causal attention)."""
    length = max(len(sequences[i]) for i in indices)
    ids = torch.zeros((len(indices), length), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, i in enumerate(indices):
        ids[row, : len(sequences[i])] = torch.tensor(sequences[i], device=device)
        mask[row, : len(sequences[i])] = 1
    return ids, mask


def _batch(sequences: list[list[int]], hidden: dict, indices: list[int], device) -> tuple[torch.Tensor, ...]:
    """`_padded` ids and mask, with the target's `[batch, length, hidden]` last hidden states."""
    ids, mask = _padded(sequences, indices, device)
    states = hidden[indices[0]].new_zeros((*ids.shape, hidden[indices[0]].shape[-1]))
    for row, i in enumerate(indices):
        states[row, : len(sequences[i])] = hidden[i]
    return ids, mask, states


@torch.no_grad()
def _read_hidden_states(target, sequences: list[list[int]], batch_size: int) -> dict[int, torch.Tensor]:
    """Each sequence's last hidden state from the target (`[length, hidden]`, after its final norm), read once: the
    MTP layers' stage-0 input, and through the head the distributions they learn."""
    device = target.get_input_embeddings().weight.device
    hidden = {}
    for start in range(0, len(sequences), batch_size):
        indices = list(range(start, min(start + batch_size, len(sequences))))
        ids, mask = _padded(sequences, indices, device)
        states = target.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        for row, i in enumerate(indices):
            hidden[i] = states[row, : len(sequences[i])].clone()
    return hidden


def _frozen_head(model, head, hidden: torch.Tensor) -> torch.Tensor:
    """`MtpModel._project_to_logits` with the target's head read, not trained (no gradient reaches its weights)."""
    multiplier = getattr(model.config, "logits_mup_width_multiplier", None)
    if multiplier is not None:
        hidden = hidden / multiplier
    bias = None if head.bias is None else head.bias.detach()
    return torch.nn.functional.linear(hidden.to(head.weight.dtype), head.weight.detach(), bias)


def _layer_losses(model, target, ids, mask, hidden, autocast_dtype) -> tuple[list[torch.Tensor], list[float]]:
    """Per MTP layer: its loss over the batch's real slots, and its top-1 agreement with the target there. The
    target's distribution at a position is its head applied to its last hidden state there."""
    head = target.get_output_embeddings()
    embed = target.get_input_embeddings()
    length = ids.shape[1]
    with torch.no_grad():
        teacher_logits = model._project_to_logits(hidden.to(head.weight.dtype))
    losses, agreements = [], []
    stage = hidden[:, :-1].to(next(model.layers.parameters()).dtype)
    for k in range(len(model.layers)):
        if length - 1 - k < 1:
            break
        tokens = ids[:, 1 + k : length]
        stage = stage[:, : length - 1 - k]
        positions = torch.arange(1 + k, length, device=ids.device)[None].expand(ids.shape[0], -1)
        with torch.no_grad():
            embeds = embed(tokens).to(stage.dtype)
        with torch.autocast(ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            stage = model.forward_layer(k, stage, positions, None, inputs_embeds=embeds)
            student = _frozen_head(model, head, stage)
        student = student[..., : teacher_logits.shape[-1]].float().log_softmax(-1)
        teacher = teacher_logits[:, 1 + k : length].float().softmax(-1)
        real = mask[:, 1 + k : length].bool()
        losses.append(-(teacher * student).sum(-1)[real].mean())
        agreements.append((student.argmax(-1) == teacher.argmax(-1))[real].float().mean().item())
    return losses, agreements


def mtp_agreement(model, target, sequences: Sequence[Sequence[int]], batch_size: int = 8) -> list[float]:
    """Per MTP layer, the fraction of slots of `sequences` (token id lists) whose top-1 prediction is the target's
    (teacher-forced: each layer fed the one before it on the same sequence)."""
    sequences = [[int(i) for i in s] for s in sequences]
    hidden = _read_hidden_states(target, sequences, batch_size)
    device = target.get_input_embeddings().weight.device
    sums, counts = [0.0] * len(model.layers), [0] * len(model.layers)
    with torch.no_grad():
        for start in range(0, len(sequences), batch_size):
            indices = list(range(start, min(start + batch_size, len(sequences))))
            ids, mask, states = _batch(sequences, hidden, indices, device)
            _, agreements = _layer_losses(model, target, ids, mask, states, None)
            for k, agreement in enumerate(agreements):
                slots = int(mask[:, 1 + k :].sum())
                sums[k] += agreement * slots
                counts[k] += slots
    return [total / max(count, 1) for total, count in zip(sums, counts)]


def train_mtp_layers(
    target,
    prompts: Sequence[str] | None = None,
    texts: Sequence | None = None,
    *,
    tokenizer=None,
    num_mtp_layers: int | None = None,
    max_minutes: float | None = None,
    num_steps: int | None = None,
    output_dir: str | Path | None = None,
    init_from_target: bool = True,
    max_answer_tokens: int = 256,
    answer_temperature: float = 0.0,
    generation_batch_size: int = 16,
    answer_dtype: torch.dtype | str | None = None,
    batch_size: int = 8,
    learning_rate: float | None = None,
    warmup_steps: int = 20,
    eval_fraction: float = 0.05,
    seed: int = 0,
    show_progress: bool = True,
):
    r"""
    Trains multi-token-prediction layers for `target` on its own outputs and returns them as a
    `transformers.modeling_layers.MtpModel` sharing the target's embeddings and head (saved beside the target in the
    published layout when `output_dir` is given). Draft with them: `model.generate(..., drafter=MtpDrafter(layers))`,
    or `drafter="mtp"` / `use_mtp=True` on the model loaded back from `output_dir`.

    Args:
        target ([`~transformers.PreTrainedModel`]):
            A decoder-only causal LM whose config is its text config; only run forward (and `generate` to answer
            `prompts`), never modified.
        prompts (`list[str]`, *optional*):
            Instructions the target answers first (with its tokenizer's chat template when it has one); the layers
            train on the answers.
        texts (`list[str]` or `list[list[int]]`, *optional*):
            Texts (or token id sequences) trained on as they are; long ones are split into pieces the target's
            positions cover. Give `prompts`, `texts` or both.
        tokenizer ([`~transformers.PreTrainedTokenizerBase`], *optional*):
            The target's tokenizer (needed for `prompts` and for texts given as strings).
        num_mtp_layers (`int`, *optional*):
            MTP layers to train; defaults to what the target's config declares (`num_mtp_layers`), else 1.
        max_minutes (`float`, *optional*):
            Wall-clock budget of the whole call (answering gets at most half). Give it, `num_steps`, or both.
        num_steps (`int`, *optional*):
            Optimizer steps.
        output_dir (`str` or `Path`, *optional*):
            Where to save the target with its MTP layers (`save_mtp_layers`) and `training_log.json`.
        init_from_target (`bool`, *optional*, defaults to `True`):
            Start each layer as the target's first decoder layer reading the token's embedding (see the module
            docstring); otherwise from the model class's initialization.
        max_answer_tokens (`int`, *optional*, defaults to 256):
            The most tokens the target writes per answer to `prompts`.
        answer_temperature (`float`, *optional*, defaults to 0.0):
            The temperature the target answers at (0: greedy, the outputs greedy decoding will verify).
        generation_batch_size (`int`, *optional*, defaults to 16):
            Prompts answered per `generate` call.
        answer_dtype (`torch.dtype` or `str`, *optional*):
            Answer with a copy of the target in this dtype (the distributions learned are always the target's own).
        batch_size (`int`, *optional*, defaults to 8):
            Sequences per step.
        learning_rate (`float`, *optional*):
            AdamW peak learning rate (linear warm-up, then cosine decay); defaults to 1e-4 from the target's first
            layer (a larger step undoes that start) and 1e-3 from the class's initialization.
        warmup_steps (`int`, *optional*, defaults to 20):
            Steps of linear warm-up.
        eval_fraction (`float`, *optional*, defaults to 0.05):
            Sequences held out to measure top-1 agreement before and after training (`training_log.json`).
        seed (`int`, *optional*, defaults to 0):
            Seeds the answers, the initialization and the data order.
        show_progress (`bool`, *optional*, defaults to `True`):
            A tqdm bar while training.
    """
    from tqdm.auto import tqdm

    started = time.perf_counter()
    if prompts is None and texts is None:
        raise ValueError(
            "train_mtp_layers needs training data: pass `prompts=` (the target answers them) and/or `texts=` "
            "(trained on as they are)."
        )
    if tokenizer is None and (prompts or any(isinstance(text, str) for text in texts or [])):
        raise ValueError(
            "train_mtp_layers needs `tokenizer=` (the target's) to read `prompts` or texts given as strings; "
            "without one, pass `texts=` as token id sequences."
        )
    if max_minutes is None and num_steps is None:
        raise ValueError("train_mtp_layers needs a budget: pass `max_minutes=` and/or `num_steps=`.")
    if max_minutes is not None and not max_minutes > 0:
        raise ValueError(f"`max_minutes` must be > 0, got {max_minutes!r}.")
    if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1):
        raise ValueError(f"`num_steps` must be a positive int, got {num_steps!r}.")
    answer_dtype = as_dtype(answer_dtype, "answer_dtype")
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
    )
    declared = getattr(target.config.get_text_config(decoder=True), "num_mtp_layers", None)
    count = (
        num_mtp_layers
        if num_mtp_layers is not None
        else (declared if isinstance(declared, int) and declared > 0 else 1)
    )
    model = build_mtp_layers(target, count)  # refuses encoder-decoder and nested-config models
    with _in_eval_mode(target):  # no dropout in the distributions learned; the mode is given back
        torch.manual_seed(seed)

        deadline = None if max_minutes is None else started + 60.0 * max_minutes
        answer_deadline = None if max_minutes is None else started + 30.0 * max_minutes
        pairs, _ = gather_sequences(
            target,
            tokenizer,
            prompts,
            texts,
            num_synthetic_prompts=0,
            answer_dtype=answer_dtype,
            copies={},
            max_answer_tokens=max_answer_tokens,
            answer_temperature=answer_temperature,
            generation_batch_size=generation_batch_size,
            answer_start=started,
            deadline=answer_deadline,
            seed=seed,
            show_progress=show_progress,
        )
        sequences = [ids for ids, _ in pairs if len(ids) >= 3]
        if len(sequences) < 2:
            raise ValueError(f"train_mtp_layers got {len(sequences)} usable sequence(s); give more prompts or texts.")
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(sequences), generator=generator).tolist()
        eval_ids, train_ids = eval_split(order, eval_fraction, "train_mtp_layers")
        eval_sequences = [sequences[i] for i in eval_ids]

        _initialize(model, target, init_from_target, seed)
        before = mtp_agreement(model, target, eval_sequences)
        dtype = next(model.layers.parameters()).dtype
        model.layers.float().train()  # float master weights; bfloat16 / float16 targets train under autocast
        autocast_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else None
        parameters = [p for p in model.layers.parameters()]
        if learning_rate is None:
            learning_rate = 1e-4 if init_from_target else 1e-3
        # the projection's output is as small as the embeddings it passes on (their RMS, about 0.02 for a usual init):
        # its steps are scaled to that size, or the first steps drown the embedding in the hidden state's half
        projections = [layer.eh_proj.weight for layer in model.layers]
        step_scale = _embedding_rms(target) if init_from_target else 1.0
        groups = [
            {"params": [p for p in parameters if all(p is not q for q in projections)], "scale": 1.0},
            {"params": projections, "scale": step_scale},
        ]
        optimizer = torch.optim.AdamW(groups, lr=learning_rate, weight_decay=0.0)
        device = target.get_input_embeddings().weight.device
        hidden = _read_hidden_states(target, [sequences[i] for i in train_ids], batch_size)
        hidden = {train_ids[j]: states for j, states in hidden.items()}
        log = []
        step = 0

        def done() -> bool:
            return (num_steps is not None and step >= num_steps) or (
                deadline is not None and time.perf_counter() >= deadline
            )

        progress = tqdm(total=num_steps, desc="train_mtp_layers", disable=not show_progress)
        try:
            while not done():
                perm = torch.randperm(len(train_ids), generator=generator).tolist()
                for start in range(0, len(perm), batch_size):
                    if done():
                        break
                    indices = [train_ids[i] for i in perm[start : start + batch_size]]
                    ids, mask, states = _batch(sequences, hidden, indices, device)
                    spent = (time.perf_counter() - started) / (60.0 * max_minutes) if max_minutes else 0.0
                    progress_fraction = max(step / num_steps if num_steps else 0.0, spent)
                    warm = min(1.0, (step + 1) / max(1, warmup_steps))
                    for group in optimizer.param_groups:
                        decay = 0.5 * (1 + math.cos(math.pi * min(1.0, progress_fraction)))
                        group["lr"] = learning_rate * group["scale"] * warm * decay
                    losses, agreements = _layer_losses(model, target, ids, mask, states.float(), autocast_dtype)
                    loss = torch.stack(losses).mean()
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(parameters, 1.0)
                    optimizer.step()
                    step += 1
                    log.append({"step": step, "loss": loss.item(), "agreement": agreements})
                    progress.update(1)
        finally:
            progress.close()
            model.layers.to(dtype).eval()
            for p in parameters:
                p.grad = None
        after = mtp_agreement(model, target, eval_sequences)
        summary = {
            "steps": step,
            "sequences": len(sequences),
            "eval_sequences": len(eval_sequences),
            "agreement_before": before,
            "agreement_after": after,
            "seconds": time.perf_counter() - started,
            "log": log,
        }
        logger.info("train_mtp_layers: %d steps, top-1 agreement %s -> %s", step, before, after)
        if output_dir is not None:
            save_mtp_layers(target, model, output_dir)
            write_text(output_dir / "training_log.json", json.dumps(summary, indent=2) + "\n")
        model.training_summary = {k: v for k, v in summary.items() if k != "log"}
        return model
