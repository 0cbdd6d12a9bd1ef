"""Key/value cache operations the decoding loops share."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import (
    CacheLayerMixin,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)
from transformers.generation import utils as _generation_utils

__all__ = [
    "CACHE_KWARG",
    "COLUMN_STATE",
    "cache_argument",
    "cache_of",
    "cached_length",
    "compact_cache",
    "compactable",
    "croppable_after_first_forward",
    "decoder_layers",
    "holds_nothing",
    "no_state_yet",
    "is_static",
    "realign_cache",
    "record_past",
    "rewind_cache",
    "slice_cache",
    "static_capacity",
    "static_layers",
    "static_rewind_problem",
]


# the tensors a cache layer holds per column: name -> (batch dim, column dim). Keys and values of every layer, and
# the indexer keys and positions of sparse-attention layers (`DynamicIndexedLayer`: deepseek_v32, glm_moe_dsa)
COLUMN_STATE = {"keys": (0, 2), "values": (0, 2), "indexer_keys": (0, 1), "indexer_position_ids": (1, 2)}


# transformers 5.24 renamed the cache everywhere from `past_key_values` to `cache`: the argument of every model's
# forward, the field of its outputs, and the key of `generate`'s model_kwargs. The old names still work there, with a
# deprecation warning, until 5.40; earlier releases know only `past_key_values`. The key `generate` keeps the cache
# under in model_kwargs, for this transformers:
CACHE_KWARG = "cache" if "cache" in getattr(_generation_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


def cache_argument(model, default: str | None = CACHE_KWARG) -> str | None:
    """The name under which `model`'s forward takes its cache: `cache` (transformers >= 5.24) or `past_key_values`
    (earlier releases, and remote-code models written for them); `default` when its forward names neither. Read it
    once per model, not per forward (it inspects the signature)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return default
    return next((name for name in ("cache", "past_key_values") if name in parameters), default)


def cache_of(outputs):
    """The cache a model's forward returned, under either name (see `CACHE_KWARG`), or None."""
    for name in ("cache", "past_key_values"):
        if name in outputs:  # a `ModelOutput` holds only the fields that are set
            return outputs[name]
    return None


def realign_cache(cache: DynamicCache, columns: torch.LongTensor) -> None:
    """Rebuilds every layer of `cache` so that column j of row r holds what column `columns[r, j]` held, in every
    per-column tensor of the layer (`COLUMN_STATE`).

    `columns` is `[batch, new_len]`; entries outside the old cache (the new left padding) are clamped, and hold
    values the attention mask hides. Callers that know every row moved alike use `slice_cache`, which copies nothing.
    A sliding-window layer (`DynamicSlidingWindowLayer`, recording its past: see `_sliding_window_columns`) gets the
    last columns of its window only.
    """
    for layer in _filled_layers(cache):
        first, kept = _sliding_window_columns(layer, columns.shape[1])
        wanted = columns[:, columns.shape[1] - kept :] - first  # [batch, kept]: columns of the stored tensors
        for name, tensor, (batch_dim, column_dim) in _column_state(layer):
            moved = tensor.movedim((batch_dim, column_dim), (0, 1))  # [batch, old_len, ...]
            index = wanted.clamp(0, moved.shape[1] - 1).to(moved.device)  # [batch, kept]
            rows = torch.arange(moved.shape[0], device=moved.device)[:, None]  # [batch, 1]
            setattr(layer, name, moved[rows, index].movedim((0, 1), (batch_dim, column_dim)).contiguous())
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = columns.shape[1]


def slice_cache(cache: DynamicCache, start: int, length: int) -> None:
    """Keeps columns `start ... start + length - 1` of every row: `realign_cache` when every row moved alike (a
    sliding-window layer: the last columns of its window among them)."""
    for layer in _filled_layers(cache):
        first, kept = _sliding_window_columns(layer, length)
        begin = start + length - kept - first  # in the stored tensors
        if begin < 0:
            raise RuntimeError(
                f"{type(layer).__name__} no longer holds column {start + length - kept} (it holds columns from {first} "
                "on): the cache cannot be sliced there"
            )
        for name, tensor, (_, column_dim) in _column_state(layer):
            setattr(layer, name, tensor.narrow(column_dim, begin, kept))
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = length


def _sliding_window_columns(layer, length: int) -> tuple[int, int]:
    """`(first, kept)` for a layer about to hold a rectangle of `length` columns: the column of the rectangle its
    stored tensors start at now, and how many of the new columns it keeps (the last ones).

    A full-attention layer stores every column (0, `length`). A sliding-window layer (`DynamicSlidingWindowLayer`)
    stores the last columns of the `cumulative_length` it has seen, and keeps the last `sliding_window - 1` new ones
    (all that a later forward attends to; as transformers' `crop` leaves it). Its cache must record its past
    (`Cache.activate_past_recording`), so that a forward keeps the window's older columns until the realignment: a row
    that moves right by as many columns as it emitted fewer tokens still finds its own window among them (the
    attention mask and the row's positions are those of plain generate: the row's tokens stay contiguous and end
    with the rectangle, so the window covers the same tokens)."""
    if not isinstance(layer, DynamicSlidingWindowLayer):
        return 0, length
    return layer.cumulative_length - layer.keys.shape[-2], min(length, max(layer.sliding_window - 1, 0))


def _column_state(layer) -> list:
    """(name, tensor, dims) of each per-column tensor `layer` holds; a layer with per-column tensors this module does
    not know is refused, as moving only some of them would misalign the rest silently."""
    state = [
        (name, value, COLUMN_STATE[name])
        for name, value in vars(layer).items()
        if isinstance(value, torch.Tensor) and name in COLUMN_STATE and value.numel()
    ]
    unknown = [
        name
        for name, value in vars(layer).items()
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and name not in COLUMN_STATE
    ]
    if unknown:
        raise ValueError(
            f"{type(layer).__name__} holds per-position state {unknown} that hf_specdec cannot move between the rows "
            "of a padded batch. Generate one sequence per call with this model."
        )
    return state


def compact_cache(cache, start: int, kept: torch.LongTensor, in_place: bool | None = None) -> None:
    """Keeps columns `0 ... start - 1` and then columns `start + kept[0], start + kept[1], ...` of every layer
    (`kept`: `[m]`, a tree's accepted path), dropping the rest: the accepted nodes' keys and values move into place
    right after the context, m columns copied per layer. A path that is already in place (`in_place`, when the
    caller knows it; else read from `kept`) is a crop (a rewind, for a static cache, whose preallocated tensors keep
    their addresses: the copy is in place and the write position moves back)."""
    length = start + kept.shape[0]
    if in_place is None:
        in_place = bool((kept == torch.arange(kept.shape[0], device=kept.device)).all())
    static = is_static(cache)
    for layer in _filled_layers(cache):
        if not in_place:
            index = (start + kept).to(layer.keys.device)
            layer.keys[:, :, start:length] = layer.keys[:, :, index]  # the indexed read copies before the write
            layer.values[:, :, start:length] = layer.values[:, :, index]
        if not static:
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]
    if static:
        rewind_cache(cache, length)


def decoder_layers(cache) -> tuple | list:
    """The layers of the cache the decoder writes to (an encoder-decoder cache's self-attention part); none for a
    cache without layers (or None)."""
    return getattr(getattr(cache, "self_attention_cache", cache), "layers", ())


def is_static(cache) -> bool:
    """Whether the cache the decoder writes to preallocates its keys and values (transformers' `StaticCache`,
    `cache_implementation="static"`): rolled back by moving its write position, never by reallocating. Its layers that
    hold no keys and values (a hybrid's linear-attention / SSM layers, whose state has one size whatever the length,
    and `DummyLayer`s) do not count: a `StaticCache` of such layers only (Mamba2's) is static too."""
    decoder_cache = getattr(cache, "self_attention_cache", cache)
    layers = _static_candidates(cache)
    if not layers:
        return isinstance(decoder_cache, StaticCache) and bool(getattr(decoder_cache, "layers", ()))
    return all(isinstance(layer, StaticLayer) for layer in layers)


def record_past(cache) -> None:
    """Sets `cache` to record its past (`Cache.activate_past_recording`: sliding-window layers and convolution windows
    keep what a forward appends until a crop), unless it is static. A static cache keeps its layers' shapes and
    addresses fixed for compiled forwards: its convolution windows stay at their kernel size (a rollback restores them
    from `recurrent.RecurrentCheckpoints`' copies), and a recording one would no longer count as compileable, which
    transformers' mask creation reads (a one-token forward over a static cache would then attend to its empty
    slots)."""
    if not is_static(cache):
        cache.activate_past_recording()


def static_layers(cache) -> list:
    """The layers of a static `cache` that hold keys and values (`StaticLayer`s; hybrid ones too)."""
    return [layer for layer in _static_candidates(cache) if isinstance(layer, StaticLayer)]


def _static_candidates(cache) -> list:
    layers = decoder_layers(cache)
    return [layer for layer in layers if isinstance(layer, CacheLayerMixin)]


def static_capacity(cache) -> int | None:
    """The positions a static `cache` can hold (the columns its attention runs over), or None for other caches and
    for a static cache without attention layers (its states have one size whatever the length)."""
    layers = static_layers(cache) if is_static(cache) else ()
    return min(layer.max_cache_len for layer in layers) if layers else None


def holds_nothing(cache) -> bool:
    """Whether `cache` holds no position yet. A cache of state-space layers only (Mamba) does not count its positions
    (`get_seq_length` raises): it holds nothing while none of its layers has a state."""
    layers = decoder_layers(cache)
    if layers and not any(isinstance(layer, CacheLayerMixin) for layer in layers):
        return not any(any(getattr(layer, "has_previous_state", {}).values()) for layer in layers)
    return cache.get_seq_length() == 0


def cached_length(cache) -> int:
    """The number of positions `cache` holds, as an int (a static cache keeps it in a tensor)."""
    return int(cache.get_seq_length())


def static_rewind_problem(cache, max_length: int) -> str | None:
    """Why a static `cache` could not be rewound during a generation that may write `max_length` positions, or None.
    A sliding-window static layer shifts its keys out once full, so what it dropped cannot come back."""
    for layer in static_layers(cache):
        # a generation writes at most max_length - 1 positions (the last token is never fed back)
        if isinstance(layer, StaticSlidingWindowLayer) and max_length - 1 > layer.max_cache_len:
            return (
                f"its sliding-window layers keep {layer.max_cache_len} positions, and a static sliding window "
                f"that fills up drops the oldest keys for good, so rejected drafts past position "
                f"{layer.max_cache_len} could not be undone (this generation may reach max_length={max_length})"
            )
    return None


def rewind_cache(cache, length: int) -> None:
    """Leaves `cache` holding its first `length` positions: a crop for a dynamic cache; for a static one, the write
    position moves back in place (the stale keys past it are hidden by the causal mask and overwritten by the next
    forward), so nothing is copied and compiled graphs keep their static addresses."""
    if not is_static(cache):
        excess = cached_length(cache) - length
        if excess > 0:
            cache.crop(-excess)
        return
    for layer in static_layers(cache):
        if not layer.is_initialized:
            continue
        if isinstance(layer, StaticSlidingWindowLayer):
            layer.cumulative_length_int = length
        layer.cumulative_length.fill_(length)


def compactable(cache) -> bool:
    """Whether `compact_cache` keeps `cache` whole: a `DynamicCache` whose layers keep every column (no sliding
    window) and hold nothing per column but their keys and values, or a static cache without sliding windows."""
    if is_static(cache):
        return all(isinstance(layer, StaticLayer) and not layer.is_sliding for layer in cache.layers)
    if not isinstance(cache, DynamicCache):
        return False
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or getattr(layer, "is_sliding", False):
            return False
        per_column_state = [
            name
            for name, value in vars(layer).items()
            if isinstance(value, torch.Tensor) and name not in ("keys", "values")
        ]
        if per_column_state:
            return False
    return True


def _filled_layers(cache: DynamicCache) -> list:
    # a `DummyLayer` (a layer that reads another's keys and values, or has no attention) holds None
    return [
        layer
        for layer in cache.layers
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel()
    ]


def croppable_after_first_forward(cache) -> bool:
    """Whether `cache` may still turn out croppable: transformers decides whether a convolution-only linear-attention
    layer (lfm2's short convolutions) can be rolled back only once a forward has shown it holds no recurrent state,
    so such a cache reports `is_croppable=False` before the first forward. Check `is_croppable` again after it."""
    layers = decoder_layers(cache)
    return bool(layers) and all(layer.is_croppable or _holds_nothing_yet(layer) for layer in layers)


def no_state_yet(cache) -> bool:
    """Whether no linear-attention layer of `cache` holds a convolution window or a recurrent state yet (nothing has
    been fed to them: `is_croppable` cannot tell yet)."""
    layers = decoder_layers(cache)
    return all(_holds_nothing_yet(layer) for layer in layers if hasattr(layer, "is_conv_states_initialized"))


def _holds_nothing_yet(layer) -> bool:
    conv = getattr(layer, "is_conv_states_initialized", None)
    recurrent = getattr(layer, "is_recurrent_states_initialized", None)
    return conv is not None and recurrent is not None and not any(conv.values()) and not any(recurrent.values())
