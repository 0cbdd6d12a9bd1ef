"""Key/value cache operations the decoding loops share."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["compact_cache", "compactable", "realign_cache", "slice_cache"]


def realign_cache(cache: DynamicCache, columns: torch.LongTensor) -> None:
    """Rebuilds every layer of `cache` so that column j of row r holds what column `columns[r, j]` held.

    `columns` is `[batch, new_len]`; entries outside the old cache (the new left padding) are clamped, and hold
    values the attention mask hides. Callers that know every row moved alike use `slice_cache`, which copies nothing.
    """
    for layer in _filled_layers(cache):
        length = layer.keys.shape[-2]
        index = columns.clamp(0, length - 1).to(layer.keys.device)[:, None, :, None]  # [batch, 1, new_len, 1]
        layer.keys = layer.keys.gather(2, index.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1]))
        layer.values = layer.values.gather(2, index.expand(-1, layer.values.shape[1], -1, layer.values.shape[-1]))


def slice_cache(cache: DynamicCache, start: int, length: int) -> None:
    """Keeps columns `start ... start + length - 1` of every row: `realign_cache` when every row moved alike."""
    for layer in _filled_layers(cache):
        layer.keys = layer.keys[:, :, start : start + length]
        layer.values = layer.values[:, :, start : start + length]


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
