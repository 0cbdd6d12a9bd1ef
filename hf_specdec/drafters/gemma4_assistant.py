"""`Gemma4AssistantDrafter`: drafts with a Gemma 4 assistant from the key/value states its target shares with it.

transformers serves these assistants (`Gemma4AssistantForCausalLM`, model type `gemma4_assistant`, and
`Gemma4UnifiedAssistantForCausalLM`, `gemma4_unified_assistant`) with `generate(assistant_model=assistant)` on a
Gemma 4 target, through `SinglePositionMultiTokenCandidateGenerator`. The assistant has no key/value projections of
its own: every one of its layers attends to the keys and values of the target's last non-shared layer of the same
kind (`full_attention`, `sliding_attention`; the target's config marks them `"store"` in `kv_sharing_modes`), and
its input is the target's last hidden state beside the embedding of the newest token. This drafter feeds it the same
way:

- **What it reads.** With n tokens in the sequence, the target's cache holds positions 0 .. n-2 between rounds. The
  keys and values of the target's `"store"` layers are read from that cache (the very tensors transformers returns
  as `shared_kv_states`; nothing is copied or recomputed): every position for `full_attention`, the last
  `sliding_window - 1` for `sliding_attention` (what the target's own sliding layers keep). The target's
  `last_hidden_state` at position n-2 (the output of its last decoder layer, recorded by the round during its own
  verification forward through `target_hidden_layers`, then the target's final norm, as transformers'
  `output_hidden_states` ties it) and the embedding of token x_{n-1} (by the target's own embeddings) make the first
  input, `[embedding, hidden]`.
- **One position.** Every draft step runs at position n-1 over the same keys and values (the assistant never adds
  its own); step k+1 reads the embedding of draft k and the assistant's own projected hidden state from step k.
- **Drafts.** Each step's logits are standardized by the target's logits processors with the draft's own prefix.
  Greedy calls take the argmax; sampling calls sample from q = softmax of the standardized logits and return that q
  as `probs`, so Algorithm 1 stays exact. (transformers drafts the argmax and hands the verifier the softmax of the
  raw logits as q, a distribution it did not sample from: its sampling is not the target's.)

Where the drafts differ from transformers' (exactness is unaffected; only what is drafted): after a rejection
transformers keeps the key/value states of the first rejected draft's position in what the assistant attends to
(`shared_kv_states` sliced to `input_ids.shape[1]` entries, one more than the context the target processed), and
its sliding keys are whatever its last verification forward returned (up to `sliding_window + 1` positions reach
the assistant); this drafter gives the assistant the accepted context only, and the sliding layers the window the
target's cache keeps. With no rejection and a sequence shorter than the window, the drafts are transformers'.

Like EAGLE, the first round is the prompt's prefill and drafts nothing: the target's states are not known before its
first forward. Batches are decoded row by row (left padding masked): the assistant reads the target's own cache,
each row's its own (`reads_target_cache`). A Gemma 3n target is refused: its forward returns no `shared_kv_states` (transformers' own
`generate(assistant_model=...)` fails on it too) and its last hidden state comes out of its AltUp streams, which the
round does not record.
"""

from __future__ import annotations

import inspect

import torch
import transformers
from transformers import PreTrainedModel
from transformers.cache_utils import StaticLayer

from ..caches import CACHE_KWARG, is_static
from ..capture import decoder_layers
from ..devices import execution_device
from ..modeling import logits_width
from ..sampling import sample_tokens
from .base import DraftContext, Drafter, DraftProposal, chain_proposal, register_drafter, require_hidden_states

__all__ = ["Gemma4AssistantDrafter", "is_gemma4_assistant"]

# the classes transformers serves with `SinglePositionMultiTokenCandidateGenerator` (absent before transformers 5.2x)
_ASSISTANT_CLASS_NAMES = ("Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM")
# the assistant builds a mask for each of these kinds, so the target must store the keys of both
_KINDS = ("full_attention", "sliding_attention")


def _assistant_classes() -> tuple[type, ...]:
    return tuple(cls for name in _ASSISTANT_CLASS_NAMES if (cls := getattr(transformers, name, None)) is not None)


def is_gemma4_assistant(model) -> bool:
    """Whether `model` is a Gemma 4 assistant (`Gemma4AssistantForCausalLM`, `Gemma4UnifiedAssistantForCausalLM`, or
    a subclass): a model that drafts from its target's shared key/value states, so `assistant_model=model` needs this
    drafter rather than `ModelDrafter`."""
    return isinstance(model, _assistant_classes())


def _returns_shared_kv_states(model: PreTrainedModel) -> bool:
    """Whether `model`'s forward returns `shared_kv_states` (its output class has the field), as Gemma 4 models do."""
    try:
        output = inspect.signature(type(model).forward).return_annotation
    except (TypeError, ValueError):
        return False
    return "shared_kv_states" in getattr(output, "__dataclass_fields__", {})


def _key_value_shape(text_config, index: int) -> tuple[int, int]:
    """(key/value heads, head size) of layer `index` of a Gemma 4 text config (per-layer overrides included)."""
    layer = text_config.per_layer_config[index] if hasattr(text_config, "per_layer_config") else text_config
    return layer.num_key_value_heads, layer.head_dim


def _check_fits_target(assistant: PreTrainedModel, target: PreTrainedModel, vocab_size: int) -> dict[str, int]:
    """Fails, naming both sides and the fix, unless `assistant` can draft for `target`; returns the index of the
    target layer whose keys and values each kind of attention reads."""
    name, assistant_name = type(target).__name__, type(assistant).__name__
    fix = "Use the assistant released with this target (its `-assistant` checkpoint)"
    if target.config.is_encoder_decoder:
        raise ValueError(
            f"{assistant_name} drafts for a Gemma 4 decoder; {name} is an encoder-decoder model. Pass a small model "
            'of the target\'s family as `assistant_model`, or use `drafter="prompt_lookup"`.'
        )
    text = target.config.get_text_config(decoder=True)
    modes = getattr(text, "kv_sharing_modes", None)
    if modes is None or not _returns_shared_kv_states(target):
        raise ValueError(
            f"{assistant_name} drafts from the key/value states its target shares with it (`shared_kv_states`, "
            f"which Gemma 4 models return), but {name} ({text.model_type}) returns none, so transformers' own "
            "`generate(assistant_model=...)` fails on it as well. Use it with a Gemma 4 target "
            "(`Gemma4ForCausalLM`, `Gemma4ForConditionalGeneration`, the Gemma 4 Unified models), or draft for "
            f'{name} with a small model of its own family or `drafter="prompt_lookup"`.'
        )
    blocks = decoder_layers(target)
    if blocks is None or not isinstance(getattr(target.get_decoder(), "norm", None), torch.nn.Module):
        raise ValueError(
            f"{assistant_name} reads the target's last hidden state, but {name} keeps no decoder layers and final "
            "norm where hf_specdec looks (`get_decoder().layers`, `get_decoder().norm`). Use another drafter with it."
        )
    assistant_text = assistant.config.get_text_config()
    backbone = assistant.config.backbone_hidden_size
    if backbone != text.hidden_size:
        raise ValueError(
            f"{assistant_name} was built for a target of hidden size {backbone} (`config.backbone_hidden_size`), but "
            f"{name} has hidden size {text.hidden_size}: the assistant reads the target's hidden states and "
            f"embeddings. {fix}."
        )
    width = logits_width(assistant)
    if width != vocab_size:
        raise ValueError(
            f"{assistant_name} has a vocabulary of {width} tokens but {name} has {vocab_size} logits: they do not "
            f"share a tokenizer. {fix}."
        )
    kinds = list(text.layer_types)
    stored = {kind: i for i, (kind, mode) in enumerate(zip(kinds, modes)) if mode == "store"}
    missing = [kind for kind in dict.fromkeys([*_KINDS, *assistant_text.layer_types]) if kind not in stored]
    if missing:
        raise ValueError(
            f"{assistant_name} attends to the keys and values of the target's last layer of each kind "
            f"({', '.join(_KINDS)}), but {name} stores none for {missing} (its `layer_types` are {kinds}). {fix}."
        )
    for index, kind in enumerate(assistant_text.layer_types):
        wanted, given = _key_value_shape(assistant_text, index), _key_value_shape(text, stored[kind])
        if wanted != given:
            raise ValueError(
                f"{assistant_name}'s layer {index} ({kind}) attends with {wanted[0]} key/value heads of size "
                f"{wanted[1]}, but {name}'s layer {stored[kind]}, whose keys and values it reads, has {given[0]} "
                f"heads of size {given[1]}. {fix}."
            )
    return stored


class Gemma4AssistantDrafter(Drafter):
    r"""
    Drafts with a Gemma 4 assistant (`Gemma4AssistantForCausalLM`, `Gemma4UnifiedAssistantForCausalLM`) from its
    Gemma 4 target's shared key/value states and last hidden state, as transformers' `generate(assistant_model=...)`
    does (see the module docstring). Greedy and sampled decoding are both exact; it drafts chains.

    Args:
        assistant_model (`PreTrainedModel`):
            The assistant, built for the target it drafts for (its `backbone_hidden_size` is the target's hidden size,
            its layers read the target's keys and values).

    Example:

    ```python
    >>> import torch, hf_specdec
    >>> from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig
    >>> sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2,
    ...     num_key_value_heads=1, head_dim=16, global_head_dim=16, sliding_window=16, hidden_size_per_layer_input=0,
    ...     vocab_size_per_layer_input=0, layer_types=["sliding_attention", "full_attention"])
    >>> target = hf_specdec.enable(Gemma4ForCausalLM(Gemma4TextConfig(num_hidden_layers=2, **sizes)).eval())
    >>> assistant = Gemma4AssistantForCausalLM(
    ...     Gemma4AssistantConfig(text_config=dict(num_hidden_layers=2, **sizes), backbone_hidden_size=32)).eval()
    >>> drafter = hf_specdec.drafters.gemma4_assistant.Gemma4AssistantDrafter(assistant)
    >>> ids = torch.tensor([[5, 6, 7]])
    >>> plain = target.generate(ids, max_new_tokens=8, do_sample=False)
    >>> fast = target.generate(ids, drafter=drafter, max_new_tokens=8, do_sample=False)
    >>> bool((plain == fast).all())
    True

    ```
    """

    reads_target_hidden_states = True
    reads_target_cache = True

    def __init__(self, assistant_model: PreTrainedModel):
        if not is_gemma4_assistant(assistant_model):
            raise TypeError(
                f"`assistant_model` must be a Gemma 4 assistant ({' or '.join(_ASSISTANT_CLASS_NAMES)}), got "
                f"{type(assistant_model).__name__}. Pass any other draft model as `assistant_model=` directly "
                "(`hf_specdec.ModelDrafter`)."
            )
        self.assistant_model = assistant_model
        # the γ its checkpoint asks for, as transformers reads it (`num_assistant_tokens`); read, never written
        gamma = getattr(assistant_model.generation_config, "num_assistant_tokens", None)
        self.default_gamma = gamma if isinstance(gamma, int) and not isinstance(gamma, bool) and gamma > 0 else None

    def reset(self, context: DraftContext) -> None:
        target = context.target
        self.store_layers = _check_fits_target(self.assistant_model, target, context.vocab_size)
        cache = context.model_kwargs.get(CACHE_KWARG)
        if cache is None or not hasattr(cache, "layers"):
            raise ValueError(
                f"Gemma4AssistantDrafter reads the target's keys and values from its cache, but the call's model "
                f"kwargs hold no layered cache under `{CACHE_KWARG}` (got {type(cache).__name__}). Generate with the "
                "default dynamic cache or a static one."
            )
        text = target.config.get_text_config(decoder=True)
        self.cache = cache  # the cache the rounds keep, updated in place: positions 0 .. n-2 at each `propose`
        self.static = is_static(cache)
        self.window = text.sliding_window - 1  # the sliding positions the target's own cache keeps
        self.target_hidden_layers = [len(decoder_layers(target))]  # the last decoder layer's output
        self.final_norm = target.get_decoder().norm
        self.embeddings = target.get_input_embeddings()
        self.embed_device = execution_device(target)
        self.device = execution_device(self.assistant_model)
        self.target_device = context.input_ids.device
        mask = context.model_kwargs.get("attention_mask")  # [1, prompt_len], 0 on left padding
        self.prompt_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        self.logits_processor = context.logits_processor
        self.do_sample = context.do_sample
        self.hidden: torch.Tensor | None = None  # [1, 1, hidden]: the target's last_hidden_state at position n-2
        self.hidden_length: int | None = None  # n, the sequence length `hidden` serves

    def _shared_kv_states(self, length: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The keys and values (`[1, heads, positions, head_dim]`) of the target's store layers over the context
        0 .. length-2 (the sliding kind: its last `sliding_window - 1` positions), read from its cache."""
        states = {}
        for kind, index in self.store_layers.items():
            layer = self.cache.layers[index]
            keys, values = layer.keys, layer.values
            if self.static or isinstance(layer, StaticLayer):  # preallocated: the context fills the first slots
                keys, values = keys[:, :, : length - 1], values[:, :, : length - 1]
            elif kind == "full_attention" and keys.shape[-2] != length - 1:
                raise RuntimeError(
                    f"Gemma4AssistantDrafter found {keys.shape[-2]} positions in the target's cache layer {index} "
                    f"before drafting after {length} tokens (expected {length - 1}): the loop did not keep the "
                    "cache holding every token but the newest."
                )
            if kind == "sliding_attention":
                keys, values = keys[:, :, -self.window :], values[:, :, -self.window :]
            states[kind] = (keys, values)
        return states

    def _context_mask(self, length: int) -> torch.LongTensor:
        """`[1, length - 1]`: the context's attention mask (0 on the prompt's left padding)."""
        mask = torch.ones(1, length - 1, dtype=torch.long, device=self.target_device)
        if self.prompt_mask is not None:
            prompt = self.prompt_mask[:, : length - 1]
            mask[:, : prompt.shape[1]] = prompt.to(mask)
        return mask

    def _drafted(self, logits: torch.Tensor, prefix: torch.LongTensor):
        """Draft from the assistant's logits `[1, vocab]` after `prefix` (`[1, len]`): the token `[1, 1]`, its q
        `[1, vocab]` (sampling) or None, and whether the processors left any token (a 0-dim bool)."""
        scores = self.logits_processor(prefix, logits.to(device=self.target_device, dtype=torch.float32))
        usable = torch.isfinite(scores).any()
        if not self.do_sample:
            return scores.argmax(dim=-1, keepdim=True), None, usable
        q = scores.softmax(dim=-1)  # [1, vocab]: the distribution the draft is sampled from
        q = torch.where(usable, q, torch.full_like(q, 1.0 / q.shape[-1]))  # cut below when unusable
        return sample_tokens(q)[:, None], q, usable

    @torch.no_grad()
    def propose(
        self, input_ids: torch.LongTensor, num_tokens: int, attention_mask: torch.LongTensor | None = None
    ) -> DraftProposal:
        batch, length = input_ids.shape
        if batch != 1:
            raise ValueError(
                "Gemma4AssistantDrafter drafts for one sequence at a time (hf_specdec decodes batches row by row)."
            )
        if num_tokens == 0 or self.hidden is None:  # a plain step, or the prompt's prefill: nothing known yet
            return DraftProposal.empty(batch, input_ids.device)
        if self.hidden_length != length:
            raise RuntimeError(
                f"Gemma4AssistantDrafter holds the target's hidden state for a sequence of {self.hidden_length} "
                f"tokens, but was asked to draft after {length}: the loop did not report every round."
            )
        shared_kv_states = self._shared_kv_states(length)
        mask = self._context_mask(length)  # [1, length - 1]
        # [1, 1]: the newest token's position (n-1 without padding), where every draft step runs
        position_ids = mask.sum(dim=-1, keepdim=True).to(self.device)
        hidden, token, ids = self.hidden, input_ids[:, -1:], input_ids
        probs, usable = [], []  # per draft: its q (sampling) and whether the processors left any token
        for _ in range(num_tokens):
            embedding = self.embeddings(token.to(self.embed_device)).to(hidden.device)
            outputs = self.assistant_model(
                inputs_embeds=torch.cat([embedding, hidden], dim=-1),  # [1, 1, 2 * hidden]
                attention_mask=mask,
                position_ids=position_ids,
                shared_kv_states=shared_kv_states,
                use_cache=False,
            )
            token, q, ok = self._drafted(outputs.logits[:, -1], ids)
            ids = torch.cat([ids, token.to(ids.device)], dim=-1)
            hidden = outputs.last_hidden_state  # [1, 1, hidden]: projected back to the target's size
            probs.append(q)
            usable.append(ok)
        return chain_proposal(ids, length, usable, probs if self.do_sample else [])

    def on_verified(
        self,
        input_ids: torch.LongTensor,
        num_accepted: torch.LongTensor,
        attention_mask: torch.LongTensor | None = None,
        accepted_nodes: torch.LongTensor | None = None,
        target_hidden_states: torch.Tensor | None = None,
    ) -> None:
        require_hidden_states(self, target_hidden_states)
        with torch.no_grad():  # the last kept position is n-2: its state predicted the newest token
            self.hidden = self.final_norm(target_hidden_states[:, -1:])  # [1, 1, hidden]: last_hidden_state
        self.hidden_length = input_ids.shape[1]


register_drafter("gemma4_assistant", Gemma4AssistantDrafter)
