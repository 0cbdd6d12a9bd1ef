"""Key/value cache operations the decoding loops share."""

from __future__ import annotations

import torch
from transformers import DynamicCache

__all__ = ["realign_cache"]


def realign_cache(cache: DynamicCache, columns: torch.LongTensor) -> None:
    """Rebuilds every layer of `cache` so that column j of row r holds what column `columns[r, j]` held.

    `columns` is `[batch, new_len]`; entries outside the old cache (the new left padding) are clamped, and hold
    values the attention mask hides. When every row moves by the same amount (`columns` is one run of consecutive
    old columns, the same in every row), the layers are sliced instead, which copies nothing.
    """
    layers = [layer for layer in cache.layers if getattr(layer, "is_initialized", False) and layer.keys.numel()]
    new_len = columns.shape[1]
    start, alike = 0, True
    if columns.numel():  # one device sync: the first row's offset, and whether every entry has that offset
        offsets = columns - torch.arange(new_len, device=columns.device)
        start, alike = torch.stack([offsets[0, 0], (offsets == offsets[0, 0]).all().long()]).tolist()
    if alike and start >= 0 and all(layer.keys.shape[-2] >= start + new_len for layer in layers):
        for layer in layers:
            layer.keys = layer.keys[:, :, start : start + new_len]
            layer.values = layer.values[:, :, start : start + new_len]
        return
    for layer in layers:
        length = layer.keys.shape[-2]
        index = columns.clamp(0, length - 1).to(layer.keys.device)[:, None, :, None]  # [batch, 1, new_len, 1]
        layer.keys = layer.keys.gather(2, index.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1]))
        layer.values = layer.values.gather(2, index.expand(-1, layer.values.shape[1], -1, layer.values.shape[-1]))
