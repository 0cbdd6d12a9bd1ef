"""The EAGLE-3 draft network (`Eagle3DraftModel`), its config for a given target, and a new head's initial weights.

One decoder layer over 2h-wide inputs (the embedding of the next token and the target's projected features), a final
norm and a head over the draft vocabulary, with its parameters named as in the published checkpoints; `EagleDrafter`
(in `eagle.py`) drafts with it, `eagle_checkpoint.py` reads and writes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from accelerate.utils import align_module_device
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from ..devices import execution_device
from ..modeling import logits_width

__all__ = ["Eagle3DraftModel", "default_eagle_layers", "eagle_config_for", "initial_head", "text_config"]

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_eagle_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high features of a target with `num_layers` decoder layers, as entries of
    `output_hidden_states` (the outputs of decoder layers 1, L // 2 - 1 and L - 4, as SGLang and vLLM capture them),
    kept inside the model for very shallow targets."""
    return [min(2, num_layers), max(1, num_layers // 2), max(1, num_layers - 3)]


def text_config(model: PreTrainedModel):
    """The config of `model`'s text decoder (the model's own for a plain causal LM)."""
    return model.config.get_text_config(decoder=True)


def _rope_parameters(config) -> dict:
    """The target's rope parameters for one full-attention layer (a plain default rope when it has none)."""
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(value, dict) for value in params.values()):  # per layer type (Gemma 3...)
        params = params.get("full_attention", next(iter(params.values())))
    params = dict(params)
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class _Attention(nn.Module):
    """Grouped-query attention over 2h-wide inputs; keys are cached after RoPE by the caller."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, past_keys, past_values, mask):
        """`x` `[b, T, 2h]`; `past_*` `[b, kv_heads, S, d]` or None; `mask` `[b or 1, 1, T, S + T]` (True: attend) or
        None (causal over the T new positions after all S). Returns the output and the new keys and values."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys = k if past_keys is None else torch.cat([past_keys, k], dim=2)
        values = v if past_values is None else torch.cat([past_values, v], dim=2)
        groups = self.num_heads // self.num_kv_heads
        if mask is None and past_keys is not None and past_keys.shape[2]:
            past = past_keys.shape[2]
            mask = torch.ones(length, past + length, dtype=torch.bool, device=x.device).tril(past)[None, None]
        out = F.scaled_dot_product_attention(
            q, repeat_kv(keys, groups), repeat_kv(values, groups), attn_mask=mask, is_causal=mask is None and length > 1
        )
        out = out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)
        return self.o_proj(out), k, v


class _MidLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)


class Eagle3DraftModel(nn.Module):
    """The EAGLE-3 draft network, with its parameters named as in the published checkpoints.

    `forward` runs the one layer; `logits` applies the final norm and the draft-vocabulary head. The token embeddings
    are not a parameter of this module (they are the target's, or the checkpoint's own in `embed_tokens`)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        hidden, target_hidden = config.hidden_size, config.target_hidden_size
        self.num_features = len(config.eagle_layers)
        self.fc = nn.Linear(self.num_features * target_hidden, hidden, bias=False)
        self.midlayer = _MidLayer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary_emb = LlamaRotaryEmbedding(config)  # inv_freq is not saved (a non-persistent buffer)
        self.embed_tokens: nn.Embedding | None = None  # set only when a checkpoint carries its own

    @property
    def hot_ids(self) -> torch.LongTensor:
        """`[draft_vocab]`: the target id of each draft id."""
        return self.d2t + torch.arange(self.d2t.shape[0], device=self.d2t.device)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.LongTensor,
        *,
        project: bool,
        past_keys=None,
        past_values=None,
        mask=None,
    ):
        """One pass of the layer. `embeds` `[b, T, h]` (the next tokens' embeddings), `hidden` `[b, T, 3 h_target]`
        target features (`project=True`) or `[b, T, h]` the layer's own earlier outputs; returns the output before
        the final norm `[b, T, h]` and the new keys and values."""
        layer = self.midlayer
        if project:
            hidden = self.fc(hidden)
        if self.config.norm_before_residual:  # vLLM's variant: the residual stream starts normalized
            hidden = layer.hidden_norm(hidden)
            residual, normed = hidden, hidden
        else:  # SGLang's and EAGLE-3's
            residual, normed = hidden, layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        cos, sin = self.rotary_emb(x, position_ids)
        attended, keys, values = layer.self_attn(x, cos, sin, past_keys, past_values, mask)
        hidden = residual + attended
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden, keys, values

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., draft_vocab]` logits over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))


def eagle_config_for(
    target: PreTrainedModel, draft_vocab_size: int, layers: Sequence[int] | None = None, **overrides
) -> LlamaConfig:
    """An EAGLE-3 config sized like `target`'s decoder layers (its hidden size, heads and MLP width). An
    attention-free target (a state-space model such as Mamba2) has no heads to copy: the head's own attention then
    has heads of 64 dimensions (one head if the hidden size is smaller), unless `num_attention_heads` is given."""
    text = text_config(target)
    hidden = text.hidden_size
    num_heads = overrides.get("num_attention_heads") or getattr(text, "num_attention_heads", None)
    attention_free = not getattr(text, "num_attention_heads", None)  # its `head_dim`, if any, is an SSM's
    if not num_heads:
        num_heads = max(1, hidden // 64) if hidden % 64 == 0 else 1
    layers = list(layers) if layers is not None else default_eagle_layers(text.num_hidden_layers)
    values = dict(
        architectures=[ARCHITECTURE],
        hidden_size=hidden,
        intermediate_size=getattr(text, "intermediate_size", None) or 4 * hidden,
        num_attention_heads=num_heads,
        num_key_value_heads=(None if attention_free else getattr(text, "num_key_value_heads", None)) or num_heads,
        head_dim=(None if attention_free else getattr(text, "head_dim", None)) or hidden // num_heads,
        num_hidden_layers=1,
        hidden_act="silu",
        rms_norm_eps=getattr(text, "rms_norm_eps", None) or 1e-6,
        max_position_embeddings=getattr(text, "max_position_embeddings", None) or 4096,
        rope_parameters=_rope_parameters(text),
        vocab_size=logits_width(target),
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=hidden,
        norm_before_residual=False,
        tie_word_embeddings=False,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers]},
    )
    values.update(overrides)
    config = LlamaConfig(**values)
    config.eagle_layers = layers
    return config


def initial_head(
    target: PreTrainedModel,
    draft_token_ids: Sequence[int] | torch.Tensor | None = None,
    layers: Sequence[int] | None = None,
    seed: int = 0,
    **config_overrides,
) -> Eagle3DraftModel:
    """A new (untrained) head for `target`, on its device and in its dtype (see `EagleDrafter.from_target`)."""
    vocab = logits_width(target)
    given = None if draft_token_ids is None else torch.as_tensor(draft_token_ids)
    if given is not None and (given.is_floating_point() or given.is_complex() or given.dtype == torch.bool):
        raise ValueError(
            f"`draft_token_ids` must be integer token ids, got a {given.dtype} tensor or a sequence of non-integers "
            f"(e.g. {given.reshape(-1)[:3].tolist()}). Pass the token ids as ints."
        )
    ids = torch.arange(vocab) if given is None else given.long()
    if ids.dim() != 1 or not len(ids) or bool(((ids < 0) | (ids >= vocab)).any()) or len(ids.unique()) != len(ids):
        raise ValueError(
            f"`draft_token_ids` must be distinct target token ids in [0, {vocab}), got {len(ids)} ids. Pass the "
            "token ids the draft vocabulary should hold (e.g. the most frequent ones in your data)."
        )
    ids = ids.sort().values  # d2t is a map of increasing ids, as in the published heads
    config = eagle_config_for(target, len(ids), layers, **config_overrides)
    generator = torch.Generator().manual_seed(seed)
    model = Eagle3DraftModel(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
        for name in ("midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"):
            model.get_parameter(name).mul_(0.1)
        hidden = config.target_hidden_size
        fc = torch.zeros_like(model.fc.weight)
        if config.hidden_size == hidden:
            fc[:, -hidden:] = torch.eye(hidden)
        model.fc.weight.copy_(fc + model.fc.weight * 0.1)
        head = target.get_output_embeddings()
        if head is not None and head.weight.shape[1] == config.hidden_size:
            with align_module_device(head):  # an offloaded head's weight is on `meta` until aligned
                model.lm_head.weight.copy_(head.weight.detach()[ids.to(head.weight.device)].float().cpu())
        model.d2t.copy_(ids - torch.arange(len(ids)))
        model.t2d.zero_()
        model.t2d[ids] = True
    model.to(device=execution_device(target), dtype=target.dtype)
    return model
