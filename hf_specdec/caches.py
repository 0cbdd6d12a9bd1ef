"""Key/value cache operations the decoding loops share."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["COLUMN_STATE", "compact_cache", "compactable", "croppable_after_first_forward", "realign_cache",
           "slice_cache"]


# the tensors a cache layer holds per column: name -> (batch dim, column dim). Keys and values of every layer, and
# the indexer keys and positions of sparse-attention layers (`DynamicIndexedLayer`: deepseek_v32, glm_moe_dsa)
COLUMN_STATE = {"keys": (0, 2), "values": (0, 2), "indexer_keys": (0, 1), "indexer_position_ids": (1, 2)}


def realign_cache(cache: DynamicCache, columns: torch.LongTensor) -> None:
    """Rebuilds every layer of `cache` so that column j of row r holds what column `columns[r, j]` held, in every
    per-column tensor of the layer (`COLUMN_STATE`).

    `columns` is `[batch, new_len]`; entries outside the old cache (the new left padding) are clamped, and hold
    values the attention mask hides. Callers that know every row moved alike use `slice_cache`, which copies nothing.
    """
    for layer in _filled_layers(cache):
        for name, tensor, (batch_dim, column_dim) in _column_state(layer):
            moved = tensor.movedim((batch_dim, column_dim), (0, 1))  # [batch, old_len, ...]
            index = columns.clamp(0, moved.shape[1] - 1).to(moved.device)  # [batch, new_len]
            rows = torch.arange(moved.shape[0], device=moved.device)[:, None]  # [batch, 1]
            setattr(layer, name, moved[rows, index].movedim((0, 1), (batch_dim, column_dim)).contiguous())


def slice_cache(cache: DynamicCache, start: int, length: int) -> None:
    """Keeps columns `start ... start + length - 1` of every row: `realign_cache` when every row moved alike."""
    for layer in _filled_layers(cache):
        for name, tensor, (_, column_dim) in _column_state(layer):
            setattr(layer, name, tensor.narrow(column_dim, start, length))


def _column_state(layer) -> list:
    """(name, tensor, dims) of each per-column tensor `layer` holds; a layer with per-column tensors this module does
    not know is refused, as moving only some of them would misalign the rest silently."""
    state = [(name, value, COLUMN_STATE[name]) for name, value in vars(layer).items()
             if isinstance(value, torch.Tensor) and name in COLUMN_STATE and value.numel()]
    unknown = [name for name, value in vars(layer).items()
               if isinstance(value, torch.Tensor) and value.dim() >= 2 and name not in COLUMN_STATE]
    if unknown:
        raise ValueError(
            f"{type(layer).__name__} holds per-position state {unknown} that hf_specdec cannot move between the rows "
            "of a padded batch. Generate one sequence per call with this model."
        )
    return state


def compact_cache(cache: DynamicCache, start: int, kept: torch.LongTensor) -> None:
    """Keeps columns `0 ... start - 1` and then columns `start + kept[0], start + kept[1], ...` of every layer
    (`kept`: `[m]`, a tree's accepted path), dropping the rest: the accepted nodes' keys and values move into place
    right after the context, m columns copied per layer. A path that is already in place is a crop."""
    length = start + kept.shape[0]
    in_place = bool((kept == torch.arange(kept.shape[0], device=kept.device)).all())
    for layer in _filled_layers(cache):
        if not in_place:
            index = (start + kept).to(layer.keys.device)
            layer.keys[:, :, start:length] = layer.keys[:, :, index]  # the indexed read copies before the write
            layer.values[:, :, start:length] = layer.values[:, :, index]
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


def compactable(cache) -> bool:
    """Whether `compact_cache` keeps `cache` whole: a `DynamicCache` whose layers keep every column (no sliding
    window) and hold nothing per column but their keys and values."""
    if not isinstance(cache, DynamicCache):
        return False
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or getattr(layer, "is_sliding", False):
            return False
        per_column_state = [name for name, value in vars(layer).items()
                            if isinstance(value, torch.Tensor) and name not in ("keys", "values")]
        if per_column_state:
            return False
    return True


def _filled_layers(cache: DynamicCache) -> list:
    return [layer for layer in cache.layers if getattr(layer, "is_initialized", False) and layer.keys.numel()]


def croppable_after_first_forward(cache) -> bool:
    """Whether `cache` may still turn out croppable: transformers decides whether a convolution-only linear-attention
    layer (lfm2's short convolutions) can be rolled back only once a forward has shown it holds no recurrent state,
    so such a cache reports `is_croppable=False` before the first forward. Check `is_croppable` again after it."""
    layers = getattr(getattr(cache, "self_attention_cache", cache), "layers", ())
    return bool(layers) and all(layer.is_croppable or _holds_nothing_yet(layer) for layer in layers)


def _holds_nothing_yet(layer) -> bool:
    conv = getattr(layer, "is_conv_states_initialized", None)
    recurrent = getattr(layer, "is_recurrent_states_initialized", None)
    return conv is not None and recurrent is not None and not any(conv.values()) and not any(recurrent.values())
