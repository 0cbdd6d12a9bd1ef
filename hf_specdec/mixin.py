"""`enable`: adds [`SpeculativeGenerationMixin`] to one model instance, and installs hf_specdec into transformers.

Importing hf_specdec changes nothing in transformers. The first `enable` of a process installs two things, once:

- transformers' "`model_kwargs` are not used" error also names `hf_specdec.enable` when hf_specdec's arguments reach
  a model that was never enabled (a wrapper of `GenerationMixin._validate_model_kwargs`; only that message changes);
- hf_specdec's pipelines, with transformers' pipeline registry ([`hf_specdec.pipelines.register_pipelines`]), so
  that `pipeline(task, model=enabled_model, ...)` takes the speculative arguments.

`SpeculativeGenerationMixin` (defined in `hf_specdec.generation_mixin`) and `resolve_drafter` are importable from
here as well.
"""

from __future__ import annotations

import functools
from typing import Any

from transformers import GenerationMixin, PreTrainedModel

from .drafter_arguments import resolve_drafter
from .generation_mixin import SpeculativeGenerationMixin
from .pipelines.registration import register_pipelines

__all__ = ["SpeculativeGenerationMixin", "enable", "resolve_drafter"]


@functools.cache
def _speculative_class(cls: type) -> type:
    # keeps the original name so `save_pretrained` writes the real architecture into config.json; pickled (pickle,
    # `torch.save`, `copy.deepcopy`) as an instance of `cls` enabled again on load, since that name finds `cls`
    def __reduce_ex__(self, protocol):
        _, (_, *args), *rest = object.__reduce_ex__(self, max(protocol, 2))  # copyreg.__newobj__, (class, ...)
        return (_new_enabled, (cls, *args), *rest)

    return type(
        cls.__name__,
        (SpeculativeGenerationMixin, cls),
        {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__reduce_ex__": __reduce_ex__},
    )


def _new_enabled(cls: type, *args):
    """An empty enabled instance of `cls` for unpickling (its state is set after)."""
    _install_into_transformers()
    speculative = _speculative_class(cls)
    return speculative.__new__(speculative, *args)


def enable(model: PreTrainedModel) -> PreTrainedModel:
    """Adds [`SpeculativeGenerationMixin`] to this one model instance and returns it.

    Other instances of the same class are unaffected; calling it twice is a no-op. Nothing else about the model
    changes (weights, config and generation config are untouched). The first call in a process also registers
    hf_specdec's pipelines with transformers ([`hf_specdec.pipelines.register_pipelines`]), so that
    `pipeline(task, model=model, ...)` takes the speculative arguments, and makes transformers' error for
    hf_specdec's arguments on a model that was not enabled name this function; importing hf_specdec does neither.

    Example:

    ```python
    >>> import hf_specdec
    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2))
    >>> hf_specdec.enable(model) is hf_specdec.enable(model)
    True

    ```
    """
    if not isinstance(model, GenerationMixin):
        raise TypeError(
            f"`hf_specdec.enable` needs a transformers model that can `generate`, got {type(model).__name__}."
        )
    _install_into_transformers()
    if isinstance(model, SpeculativeGenerationMixin):
        return model
    model.__class__ = _speculative_class(type(model))
    return model


@functools.cache
def _install_into_transformers() -> None:
    """What the first `enable` of a process installs into transformers (see the module docstring), once."""
    _hint_enable_on_unused_arguments()
    register_pipelines()


def _hint_enable_on_unused_arguments() -> None:
    """Makes transformers' "`model_kwargs` are not used" error name `hf_specdec.enable` when hf_specdec's arguments
    reach a model that was never enabled.

    transformers rejects them there as unused model arguments, without saying why; this wraps its check
    (`GenerationMixin._validate_model_kwargs`) once. Only that error's message changes: what is accepted, refused and
    generated stays transformers' own.
    """
    validate = GenerationMixin._validate_model_kwargs
    if getattr(validate, "_names_hf_specdec_enable", False):
        return

    @functools.wraps(validate)
    def _validate_model_kwargs(self, model_kwargs: dict[str, Any]):
        try:
            return validate(self, model_kwargs)
        except ValueError as error:
            ours = sorted(
                name
                for name in model_kwargs
                if name in ("drafter", "drafter_kwargs") or name.startswith("speculative_")
            )
            if not ours or isinstance(self, SpeculativeGenerationMixin):
                raise
            raise ValueError(
                f"{error}. {', '.join(f'`{name}`' for name in ours)} are hf_specdec's arguments, and this "
                f"{type(self).__name__} was not enabled for speculative decoding: call `model = "
                "hf_specdec.enable(model)` first (it changes only that instance)."
            ) from error

    _validate_model_kwargs._names_hf_specdec_enable = True
    GenerationMixin._validate_model_kwargs = _validate_model_kwargs
