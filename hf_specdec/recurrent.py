"""Exact rollback of recurrent state: the caches of hybrid and state-space models (Qwen3.5, Qwen3-Next, Mamba,
Mamba2, Falcon-H1, Zamba, ...), whose linear-attention / SSM layers keep one state for the whole sequence instead of
a key and a value per position.

A key/value cache is rolled back by cropping its columns. A recurrent layer's state after position t cannot be
recovered from its state after a later position, and the kernels transformers runs over several positions (chunked
gated delta rule, chunked SSD scan) return the final state only. So rejected drafts are undone from a checkpoint:

- `RecurrentCheckpoints.save()` copies every recurrent state and convolution window, at the number of positions the
  cache holds (before the verify forward of a round; after each forward of a draft model). The windows are small
  (the last `conv_kernel_size` inputs), and copying them does not rely on transformers' past recording
  (`Cache.activate_past_recording`), which some layers bypass in their one-token path (Kimi-Linear, Bailing-hybrid:
  they shift the window in place) and others misread (Zaya hands the cache a whole window, which a recording would
  append): the linear-attention layers do not record (`stop_recording_windows`); attention layers do.
- `RecurrentCheckpoints.rewind(length)` leaves the cache at `length` when that is its current length (a round that
  kept everything it fed: the state is already the right one) or a checkpoint; otherwise it goes back to the latest
  checkpoint before `length` and returns that length. The positions between are then uncached: the caller feeds
  them again with its next forward (the target: before the next round's drafts, in the same forward, up to
  `sequence.FOLDED_TAIL` of them; a draft model: in its next step), exactly as it feeds any uncached tail.

Verify forwards are short (1 + γ tokens, plus a kept tail), and the chunked kernels transformers' gated-delta-rule
layers run over several tokens (Qwen3.5, Qwen3-Next, OLMo-hybrid, ...) pad them to a whole chunk (64 positions)
before computing it. Where a model's forward takes the kernel's `chunk_size` (`takes_chunk_size`: the argument reaches
the kernel, as transformers passes a forward's keyword arguments down, and the logits agree with the default's), the
verify and draft forwards after the first pass `chunk_size` = their number of new tokens (`chunk_kwargs`): one chunk
without padding, the same recurrence (a forward over several tokens agrees with the default chunking to float
tolerance, which the capability probe checks in the verify's own shapes). The prefill keeps the model's default.

A stateful model may also keep state a crop cannot undo in key/value layers of its own (`snapshot_layers`):
DeepSeek-V4's compressed-attention layers hold, beside a window of keys that their `update` keeps at
`sliding_window - 1` whatever the recording, each compressor's buffer of tokens not yet compressed, its compressed
entries, their count and the last window's overlap. Those layers are checkpointed whole: a checkpoint keeps what the
layer's attributes refer to (their tensors are replaced by each forward, never written in place, so keeping the
references is a copy; the capability probe checks the rollback against step-by-step decoding), and a rollback puts
them back, the kept tokens then fed again as for a recurrent layer.

Cost: one copy of the recurrent states per round (per drafted token for a stateful draft model), and, after a round
that rejected drafts, its kept tokens carried again by the next forward (no extra forward). Not supported: token
trees (each branch would need a state of its own) and static caches.

The state after a rollback is the state the recurrence reaches over the kept tokens, computed by the same kernels
plain `generate` runs (a forward over several tokens agrees with one-token forwards to float tolerance, as
transformers' own chunked prefill does): nothing is approximated and nothing is kept of a rejected position.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from .caches import decoder_layers, is_static, record_past

__all__ = [
    "RecurrentCheckpoints",
    "chunk_kwargs",
    "draft_checkpoints",
    "finish_recording",
    "forgo_chunk_size",
    "held_positions",
    "is_recording",
    "is_recurrent",
    "pad_conv_windows",
    "recurrent_layers",
    "rolls_back_from_checkpoints",
    "snapshot_layers",
    "stop_recording_windows",
    "takes_chunk_size",
]

# a chunk of at most this many new tokens is passed as the kernel's `chunk_size`; longer forwards keep the default
# (transformers' gated-delta-rule kernels chunk by 64)
CHUNK_LIMIT = 64
# model -> (dtype, whether its forward takes `chunk_size`): nothing is written onto the user's model
_CHUNK_SIZED: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def recurrent_layers(cache) -> list:
    """The layers of `cache` (or of an encoder-decoder cache's self-attention part) that keep recurrent state."""
    layers = decoder_layers(cache)
    return [layer for layer in layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def snapshot_layers(model, cache) -> list:
    """The key/value layers of a stateful model's cache (transformers' `_is_stateful`) of a class the model defines
    itself, outside `transformers.cache_utils` (DeepSeek-V4's compressed-attention layers): they keep state of their
    own beside keys and values, which a crop does not roll back, so `RecurrentCheckpoints` restores them whole."""
    if not getattr(model, "_is_stateful", False):
        return []
    return [
        layer
        for layer in decoder_layers(cache)
        if isinstance(layer, CacheLayerMixin)
        and not isinstance(layer, LinearAttentionCacheLayerMixin)
        and type(layer).__module__ != CacheLayerMixin.__module__
    ]


def is_recurrent(cache) -> bool:
    """Whether `cache` has linear-attention / SSM layers (whose state a crop cannot roll back)."""
    return bool(recurrent_layers(cache))


def held_positions(cache) -> int | None:
    """How many positions a recurrent `cache` holds: 0 before its first forward, then what its attention layers
    count; None for a cache of recurrent layers only that holds state (nothing there counts its positions)."""
    recurrent = recurrent_layers(cache)
    if recurrent and not any(any(layer.has_previous_state.values()) for layer in recurrent):
        return 0
    layers = decoder_layers(cache)
    if not any(isinstance(layer, CacheLayerMixin) for layer in layers):
        return None
    return int(cache.get_seq_length())


def rolls_back_from_checkpoints(model, cache) -> bool:
    """Whether `cache` has linear-attention / SSM layers that `RecurrentCheckpoints` rolls back: those of a stateful
    model (transformers' `_is_stateful`), and those of any static cache. A convolution-only linear-attention cache
    (lfm2's short convolutions) is not stateful: in a dynamic cache, which records its past, transformers' own crop
    rolls it back; a static cache does not record (`caches.record_past`), so its windows come back from checkpoints.
    Also a stateful model's own key/value layers (`snapshot_layers`), which it restores whole."""
    if not is_recurrent(cache):
        return bool(snapshot_layers(model, cache))
    return bool(getattr(model, "_is_stateful", False)) or is_static(cache)


def chunk_kwargs(model, new_tokens: int) -> dict:
    """The keyword arguments of a cached forward over `new_tokens` after the first (a verify, a draft model's refed
    tail): `{"chunk_size": new_tokens}` where `takes_chunk_size(model)` found the argument taken (one chunk, no
    padding), nothing otherwise (one token, a forward longer than `CHUNK_LIMIT`, a model not checked or that does not
    take it)."""
    known = _CHUNK_SIZED.get(model)
    if known is not None and known[1] and 1 < new_tokens <= CHUNK_LIMIT:
        return {"chunk_size": new_tokens}
    return {}


@torch.no_grad()
def takes_chunk_size(model) -> bool:
    """Whether `model`'s forward takes the chunked recurrent kernel's `chunk_size` (once per model and dtype): a
    forward over 5 tokens without a cache, with `chunk_size=2` (three chunks) and without it, raises nothing and gives
    the same logits to float tolerance. A forward that ignores the argument passes too (harmless: it changes nothing);
    one that rejects it, or computes something else with it, does not, and is then never given it."""
    known = _CHUNK_SIZED.get(model)
    if known is not None and known[0] == model.dtype:
        return known[1]
    try:
        embeddings = model.get_input_embeddings()
        ids = (torch.arange(1, 6, device=embeddings.weight.device) % embeddings.weight.shape[0])[None]  # [1, 5]
        default = model(input_ids=ids, use_cache=False).logits.float()
        chunked = model(input_ids=ids, use_cache=False, chunk_size=2).logits.float()
    except Exception:  # any failure means: never pass it
        taken = False
    else:
        scale = float(default.abs().max().clamp(min=1.0))
        tolerance = (1e-4 if model.dtype == torch.float32 else 3e-2) * scale
        taken = bool((chunked - default).abs().max() <= tolerance)
    _CHUNK_SIZED[model] = (model.dtype, taken)
    return taken


def forgo_chunk_size(model) -> None:
    """Never pass `model` the kernel's `chunk_size` (the capability probe found its default chunking exact and the
    chunked one not)."""
    _CHUNK_SIZED[model] = (model.dtype, False)


def draft_checkpoints(model, cache, static: bool, tree_budget: int | None) -> RecurrentCheckpoints | None:
    """The checkpoints of a draft model's cache when the draft model is stateful (None otherwise); refused for a static
    draft cache or a tree, which they cannot serve."""
    if not rolls_back_from_checkpoints(model, cache):
        return None
    if static or tree_budget is not None:
        raise ValueError(
            f"`assistant_model` ({type(model).__name__}) keeps recurrent state, which hf_specdec rolls back in a "
            "dynamic draft cache drafting chains. "
            + (
                "Leave the drafter's cache dynamic (`cache_implementation=None`)."
                if static
                else "Drop `speculative_tree_budget` (a tree's branches would each need a state of their own)."
            )
        )
    return RecurrentCheckpoints(cache, model=model)


def stop_recording_windows(cache) -> None:
    """Stops the past recording of the linear-attention layers of `cache` but those with a sliding window beside
    (cropped back from their recording): their windows come back from `RecurrentCheckpoints`, not from a recording,
    and some models' own window updates (Zaya's) hand the cache a whole window rather than the new columns, which a
    recording would keep appending to (the next forward then reads a window longer than its kernel)."""
    for layer in recurrent_layers(cache):
        if not getattr(layer, "is_sliding", False):
            layer.record_past = False


class RecurrentCheckpoints:
    """Checkpoints of one cache's recurrent states (and, given the `model` whose cache it is, of the layers
    `snapshot_layers` finds there), by the number of positions the cache held when each was taken.

    `length`: the positions the cache holds now (counted here, as a pure state-space cache does not count them), kept
    up to date by `fed` and `rewind`."""

    def __init__(self, cache, length: int = 0, model=None):
        self.cache = cache
        self.layers = recurrent_layers(cache)
        self.snapshots = snapshot_layers(model, cache)  # none without a model
        self.length = length
        self.saved: dict[int, list[dict]] = {}
        record_past(cache)
        stop_recording_windows(cache)

    def fed(self, count: int) -> None:
        """Books `count` positions the owner just fed to the cache. A convolution window shorter than its kernel (a
        first forward over fewer positions: the recording keeps it unpadded) is padded with zeros on the left, as
        transformers pads it without the recording (a one-token forward that shifts the window in place needs all of
        it)."""
        self.length += count
        pad_conv_windows(self.cache)

    def save(self) -> None:
        """Copies every recurrent state and convolution window (its last `conv_kernel_size` columns), as they are after
        the `length` positions the cache holds now (a layer that has seen no position yet is saved as such: rolling
        back to it empties the layer), and what every `snapshot_layers` layer holds."""
        self.saved[self.length] = [_attributes(layer) for layer in self.snapshots] + [
            {
                index: (state.clone() if layer.has_previous_state[index] and state is not None else None)
                for index, state in layer.recurrent_states.items()
            }
            | {
                ("conv", index): (
                    window[..., -layer.conv_kernel_size[index] :].clone()
                    if window is not None and layer.is_conv_states_initialized[index]
                    else None
                )
                for index, window in layer.conv_states.items()
            }
            | {("started", index): started for index, started in layer.has_previous_state.items()}
            for layer in self.layers
        ]

    def rewind(self, length: int) -> int:
        """Leaves the cache holding its first `length` positions if it holds that many now or a checkpoint was taken
        there, otherwise the latest checkpoint's positions before `length`; returns the positions it holds."""
        if length > self.length:
            raise ValueError(f"cannot rewind a cache of {self.length} positions forward to {length}")
        if length == self.length:
            target = length
        else:
            earlier = [point for point in self.saved if point <= length]
            if not earlier:
                raise RuntimeError(
                    f"no checkpoint of the recurrent state at or before position {length} (checkpoints: "
                    f"{sorted(self.saved)}): the cache cannot be rolled back there"
                )
            target = max(earlier)
            saved = self.saved[target]
            for layer, attributes in zip(self.snapshots, saved, strict=False):
                vars(layer).clear()
                vars(layer).update(_attributes(attributes))
            for layer, states in zip(self.layers, saved[len(self.snapshots) :], strict=True):
                if not any(states[("started", index)] for index in layer.has_previous_state):
                    # saved before the layer's first position: it starts again from nothing (its first forward then
                    # fills it as a prefill does)
                    LinearAttentionCacheLayerMixin.reset(layer)
                    continue
                for index in layer.has_previous_state:
                    if states[index] is not None:
                        layer.recurrent_states[index].copy_(states[index])
                for index, window in layer.conv_states.items():
                    saved = states[("conv", index)]
                    if saved is None:
                        continue
                    if window is not None and window.shape == saved.shape:
                        window.copy_(saved)  # in place: a static cache's windows keep their addresses
                    else:
                        layer.conv_states[index] = saved.clone()
        # attention keys and values are cropped; convolution windows were restored above, or (everything fed kept)
        # trimmed to their kernel
        _crop(self.cache, self.length - target, windows=target == self.length, skip=self.snapshots)
        keep = self.saved.get(target) if target != self.length else None
        self.saved = {} if keep is None else {target: keep}
        self.length = target
        return target


def is_recording(cache) -> bool:
    """Whether any layer of `cache` records its past (`Cache.activate_past_recording`)."""
    layers = decoder_layers(cache)
    return any(getattr(layer, "record_past", False) for layer in layers)


def finish_recording(cache) -> None:
    """Leaves a cache that a decoding loop set to record its past as plain generate leaves it: sliding-window layers
    and convolution windows trimmed to what the next forward reads, and no layer recording (a returned cache would
    otherwise keep every position its sliding-window layers were given, and go on growing)."""
    _crop(cache, 0)
    for layer in decoder_layers(cache):
        if hasattr(layer, "record_past"):
            layer.record_past = False


def pad_conv_windows(cache) -> None:
    """Pads every convolution window of `cache` shorter than its kernel with zeros on the left, as transformers pads
    it after a first forward over fewer positions than the kernel when the cache does not record its past (with the
    recording it stays unpadded, and a one-token forward that shifts the window in place would fail on it)."""
    for layer in recurrent_layers(cache):
        for index, window in layer.conv_states.items():
            size = layer.conv_kernel_size[index]
            if window is not None and layer.is_conv_states_initialized[index] and window.shape[-1] < size:
                layer.conv_states[index] = torch.nn.functional.pad(window, (size - window.shape[-1], 0))


def _attributes(layer) -> dict:
    """What a `snapshot_layers` layer (or such a copy) holds: its attributes, its dicts and lists copied (their
    tensors are replaced by the layer's forwards, not written in place)."""
    attributes = layer if isinstance(layer, dict) else vars(layer)
    return {
        name: type(value)(value) if isinstance(value, (dict, list)) else value for name, value in attributes.items()
    }


def _crop(cache, count: int, windows: bool = True, skip=()) -> None:
    """Drops the last `count` positions of every layer of `cache` but those in `skip` (restored whole by
    `RecurrentCheckpoints`): attention keys and values, and (with `windows`)
    the convolution windows of linear-attention / SSM layers, which are also trimmed back to their kernel size (so a
    crop by 0 keeps them from growing with the sequence). The windows are cut here rather than by transformers' `crop`,
    which also cuts windows that were never filled (a layer with more states than it uses). A layer that holds nothing
    yet (a draft model told of a round before it ever drafted) is left as it is."""
    layers = decoder_layers(cache)
    for layer in layers:
        if any(layer is kept for kept in skip):
            continue
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            if getattr(layer, "is_initialized", True):
                layer.crop(-count)
            continue
        for index, window in layer.conv_states.items():
            if not windows or window is None or not layer.is_conv_states_initialized[index]:
                continue
            end = window.shape[-1] - count
            start = max(0, end - layer.conv_kernel_size[index])
            if (start, end) != (0, window.shape[-1]):  # a window already cut to size keeps its tensor (static address)
                layer.conv_states[index] = window[..., start:end]
        attention = _attention_part(type(layer))
        if attention is not None:  # a layer with attention beside its recurrence (Falcon-H1, Zamba)
            attention.crop(layer, -count)


def _attention_part(layer_class):
    """The key/value layer class a mixed layer class derives from (its attention half), or None."""
    return next(
        (
            base
            for base in layer_class.__mro__
            if issubclass(base, CacheLayerMixin)
            and not issubclass(base, LinearAttentionCacheLayerMixin)
            and "crop" in vars(base)
        ),
        None,
    )
