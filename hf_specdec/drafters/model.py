"""`ModelDrafter`: a smaller causal LM drafts γ tokens autoregressively (the paper's M_q)."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from .base import DraftContext, DraftProposal, Drafter, register_drafter

__all__ = ["ModelDrafter"]


def logits_width(model: PreTrainedModel) -> int:
    """The number of logits a causal LM produces per position (its vocabulary as the sampler sees it)."""
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return head.weight.shape[0]
    return model.config.get_text_config(decoder=True).vocab_size


class ModelDrafter(Drafter):
    r"""
    Drafts with a (small) causal language model that shares the target's tokenizer, the paper's approximation
    model M_q. `generate(assistant_model=draft)` builds one.

    The drafter keeps its own `DynamicCache` for the duration of one `generate` call. Each round it feeds only the
    tokens it has not seen (including the target's recovered or bonus token) and, after verification, crops the
    drafts that were rejected. Its logits go through the target's own logits processors with the same prefix, so
    q is standardized exactly like p (section 2.2).

    Args:
        model ([`~transformers.PreTrainedModel`]):
            A causal LM with the same vocabulary as the target. It may sit on another device or use another dtype:
            its inputs and logits are moved for it. It is never modified.

    Example:

    ```python
    >>> import torch, hf_specdec
    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> target = hf_specdec.enable(AutoModelForCausalLM.from_config(config))
    >>> out = target.generate(torch.tensor([[1, 2, 3]]), drafter=hf_specdec.ModelDrafter(target), max_new_tokens=5)
    >>> out.shape
    torch.Size([1, 8])
    ```
    """

    def __init__(self, model: PreTrainedModel):
        if not isinstance(model, PreTrainedModel):
            raise TypeError(
                f"`assistant_model` must be a transformers `PreTrainedModel`, got {type(model).__name__}. "
                "Load it with `AutoModelForCausalLM.from_pretrained(...)`."
            )
        self.model = model

    def reset(self, context: DraftContext) -> None:
        model = self.model
        if model.config.is_encoder_decoder or context.target.config.is_encoder_decoder:
            raise ValueError(
                f"`assistant_model` ({type(model).__name__}) and the target ({type(context.target).__name__}) must both "
                "be decoder-only models; encoder-decoder pairs are not supported yet."
            )
        width = logits_width(model)
        if width != context.vocab_size:
            raise ValueError(
                f"`assistant_model` has a vocabulary of {width} tokens but the target has {context.vocab_size}. "
                "Speculative decoding needs a drafter that shares the target's tokenizer and vocabulary; use a "
                "drafter from the same model family, or resize its embeddings to the target's vocabulary."
            )
        cache = DynamicCache(config=model.config)
        cache.activate_past_recording()
        if not cache.is_croppable:
            raise ValueError(
                f"`assistant_model` ({type(model).__name__}) uses a cache that cannot be rolled back, so rejected "
                "drafts could not be undone. Use a drafter with standard (full or sliding-window) attention."
            )
        self.cache = cache
        self.device = model.device
        self.target_device = context.input_ids.device
        self.logits_processor = context.logits_processor
        self.do_sample = context.do_sample
        self.prompt_attention_mask = context.model_kwargs.get("attention_mask")  # [batch, prompt_len] or None
        forward_params = inspect.signature(model.forward).parameters
        self.accepts_position_ids = "position_ids" in forward_params
        self.accepts_logits_to_keep = "logits_to_keep" in forward_params

    def propose(self, input_ids: torch.LongTensor, num_tokens: int) -> DraftProposal:
        if num_tokens == 0:
            return DraftProposal.empty(input_ids.shape[0], input_ids.device)
        start = input_ids.shape[1]
        ids = input_ids  # [batch, seq_len + drafted so far], on the target's device
        probs = []
        for _ in range(num_tokens):
            scores = self.logits_processor(ids, self._next_logits(ids))  # [batch, vocab]: standardized q
            if self.do_sample:
                q = scores.softmax(dim=-1)
                token = torch.multinomial(q, 1)  # [batch, 1]
                probs.append(q)
            else:
                token = scores.argmax(dim=-1, keepdim=True)  # [batch, 1]
            ids = torch.cat([ids, token], dim=-1)
        return DraftProposal(tokens=ids[:, start:], probs=torch.stack(probs, dim=1) if probs else None)

    def on_verified(self, input_ids: torch.LongTensor, num_accepted: torch.LongTensor) -> None:
        # everything but the newest token (the target's, never fed to the drafter) may be in the cache
        excess = self.cache.get_seq_length() - (input_ids.shape[1] - 1)
        if excess > 0:
            self.cache.crop(-excess)

    def _next_logits(self, ids: torch.LongTensor) -> torch.FloatTensor:
        """Feeds the uncached tail of `ids` and returns the float32 logits of the last position, `[batch, vocab]`."""
        cached = self.cache.get_seq_length()
        batch, seq_len = ids.shape
        inputs = {"input_ids": ids[:, cached:].to(self.device), "past_key_values": self.cache, "use_cache": True}
        if self.prompt_attention_mask is not None:
            mask = self.prompt_attention_mask
            mask = torch.cat([mask, mask.new_ones(batch, seq_len - mask.shape[1])], dim=-1)  # [batch, seq_len]
            inputs["attention_mask"] = mask.to(self.device)
            if self.accepts_position_ids:
                positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, cached:]
                inputs["position_ids"] = positions.to(self.device)
        elif self.accepts_position_ids:
            inputs["position_ids"] = torch.arange(cached, seq_len, device=self.device).expand(batch, -1)
        if self.accepts_logits_to_keep:
            inputs["logits_to_keep"] = 1
        logits = self.model(**inputs).logits[:, -1]
        return logits.to(device=self.target_device, dtype=torch.float32, copy=True)


register_drafter("model", ModelDrafter)
