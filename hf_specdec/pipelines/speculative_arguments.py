"""The speculative arguments of hf_specdec's pipelines, and `assistant_model`s given by path, loaded from
safetensors only."""

from __future__ import annotations

import os
from typing import Any

from transformers import AutoConfig
from transformers.pipelines.base import load_model

from ..generation_mixin import SpeculativeGenerationMixin

# `generate` arguments that run speculative decoding, besides every `speculative_*` one
_SPECULATIVE_ARGUMENTS = ("assistant_model", "drafter", "drafter_kwargs")
# the arguments transformers' own pipelines take for its assisted generation
_ASSISTANT_ARGUMENTS = ("assistant_model", "assistant_tokenizer")


class _PathAssistants:
    """Loads an `assistant_model` given as a path or Hub id once per pipeline, from safetensors only."""

    # tried before the classes the checkpoint's config names (none: only those, as transformers' pipelines do)
    _assistant_classes: tuple[type, ...] = ()

    def _load_assistant(self, assistant_model):
        if not isinstance(assistant_model, str):
            return assistant_model
        loaded = vars(self).setdefault("_loaded_assistants", {})  # path -> model
        if assistant_model not in loaded:  # once per pipeline, not once per call
            _check_safetensors_checkpoint(assistant_model)
            config = AutoConfig.from_pretrained(assistant_model)
            # safetensors only: a path never reaches the unpickler, whatever transformers' loading defaults are
            model = load_model(
                assistant_model, config=config, model_classes=self._assistant_classes, use_safetensors=True
            )
            loaded[assistant_model] = model.to(device=self.model.device, dtype=self.model.dtype)
        return loaded[assistant_model]


def _check_safetensors_checkpoint(path: str) -> None:
    """Refuses a local directory without safetensors weights before anything is loaded from it."""
    if not os.path.isdir(path):
        return  # a Hub id: `use_safetensors=True` refuses a repository without safetensors weights
    files = sorted(os.listdir(path))
    if any(name.endswith(".safetensors") for name in files):
        return
    found = [name for name in files if name.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl"))]
    raise ValueError(
        f"`assistant_model` {path!r} holds no safetensors weights"
        f"{' (only the pickle checkpoint ' + ', '.join(found) + ')' if found else ''}. Assistants given by path are "
        "loaded from safetensors only and never unpickled: load that checkpoint where you trust it and re-save it "
        "with `model.save_pretrained(path)` (which writes model.safetensors), or pass the loaded model as "
        "`assistant_model=model`."
    )


def _check_speculation_enabled(model, kwargs: dict[str, Any]) -> None:
    requested = sorted(
        name
        for name, value in kwargs.items()
        if (name in _SPECULATIVE_ARGUMENTS and value is not None) or name.startswith("speculative_")
    )
    if requested and not isinstance(model, SpeculativeGenerationMixin):
        raise ValueError(
            f"{', '.join(f'`{name}`' for name in requested)} need(s) speculative decoding, which the pipeline's model "
            f"({type(model).__name__}) does not have. Call `hf_specdec.enable(model)` on it before building the "
            "pipeline (or `hf_specdec.enable(pipe.model)`); the pipeline does not change your model for you."
        )
