"""What `ModelDrafter` (in `model.py`) sets up once per call besides its own bookkeeping: the source that the draft
model of an encoder-decoder target reads, and a static draft cache with transformers' compiled forward over it."""

from __future__ import annotations

import inspect

from transformers import PreTrainedModel, StaticCache
from transformers.modeling_outputs import BaseModelOutput
from transformers.utils import logging

from ..caches import CACHE_KWARG, is_static, static_rewind_problem
from .base import DraftContext

__all__ = ["compiled_forward", "encoder_inputs", "static_draft_cache"]

logger = logging.get_logger(__name__)


def encoder_inputs(model: PreTrainedModel, context: DraftContext, device, forward_params) -> dict:
    """The forward kwargs that carry the source to `model` (on `device`, taking `forward_params`), the drafter of an
    encoder-decoder target: its own encoding of the source, or the target's encoder outputs for a decoder with
    cross-attention. Computed once per call."""
    target = context.target
    encoder_mask = context.model_kwargs.get("attention_mask")  # [batch, src_len] or None
    if encoder_mask is not None:
        encoder_mask = encoder_mask.to(device)
    if model.config.is_encoder_decoder:
        # its own encoder, once, on the same source the target encoded, under the encoder's own input name
        # (a composite model's is not the encoder's: SpeechEncoderDecoderModel takes `inputs`, Wav2Vec2
        # `input_values`)
        encoder = model.get_encoder()
        input_name = getattr(encoder, "main_input_name", None) or model.main_input_name
        source = context.inputs_tensor
        # without a source, generate passes a placeholder of -100s
        token_ids = source is not None and not source.is_floating_point()
        if (
            input_name == "input_ids"
            and source is not None
            and not token_ids
            and source.shape[-1] == model.config.get_text_config(decoder=False).hidden_size
            and "inputs_embeds" in inspect.signature(encoder.forward).parameters
        ):
            # a source given as embeddings (Pop2Piano's `generate` always passes `inputs_embeds`), of the
            # width the drafter's encoder takes: encoded as embeddings
            input_name = "inputs_embeds"
        if source is None or (token_ids and bool((source < 0).any())) or (input_name == "input_ids" and not token_ids):
            raise ValueError(
                f"The encoder-decoder `assistant_model` ({type(model).__name__}) needs the source as "
                f"`{input_name}`, but the target was called with "
                f"{'no input tensor' if source is None else 'a different kind of input'}. Call `generate` with "
                "the tokenized source (e.g. `input_ids=...`, not `encoder_outputs=` or `inputs_embeds=`)."
            )
        source = source.to(device=device, dtype=model.dtype if input_name == "inputs_embeds" else None)
        encoder_outputs = encoder(**{input_name: source}, attention_mask=encoder_mask, return_dict=True)
        return {"encoder_outputs": encoder_outputs, "attention_mask": encoder_mask}
    # a decoder-only drafter reads the target's encoder outputs through its cross-attention (distil-whisper)
    hidden_size = model.config.get_text_config(decoder=True).hidden_size
    target_states = context.model_kwargs["encoder_outputs"].last_hidden_state  # [batch, src_len, hidden]
    takes_states = "encoder_hidden_states" in forward_params
    if not takes_states and "encoder_outputs" in forward_params and target_states.shape[-1] == hidden_size:
        # WhisperForCausalLM takes the encoder's output object itself
        return {
            "encoder_outputs": BaseModelOutput(last_hidden_state=target_states.to(device=device, dtype=model.dtype))
        }
    if not takes_states or getattr(model.config, "add_cross_attention", True) is False:
        raise ValueError(
            f"`assistant_model` ({type(model).__name__}) is decoder-only without cross-attention, so it cannot "
            f"read the source of the encoder-decoder target ({type(context.target).__name__}). Use an "
            "encoder-decoder drafter, or a decoder with cross-attention (e.g. `BartForCausalLM`, or a config "
            "with `add_cross_attention=True`)."
        )
    if target_states.shape[-1] != hidden_size:
        raise ValueError(
            f"`assistant_model` ({type(model).__name__}) has cross-attention for encoder states of size "
            f"{hidden_size}, but the target's encoder ({type(target).__name__}) outputs size "
            f"{target_states.shape[-1]}. A decoder-only drafter shares the target's encoder outputs only when "
            "its hidden size matches; use an encoder-decoder drafter instead."
        )
    return {
        "encoder_hidden_states": target_states.to(device=device, dtype=model.dtype),
        "encoder_attention_mask": encoder_mask,
    }


def static_draft_cache(model: PreTrainedModel, capacity: int) -> StaticCache:
    """A `StaticCache` of `capacity` positions for one sequence of `model`, checked to roll back by moving its write
    position."""
    cache = StaticCache(config=model.config, max_cache_len=capacity)
    if not is_static(cache):
        layers = sorted({type(layer).__name__ for layer in cache.layers})
        raise ValueError(
            f"`ModelDrafter(cache_implementation='static')`: the drafter model ({type(model).__name__}) gets "
            f"cache layers {layers} from `StaticCache`, not preallocated attention layers that can be rolled back "
            "by moving their write position. Leave the drafter's cache dynamic (`cache_implementation=None`)."
        )
    problem = static_rewind_problem(cache, capacity + 1)
    if problem is not None:
        raise ValueError(
            f"`ModelDrafter(cache_implementation='static')` cannot roll the drafter's static cache of "
            f"{capacity} positions back: {problem}. Leave the drafter's cache dynamic "
            "(`cache_implementation=None`), which keeps what a sliding window needs."
        )
    return cache


def compiled_forward(model: PreTrainedModel, cache: StaticCache, generation_config):
    """transformers' own compiled forward of `model` over the static `cache`, where transformers would compile one
    (`model._valid_auto_compile_criteria` with the call's `compile_config` and `disable_compile`), else None."""
    if not (
        hasattr(model, "_valid_auto_compile_criteria")
        and model._valid_auto_compile_criteria({CACHE_KWARG: cache}, generation_config)
    ):
        return None
    # transformers' own compiled call, cached on the model by transformers as for plain decoding
    compiled = model.get_compiled_call(generation_config.compile_config)
    if getattr(getattr(compiled, "__wrapped__", None), "__self__", model) is model:
        return compiled
    logger.warning_once(
        f"The draft model ({type(model).__name__}) holds a compiled forward that transformers made for "
        "another model (`copy.deepcopy` of a model that has generated with a static cache copies its "
        "`_compiled_call`, which runs the original's weights), so the drafter drafts eagerly. Delete it "
        "(`del draft._compiled_call`) to compile the draft model's own forward."
    )
    return None
