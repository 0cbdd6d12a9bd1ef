"""The target's hidden states at the layers a drafter reads, recorded during the forwards a round already runs.

A capture belongs to the call that made it: it records the forwards run in the thread that built it, and no other.
Several `generate` calls may share one target from several threads (each with its own capture on the same layers):
one forward hook per layer dispatches each forward's output to the captures of the thread that ran it, so no call
reads another's features. The hook is added by the first capture of a layer and removed with the last."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .drafters.base import Drafter

__all__ = ["HiddenStateCapture", "capture_for", "decoder_layers"]


def decoder_layers(model) -> torch.nn.ModuleList | None:
    """The target's decoder layers, in order, where the model keeps them in the usual place (`model.layers` of its
    decoder); `None` otherwise."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None) if decoder is not None else None
    return layers if isinstance(layers, torch.nn.ModuleList) and len(layers) else None


class _LayerHook:
    """The one forward hook hf_specdec keeps on a layer while any capture reads it: hands each forward's output to
    the captures of the thread that ran the forward (`listeners`: thread id -> `[(capture, slot)]`)."""

    def __init__(self, module: torch.nn.Module):
        self.listeners: dict[int, list[tuple[HiddenStateCapture, int]]] = {}
        self.handle = module.register_forward_hook(self)

    def __deepcopy__(self, memo) -> _LayerHook:
        # a copy of the model (`copy.deepcopy(target)` during a call) gets an inert hook: no capture reads the copy
        inert = _LayerHook.__new__(_LayerHook)
        inert.listeners, inert.handle = {}, None
        return inert

    def __call__(self, module, args, output) -> None:
        listeners = self.listeners.get(threading.get_ident())
        if listeners:
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            for capture, slot in listeners:
                capture.records[slot].append(hidden.detach())


# the hook on each layer some capture reads; changed under `_HOOKS_LOCK` only (registration races otherwise: two
# threads could each add a hook, or remove the one the other still needs)
_HOOKS: weakref.WeakKeyDictionary[torch.nn.Module, _LayerHook] = weakref.WeakKeyDictionary()
_HOOKS_LOCK = threading.Lock()


class HiddenStateCapture:
    """Records the target's hidden states at the few layers a drafter reads (`Drafter.target_hidden_layers`) during
    the target forwards a round already runs, in the thread that built it (one call: concurrent calls on the same
    target each record their own forwards only); `close` stops it. Nothing else is computed or kept (no
    `output_hidden_states` of every layer, no second forward).

    Layer `i` is entry `i` of transformers' `output_hidden_states`: 0 the embeddings' output, `i >= 1` the output
    of decoder layer `i - 1`."""

    def __init__(self, model, layers, owner: str = "the drafter"):
        blocks = decoder_layers(model)
        if blocks is None:
            raise ValueError(
                f"{owner} reads the target's hidden states, but {type(model).__name__} keeps no list of decoder "
                "layers where hf_specdec looks (`model.get_decoder().layers`). Use a drafter that does not read "
                "hidden states (an assistant model, prompt lookup) with this model."
            )
        layers = list(layers)
        if not layers or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= len(blocks) for i in layers
        ):
            raise ValueError(
                f"{owner} asked for the target's hidden states at layers {layers}, but {type(model).__name__} has "
                f"{len(blocks)} decoder layers: use indices in [0, {len(blocks)}] (0: the embeddings' output, i: "
                "the output of decoder layer i - 1)."
            )
        self.layers = layers
        self.owner, self.model_name, self.checked = owner, type(model).__name__, False
        self.records: list[list[torch.Tensor]] = [[] for _ in layers]
        self.thread = threading.get_ident()
        self.modules = [model.get_input_embeddings() if index == 0 else blocks[index - 1] for index in layers]
        with _HOOKS_LOCK:
            for slot, module in enumerate(self.modules):
                hook = _HOOKS.get(module)
                if hook is None:
                    hook = _HOOKS[module] = _LayerHook(module)
                hook.listeners.setdefault(self.thread, []).append((self, slot))

    def take(self) -> torch.Tensor | None:
        """Everything recorded since the last call, `[batch, positions, sum of hidden sizes]`, layers side by side
        in the order asked for; `None` when no forward ran."""
        if not self.records[0]:
            return None
        odd = None if self.checked else next((r.shape for rs in self.records for r in rs if r.dim() != 3), None)
        self.checked = True  # the first forward's outputs tell
        if odd is not None:
            raise ValueError(
                f"{self.owner} reads the target's hidden states as [batch, positions, hidden], but the decoder "
                f"layers of {self.model_name} output tensors of shape {tuple(odd)} (several residual streams per "
                "position, as DeepSeek-V4's hyper-connections keep them). Use a drafter that does not read hidden "
                'states with this model (`drafter="prompt_lookup"`, `"suffix"`, an `assistant_model`).'
            )
        states = torch.cat([torch.cat(records, dim=1) for records in self.records], dim=-1)
        self.records = [[] for _ in self.layers]
        return states

    def close(self) -> None:
        """Stops recording; the last capture of a layer removes its hook. Closing twice is harmless."""
        with _HOOKS_LOCK:
            for module in self.modules:
                hook = _HOOKS.get(module)
                if hook is None:
                    continue
                others = [entry for entry in hook.listeners.get(self.thread, []) if entry[0] is not self]
                if others:  # a new list: the hook may be iterating the old one
                    hook.listeners[self.thread] = others
                else:
                    hook.listeners.pop(self.thread, None)
                if not hook.listeners:
                    hook.handle.remove()
                    del _HOOKS[module]
        self.modules = []

    def __enter__(self) -> HiddenStateCapture:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def capture_for(model, drafter: Drafter) -> HiddenStateCapture | None:
    """The capture a reset drafter asks for, or `None` when it reads no hidden states."""
    layers = getattr(drafter, "target_hidden_layers", None)
    return None if layers is None else HiddenStateCapture(model, layers, owner=type(drafter).__name__)
