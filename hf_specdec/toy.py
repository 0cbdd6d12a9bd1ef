"""The embedded default pair, built from configs (no download): an 8-layer Llama-style target and its early-exit
drafter (the target's own embedding, first layer, final norm and head).

The deeper layers' output projections are scaled down so that the drafter agrees with the target often (α around
0.6-0.7 at the default scale), which is what a well-matched drafter looks like to the sampler. Both models are
seeded and deterministic.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

__all__ = ["build_early_exit_pair", "copying_target", "decode_ids"]


def build_early_exit_pair(
    *,
    num_layers: int = 8,
    hidden_size: int = 768,
    vocab_size: int = 2048,
    deep_layer_scale: float = 0.05,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_logit_std: float | None = None,
    sliding_window: int | None = None,
) -> tuple[PreTrainedModel, PreTrainedModel]:
    """Returns `(target, drafter)`: a `num_layers` Llama target and its 1-layer early-exit drafter.

    `intermediate_size`, `num_attention_heads` and `num_key_value_heads` default to `hidden_size * 11 // 4`,
    `hidden_size // 64` and `hidden_size // 128`. The head is multiplied by 6 to sharpen the next-token
    distributions; with `head_logit_std` it is instead rescaled so that the target's logits, measured on one forward
    over seeded random tokens, have that standard deviation (a sharpness that does not depend on the shape, e.g.
    `head_logit_std=4.0` for a TinyLlama-shaped pair). With `sliding_window`, both are Mistral models (Llama's
    layers and weight names) whose every layer attends to the last `sliding_window` positions only.
    """
    window = {} if sliding_window is None else {"sliding_window": sliding_window}
    config = AutoConfig.for_model(
        "llama" if sliding_window is None else "mistral",
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 11 // 4 if intermediate_size is None else intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=max(1, hidden_size // 64) if num_attention_heads is None else num_attention_heads,
        num_key_value_heads=max(1, hidden_size // 128) if num_key_value_heads is None else num_key_value_heads,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        **window,
    )
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        # a sharper head gives the peaked next-token distributions of a trained model
        if head_logit_std is None:
            target.lm_head.weight.mul_(6.0)
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(deep_layer_scale)
            layer.mlp.down_proj.weight.mul_(deep_layer_scale)
        if head_logit_std is not None:
            probe = torch.randint(0, vocab_size, (1, 64), generator=torch.Generator().manual_seed(seed), device="cpu")
            logit_std = target(probe.to(target.device), use_cache=False).logits.float().std()
            target.lm_head.weight.mul_(head_logit_std / float(logit_std))
    drafter_config = copy.deepcopy(config)
    drafter_config.num_hidden_layers = 1
    drafter_config.layer_types = None
    drafter = AutoModelForCausalLM.from_config(drafter_config, dtype=dtype).eval()
    state = {
        k: v
        for k, v in target.state_dict().items()
        if not k.startswith("model.layers.") or k.startswith("model.layers.0.")
    }
    drafter.load_state_dict(state)
    for model in (target, drafter):
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = None
        model.generation_config.bos_token_id = None
    return target, drafter


_ALPHABET = "etaoinshrdlucmfwypvbgkqjxz ETAOINSHRDLUCMFWYPVBGKQJXZ.,;:!?'-()0123456789\n"


def copying_target(target: PreTrainedModel) -> PreTrainedModel:
    """A copy of a Llama-style `target` whose attention contributes nothing (output projections zeroed), at the same
    compute per forward: its next token depends on the current token only. For a prompt S + C + S, where C is its
    greedy continuation of S, it writes C again, like a model asked to return a block of code. `target` is left
    as it is."""
    markov = copy.deepcopy(target)
    with torch.no_grad():
        for layer in markov.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return markov


def decode_ids(ids) -> str:
    """A readable stand-in for a tokenizer: token id -> one character (the toy models have no tokenizer)."""
    return "".join(_ALPHABET[int(i) % len(_ALPHABET)] for i in ids)
