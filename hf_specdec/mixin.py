"""`SpeculativeGenerationMixin` and `enable`: speculative decoding inside `model.generate`."""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from transformers import GenerationMixin, Pipeline, PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from .configuration import resolve_speculative_options
from .decoding import speculative_decode
from .drafters.base import Drafter, get_drafter_class
from .drafters.cross_tokenizer import CrossTokenizerDrafter
from .drafters.model import ModelDrafter
from .modeling import logits_width
from .stats import SpeculativeStats

__all__ = ["SpeculativeGenerationMixin", "enable", "resolve_drafter"]


class SpeculativeGenerationMixin:
    r"""
    Adds speculative decoding to `generate`. Put it before the model class
    (`class MyLlama(SpeculativeGenerationMixin, LlamaForCausalLM)`), or call [`enable`] on one model instance.

    `generate` gains two arguments and the `speculative_*` fields of [`SpeculativeGenerationConfig`]:

    - `assistant_model` ([`~transformers.PreTrainedModel`], *optional*): a small causal LM with the target's
      vocabulary that drafts tokens (the paper's M_q). With `tokenizer=` (the target's) and `assistant_tokenizer=`
      (the assistant's), it may have another tokenizer: see [`CrossTokenizerDrafter`].
    - `drafter` (`str`, [`Drafter`] or [`~transformers.PreTrainedModel`], *optional*): any drafter, by registered
      name (see [`list_drafters`]), as an instance, or as a model. `drafter_kwargs` (`dict`, *optional*) are passed
      to the registered class when `drafter` is a name.
    - `speculative_gamma` (`int`, *optional*, defaults to 5, or the drafter's `default_gamma`: 10 for prompt
      lookup), `speculative_lenience` (`float`, *optional*, defaults to 1.0): see [`SpeculativeGenerationConfig`].

    Without `assistant_model` and `drafter`, `generate` is exactly transformers' `generate`. With one, the output
    is token for token what plain `generate` returns when greedy, and distributed exactly as it when sampling.
    `return_dict_in_generate=True` adds `speculative_stats` ([`SpeculativeStats`]) to the output.

    Example:

    ```python
    >>> import torch, hf_specdec
    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = hf_specdec.enable(AutoModelForCausalLM.from_config(config))
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> out = model.generate(ids, assistant_model=model, speculative_gamma=3, max_new_tokens=8,
    ...     return_dict_in_generate=True)
    >>> torch.equal(out.sequences, model.generate(ids, max_new_tokens=8))
    True
    >>> out.speculative_stats.acceptance_rate
    1.0

    ```
    """

    @torch.no_grad()
    def generate(
        self, *args, assistant_model=None, drafter=None, drafter_kwargs: dict[str, Any] | None = None, **kwargs
    ):
        """The model class's own `generate`, speculative when `assistant_model` or `drafter` is given (see the class
        docstring for the arguments it adds)."""
        # every other argument goes to the class's own `generate` exactly as given, by position or by name: classes
        # that override it (Whisper's `input_features`, SeamlessM4T's `tgt_lang`) name and order them differently
        parent_generate = super().generate
        call = _BoundCall(parent_generate, args, kwargs)
        # the call's `speculative_*` arguments (not a config's, which may hold defaults for later calls)
        called_with = [
            (name, value) for name, value in call.extra.items() if name.startswith("speculative_") and value is not None
        ]
        options = resolve_speculative_options(call.extra, call.get("generation_config"), self.generation_config)
        if assistant_model is None and drafter is None:
            if drafter_kwargs is not None:
                raise ValueError("`drafter_kwargs` was given without `drafter`; pass `drafter=<name>` as well.")
            # a pipeline hands every call the `speculative_*` settings given at its construction, also to a call
            # that turns its assistant off (`assistant_model=None`): there they wait for the calls that draft
            pipe = _calling_pipeline(self) if called_with else None
            unused = [(name, value) for name, value in called_with if not _built_with(pipe, name)]
            if unused:
                name, value = unused[0]
                raise ValueError(
                    f"`{name}={value!r}` was given without a drafter, so nothing would use it and "
                    "`generate` would decode plainly. Pass `assistant_model=...` or `drafter=...` (e.g. "
                    '`drafter="prompt_lookup"`), or drop it.'
                )
            return parent_generate(*call.args, **call.kwargs)

        # the tokenizers: `tokenizer` for stop strings and, with `assistant_tokenizer`, drafting with another
        # tokenizer; transformers hands them only to its own decoding methods, so they are taken out of the call
        tokenizer = call.pop("tokenizer")
        assistant_tokenizer = call.pop("assistant_tokenizer")
        if assistant_tokenizer is not None and tokenizer is None:
            tokenizer = _calling_pipeline_tokenizer(self)
        drafter = resolve_drafter(
            drafter,
            assistant_model,
            drafter_kwargs,
            tokenizer=tokenizer,
            assistant_tokenizer=assistant_tokenizer,
            target=self,
        )
        options = options.with_default_gamma(
            getattr(drafter, "default_gamma", None), f"{type(drafter).__name__}.default_gamma"
        )
        generation_config = call.get("generation_config")
        _reject_conflicting_arguments(
            call.get("custom_generate"), call.get("synced_gpus"), generation_config, self.generation_config, call.extra
        )
        _check_model_supported(self, call.get("inputs_embeds"))
        # stop strings need the tokenizer: build the criterion here and clear the field on a copy (the user's config
        # is never modified)
        stop_strings = call.get(
            "stop_strings",
            getattr(
                generation_config if generation_config is not None else self.generation_config, "stop_strings", None
            ),
        )
        if stop_strings is not None:
            if tokenizer is None:
                raise ValueError(
                    f"`stop_strings` ({stop_strings!r}) needs the model's tokenizer: pass `tokenizer=tokenizer` to "
                    "`generate`."
                )
            stopping_criteria = StoppingCriteriaList(list(call.get("stopping_criteria") or []))
            stopping_criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
            call.set("stopping_criteria", stopping_criteria)
            if generation_config is not None:  # clear it on a copy (a kwarg next to a config would warn)
                call.pop("stop_strings")
                generation_config = copy.deepcopy(generation_config)
                generation_config.stop_strings = None
                call.set("generation_config", generation_config)
            else:  # overrides the model's own generation config for this call
                call.set("stop_strings", None)

        # the loop replaces transformers' decoding method; `assistant_model` is never passed on, so classes that
        # special-case it (Whisper drops `begin_suppress_tokens` and writes onto the assistant's config) decode
        # exactly as plain `generate` does
        # a class with its own `generate` may call the loop several times (Whisper's long-form segments) and split
        # and restack its outputs by row: the call's stats accumulate in one object, attached to the final output
        stats = SpeculativeStats(lenience=options.speculative_lenience)
        overridden = _overrides_generate(type(self))
        if type(self) in _IGNORES_CUSTOM_GENERATE:
            raise _own_loop_error(self, _IGNORED_DRAFTER)
        decoding_loop = functools.partial(
            _decoding_method,
            drafter=drafter,
            options=options,
            streamer=call.get("streamer"),
            stats=stats,
            attach_stats=not overridden,
        )
        call.set("custom_generate", decoding_loop)
        try:
            output = parent_generate(*call.args, **call.kwargs)
        except ValueError as error:
            # transformers' check of unused arguments, in a class whose `generate` never hands decoding over
            if not (overridden and "not used by the model" in str(error) and "'custom_generate'" in str(error)):
                raise
            raise _own_loop_error(
                self,
                "its own `generate` decodes with a loop of its own instead of "
                "transformers' (it does not take `custom_generate`), so a drafter has "
                "nowhere to run",
            ) from error
        if overridden and not stats.target_calls:
            # its own `generate` took `custom_generate` and decoded with a loop of its own anyway (Dia): the output is
            # plain decoding's, but the drafter was ignored; refused, from the start for the next calls
            _IGNORES_CUSTOM_GENERATE.add(type(self))
            raise _own_loop_error(self, _IGNORED_DRAFTER)
        if overridden and isinstance(output, dict):  # `ModelOutput`s are dicts; tensors carry no stats
            output["speculative_stats"] = stats
        return output


# enabled classes whose own `generate` was seen to take `custom_generate` and not use it
_IGNORES_CUSTOM_GENERATE: set[type] = set()


_IGNORED_DRAFTER = (
    "its own `generate` takes `custom_generate` but decodes with a loop of its own, so the drafter would be ignored"
)


def _own_loop_error(model, reason: str) -> ValueError:
    """The refusal of a class that decodes with a loop of its own, which speculative decoding cannot run in."""
    return ValueError(
        f"{type(model).__name__} cannot run speculative decoding: {reason}. Drop `assistant_model`/"
        "`drafter` for this model."
    )


def _overrides_generate(cls: type) -> bool:
    """Whether a class between `cls` and `GenerationMixin` defines its own `generate` (Whisper, SeamlessM4T)."""
    return _overriding_class(cls, "generate") is not None


def _overriding_class(cls: type, name: str) -> type | None:
    """The first class between `cls` and `GenerationMixin` that defines `name` itself, or None."""
    for base in cls.__mro__:
        if base is GenerationMixin:
            return None
        if base is not SpeculativeGenerationMixin and name in vars(base):
            return base
    return None


class _BoundCall:
    """The arguments of one call to a `generate` method, read and changed by name whether they were given by
    position or by keyword, and whether that `generate` declares them or takes them through `**kwargs`."""

    def __init__(self, function, args: tuple, kwargs: dict):
        signature = inspect.signature(function)
        self.bound = signature.bind(*args, **kwargs)
        self.declared = {
            name
            for name, parameter in signature.parameters.items()
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
        }
        self.function = function
        var_keyword = [
            name for name, parameter in signature.parameters.items() if parameter.kind == parameter.VAR_KEYWORD
        ]
        # the **kwargs, changed in place (a `generate` without them takes no undeclared argument)
        self.extra = self.bound.arguments.setdefault(var_keyword[0], {}) if var_keyword else {}
        self.takes_extra = bool(var_keyword)

    def get(self, name: str, default=None):
        if name in self.declared:
            return self.bound.arguments.get(name, default)
        return self.extra.get(name, default)

    def set(self, name: str, value) -> None:
        if name in self.declared:
            self.bound.arguments[name] = value
        elif self.takes_extra:
            self.extra[name] = value
        else:
            raise TypeError(
                f"{self.function.__qualname__} takes no `{name}` argument, which speculative decoding passes to it; "
                "drop `assistant_model`/`drafter` for this model."
            )

    def pop(self, name: str, default=None):
        if name in self.declared:
            return self.bound.arguments.pop(name, default)
        return self.extra.pop(name, default)

    @property
    def args(self) -> tuple:
        return self.bound.args

    @property
    def kwargs(self) -> dict:
        return self.bound.kwargs


def _decoding_method(
    model,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    inputs_tensor=None,
    *,
    drafter,
    options,
    streamer,
    **model_kwargs,
):
    # transformers calls this after preparing the inputs; its signature declares `inputs_tensor` to receive it
    return speculative_decode(
        model,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        drafter=drafter,
        options=options,
        streamer=streamer,
        inputs_tensor=inputs_tensor,
        **model_kwargs,
    )


def _check_model_supported(model, inputs_embeds) -> None:
    """What can be refused from the model and the call alone, before `generate` runs any forward."""
    own_sample = _overriding_class(type(model), "_sample")
    if own_sample is not None:
        # transformers' assisted generation replaces it too
        raise _own_loop_error(
            model,
            f"it decodes with its own `_sample` (defined by {own_sample.__name__}: work "
            "done between tokens, such as generating audio), which hf_specdec's loop would "
            "replace, so the output would differ from plain `generate`",
        )
    if getattr(model, "_is_stateful", False):
        # transformers' assisted generation refuses these too
        raise ValueError(
            f"{type(model).__name__} is stateful: its recurrent state cannot be rolled back to an earlier token, so "
            "rejected drafts could not be undone. Speculative decoding is not supported for it; drop "
            "`assistant_model`/`drafter`."
        )
    if inputs_embeds is not None and not model.config.is_encoder_decoder:
        raise ValueError(
            f"`inputs_embeds` (a tensor of shape {tuple(inputs_embeds.shape)}) cannot be combined with a drafter for "
            f"the decoder-only {type(model).__name__}: drafters and verification work on token ids, and a prompt "
            "given as embeddings has none. Pass the prompt as `input_ids` instead, or drop `assistant_model`/"
            "`drafter`."
        )


def resolve_drafter(
    drafter,
    assistant_model,
    drafter_kwargs: dict[str, Any] | None = None,
    *,
    tokenizer=None,
    assistant_tokenizer=None,
    target: PreTrainedModel | None = None,
) -> Drafter:
    """Turns the `drafter` / `assistant_model` arguments of one `generate` call into a `Drafter`: with
    `assistant_tokenizer` (and the target's `tokenizer`), a model with another vocabulary becomes a
    `CrossTokenizerDrafter`; `target` lets a vocabulary mismatch without `assistant_tokenizer` fail naming the fix."""
    if assistant_tokenizer is not None:
        return _cross_tokenizer_drafter(
            drafter, assistant_model, drafter_kwargs, tokenizer, assistant_tokenizer, target
        )
    if target is not None and isinstance(assistant_model if assistant_model is not None else drafter, PreTrainedModel):
        model = assistant_model if assistant_model is not None else drafter
        width, target_width = logits_width(model), logits_width(target)
        if width != target_width:
            raise ValueError(
                f"`assistant_model` ({type(model).__name__}) has a vocabulary of {width} tokens but the target has "
                f"{target_width} ({type(target).__name__}): they do not share a tokenizer. To draft with "
                "another tokenizer, pass both tokenizers: `generate(..., assistant_model=draft, tokenizer=tokenizer, "
                "assistant_tokenizer=draft_tokenizer)`; or use a drafter with the target's vocabulary."
            )
    if drafter is not None and assistant_model is not None:
        raise ValueError(
            f"Pass either `assistant_model` or `drafter`, not both (got assistant_model={type(assistant_model).__name__} "
            f"and drafter={drafter!r})."
        )
    if drafter_kwargs is not None and not isinstance(drafter, str):
        raise ValueError(
            f"`drafter_kwargs` only applies when `drafter` is a registered name, got drafter={drafter!r}. "
            "Configure a drafter instance through its constructor instead."
        )
    if assistant_model is not None:
        return ModelDrafter(assistant_model)
    if isinstance(drafter, Drafter):
        return drafter
    if isinstance(drafter, PreTrainedModel):
        return ModelDrafter(drafter)
    if isinstance(drafter, str):
        if drafter_kwargs is not None and not isinstance(drafter_kwargs, Mapping):
            raise TypeError(
                f"`drafter_kwargs` must be a dict of options for the drafter {drafter!r}, got "
                f"{type(drafter_kwargs).__name__} {drafter_kwargs!r}. For example `drafter_kwargs={{'max_ngram_size': "
                "4}` with `drafter='prompt_lookup'`."
            )
        return get_drafter_class(drafter).from_options(**(drafter_kwargs or {}))
    raise TypeError(
        f"`drafter` must be a registered drafter name, a `hf_specdec.Drafter` or a `PreTrainedModel`, got "
        f"{type(drafter).__name__}. Registered names: see `hf_specdec.list_drafters()`."
    )


def _cross_tokenizer_drafter(
    drafter, assistant_model, drafter_kwargs, tokenizer, assistant_tokenizer, target
) -> Drafter:
    """`assistant_tokenizer`: a `CrossTokenizerDrafter`, or a `ModelDrafter` when the two tokenizers are the same."""
    model = assistant_model if assistant_model is not None else drafter
    if not isinstance(model, PreTrainedModel) or (assistant_model is not None and drafter is not None):
        raise ValueError(
            f"`assistant_tokenizer` ({type(assistant_tokenizer).__name__}) is the tokenizer of `assistant_model`, "
            f"so it needs an `assistant_model` (a `PreTrainedModel`) and no `drafter`, got assistant_model="
            f"{type(assistant_model).__name__ if assistant_model is not None else None} and drafter={drafter!r:.80}. "
            "Pass `assistant_model=draft_model`, or drop `assistant_tokenizer`."
        )
    if drafter_kwargs is not None:
        raise ValueError(
            f"`drafter_kwargs` ({drafter_kwargs!r}) only applies when `drafter` is a registered name. Build a "
            "`hf_specdec.CrossTokenizerDrafter(...)` yourself to set its options."
        )
    if tokenizer is None:
        raise ValueError(
            f"`assistant_tokenizer` ({type(assistant_tokenizer).__name__}) needs the target's tokenizer as well, to "
            "move text between the two vocabularies: pass `tokenizer=tokenizer` to `generate` (as with transformers' "
            "universal assisted generation)."
        )
    same = (
        target is not None
        and hasattr(tokenizer, "get_vocab")
        and hasattr(assistant_tokenizer, "get_vocab")
        and tokenizer.get_vocab() == assistant_tokenizer.get_vocab()
    )
    if same:  # one vocabulary: token ids need no translation (the models' logits may be padded to other widths)
        return ModelDrafter(model, same_tokenizer=True)
    return CrossTokenizerDrafter(model, tokenizer, assistant_tokenizer)


def _calling_pipeline_tokenizer(model):
    """The tokenizer of the transformers pipeline calling `model.generate`, if one is (its per-call
    `assistant_tokenizer` reaches `generate` without the pipeline's `tokenizer`); `None` otherwise."""
    pipe = _calling_pipeline(model)
    return pipe.tokenizer if pipe is not None else None


def _built_with(pipe, name: str) -> bool:
    """Whether the pipeline `pipe` (or None) was built with the `generate` argument `name` (transformers keeps a
    construction's arguments in `_forward_params`, nested under "generate_kwargs" in some pipelines; hf_specdec's
    wrappers of transformers' pipelines keep the speculative ones in `_speculative_kwargs`)."""
    if pipe is None:
        return False
    forward_params = getattr(pipe, "_forward_params", None) or {}
    return (
        name in forward_params
        or name in (forward_params.get("generate_kwargs") or {})
        or name in (getattr(pipe, "_speculative_kwargs", None) or {})
    )


def _calling_pipeline(model):
    """The transformers pipeline calling `model.generate`, if one is; `None` otherwise."""
    frame = inspect.currentframe()
    try:
        for _ in range(32):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            caller = frame.f_locals.get("self")
            if isinstance(caller, Pipeline) and caller.model is model:
                return caller
        return None
    finally:
        del frame


def _reject_conflicting_arguments(custom_generate, synced_gpus, generation_config, model_config, kwargs) -> None:
    if custom_generate is not None:
        raise ValueError(
            f"`custom_generate` ({custom_generate!r}) replaces the decoding loop and cannot be combined with a drafter."
        )
    if synced_gpus:
        raise ValueError("`synced_gpus=True` is not supported with a drafter yet; drop it or the drafter.")
    if kwargs.get("cache_implementation") == "paged":  # read from the call only, as transformers reads it
        raise ValueError(
            "`cache_implementation='paged'` switches `generate` to continuous batching (`generate_batch`), where a "
            "drafter would be left unused (transformers refuses `assistant_model` there too). Drop it or the drafter."
        )
    config = generation_config if generation_config is not None else model_config
    for name in ("prompt_lookup_num_tokens", "assistant_early_exit"):
        value = kwargs.get(name, getattr(config, name, None))
        if value is not None:
            raise ValueError(
                f"`{name}={value!r}` selects transformers' own assisted generation and cannot be combined with "
                f"an hf_specdec drafter. Drop `{name}` (use `drafter=...` instead)."
            )
    # transformers' other assisted-generation settings would be silently unused by hf_specdec's loop: refused where
    # the call sets them (in its kwargs or its `generation_config`). The model's own generation config is not read
    # for them, as transformers does not read them there either (it reads the assistant's).
    for name, fix in _TRANSFORMERS_ASSISTED_SETTINGS.items():
        value = kwargs[name] if name in kwargs else getattr(generation_config, name, None)
        if value is not None and value is not False:
            raise ValueError(
                f"`{name}={value!r}` is a setting of transformers' own assisted generation, which an hf_specdec "
                f"drafter does not use. {fix.format(value=value)}"
            )


# transformers' assisted-generation settings that an hf_specdec drafter would leave unused -> the fix ({value}: theirs)
_TRANSFORMERS_ASSISTED_SETTINGS = {
    "num_assistant_tokens": "Set the number of drafted tokens with `speculative_gamma={value!r}` instead.",
    "max_matching_ngram_size": (
        'With `drafter="prompt_lookup"`, set the longest n-gram it matches with '
        '`drafter_kwargs={{"max_ngram_size": {value!r}}}` instead.'
    ),
    "num_assistant_tokens_schedule": (
        'Choose how γ changes with `speculative_gamma_policy=...` instead ("constant", "heuristic": '
        'transformers\' schedule, per call; "auto", the default; "optimal").'
    ),
    "assistant_confidence_threshold": (
        'Drop it: the γ policy (`speculative_gamma_policy`, "auto" by default) decides how much to draft.'
    ),
    "assistant_lookbehind": (
        "Drop it: with `assistant_tokenizer`, hf_specdec's `CrossTokenizerDrafter` realigns the texts itself."
    ),
    "target_lookbehind": (
        "Drop it: with `assistant_tokenizer`, hf_specdec's `CrossTokenizerDrafter` realigns the texts itself."
    ),
    "assistant_ensemble_weight": (
        "Drop it (it verifies against a mixture of the target and the drafter, so the output is no longer the "
        "target's); `speculative_lenience` is hf_specdec's documented trade of exactness for acceptance."
    ),
    "use_mtp": "Drop it, or drop `assistant_model`/`drafter` to decode with the model's multi-token prediction.",
    "speculation_type": "Drop it, or drop `assistant_model`/`drafter` to use transformers' speculation of that type.",
}


@functools.cache
def _speculative_class(cls: type) -> type:
    # keeps the original name so `save_pretrained` writes the real architecture into config.json
    return type(
        cls.__name__,
        (SpeculativeGenerationMixin, cls),
        {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
    )


def enable(model: PreTrainedModel) -> PreTrainedModel:
    """Adds [`SpeculativeGenerationMixin`] to this one model instance and returns it.

    Other instances of the same class are unaffected; calling it twice is a no-op. Nothing else about the model
    changes (weights, config and generation config are untouched).

    Example:

    ```python
    >>> import hf_specdec
    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2))
    >>> hf_specdec.enable(model) is hf_specdec.enable(model)
    True

    ```
    """
    if isinstance(model, SpeculativeGenerationMixin):
        return model
    if not isinstance(model, GenerationMixin):
        raise TypeError(
            f"`hf_specdec.enable` needs a transformers model that can `generate`, got {type(model).__name__}."
        )
    model.__class__ = _speculative_class(type(model))
    return model


def _hint_enable_on_unused_arguments() -> None:
    """Makes transformers' "`model_kwargs` are not used" error name `hf_specdec.enable` when hf_specdec's arguments
    reach a model that was never enabled.

    transformers rejects them there as unused model arguments, without saying why; this wraps its check
    (`GenerationMixin._validate_model_kwargs`) once, when hf_specdec is imported. Only that error's message changes:
    what is accepted, refused and generated stays transformers' own.
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


_hint_enable_on_unused_arguments()
