"""Whether a model can verify (or draft) a token tree: a functional check, not a list of model classes.

A tree forward hands the model a custom additive 4D attention mask and depth-based `position_ids`. A model whose
attention builds its own mask, ignores the given one, or derives positions from cache slots would compute
something else for the tree's nodes, silently. So the check runs the model once on a tiny tree and compares each
node's logits with a plain causal forward over that node's own path; a model that raises, or disagrees, is refused
with a clear error when a tree is asked for.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from transformers import DynamicCache

from .trees import tree_attention_bias

__all__ = ["check_tree_attention", "supports_tree_attention"]

# model -> (dtype, attention implementation, verdict): a model object changes neither often, and nothing is
# written onto the user's model
_VERDICTS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def supports_tree_attention(model) -> bool:
    """True when `model` computes a tree's nodes exactly as plain causal forwards over their paths would."""
    key = (model.dtype, getattr(model.config, "_attn_implementation", None))
    cached = _VERDICTS.get(model)
    if cached is not None and cached[:2] == key:
        return cached[2]
    verdict = _probe(model)
    _VERDICTS[model] = (*key, verdict)
    return verdict


def check_tree_attention(model, argument: str = "speculative_tree_budget") -> None:
    """Raises a `ValueError` naming the model class when it cannot take a tree forward."""
    if not supports_tree_attention(model):
        raise ValueError(
            f"`{argument}` needs a model that takes a custom 4D attention mask and `position_ids` in a cached "
            f"forward, and {type(model).__name__} does not compute a token tree as it computes the same paths one "
            f"by one. Drop `{argument}` (chains work with every model), or use a model whose attention takes 4D "
            "masks (most decoder-only models in transformers do)."
        )


@torch.no_grad()
def _probe(model) -> bool:
    if model.config.is_encoder_decoder or "position_ids" not in inspect.signature(model.forward).parameters:
        return False
    device = model.device
    vocab = model.config.get_text_config(decoder=True).vocab_size
    x, a, b, c, d = (torch.tensor([[t % vocab]], device=device) for t in (3, 5, 7, 11, 13))
    try:
        # the path x a b c in one causal forward, and x a d
        reference = model(input_ids=torch.cat([x, a, b, c], -1)).logits[0, -2:].float()  # after b, after c
        reference_d = model(input_ids=torch.cat([x, a, d], -1)).logits[0, -1].float()
        # x cached; tail a; nodes b (child of a), d (child of a), c (child of b), in one tree forward
        cache = DynamicCache(config=model.config)
        model(input_ids=x, past_key_values=cache, use_cache=True)
        parents = torch.tensor([[-1, -1, 0]], device=device)
        bias = tree_attention_bias(parents, past_length=1, tail_length=1, dtype=model.dtype)
        positions = torch.tensor([[1, 2, 2, 3]], device=device)
        tree = model(input_ids=torch.cat([a, b, d, c], -1), attention_mask=bias, position_ids=positions,
                     past_key_values=cache, use_cache=True).logits[0].float()  # [4, vocab]
    except Exception:  # any failure means "cannot": the caller raises a clear error naming the model
        return False
    got = torch.stack([tree[1], tree[3], tree[2]])
    want = torch.stack([reference[0], reference[1], reference_d])
    scale = want.abs().max().clamp(min=1.0)
    tolerance = 1e-3 if model.dtype == torch.float32 else 5e-2
    return bool(((got - want).abs().max() / scale) <= tolerance)
