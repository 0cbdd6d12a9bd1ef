"""Key/value cache operations the decoding loops share."""

from __future__ import annotations

import torch
from transformers import DynamicCache

__all__ = ["realign_cache", "slice_cache"]


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


def _filled_layers(cache: DynamicCache) -> list:
    return [layer for layer in cache.layers if getattr(layer, "is_initialized", False) and layer.keys.numel()]
