"""The entry point that `model.generate` calls with a drafter: one capability check, then the loop for one
sequence (`sequence.py`, chains or token trees) or for a batch (`batching.py`), both built on the shared round of
`rounds.py`.

`generate` prepares everything as usual (generation config, logits processors, stopping criteria, cache, encoder
outputs) and hands the loop the prepared pieces.
"""

from __future__ import annotations

import inspect
import weakref
from typing import TYPE_CHECKING

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from .batching import decode_batch, slice_kwargs
from .beam import speculative_beam_search
from .caches import (cached_length, compactable, croppable_after_first_forward, is_static, rewind_cache,
                     static_rewind_problem)
from .configuration import SpeculativeOptions
from .drafters.base import Drafter
from .drafters.model import logits_width
from .outputs import SpeculativeDecoderOnlyOutput, SpeculativeEncoderDecoderOutput
from .policies import get_gamma_policy_class
from .rounds import draft_context, target_logits
from .sequence import decode_sequence
from .stats import SpeculativeStats
from .tree_attention import check_tree_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.generation.streamers import BaseStreamer

__all__ = ["check_multi_token_forward", "speculative_decode"]


def speculative_decode(
    model: "PreTrainedModel",
    input_ids: torch.LongTensor,  # [batch, prompt_len]
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    *,
    drafter: Drafter,
    options: SpeculativeOptions,
    streamer: "BaseStreamer | None" = None,
    inputs_tensor: torch.Tensor | None = None,
    stats: SpeculativeStats | None = None,
    attach_stats: bool = True,
    **model_kwargs,
):
    """`stats`: accumulate into this object (one per `generate` call, which may decode several times: Whisper's
    long-form segments); `attach_stats=False` leaves `speculative_stats` out of the output, for callers that attach
    it to their own (classes whose `generate` splits and restacks outputs by row)."""
    if generation_config.num_beams > 1:  # the paper's Appendix A.4: `beam.py`
        return speculative_beam_search(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                       drafter=drafter, options=options, streamer=streamer,
                                       inputs_tensor=inputs_tensor, stats=stats, attach_stats=attach_stats,
                                       **model_kwargs)
    _check_supported(model, input_ids, generation_config, model_kwargs, streamer)
    if options.speculative_tree_budget is not None:
        _check_trees_supported(model, input_ids, generation_config, model_kwargs, options.speculative_tree_budget)
    if stats is None:
        stats = SpeculativeStats(lenience=options.speculative_lenience)
    policy = get_gamma_policy_class(options.speculative_gamma_policy)(
        options.speculative_gamma, options.speculative_max_gamma
    )
    run = dict(logits_processor=logits_processor, stopping_criteria=stopping_criteria,
               generation_config=generation_config, options=options, policy=policy, stats=stats)
    check_multi_token_forward(model, input_ids, model_kwargs, generation_config)
    scores = raw_logits = None
    if input_ids.shape[0] == 1:
        drafter = drafter.for_call(draft_context(model, input_ids, logits_processor, generation_config, model_kwargs,
                                                 inputs_tensor, options.speculative_tree_budget))
        input_ids, scores, raw_logits = decode_sequence(model, input_ids, drafter=drafter, streamer=streamer, **run,
                                                        **model_kwargs)
        cache = model_kwargs["past_key_values"]
    else:
        input_ids, cache = decode_batch(model, input_ids, model_kwargs, drafter=drafter, inputs_tensor=inputs_tensor,
                                        **run)
    if streamer is not None:
        streamer.end()
    if not generation_config.return_dict_in_generate:
        return input_ids
    output_class = SpeculativeEncoderDecoderOutput if model.config.is_encoder_decoder else SpeculativeDecoderOnlyOutput
    return output_class(
        sequences=input_ids, scores=scores, logits=raw_logits, past_key_values=cache,
        speculative_stats=stats if attach_stats else None,
    )


def _check_supported(model, input_ids, generation_config, model_kwargs, streamer) -> None:
    """One capability check, before any forward: everything speculation cannot honour fails here, clearly."""
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
    if not generation_config.use_cache:
        raise ValueError(
            "`use_cache=False` cannot be combined with a drafter: speculative decoding rolls back the target's "
            "key/value cache. Use `use_cache=True` (the default)."
        )
    if generation_config.guidance_scale not in (None, 1, 1.0):
        raise ValueError(
            f"`guidance_scale` cannot be combined with a drafter, got guidance_scale={generation_config.guidance_scale}: "
            "classifier-free guidance keeps its own state per step. Drop `guidance_scale` or the drafter."
        )
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "`output_attentions` and `output_hidden_states` are not supported with a drafter yet "
            f"(got output_attentions={generation_config.output_attentions}, "
            f"output_hidden_states={generation_config.output_hidden_states}). Set them to False."
        )
    cache = model_kwargs.get("past_key_values")
    if cache is None or "past_key_values" not in inspect.signature(model.forward).parameters:
        raise ValueError(
            f"{type(model).__name__} generates without a `Cache` object (it recomputes the whole sequence at every "
            "step), so there are no keys and values to keep or roll back. Speculative decoding needs a model that "
            "supports `DynamicCache`; drop `assistant_model`/`drafter` for this model."
        )
    if is_static(cache):
        problem = static_rewind_problem(cache, generation_config.max_length)
        if problem is not None:
            raise ValueError(
                f"The target's static cache ({type(cache).__name__}, cache_implementation="
                f"{generation_config.cache_implementation!r}) cannot be rolled back here: {problem}. Use the default "
                "dynamic cache (`cache_implementation=None`), or a `max_new_tokens` that stays within the window."
            )
    elif not getattr(cache, "is_croppable", False) and not croppable_after_first_forward(cache):
        raise ValueError(
            f"The target's cache ({type(cache).__name__}, cache_implementation="
            f"{generation_config.cache_implementation!r}) cannot be rolled back. Quantized, offloaded-static and "
            "linear-attention caches are not supported with a drafter; use the default dynamic cache "
            "(`cache_implementation=None`) or a static one (`cache_implementation=\"static\"`)."
        )


def _check_trees_supported(model, input_ids, generation_config, model_kwargs, tree_budget: int) -> None:
    """Token trees need one sequence, a cache whose columns can be compacted, and a model that takes a 4D mask."""
    budget = f"speculative_tree_budget={tree_budget}"
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
    cache = model_kwargs.get("past_key_values")
    if not compactable(cache):
        raise ValueError(
            f"Token trees need a cache that keeps every position ({type(cache).__name__} of {type(model).__name__} "
            "has sliding-window or other per-position state that a tree's compaction would break). Drop "
            "`speculative_tree_budget` (chains work with this cache)."
        )
    check_tree_attention(model)


# model -> (dtype, attention implementation, refusal reason or None): nothing is written onto the user's model
_MULTI_TOKEN_VERDICTS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
_PROBE_DRAFTS = 4  # tokens of the probe's first round, as a drafter proposing γ = 4 would


def check_multi_token_forward(model, input_ids, model_kwargs, generation_config) -> None:
    """Refuses, with a `ValueError` naming the model class and the reason, a target whose cached forward over several
    new tokens does not compute what step-by-step decoding computes (as plain `generate` runs it), or whose cache
    cannot be rolled back: speculation on such a model would be silently wrong, or crash mid-generation.

    A functional check, not a list of model classes: once per model object (and dtype and attention implementation),
    on the first row of the first call, it runs the target over the row's prompt and 4 extra tokens twice, step by
    step (1 + 4 forwards, each of 1 token after the prompt) and as speculation would (the prompt and the 4 tokens in
    one forward, a rollback of 3, then the last 3 tokens again in one forward), and compares the logits. Cost: 7
    target forwards over about `prompt + 4` tokens, once for the model's lifetime, i.e. about what generating 7
    tokens costs once; later calls only look the verdict up. What it cannot see: differences that appear only past
    lengths the probe does not reach (see `_attention_limit`).
    """
    key = (model.dtype, getattr(model.config, "_attn_implementation", None))
    cached = _MULTI_TOKEN_VERDICTS.get(model)
    if cached is None or cached[:2] != key:
        cached = (*key, _probe_multi_token_forward(model, input_ids, model_kwargs, generation_config))
        _MULTI_TOKEN_VERDICTS[model] = cached
    reason = cached[2]
    if reason is None:
        limit = _attention_limit(model)
        if limit is not None and generation_config.max_length > limit[1]:
            reason = (f"its attention selects at most {limit[0]}={limit[1]} keys per query, which makes a forward over "
                      "several new tokens compute something else than step-by-step decoding once the sequence is "
                      f"longer than that (this generation may reach max_length={generation_config.max_length})")
    if reason is not None:
        raise ValueError(
            f"{type(model).__name__} cannot be verified exactly by speculative decoding: {reason}. Drop "
            "`assistant_model`/`drafter` and use plain `generate` for this model."
        )


def _attention_limit(model) -> tuple[str, int] | None:
    """A sparse-attention indexer's top-k: a multi-token forward picks its keys per chunk, not per token, so
    speculation is exact only while the whole sequence fits within it (transformers' assisted generation differs
    there as well)."""
    config = model.config.get_text_config(decoder=True)
    value = getattr(config, "index_topk", None)
    return ("index_topk", value) if isinstance(value, int) else None


@torch.no_grad()
def _probe_multi_token_forward(model, input_ids, model_kwargs, generation_config) -> str | None:
    """The reason `model` cannot be speculated on exactly, or None; see `check_multi_token_forward`."""
    is_encoder_decoder = model.config.is_encoder_decoder
    row_kwargs = slice_kwargs(model_kwargs, 0, input_ids.shape[0], model)
    prompt = input_ids[:1]  # [1, prompt_len]
    vocab = logits_width(model)
    # tokens that differ from each other and from the prompt's last one
    extra = (prompt[:, -1:] + torch.arange(1, _PROBE_DRAFTS + 1, device=prompt.device) * 7) % vocab  # [1, 4]
    sequence = torch.cat([prompt, extra], dim=-1)
    prompt_len = prompt.shape[1]

    def advance(kwargs, new_tokens):
        return model._update_model_kwargs_for_generation({}, dict(kwargs), is_encoder_decoder=is_encoder_decoder,
                                                         num_new_tokens=new_tokens)

    def fresh():
        kwargs = slice_kwargs(row_kwargs, 0, 1, model)  # a cache of its own
        cache = kwargs["past_key_values"]
        cache.activate_past_recording()
        if is_static(cache):  # an empty copy, sized for the probe (the call's may hold fewer positions)
            for layer in getattr(cache, "self_attention_cache", cache).layers:
                if not layer.is_sliding:
                    layer.max_cache_len = max(layer.max_cache_len, prompt_len + _PROBE_DRAFTS + 1)
        return kwargs

    try:
        # step by step, as plain generate decodes: the logits after the prompt and after each extra token
        kwargs = fresh()
        steps = [target_logits(model, prompt, 0, kwargs, True)[:, -1]]
        cached = cached_length(kwargs["past_key_values"])
        if cached == 0:
            return (f"it does not keep its keys and values in the cache (after a forward over {prompt_len} tokens "
                    "the cache is empty), so there is nothing to roll rejected drafts back from")
        if cached != prompt_len:
            return (f"its cache holds {cached} positions after a forward over {prompt_len} tokens, so rolling it back "
                    "by a number of rejected tokens would misalign it")
        for i in range(_PROBE_DRAFTS):
            kwargs = advance(kwargs, 1)
            steps.append(target_logits(model, sequence[:, : prompt_len + i + 1], 0, kwargs, False)[:, -1])
        want = torch.stack(steps, dim=1)  # [1, 5, vocab]

        # as speculation runs: the prompt and 4 drafts in one forward; 1 accepted, the second replaced (a rollback of
        # 3); then the remaining 2 drafts after it in one forward
        kwargs = fresh()
        cache = kwargs["past_key_values"]
        first = target_logits(model, sequence, _PROBE_DRAFTS, advance(kwargs, _PROBE_DRAFTS), True)  # [1, 5, vocab]
        if not cache.is_croppable and not is_static(cache):
            return ("its cache keeps recurrent state that cannot be rolled back to an earlier token, so rejected "
                    "drafts could not be undone")
        rewind_cache(cache, prompt_len + 1)
        kwargs = advance(kwargs, 2)
        second = target_logits(model, sequence, _PROBE_DRAFTS - 2, advance(kwargs, _PROBE_DRAFTS - 2), False)
    except Exception as error:  # noqa: BLE001 - any failure is a refusal that names it
        message = str(error).splitlines()[0] if str(error) else ""
        return f"a cached forward over several new tokens fails ({type(error).__name__}: {message[:200]})"
    # 'second' holds the logits after extra tokens 1, 2 and 3: positions 2-4 of `want`
    error = max(float((first - want).abs().max()), float((second - want[:, 2:]).abs().max()))
    scale = float(want.abs().max().clamp(min=1.0))
    tolerance = (1e-4 if model.dtype == torch.float32 else 3e-2) * scale
    if not error <= tolerance:
        return (f"a cached forward over several new tokens disagrees with step-by-step decoding (largest logit "
                f"difference {error:.3g}, against {tolerance:.3g} of rounding)")
    return None
