"""Where a model computes, including models dispatched by accelerate."""

from __future__ import annotations

import torch

__all__ = ["execution_device"]


def execution_device(model: torch.nn.Module) -> torch.device:
    """The device a model computes on. For a model dispatched by accelerate (`device_map=...` with layers offloaded
    to the CPU or disk, or `accelerate.cpu_offload`), `model.device` names the device of its first parameter, which
    is `meta` when that parameter is offloaded: the device that matters for its inputs is where the hook of its input
    embeddings runs it (accelerate's `execution_device`)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for module in (embeddings, model):
        hook = getattr(module, "_hf_hook", None)
        for part in getattr(hook, "hooks", None) or [hook]:  # a SequentialHook chains several
            device = getattr(part, "execution_device", None)
            if device is not None:
                return torch.device(device)
    for tensor in (embeddings.parameters() if embeddings is not None else ()):
        if tensor.device.type != "meta":
            return tensor.device
    for tensor in model.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")
