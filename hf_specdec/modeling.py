"""What the loops and drafters read off a transformers model, in one place (the core, not a drafter)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["logits_width"]


def logits_width(model: PreTrainedModel) -> int:
    """The number of logits a causal LM produces per position (its vocabulary as the sampler sees it)."""
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return head.weight.shape[0]
    return model.config.get_text_config(decoder=True).vocab_size
