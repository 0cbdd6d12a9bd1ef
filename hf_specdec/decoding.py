"""The entry point that `model.generate` calls with a drafter: one capability check, then the loop for one
sequence (`sequence.py`, chains or token trees), for a batch (`batching.py`) or for beam search (`beam.py`), each
running the shared round of `rounds.py` with its own lane.

`generate` prepares everything as usual (generation config, logits processors, stopping criteria, cache, encoder
outputs) and hands the loop the prepared pieces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode

from .batching import decode_batch
from .beam import speculative_beam_search
from .caches import (
    CACHE_KWARG,
    cache_argument,
    compactable,
    croppable_after_first_forward,
    is_static,
    static_rewind_problem,
)
from .capability import check_multi_token_forward
from .configuration import SpeculativeOptions
from .devices import cudnn_attention_off, execution_device
from .drafters.base import Drafter
from .outputs import SpeculativeDecoderOnlyOutput, SpeculativeEncoderDecoderOutput
from .policies import get_gamma_policy_class
from .proposals import draft_context
from .recurrent import held_positions, rolls_back_from_checkpoints, snapshot_layers
from .sequence import decode_sequence
from .stats import SpeculativeStats
from .tree_attention import check_tree_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.generation.streamers import BaseStreamer

__all__ = ["check_multi_token_forward", "speculative_decode"]  # the check lives in `capability.py`


def speculative_decode(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,  # [batch, prompt_len]
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    *,
    drafter: Drafter,
    options: SpeculativeOptions,
    streamer: BaseStreamer | None = None,
    inputs_tensor: torch.Tensor | None = None,
    stats: SpeculativeStats | None = None,
    attach_stats: bool = True,
    **model_kwargs,
):
    """`stats`: accumulate into this object (one per `generate` call, which may decode several times: Whisper's
    long-form segments); `attach_stats=False` leaves `speculative_stats` out of the output, for callers that attach
    it to their own (classes whose `generate` splits and restacks outputs by row). On a CUDA device the call runs
    without cuDNN's attention unless `speculative_cudnn_attention` (`devices.cudnn_attention_off`), or unless its
    target forwards are compiled (a static cache with `torch.compile`): compiled graphs are shared with plain
    `generate` and fix their attention kernel when traced, so the switch would not reach the graphs plain calls traced
    and would leak into plain calls through the graphs this one traced."""
    compiled = is_static(model_kwargs.get(CACHE_KWARG)) and model._valid_auto_compile_criteria(
        model_kwargs, generation_config
    )
    with cudnn_attention_off(execution_device(model), not (options.speculative_cudnn_attention or compiled)):
        if generation_config.num_beams > 1:  # the paper's Appendix A.4: `beam.py`
            return speculative_beam_search(
                model,
                input_ids,
                logits_processor,
                stopping_criteria,
                generation_config,
                drafter=drafter,
                options=options,
                streamer=streamer,
                inputs_tensor=inputs_tensor,
                stats=stats,
                attach_stats=attach_stats,
                **model_kwargs,
            )
        _check_supported(model, input_ids, generation_config, model_kwargs, streamer)
        if options.speculative_tree_budget is not None:
            _check_trees_supported(model, input_ids, generation_config, model_kwargs, options.speculative_tree_budget)
        if stats is None:
            stats = SpeculativeStats(lenience=options.speculative_lenience)
        policy = get_gamma_policy_class(options.speculative_gamma_policy)(
            options.speculative_gamma, options.speculative_max_gamma
        )
        policy.free_drafts = bool(getattr(drafter, "free_drafts", False))
        run = dict(
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            generation_config=generation_config,
            options=options,
            policy=policy,
            stats=stats,
        )
        check_multi_token_forward(model, input_ids, model_kwargs, generation_config)
        scores = raw_logits = None
        if input_ids.shape[0] == 1:
            drafter = drafter.for_call(
                draft_context(
                    model,
                    input_ids,
                    logits_processor,
                    generation_config,
                    model_kwargs,
                    inputs_tensor,
                    options.speculative_tree_budget,
                )
            )
            input_ids, scores, raw_logits = decode_sequence(
                model, input_ids, drafter=drafter, streamer=streamer, **run, **model_kwargs
            )
            cache = model_kwargs[CACHE_KWARG]
        else:
            # no cache comes back for a batch (`decode_batch`): `past_key_values` is None
            input_ids = decode_batch(
                model, input_ids, model_kwargs, drafter=drafter, inputs_tensor=inputs_tensor, **run
            )
            cache = None
        if streamer is not None:
            streamer.end()
        if not generation_config.return_dict_in_generate:
            return input_ids
        output_class = (
            SpeculativeEncoderDecoderOutput if model.config.is_encoder_decoder else SpeculativeDecoderOnlyOutput
        )
        return output_class(
            sequences=input_ids,
            scores=scores,
            logits=raw_logits,
            **{CACHE_KWARG: cache},
            speculative_stats=stats if attach_stats else None,
        )


# transformers' decoding methods selected by a setting, which the loop would ignore -> (settings, name)
_OTHER_DECODING_METHODS = {
    GenerationMode.CONTRASTIVE_SEARCH: (("penalty_alpha", "top_k"), "contrastive search"),
    GenerationMode.DOLA_GENERATION: (("dola_layers",), "DoLa decoding"),
    GenerationMode.CONSTRAINED_BEAM_SEARCH: (("force_words_ids", "constraints"), "constrained beam search"),
}


def _check_supported(model, input_ids, generation_config, model_kwargs, streamer) -> None:
    """One capability check, before any decoding forward (an encoder-decoder's encoder has run): everything
    speculation cannot honour fails here, clearly."""
    if input_ids.shape[0] > 1:
        if streamer is not None:
            raise ValueError(
                f"A `streamer` needs a batch of one sequence, got {input_ids.shape[0]} "
                f"(num_return_sequences={generation_config.num_return_sequences}); transformers' streamers take one "
                "token per step. Drop `streamer` or generate one sequence per call."
            )
        if generation_config.return_dict_in_generate and (
            generation_config.output_scores or generation_config.output_logits
        ):
            raise ValueError(
                "`output_scores` / `output_logits` are supported with a drafter for one sequence only, got a batch of "
                f"{input_ids.shape[0]}: rows advance by different numbers of tokens per step. Set them to False, or "
                "generate one sequence per call."
            )
    mask = model_kwargs.get("attention_mask")
    if (
        model.config.is_encoder_decoder
        and generation_config.prefill_chunk_size is not None
        and isinstance(mask, torch.Tensor)
        and not bool(mask.bool().all())
    ):
        # transformers' `_prefill` cuts the attention mask to the decoder prompt's length, on an encoder-decoder
        # model the encoder's: plain generate's first token then attends the source's padding
        raise ValueError(
            f"`prefill_chunk_size={generation_config.prefill_chunk_size}` with the encoder-decoder "
            f"{type(model).__name__} and a padded `attention_mask`: plain `generate`'s chunked prefill cuts the "
            "encoder's attention mask to the decoder prompt's length, so its first token sees the source's padding, "
            "unlike unchunked decoding, and a drafter cannot reproduce that exactly. Drop `prefill_chunk_size` (the "
            "decoder prompt of an encoder-decoder model is a token or a few: there is nothing to chunk), or generate "
            "unpadded rows."
        )
    if not generation_config.use_cache:
        raise ValueError(
            "`use_cache=False` cannot be combined with a drafter: speculative decoding rolls back the target's "
            "key/value cache. Use `use_cache=True` (the default)."
        )
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):  # beam search went to `beam.py`
        settings, name = _OTHER_DECODING_METHODS.get(mode, ((), f"the {mode.value} decoding method"))
        given = ", ".join(
            f"{field}={getattr(generation_config, field)!r}"
            for field in settings
            if getattr(generation_config, field, None) is not None
        )
        selects = f"`{'` / `'.join(settings)}` selects {name} ({given})" if settings else f"This call selects {name}"
        raise ValueError(
            f"{selects}, a decoding method of its own that a drafter cannot serve: hf_specdec's loop verifies "
            f"greedy or sampled tokens, so it would decode without it. Drop it or the drafter (plain `generate` runs "
            f"{name} from the Hub, with `trust_remote_code=True`)."
        )
    if generation_config.guidance_scale not in (None, 1, 1.0):
        raise ValueError(
            f"`guidance_scale` cannot be combined with a drafter, got guidance_scale={generation_config.guidance_scale}: "
            "classifier-free guidance keeps its own state per step. Drop `guidance_scale` or the drafter."
        )
    if getattr(generation_config, "return_token_timestamps", False):
        # Whisper turns `output_attentions` on itself for them
        raise ValueError(
            'Word-level timestamps (`return_token_timestamps=True`, or a pipeline\'s `return_timestamps="word"`) '
            "are computed from the cross-attention weights of every decoding step, which hf_specdec's rounds do not "
            "return. Drop the drafter for them, or use segment-level timestamps (`return_timestamps=True`), which "
            "are served."
        )
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "`output_attentions` and `output_hidden_states` are not supported with a drafter yet "
            f"(got output_attentions={generation_config.output_attentions}, "
            f"output_hidden_states={generation_config.output_hidden_states}). Set them to False."
        )
    cache = model_kwargs.get(CACHE_KWARG)
    if cache is None or cache_argument(model, default=None) is None:
        raise ValueError(
            f"{type(model).__name__} generates without a `Cache` object (it recomputes the whole sequence at every "
            "step), so there are no keys and values to keep or roll back. Speculative decoding needs a model that "
            "supports `DynamicCache`; drop `assistant_model`/`drafter` for this model."
        )
    if getattr(cache, "offloading", False):
        raise ValueError(
            f"The target's cache offloads its layers to the CPU (cache_implementation="
            f"{generation_config.cache_implementation!r}), which hf_specdec does not roll back. Use the default dynamic "
            'cache (`cache_implementation=None`) or a static one (`cache_implementation="static"`) with a drafter.'
        )
    # a recurrent (linear-attention / SSM) cache is rolled back from checkpoints, static or dynamic
    recurrent = rolls_back_from_checkpoints(model, cache)
    if recurrent:
        _check_recurrent_supported(model, cache, model_kwargs.get("attention_mask"))
    if is_static(cache):
        problem = static_rewind_problem(cache, generation_config.max_length)
        if problem is not None:
            raise ValueError(
                f"The target's static cache ({type(cache).__name__}, cache_implementation="
                f"{generation_config.cache_implementation!r}) cannot be rolled back here: {problem}. Use the default "
                "dynamic cache (`cache_implementation=None`), or a `max_new_tokens` that stays within the window."
            )
    elif recurrent:
        return
    elif getattr(model, "_is_stateful", False) and not getattr(cache, "is_croppable", False):
        raise ValueError(
            f"{type(model).__name__} is stateful: its recurrent state cannot be rolled back to an earlier token, so "
            f"rejected drafts could not be undone (hf_specdec checkpoints the linear-attention / SSM layers of "
            f"transformers' `DynamicCache`, and its {type(cache).__name__} has none). Drop `assistant_model`/`drafter`."
        )
    elif not getattr(cache, "is_croppable", False) and not croppable_after_first_forward(cache):
        raise ValueError(
            f"The target's cache ({type(cache).__name__}, cache_implementation="
            f"{generation_config.cache_implementation!r}) cannot be rolled back. Quantized, offloaded-static and "
            "linear-attention caches are not supported with a drafter; use the default dynamic cache "
            '(`cache_implementation=None`) or a static one (`cache_implementation="static"`).'
        )


def _check_recurrent_supported(model, cache, attention_mask) -> None:
    """A recurrent (linear-attention / SSM) cache is rolled back from checkpoints (`recurrent.py`), dynamic or static.
    One that already holds state (a cache returned by an earlier call, continued) must say how many positions it
    holds, which only its attention layers count. A model's own stateful layers (`snapshot_layers`) are served for
    rows without padding."""
    layers = snapshot_layers(model, cache)
    if layers and attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            f"{type(model).__name__} cannot be verified exactly on rows with padding: its {type(layers[0]).__name__} "
            "layers compress their keys in windows counted in cache slots, padding included, and a forward over "
            "several new tokens hides the compressed entries by position ids, which padding shifts from the slots "
            "(a one-token forward hides none), so a padded row's verify forward computes something else than plain "
            "decoding. Pass rows of equal length without padding (`attention_mask` all ones), or one row per call."
        )
    if held_positions(cache) is None:
        raise ValueError(
            f"The cache passed to {type(model).__name__} already holds recurrent state, and it has no attention layer "
            "that counts the positions it holds (a state-space model's), so hf_specdec cannot tell which of "
            "`input_ids` it still has to feed. Pass a fresh cache (or none) with the whole sequence."
        )


def _check_trees_supported(model, input_ids, generation_config, model_kwargs, tree_budget: int) -> None:
    """Token trees need one sequence, a cache whose columns can be compacted, and a model that takes a 4D mask."""
    budget = f"speculative_tree_budget={tree_budget}"
    if rolls_back_from_checkpoints(model, model_kwargs.get(CACHE_KWARG)):
        raise ValueError(
            f"Token trees ({budget}) cannot be verified on {type(model).__name__}: its cache keeps state along the "
            "sequence (linear-attention / SSM layers, or compressors of past keys), and the branches of a tree would "
            "each need a state of their own. Drop `speculative_tree_budget` (chains are exact on this model)."
        )
    if input_ids.shape[0] > 1:
        raise ValueError(
            f"Token trees ({budget}) are verified for one sequence at a time, got a batch of {input_ids.shape[0]} "
            f"(num_return_sequences={generation_config.num_return_sequences}). Drop `speculative_tree_budget` to "
            "speculate with chains in a batch, or generate one sequence per call."
        )
    if model.config.is_encoder_decoder:
        raise ValueError(
            f"Token trees are supported for decoder-only targets, got the encoder-decoder {type(model).__name__}. "
            "Drop `speculative_tree_budget` (chains work with encoder-decoder targets)."
        )
    cache = model_kwargs.get(CACHE_KWARG)
    if not compactable(cache):
        raise ValueError(
            f"Token trees need a cache that keeps every position ({type(cache).__name__} of {type(model).__name__} "
            "has sliding-window or other per-position state that a tree's compaction would break). Drop "
            "`speculative_tree_budget` (chains work with this cache)."
        )
    check_tree_attention(model)
