"""`SpeculativeGenerationMixin` and `enable`: speculative decoding inside `model.generate`."""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from transformers import GenerationMixin, PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from .configuration import resolve_speculative_options
from .decoding import speculative_decode
from .drafters.base import Drafter, get_drafter_class
from .drafters.model import ModelDrafter

__all__ = ["SpeculativeGenerationMixin", "enable", "resolve_drafter"]


class SpeculativeGenerationMixin:
    r"""
    Adds speculative decoding to `generate`. Put it before the model class
    (`class MyLlama(SpeculativeGenerationMixin, LlamaForCausalLM)`), or call [`enable`] on one model instance.

    `generate` gains two arguments and the `speculative_*` fields of [`SpeculativeGenerationConfig`]:

    - `assistant_model` ([`~transformers.PreTrainedModel`], *optional*): a small causal LM with the target's
      vocabulary that drafts tokens (the paper's M_q).
    - `drafter` (`str`, [`Drafter`] or [`~transformers.PreTrainedModel`], *optional*): any drafter, by registered
      name (see [`list_drafters`]), as an instance, or as a model. `drafter_kwargs` (`dict`, *optional*) are passed
      to the registered class when `drafter` is a name.
    - `speculative_gamma` (`int`, *optional*, defaults to 5), `speculative_lenience` (`float`, *optional*, defaults
      to 1.0): see [`SpeculativeGenerationConfig`].

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
        self,
        inputs: torch.Tensor | None = None,
        generation_config=None,
        logits_processor=None,
        stopping_criteria=None,
        prefix_allowed_tokens_fn=None,
        synced_gpus=None,
        assistant_model=None,
        streamer=None,
        negative_prompt_ids=None,
        negative_prompt_attention_mask=None,
        custom_generate=None,
        drafter=None,
        drafter_kwargs: dict[str, Any] | None = None,
        **kwargs,
    ):
        options = resolve_speculative_options(kwargs, generation_config, self.generation_config)
        plain_args = dict(
            inputs=inputs,
            generation_config=generation_config,
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
            synced_gpus=synced_gpus,
            streamer=streamer,
            negative_prompt_ids=negative_prompt_ids,
            negative_prompt_attention_mask=negative_prompt_attention_mask,
        )
        if assistant_model is None and drafter is None:
            if drafter_kwargs is not None:
                raise ValueError("`drafter_kwargs` was given without `drafter`; pass `drafter=<name>` as well.")
            return super().generate(**plain_args, custom_generate=custom_generate, **kwargs)

        drafter = resolve_drafter(drafter, assistant_model, drafter_kwargs)
        _reject_conflicting_arguments(custom_generate, synced_gpus, generation_config, self.generation_config, kwargs)
        # stop strings need the tokenizer, which transformers hands only to its own decoding methods: build the
        # criterion here and clear the field on a copy (the user's config is never modified)
        tokenizer = kwargs.pop("tokenizer", None)
        stop_strings = kwargs.get(
            "stop_strings", getattr(generation_config if generation_config is not None else self.generation_config,
                                    "stop_strings", None)
        )
        if stop_strings is not None:
            if tokenizer is None:
                raise ValueError(
                    f"`stop_strings` ({stop_strings!r}) needs the model's tokenizer: pass `tokenizer=tokenizer` to "
                    "`generate`."
                )
            stopping_criteria = StoppingCriteriaList(list(stopping_criteria or []))
            stopping_criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
            if generation_config is not None:  # clear it on a copy (a kwarg next to a config would warn)
                kwargs.pop("stop_strings", None)
                generation_config = copy.deepcopy(generation_config)
                generation_config.stop_strings = None
            else:  # overrides the model's own generation config for this call
                kwargs["stop_strings"] = None
            plain_args.update(stopping_criteria=stopping_criteria, generation_config=generation_config)

        decoding_loop = functools.partial(_decoding_method, drafter=drafter, options=options, streamer=streamer)
        return super().generate(**plain_args, custom_generate=decoding_loop, **kwargs)


def _decoding_method(
    model, input_ids, logits_processor, stopping_criteria, generation_config, inputs_tensor=None, *, drafter,
    options, streamer, **model_kwargs
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


def resolve_drafter(drafter, assistant_model, drafter_kwargs: dict[str, Any] | None = None) -> Drafter:
    """Turns the `drafter` / `assistant_model` arguments of one `generate` call into a `Drafter`."""
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
        return get_drafter_class(drafter).from_options(**(drafter_kwargs or {}))
    raise TypeError(
        f"`drafter` must be a registered drafter name, a `hf_specdec.Drafter` or a `PreTrainedModel`, got "
        f"{type(drafter).__name__}. Registered names: see `hf_specdec.list_drafters()`."
    )


def _reject_conflicting_arguments(custom_generate, synced_gpus, generation_config, model_config, kwargs) -> None:
    if custom_generate is not None:
        raise ValueError(
            f"`custom_generate` ({custom_generate!r}) replaces the decoding loop and cannot be combined with a drafter."
        )
    if synced_gpus:
        raise ValueError("`synced_gpus=True` is not supported with a drafter yet; drop it or the drafter.")
    if kwargs.get("assistant_tokenizer") is not None:
        raise ValueError(
            "`assistant_tokenizer` (drafting with a different tokenizer) is not supported: the drafter must share "
            "the target's vocabulary. Drop `assistant_tokenizer`."
        )
    config = generation_config if generation_config is not None else model_config
    for name in ("prompt_lookup_num_tokens", "assistant_early_exit"):
        value = kwargs.get(name, getattr(config, name, None))
        if value is not None:
            raise ValueError(
                f"`{name}={value!r}` selects transformers' own assisted generation and cannot be combined with "
                f"an hf_specdec drafter. Drop `{name}` (use `drafter=...` instead)."
            )


@functools.cache
def _speculative_class(cls: type) -> type:
    # keeps the original name so `save_pretrained` writes the real architecture into config.json
    return type(cls.__name__, (SpeculativeGenerationMixin, cls), {"__module__": cls.__module__,
                                                                   "__qualname__": cls.__qualname__})


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
