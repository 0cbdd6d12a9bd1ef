"""`EagleDrafter`: a drafter that reads the target's own hidden states (EAGLE-3, Li et al. 2025).

The draft model is one decoder layer on top of the target's features. At a position t whose next token x_{t+1} is
known, it reads the target's hidden states at three layers (low, middle, high: by default entries 2, L // 2 and
L - 3 of `output_hidden_states`, as SGLang and vLLM capture them), concatenated and projected by `fc`, together with
the embedding of x_{t+1}; its one layer attends over the concatenation `[input_layernorm(embedding),
hidden_norm(features)]` (2h wide), and a final norm and a head over a reduced **draft vocabulary** predict x_{t+2}.
Drafting further, the layer's own output (before the final norm) stands in for the target's features, with the
embedding of the token it drafted, one position further on. Draft ids map to target ids through `d2t`
(`target = draft + d2t[draft]`); `t2d` marks the target ids the draft vocabulary holds.

The weights use the layout that SGLang (`LlamaForCausalLMEagle3`), vLLM and SpecForge read and write: `fc.weight`,
`midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight` (q, k, v taking 2h inputs; vLLM's `norm_before_residual: true` variant
is read too), `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`,
and a `config.json` with `architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, `target_hidden_size` and,
when the layers read are not the default, `eagle_config.eagle_aux_hidden_state_layer_ids` (decoder layer ids k,
whose output is entry k + 1 of `output_hidden_states`). The token embeddings are the target's unless the checkpoint
carries its own `embed_tokens.weight`.

The round hands the drafter the target's hidden states of the positions it keeps, from the verification forward it
runs anyway (`Drafter.target_hidden_layers`, `HiddenStateCapture` in `hf_specdec.rounds`): no second target
forward, and only the three layers read are recorded. The first round has no features yet, so it drafts nothing
(that round is the prompt's prefill). Sampling stays exact: a proposal carries the q it sampled from, the draft
logits scattered over the full target vocabulary (`-inf` outside the draft vocabulary) and standardized by the
target's logits processors, so q(x) > 0 for every drafted token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

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
from ..sampling import sample_tokens
from .base import DraftContext, Drafter, DraftProposal, register_drafter
from .tree_builder import DynamicTree

__all__ = ["Eagle3DraftModel", "EagleDrafter", "default_eagle_layers"]

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_NAME = "model.safetensors"
PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
HUB_OPTIONS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "proxies")


def default_eagle_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high features of a target with `num_layers` decoder layers, as entries of
    `output_hidden_states` (the outputs of decoder layers 1, L // 2 - 1 and L - 4, as SGLang and vLLM capture them),
    kept inside the model for very shallow targets."""
    return [min(2, num_layers), max(1, num_layers // 2), max(1, num_layers - 3)]


def _text_config(model: PreTrainedModel):
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
    """An EAGLE-3 config sized like `target`'s decoder layers (its hidden size, heads and MLP width)."""
    text = _text_config(target)
    num_heads = text.num_attention_heads
    hidden = text.hidden_size
    layers = list(layers) if layers is not None else default_eagle_layers(text.num_hidden_layers)
    values = dict(
        architectures=[ARCHITECTURE],
        hidden_size=hidden,
        intermediate_size=getattr(text, "intermediate_size", None) or 4 * hidden,
        num_attention_heads=num_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(text, "head_dim", None) or hidden // num_heads,
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


def _layers_of(config: LlamaConfig, target_layers: int) -> list[int]:
    """Entries of `output_hidden_states` a config reads (its `eagle_aux_hidden_state_layer_ids`, plus one)."""
    ids = (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    return [int(i) + 1 for i in ids] if ids else default_eagle_layers(target_layers)


class EagleDrafter(Drafter):
    r"""
    Drafts with an EAGLE-3 head: one decoder layer that reads the target's own hidden states (see the module
    docstring for the architecture). `generate(drafter="eagle", drafter_kwargs={"pretrained": path})` loads one;
    `hf_specdec.distill.train_eagle_drafter` trains one for any decoder-only target.

    It drafts chains, and dynamic token trees with `speculative_tree_budget` (EAGLE-2: each depth expands the
    `tree_top_k` best nodes, by cumulative log q along their path, with their `tree_top_k` most likely tokens, in one
    draft forward; the proposal keeps the budget's best nodes). Greedy and sampled decoding are both exact.

    Args:
        model (`Eagle3DraftModel`, *optional*):
            The draft network (from `from_pretrained`, `from_target` or training). Give it or `pretrained`.
        pretrained (`str` or `Path`, *optional*):
            A local directory or Hub repo id of an EAGLE-3 head, loaded with `from_pretrained` at the start of each
            call, for the call's target. Give it or `model`.
        target_name (`str`, *optional*):
            The target it was trained for, recorded in the saved model card.
        tree_top_k (`int`, *optional*, defaults to 4):
            Children per expanded tree node, and nodes expanded per depth.
        training_info (`dict`, *optional*):
            What training recorded (data, time, acceptance), for the model card.
        hub_kwargs:
            Hub download options for `pretrained`: `revision`, `token`, `cache_dir`, `local_files_only`,
            `force_download`, `proxies`.

    Example:

    ```python
    >>> import torch, hf_specdec
    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    >>> target = hf_specdec.enable(AutoModelForCausalLM.from_config(config))
    >>> drafter = hf_specdec.EagleDrafter.from_target(target)
    >>> plain = target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8, do_sample=False)
    >>> fast = target.generate(torch.tensor([[1, 2, 3]]), drafter=drafter, max_new_tokens=8, do_sample=False)
    >>> bool((plain == fast).all())
    True

    ```
    """

    reads_target_hidden_states = True

    def __init__(
        self,
        model: Eagle3DraftModel | None = None,
        *,
        pretrained: str | Path | None = None,
        target_name: str | None = None,
        tree_top_k: int = 4,
        training_info: dict | None = None,
        **hub_kwargs,
    ):
        _check_hub_options(hub_kwargs)
        if (model is None) == (pretrained is None):
            raise ValueError(
                "EagleDrafter needs exactly one of `model` (an `Eagle3DraftModel`) or `pretrained` (a local "
                "directory or Hub repo id of an EAGLE-3 head), got "
                f"{'neither' if model is None else 'both'}. For example `drafter_kwargs={{'pretrained': path}}`, or "
                "`EagleDrafter.from_pretrained(path, target=model)`."
            )
        if model is not None and not isinstance(model, Eagle3DraftModel):
            raise TypeError(f"`model` must be an `Eagle3DraftModel`, got {type(model).__name__}.")
        if isinstance(tree_top_k, bool) or not isinstance(tree_top_k, int) or tree_top_k < 1:
            raise ValueError(
                f"`tree_top_k` must be a positive int (children per expanded tree node), got {tree_top_k!r}. "
                "Use `tree_top_k=4` (the default), or any int >= 1."
            )
        self.model = model
        self.pretrained = pretrained
        self.hub_kwargs = hub_kwargs
        self.target_name = target_name
        self.tree_top_k = tree_top_k
        self.training_info = dict(training_info or {})

    # ------------------------------------------------------------------ building, saving and loading
    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        draft_token_ids: Sequence[int] | torch.Tensor | None = None,
        layers: Sequence[int] | None = None,
        seed: int = 0,
        **config_overrides,
    ) -> EagleDrafter:
        """A new (untrained) head for `target`: sized like its layers, the draft vocabulary `draft_token_ids` (all
        target ids by default, most useful first), `fc` starting as the high features alone, the head's rows and
        the final norm copied from the target's, so that it starts close to an early exit of the target."""
        vocab = logits_width(target)
        ids = torch.arange(vocab) if draft_token_ids is None else torch.as_tensor(draft_token_ids, dtype=torch.long)
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
        name = getattr(target.config, "_name_or_path", None) or type(target).__name__
        return cls(model, target_name=name)

    def save_pretrained(self, save_directory: str | Path) -> None:
        """Writes `config.json`, `model.safetensors` (the published EAGLE-3 layout) and a model card."""
        from safetensors.torch import save_file

        model = self._loaded_model("save_pretrained")
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = model.config.to_dict()
        config.pop("eagle_layers", None)
        config["architectures"] = [ARCHITECTURE]
        (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()}
        if model.embed_tokens is not None:
            tensors["embed_tokens.weight"] = model.embed_tokens.weight.detach().contiguous().cpu()
        save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
        (directory / "README.md").write_text(self._model_card(config))

    def _model_card(self, config: dict) -> str:
        info = self.training_info
        lines = ["---", "library_name: hf-specdec", "tags:", "- speculative-decoding", "- eagle3"]
        if self.target_name:
            lines.append(f"base_model: {self.target_name}")
        lines += [
            "---",
            "",
            "# EAGLE-3 draft head",
            "",
            f"A draft head for `{self.target_name or 'its target'}` in the EAGLE-3 layout that SGLang and vLLM "
            "read (`LlamaForCausalLMEagle3`), for exact speculative decoding with `hf_specdec`:",
            "",
            "```python",
            "import hf_specdec",
            "drafter = hf_specdec.EagleDrafter.from_pretrained(path, target=model)",
            "out = hf_specdec.enable(model).generate(ids, drafter=drafter)",
            "```",
            "",
            f"- draft vocabulary: {config['draft_vocab_size']} of {config['vocab_size']} tokens",
            f"- target features: `output_hidden_states` entries "
            f"{[i + 1 for i in config['eagle_config']['eagle_aux_hidden_state_layer_ids']]}",
        ]
        for key, value in info.items():
            lines.append(f"- {key.replace('_', ' ')}: {value}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_pretrained(
        cls, pretrained: str | Path, target: PreTrainedModel, *, tree_top_k: int = 4, **hub_kwargs
    ) -> EagleDrafter:
        """Loads an EAGLE-3 head saved in the published layout (`model.safetensors`, or `pytorch_model.bin` read with
        `weights_only=True`) from a local directory or the Hub, and checks that it fits `target`."""
        _check_hub_options(hub_kwargs)
        directory = _resolve(pretrained, hub_kwargs)
        config_path = directory / "config.json"
        try:
            values = json.loads(config_path.read_text())
        except FileNotFoundError:
            raise OSError(f"{directory} has no config.json, so it is not an EAGLE-3 head directory.") from None
        except json.JSONDecodeError as error:
            raise OSError(f"{config_path} is not valid JSON ({error}).") from None
        tensors = _read_weights(directory)
        tensors = {name.removeprefix("model."): tensor for name, tensor in tensors.items()}
        text = _text_config(target)
        vocab = logits_width(target)
        values.pop("architectures", None)
        if "speculators_config" in values or "transformer_layer_config" in values or values.get("norm_before_fc"):
            raise ValueError(
                f"The EAGLE-3 head at {pretrained} uses a layout hf_specdec does not read yet (a `speculators` config, "
                "or `norm_before_fc`); serving it anyway could draft from wrong features. Use a head saved in the "
                "SGLang / EAGLE-3 layout (`LlamaForCausalLMEagle3`)."
            )
        values.setdefault("target_hidden_size", values.get("hidden_size"))
        values.setdefault("norm_before_residual", False)
        fc = tensors.get("fc.weight")
        head = tensors.get("lm_head.weight")
        if fc is None or head is None or "midlayer.self_attn.q_proj.weight" not in tensors:
            raise OSError(
                f"{directory} does not hold EAGLE-3 weights (`fc.weight`, `midlayer.*`, `lm_head.weight`); found "
                f"{sorted(tensors)[:8]}."
            )
        if values.get("draft_vocab_size") is None:
            values["draft_vocab_size"] = head.shape[0]
        config = LlamaConfig(**{**values, "architectures": [ARCHITECTURE]})
        config.eagle_layers = _layers_of(config, text.num_hidden_layers)
        problems = []
        if config.target_hidden_size != text.hidden_size:
            problems.append(
                f"it reads target hidden states of size {config.target_hidden_size}, the target's are "
                f"{text.hidden_size}"
            )
        if fc.shape[1] != len(config.eagle_layers) * text.hidden_size:
            problems.append(
                f"its `fc` takes {fc.shape[1]} features, {len(config.eagle_layers)} layers of the target "
                f"give {len(config.eagle_layers) * text.hidden_size}"
            )
        if config.vocab_size != vocab:
            problems.append(f"it maps into a vocabulary of {config.vocab_size} tokens, the target has {vocab}")
        if max(config.eagle_layers) > text.num_hidden_layers:
            problems.append(
                f"it reads layer outputs {config.eagle_layers}, the target has {text.num_hidden_layers} layers"
            )
        if problems:
            raise ValueError(
                f"The EAGLE-3 head at {pretrained} does not fit the target {type(target).__name__}: "
                + "; ".join(problems)
                + ". Use a head trained for this target (or train one with "
                "`hf_specdec.distill.train_eagle_drafter`)."
            )
        model = Eagle3DraftModel(config)
        embed = tensors.pop("embed_tokens.weight", None)
        if "d2t" not in tensors:  # a head over the full vocabulary
            tensors["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
            tensors["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
        tensors["d2t"] = tensors["d2t"].long()
        tensors["t2d"] = tensors["t2d"].bool()
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        missing = [name for name in missing if not name.startswith("rotary_emb.")]
        if missing or unexpected:
            raise ValueError(
                f"The EAGLE-3 head at {pretrained} does not match the EAGLE-3 layout: missing {missing}, unexpected "
                f"{unexpected}."
            )
        if embed is not None:
            model.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        model.to(device=execution_device(target), dtype=target.dtype)
        return cls(model, target_name=values.get("_name_or_path") or str(pretrained), tree_top_k=tree_top_k)

    def _loaded_model(self, what: str) -> Eagle3DraftModel:
        if self.model is None:
            raise ValueError(
                f"EagleDrafter.{what} needs a loaded head; load it with `EagleDrafter.from_pretrained("
                f"{self.pretrained!r}, target=model)` first."
            )
        return self.model

    # ------------------------------------------------------------------ drafting
    def reset(self, context: DraftContext) -> None:
        target = context.target
        if target.config.is_encoder_decoder:
            raise ValueError(
                f"EagleDrafter drafts for decoder-only targets; {type(target).__name__} is an encoder-decoder model. "
                "Use `assistant_model=` or prompt lookup with it."
            )
        if self.model is None:  # `drafter="eagle"` with `drafter_kwargs={"pretrained": ...}`: loaded per call
            self.model = EagleDrafter.from_pretrained(self.pretrained, target, **self.hub_kwargs).model
        model = self.model
        text = _text_config(target)
        if model.config.target_hidden_size != text.hidden_size or model.config.vocab_size != context.vocab_size:
            raise ValueError(
                f"This EAGLE-3 head was built for a target with hidden size {model.config.target_hidden_size} and "
                f"{model.config.vocab_size} logits, but {type(target).__name__} has hidden size {text.hidden_size} "
                f"and {context.vocab_size} logits. Use a head trained for this target."
            )
        self.target_hidden_layers = list(model.config.eagle_layers)
        self.embeddings = model.embed_tokens if model.embed_tokens is not None else target.get_input_embeddings()
        self.embeddings_device = execution_device(self.embeddings)  # the target's may be offloaded by accelerate
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.target_device = context.input_ids.device
        self.vocab_size = context.vocab_size
        self.hot_ids = model.hot_ids.to(self.target_device)
        self.logits_processor = context.logits_processor
        self.do_sample = context.do_sample
        self.tree_budget = context.tree_budget if context.input_ids.shape[0] == 1 else None
        self.keys = self.values = None  # [1, kv_heads, seen, head_dim]: the layer's cache of real positions
        self.seen = 0  # positions t (with x_{t+1} known) the cache holds
        self.pending = None  # [1, n, features]: target features of positions seen, seen + 1, ... not yet fed

    def _embed(self, token_ids: torch.LongTensor) -> torch.Tensor:
        embeds = self.embeddings(token_ids.to(self.embeddings_device))
        return embeds.to(device=self.device, dtype=self.dtype)

    def _scores(self, draft_logits: torch.Tensor, prefixes: torch.LongTensor) -> torch.FloatTensor:
        """Draft logits `[n, draft_vocab]` over the full target vocabulary (`-inf` outside the draft vocabulary),
        standardized by the target's processors with each row's prefix: `[n, vocab]`."""
        full = torch.full((draft_logits.shape[0], self.vocab_size), float("-inf"), device=self.target_device)
        full[:, self.hot_ids] = draft_logits.to(device=self.target_device, dtype=torch.float32)
        return self.logits_processor(prefixes, full)

    def _feed_context(self, input_ids: torch.LongTensor) -> torch.Tensor | None:
        """Feeds the pending target features (positions `seen`..len-2, each with the embedding of the token after
        it) into the layer's cache; returns the layer's output at the last one `[1, 1, h]`, or None without
        features."""
        length = input_ids.shape[1]
        if self.pending is None:
            return None
        if self.seen + self.pending.shape[1] != length - 1:
            raise RuntimeError(
                f"EagleDrafter holds target features up to position {self.seen + self.pending.shape[1] - 1}, but the "
                f"sequence has {length} tokens: the loop did not hand it the hidden states of every kept position."
            )
        features = self.pending.to(device=self.device, dtype=self.dtype)
        start = self.seen
        positions = torch.arange(start, length - 1, device=self.device)[None]
        hidden, keys, values = self.model(
            self._embed(input_ids[:, start + 1 :]),
            features,
            positions,
            project=True,
            past_keys=self.keys,
            past_values=self.values,
        )
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=2)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=2)
        self.seen, self.pending = length - 1, None
        return hidden[:, -1:]

    @torch.no_grad()
    def propose(
        self, input_ids: torch.LongTensor, num_tokens: int, attention_mask: torch.LongTensor | None = None
    ) -> DraftProposal:
        batch = input_ids.shape[0]
        if batch != 1:
            raise ValueError(
                "EagleDrafter drafts for one sequence at a time (hf_specdec decodes batches row by row for it)."
            )
        if num_tokens == 0:  # a plain step: the features wait, and are fed in one forward when drafts are asked
            return DraftProposal.empty(batch, input_ids.device)
        hidden = self._feed_context(input_ids)
        if hidden is None:
            return DraftProposal.empty(batch, input_ids.device)
        if self.tree_budget is not None:
            return self._propose_tree(input_ids, num_tokens, hidden)
        model = self.model
        ids = input_ids
        probs = []
        keys, values = self.keys, self.values
        position = self.seen - 1  # the last real position
        usable = []  # per step: whether the processors left any draft token (no host sync inside the loop)
        for step in range(num_tokens):
            scores = self._scores(model.logits(hidden[:, -1]).float(), ids)  # [1, vocab]: standardized q
            usable.append(torch.isfinite(scores).any())
            if self.do_sample:
                q = scores.softmax(dim=-1)
                q = torch.where(usable[-1], q, torch.full_like(q, 1.0 / q.shape[-1]))  # cut below if unusable
                token = sample_tokens(q)[:, None]
                probs.append(q)
            else:
                token = scores.argmax(dim=-1, keepdim=True)
            ids = torch.cat([ids, token], dim=-1)
            if step + 1 == num_tokens:
                break
            position += 1
            hidden, new_keys, new_values = model(
                self._embed(token),
                hidden,
                torch.full((1, 1), position, device=self.device),
                project=False,
                past_keys=keys,
                past_values=values,
            )
            keys, values = torch.cat([keys, new_keys], dim=2), torch.cat([values, new_values], dim=2)
        kept = int(torch.stack(usable).long().cumprod(0).sum())  # drafts before the first step with nothing left
        tokens = ids[:, input_ids.shape[1] : input_ids.shape[1] + kept]
        return DraftProposal(tokens=tokens, probs=torch.stack(probs, dim=1)[:, :kept] if probs else None)

    def _propose_tree(self, input_ids: torch.LongTensor, num_tokens: int, hidden: torch.Tensor) -> DraftProposal:
        """EAGLE-2's dynamic tree ([`DynamicTree`]) over the layer's outputs: `hidden` `[1, 1, h]` is the output at
        the last real position. Each expanded node is fed with the output that predicted it."""
        model, device = self.model, self.device
        tree = DynamicTree(
            self._scores(model.logits(hidden[:, -1]).float(), input_ids).log_softmax(dim=-1),
            self.tree_budget,
            self.tree_top_k,
            device,
        )
        if not len(tree):
            return tree.proposal()
        node_hidden = hidden[0].expand(len(tree), -1)  # [n, h]: the output that predicted each node
        fed_keys = fed_values = None  # [1, kv, expanded, d]
        real = self.keys.shape[2]
        for depth in range(1, num_tokens):
            expansion = tree.expand()
            if expansion is None:
                break
            size = expansion.tokens.shape[0]
            allowed = torch.cat(
                [torch.ones(size, real, dtype=torch.bool, device=device), expansion.mask], dim=1
            )  # [f, real + expanded]
            keys = self.keys if fed_keys is None else torch.cat([self.keys, fed_keys], dim=2)
            values = self.values if fed_values is None else torch.cat([self.values, fed_values], dim=2)
            positions = torch.full((1, size), self.seen - 1 + depth, device=device)
            out, new_keys, new_values = model(
                self._embed(expansion.tokens[None]),
                node_hidden[expansion.nodes.to(device)][None],
                positions,
                project=False,
                past_keys=keys,
                past_values=values,
                mask=allowed[None, None],
            )
            fed_keys = new_keys if fed_keys is None else torch.cat([fed_keys, new_keys], dim=2)
            fed_values = new_values if fed_values is None else torch.cat([fed_values, new_values], dim=2)
            prefixes = torch.cat([input_ids.expand(size, -1), expansion.paths], dim=-1)  # [f, seq_len + depth]
            tree.grow(self._scores(model.logits(out[0]).float(), prefixes).log_softmax(dim=-1))
            node_hidden = torch.cat([node_hidden, out[0].repeat_interleave(tree.top_k, dim=0)])
        return tree.proposal()

    def on_verified(
        self,
        input_ids: torch.LongTensor,
        num_accepted: torch.LongTensor,
        attention_mask: torch.LongTensor | None = None,
        accepted_nodes: torch.LongTensor | None = None,
        target_hidden_states: torch.Tensor | None = None,
    ) -> None:
        if target_hidden_states is None:
            raise ValueError(
                "EagleDrafter needs the target's hidden states after each verification (`target_hidden_states`), "
                "but the caller did not pass them. hf_specdec's loops do; a custom loop must capture them "
                "(`hf_specdec.rounds.HiddenStateCapture`)."
            )
        pending = (
            target_hidden_states if self.pending is None else torch.cat([self.pending, target_hidden_states], dim=1)
        )
        self.pending = pending


def _check_hub_options(hub_kwargs: dict) -> None:
    unknown = sorted(set(hub_kwargs) - set(HUB_OPTIONS))
    if unknown:
        raise TypeError(
            f"Unknown option(s) {unknown} for EagleDrafter. Besides `model` / `pretrained`, `target_name`, "
            f"`tree_top_k` and `training_info`, it takes the Hub download options {list(HUB_OPTIONS)}."
        )


def _resolve(pretrained: str | Path, hub_kwargs: dict) -> Path:
    path = Path(pretrained)
    if path.is_dir():
        return path
    if path.exists() or str(pretrained).startswith((".", "/", "~")) or str(pretrained).count("/") > 1:
        raise OSError(f"`pretrained` {str(pretrained)!r} is not a directory holding an EAGLE-3 head.")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                str(pretrained), allow_patterns=["*.json", "*.safetensors", "*.bin", "*.md"], **hub_kwargs
            )
        )
    except Exception as error:  # offline, unknown repo, gated...
        raise OSError(
            f"Could not load the EAGLE-3 head {str(pretrained)!r}: it is not a local directory, and the Hub download "
            f"failed ({type(error).__name__}: {error}). Pass a local directory, or check the repo id and network."
        ) from error


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The head's tensors: safetensors when present, else `pytorch_model.bin` read with `weights_only=True` (plain
    tensors only: no code is ever unpickled)."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if files:
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            try:
                tensors.update(load_file(str(file)))
            except Exception as error:
                raise OSError(f"Could not read the safetensors file {file} ({error}).") from error
        return tensors
    file = directory / PICKLE_WEIGHTS_NAME
    if not file.exists():
        raise OSError(f"{directory} holds no `{WEIGHTS_NAME}` or `{PICKLE_WEIGHTS_NAME}` with EAGLE-3 weights.")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:
        raise OSError(
            f"Could not read {file} as plain tensors ({type(error).__name__}: {error}). hf_specdec loads `.bin` heads "
            "with `weights_only=True` and never unpickles code; convert the head to safetensors."
        ) from error
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise OSError(f"{file} does not hold a flat dict of tensors.")
    return state


register_drafter("eagle", EagleDrafter)
