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

from .caches import cache_argument
from .devices import execution_device
from .trees import tree_attention_bias

__all__ = ["check_tree_attention", "supports_tree_attention"]

# model -> (dtype, attention implementation, verdict): a model object changes neither often, and nothing is
# written onto the user's model
_VERDICTS: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def supports_tree_attention(model) -> bool:
    """True when `model` computes a tree's nodes exactly as plain causal forwards over their paths would."""
    key = (model.dtype, getattr(model.config, "_attn_implementation", None))
    cached = _VERDICTS.get(model)
    if cached is not None and cached[:2] == key:
        return cached[2]
    verdict = _probe(model)
    _VERDICTS[model] = (*key, verdict)
    return verdict


def check_tree_attention(model, argument: str = "speculative_tree_budget", role: str = "the target") -> None:
    """Raises a `ValueError` naming the model class (and its `role`) when it cannot take a tree forward."""
    if not supports_tree_attention(model):
        raise ValueError(
            f"`{argument}` needs models that take a custom 4D attention mask and `position_ids` in a cached "
            f"forward, and {role} ({type(model).__name__}) does not compute a token tree as it computes the same "
            f"paths one by one. Drop `{argument}` (chains work with every model), or use a model whose attention "
            "takes 4D masks (most decoder-only models in transformers do)."
        )


@torch.no_grad()
def _probe(model) -> bool:
    if model.config.is_encoder_decoder or "position_ids" not in inspect.signature(model.forward).parameters:
        return False
    device = execution_device(model)  # not `model.device`: `meta` for a target dispatched by accelerate
    vocab = model.config.get_text_config(decoder=True).vocab_size
    x, a, b, c, d = (torch.tensor([[t % vocab]], device=device) for t in (3, 5, 7, 11, 13))
    # nodes b (child of a), d (child of a), c (child of b) after the context x a
    parents = torch.tensor([[-1, -1, 0]], device=device)
    tree_ids = torch.cat([a, b, d, c], -1)
    tree_positions = torch.tensor([[1, 2, 2, 3]], device=device)
    try:
        # each node's path in one causal forward: the logits after b, after c, and after d
        path = model(input_ids=torch.cat([x, a, b, c], -1)).logits[0, -2:].float()
        want = torch.stack([path[0], path[1], model(input_ids=torch.cat([x, a, d], -1)).logits[0, -1].float()])
        # what a model that ignored the positions or the mask would compute for c: the scale errors are judged by
        shifted = model(input_ids=torch.cat([x, a, b, c], -1), position_ids=torch.tensor([[0, 1, 2, 4]], device=device))
        unmasked = model(input_ids=torch.cat([x, a, b, d, c], -1))
        sensitivity = min(
            float((shifted.logits[0, -1].float() - want[1]).abs().max()),
            float((unmasked.logits[0, -1].float() - want[1]).abs().max()),
        )
        errors = []
        name = cache_argument(model)
        for cached in (0, 1):  # the first round (nothing cached, the context in the tail) and a later round
            cache = DynamicCache(config=model.config)
            if cached:
                model(input_ids=x, use_cache=True, **{name: cache})
            ids = tree_ids if cached else torch.cat([x, tree_ids], -1)
            positions = tree_positions if cached else torch.cat([tree_positions.new_zeros(1, 1), tree_positions], -1)
            bias = tree_attention_bias(parents, past_length=cached, tail_length=2 - cached, dtype=model.dtype)
            logits = (
                model(input_ids=ids, attention_mask=bias, position_ids=positions, use_cache=True, **{name: cache})
                .logits[0, -4:]
                .float()
            )  # [a, b, d, c]
            got = torch.stack([logits[1], logits[3], logits[2]])  # after b, after c, after d
            errors.append(float((got - want).abs().max()))
    except Exception:  # any failure means "cannot": the caller raises a clear error naming the model
        return False
    # rounding differs between a tree forward and a plain one (more in half precision), but far less than what a
    # wrong position or a sibling seen through the mask changes; a model whose output does not depend on them at
    # all (attention switched off) is exact when it agrees to rounding
    noise = (1e-5 if model.dtype == torch.float32 else 1e-2) * float(want.abs().max().clamp(min=1.0))
    return max(errors) <= max(0.1 * sensitivity, noise)
