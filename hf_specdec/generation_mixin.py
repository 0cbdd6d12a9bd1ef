"""`SpeculativeGenerationMixin`: speculative decoding inside `model.generate`.

The mixin's `generate` hands every argument it does not own to the model class's own `generate`, and runs
hf_specdec's decoding loop (`decoding.speculative_decode`) as transformers' `custom_generate`. This module also holds
the checks of what a call or a model class cannot combine with a drafter. Add the mixin to a model with
[`hf_specdec.enable`] (`hf_specdec.mixin`).
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any

import torch
from transformers import GenerationMixin, Pipeline, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from . import continuous_batching
from .configuration import resolve_speculative_options
from .decoding import speculative_decode
from .drafter_arguments import refuse_unused_arguments, resolve_drafter
from .drafters.base import get_drafter_class
from .generate_call import _BoundCall
from .stats import SpeculativeStats

__all__ = ["SpeculativeGenerationMixin"]


class SpeculativeGenerationMixin:
    r"""
    Adds speculative decoding to `generate`. Put it before the model class
    (`class MyLlama(SpeculativeGenerationMixin, LlamaForCausalLM)`), or call [`enable`] on one model instance. A
    subclass installs nothing into transformers (the first [`enable`] does): call
    `hf_specdec.pipelines.register_pipelines()` to build pipelines with it.

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
        if call.extra.get("cache_implementation") == "paged" and (assistant_model is not None or drafter is not None):
            return continuous_batching.paged_generate(
                self, parent_generate, call, drafter, assistant_model, drafter_kwargs
            )
        # the call's `speculative_*` arguments (not a config's, which may hold defaults for later calls)
        called_with = [
            (name, value) for name, value in call.extra.items() if name.startswith("speculative_") and value is not None
        ]
        options = resolve_speculative_options(call.extra, call.get("generation_config"), self.generation_config)
        drafter, drafter_kwargs = _native_drafter_request(call, drafter, assistant_model, drafter_kwargs, self)
        drafter, drafter_kwargs, assistant_model = _speculation_type_request(
            call, drafter, assistant_model, drafter_kwargs, self
        )
        drafting = assistant_model is not None or drafter is not None
        if not drafting and drafter_kwargs is not None:
            raise ValueError("`drafter_kwargs` was given without `drafter`; pass `drafter=<name>` as well.")
        beams = call.get("num_beams") or getattr(
            call.get("generation_config") or self.generation_config, "num_beams", 1
        )
        pipeline_built_with = lambda name: _built_with(_calling_pipeline(self), name)
        refuse_unused_arguments(called_with, call.get("assistant_tokenizer"), drafting, beams, pipeline_built_with)
        if not drafting:
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

    def generate_batch(self, inputs, generation_config=None, *args, **kwargs):
        """transformers' continuous batching; with `drafter=...` (or `assistant_model=...`), `drafter_kwargs` and the
        `speculative_*` settings, each request drafts and verifies inside it (see `hf_specdec.continuous_batching`),
        and each result carries its `speculative_stats`. Drafting arguments it cannot serve are refused, never
        dropped."""
        request = continuous_batching.take_drafting_request(self, generation_config, kwargs)
        if request is None:
            return super().generate_batch(inputs, generation_config, *args, **kwargs)
        token = continuous_batching.pending_drafting.set(request)
        try:
            return super().generate_batch(inputs, generation_config, *args, **kwargs)
        finally:
            continuous_batching.pending_drafting.reset(token)

    def init_continuous_batching(
        self, generation_config=None, continuous_batching_config=None, workload_hints=None, **drafting
    ):
        """transformers' `init_continuous_batching`; with `drafter=...` (and `drafter_kwargs`, `speculative_*`), a
        manager with the same interface whose steps draft and verify."""
        return continuous_batching.init_manager(
            self,
            super().init_continuous_batching,
            generation_config,
            continuous_batching_config,
            workload_hints,
            drafting,
        )


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
    if inputs_embeds is not None and not model.config.is_encoder_decoder:
        raise ValueError(
            f"`inputs_embeds` (a tensor of shape {tuple(inputs_embeds.shape)}) cannot be combined with a drafter for "
            f"the decoder-only {type(model).__name__}: drafters and verification work on token ids, and a prompt "
            "given as embeddings has none. Pass the prompt as `input_ids` instead, or drop `assistant_model`/"
            "`drafter`."
        )


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
    # transformers keeps a construction's assistant and assistant tokenizer as the pipeline's attributes
    kept_on_pipeline = getattr(pipe, name, None) is not None
    return (
        kept_on_pipeline
        or name in forward_params
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


# transformers' own requests for a drafter that ships with the model -> (hf_specdec's registered drafter, the
# `drafter_kwargs` key that takes the request's value, or None where the value is a flag)
NATIVE_DRAFTER_REQUESTS = {"assistant_early_exit": ("early_exit", "exit_layer"), "use_mtp": ("mtp", None)}


def _native_drafter_request(call, drafter, assistant_model, drafter_kwargs, model):
    """Serves transformers' own requests for the model's built-in drafter (`assistant_early_exit=k`, `use_mtp=True`,
    in the call, its `generation_config` or the model's) with hf_specdec's drafter of that family: returns the call's
    (drafter, drafter_kwargs), and takes the request out of the call so that transformers does not act on it too."""
    generation_config = call.get("generation_config")
    for name, (registered, option) in NATIVE_DRAFTER_REQUESTS.items():
        if name in call.extra:
            value = call.extra[name]
        else:
            config = generation_config if generation_config is not None else model.generation_config
            value = getattr(config, name, None)
        if value is None or value is False:
            continue
        if assistant_model is not None or (drafter is not None and drafter != registered):
            given = "assistant_model" if assistant_model is not None else f"drafter={drafter!r}"
            raise ValueError(
                f"`{name}={value!r}` asks for the model's own drafter, but the call also passes `{given}`. Drop one "
                f'of them (`{name}` is the same request as `drafter="{registered}"`).'
            )
        if option is not None:
            if drafter_kwargs is not None and option in drafter_kwargs and drafter_kwargs[option] != value:
                raise ValueError(
                    f"`{name}={value!r}` and `drafter_kwargs={{'{option}': {drafter_kwargs[option]!r}}}` disagree; "
                    "pass one of them."
                )
            drafter_kwargs = {**(drafter_kwargs or {}), option: value}
        drafter = registered
        # the request is served here: transformers must not run its own generator for it too
        call.set(name, None)
        if generation_config is not None and getattr(generation_config, name, None) is not None:
            generation_config = copy.deepcopy(generation_config)  # the user's config is never modified
            setattr(generation_config, name, None)
            call.set("generation_config", generation_config)
    return drafter, drafter_kwargs


# transformers' `speculation_type` values -> (hf_specdec's registered drafter, the `drafter_kwargs` key that takes the
# call's `assistant_model`)
SPECULATION_TYPES = {"dflash": ("dflash", "model")}


def _speculation_type_request(call, drafter, assistant_model, drafter_kwargs, model):
    """Serves transformers' `speculation_type` (in the call, its `generation_config` or the model's) with hf_specdec's
    drafter of that type: `generate(assistant_model=m, speculation_type="dflash")` is `drafter="dflash",
    drafter_kwargs={"model": m}`. Returns the call's (drafter, drafter_kwargs, assistant_model) and takes the request
    out of the call. Without a drafter it is left to transformers (which then decodes plainly), unless the call set
    it itself."""
    generation_config = call.get("generation_config")
    in_call = "speculation_type" in call.extra
    if in_call:
        value = call.extra["speculation_type"]
    else:
        in_call = generation_config is not None and getattr(generation_config, "speculation_type", None) is not None
        config = generation_config if generation_config is not None else model.generation_config
        value = getattr(config, "speculation_type", None)
    if value is None or (assistant_model is None and drafter is None and not in_call):
        return drafter, drafter_kwargs, assistant_model
    if value not in SPECULATION_TYPES:
        raise ValueError(
            f"`speculation_type={value!r}` is not a speculation type hf_specdec serves (it serves "
            f"{sorted(SPECULATION_TYPES)}, as transformers does). Drop it, or choose a drafter by name: "
            "`drafter=...` (see `hf_specdec.list_drafters()`)."
        )
    registered, option = SPECULATION_TYPES[value]
    if drafter is not None and drafter != registered and not isinstance(drafter, get_drafter_class(registered)):
        raise ValueError(
            f"`speculation_type={value!r}` asks for the {value} drafter, but the call passes `drafter={drafter!r}`. "
            f'Drop one of them (`speculation_type={value!r}` with `assistant_model=m` is `drafter="{registered}", '
            f"drafter_kwargs={{'{option}': m}}`)."
        )
    if assistant_model is not None:
        if drafter is not None or (drafter_kwargs is not None and option in drafter_kwargs):
            raise ValueError(
                f"`speculation_type={value!r}` takes its drafter model from `assistant_model` or from "
                f"`drafter_kwargs={{'{option}': ...}}` with `drafter=\"{registered}\"`; the call passes both. Drop one."
            )
        drafter, drafter_kwargs, assistant_model = registered, {**(drafter_kwargs or {}), option: assistant_model}, None
    elif drafter is None:
        raise ValueError(
            f"`speculation_type={value!r}` needs its drafter model: pass `assistant_model=<the {value} drafter>` (or "
            f"`drafter=\"{registered}\", drafter_kwargs={{'{option}': <the {value} drafter>}}`), or drop it."
        )
    # the request is served here: transformers must not run its own generator for it too (a kwarg next to a
    # `generation_config` would warn: set only where it was given, or over the model's own config)
    if "speculation_type" in call.extra or generation_config is None:
        call.set("speculation_type", None)
    if generation_config is not None and getattr(generation_config, "speculation_type", None) is not None:
        generation_config = copy.deepcopy(generation_config)  # the user's config is never modified
        generation_config.speculation_type = None
        call.set("generation_config", generation_config)
    return drafter, drafter_kwargs, assistant_model


def _reject_conflicting_arguments(custom_generate, synced_gpus, generation_config, model_config, kwargs) -> None:
    if custom_generate is not None:
        raise ValueError(
            f"`custom_generate` ({custom_generate!r}) replaces the decoding loop and cannot be combined with a drafter."
        )
    if synced_gpus:
        raise ValueError("`synced_gpus=True` is not supported with a drafter yet; drop it or the drafter.")
    if kwargs.get("cache_implementation") == "paged":  # read from the call only, as transformers reads it
        raise ValueError(
            "`cache_implementation='paged'` switches `generate` to continuous batching (`generate_batch`), where "
            "hf_specdec drafts only with `drafter=...` or `assistant_model=...` given to the call, not with "
            "transformers' own drafting settings (`use_mtp`, `assistant_early_exit`, `speculation_type`). Drop "
            'them or the paged cache, or pass a drafter it serves there (e.g. `drafter="prompt_lookup"`).'
        )
    config = generation_config if generation_config is not None else model_config
    for name in ("prompt_lookup_num_tokens",):
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
}
