"""The speculative decoding loop that runs inside `model.generate` (one sequence; batches: `batching.py`).

`generate` prepares everything as usual (generation config, logits processors, stopping criteria, cache, encoder
outputs) and hands this loop the prepared pieces. Each round:

1. the drafter proposes up to γ tokens (`DraftProposal`), standardized with the target's own logits processors;
2. the target runs one forward over its uncached tail plus the drafts and standardizes the γ + 1 distributions with
   the same processors, each with its exact prefix;
3. `hf_specdec.sampling` decides how many drafts are accepted and draws the recovered or bonus token;
4. the new tokens are appended one at a time through the stopping criteria (EOS, max length, stop strings, custom
   criteria, max time), so the output stops exactly where plain `generate` would;
5. the target's `DynamicCache` is cropped back to the accepted prefix and the drafter is told what was kept.

Invariant between rounds: the target cache holds every token of `input_ids` but the last.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from .configuration import SpeculativeOptions
from .drafters.base import DraftContext, DraftProposal, Drafter
from .drafters.model import logits_width
from .outputs import SpeculativeDecoderOnlyOutput, SpeculativeEncoderDecoderOutput
from .policies import get_gamma_policy_class
from .sampling import draft_target_overlap, verify_greedy, verify_sampling
from .stats import SpeculativeStats

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.generation.streamers import BaseStreamer

__all__ = ["speculative_decode"]


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
    **model_kwargs,
):
    _check_supported(model, input_ids, generation_config, model_kwargs, streamer)
    stats = SpeculativeStats(lenience=options.speculative_lenience)
    policy = get_gamma_policy_class(options.speculative_gamma_policy)(
        options.speculative_gamma, options.speculative_max_gamma
    )
    run = dict(logits_processor=logits_processor, stopping_criteria=stopping_criteria,
               generation_config=generation_config, options=options, policy=policy, stats=stats)
    scores = raw_logits = None
    if input_ids.shape[0] == 1:
        drafter = drafter.for_call(_context(model, input_ids, logits_processor, generation_config, model_kwargs,
                                            inputs_tensor))
        input_ids, scores, raw_logits = _decode_one(model, input_ids, drafter=drafter, streamer=streamer, **run,
                                                    **model_kwargs)
        cache = model_kwargs["past_key_values"]
    else:
        from .batching import decode_batch  # the batched loop builds on this module

        input_ids, cache = decode_batch(model, input_ids, model_kwargs, drafter=drafter, inputs_tensor=inputs_tensor,
                                        **run)
    if streamer is not None:
        streamer.end()
    if not generation_config.return_dict_in_generate:
        return input_ids
    output_class = SpeculativeEncoderDecoderOutput if model.config.is_encoder_decoder else SpeculativeDecoderOnlyOutput
    return output_class(
        sequences=input_ids, scores=scores, logits=raw_logits, past_key_values=cache, speculative_stats=stats
    )


def _context(model, input_ids, logits_processor, generation_config, model_kwargs, inputs_tensor) -> DraftContext:
    return DraftContext(
        target=model,
        input_ids=input_ids,
        logits_processor=logits_processor,
        generation_config=generation_config,
        vocab_size=logits_width(model),
        model_kwargs=model_kwargs,
        inputs_tensor=inputs_tensor,
    )


def _decode_one(
    model: "PreTrainedModel",
    input_ids: torch.LongTensor,  # [1, prompt_len]
    *,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    drafter: Drafter,
    options: SpeculativeOptions,
    policy,
    stats: SpeculativeStats,
    streamer: "BaseStreamer | None" = None,
    **model_kwargs,
):
    """The loop for one sequence; `drafter` is already reset for it. Returns (sequences, scores, logits)."""
    cache = model_kwargs["past_key_values"]
    cache.activate_past_recording()
    vocab_size = logits_width(model)
    do_sample = bool(generation_config.do_sample)
    return_dict = bool(generation_config.return_dict_in_generate)
    output_scores = return_dict and bool(generation_config.output_scores)
    output_logits = return_dict and bool(generation_config.output_logits)
    scores = () if output_scores else None
    raw_logits = () if output_logits else None
    is_encoder_decoder = model.config.is_encoder_decoder
    max_length = generation_config.max_length
    first_round = True
    finished = False

    while not finished:
        cur_len = input_ids.shape[1]
        chosen_gamma = policy.next_gamma()
        # never emit past max_length: a round emits at most gamma + 1 tokens
        gamma = max(0, min(chosen_gamma, max_length - cur_len - 1))

        # 1. draft
        draft_start = time.perf_counter()
        proposal = drafter.propose(input_ids, gamma)
        draft_tokens = checked_tokens(proposal, drafter, input_ids, gamma, vocab_size)  # [1, k]
        num_drafted = draft_tokens.shape[1]
        verify_start = time.perf_counter()

        # 2. one target forward over the uncached tail and the drafts
        candidate_ids = torch.cat([input_ids, draft_tokens], dim=-1)  # [1, cur_len + k]
        forward_kwargs = model_kwargs
        if num_drafted:
            forward_kwargs = model._update_model_kwargs_for_generation(
                {}, dict(model_kwargs), is_encoder_decoder=is_encoder_decoder, num_new_tokens=num_drafted
            )
        new_logits = target_logits(model, candidate_ids, num_drafted, forward_kwargs, first_round)  # [1, k + 1, V]
        new_scores = new_logits
        if len(logits_processor):
            new_scores = new_logits.clone()
            for i in range(num_drafted + 1):
                new_scores[:, i] = logits_processor(candidate_ids[:, : cur_len + i], new_scores[:, i])

        # 3. verify (Algorithm 1)
        accepted, next_tokens, betas = verify(do_sample, draft_tokens, proposal.probs, new_scores, options)
        num_accepted = int(accepted[0])
        stats.record_round(chosen_gamma, num_drafted, num_accepted,
                           betas[0, : min(num_accepted + 1, num_drafted)].tolist())

        # 4. append token by token through the stopping criteria: any criterion (custom ones too) may fire in the
        # middle of an accepted block, and plain generate checks after every token
        new_tokens = torch.cat([draft_tokens[:, :num_accepted], next_tokens[:, None]], dim=-1)  # [1, n + 1]
        round_ids = torch.cat([input_ids, new_tokens], dim=-1)
        emitted = 0
        while emitted < num_accepted + 1 and not finished:
            if output_scores:
                scores += (new_scores[:, emitted],)
            if output_logits:
                raw_logits += (new_logits[:, emitted],)
            emitted += 1
            finished = bool(stopping_criteria(round_ids[:, : cur_len + emitted], scores).any())
        input_ids = round_ids[:, : cur_len + emitted]
        stats.emitted_tokens += emitted
        if streamer is not None:
            for token in new_tokens[:, :emitted].cpu().unbind(dim=1):
                streamer.put(token)

        # 5. roll back: the cache keeps everything but the newest token (crop(0) still trims sliding windows)
        cache.crop(-(cache.get_seq_length() - (input_ids.shape[1] - 1)))
        model_kwargs = model._update_model_kwargs_for_generation(
            {}, model_kwargs, is_encoder_decoder=is_encoder_decoder, num_new_tokens=emitted
        )
        drafter.on_verified(input_ids, accepted)
        verify_end = time.perf_counter()
        stats.draft_time_s += verify_start - draft_start
        stats.verify_time_s += verify_end - verify_start
        policy.observe(drafted=num_drafted, accepted=num_accepted, draft_time_s=verify_start - draft_start,
                       verify_time_s=verify_end - verify_start, first_round=first_round)
        first_round = False
    return input_ids, scores, raw_logits


def target_logits(model, candidate_ids, num_drafted: int, model_kwargs, first_round: bool) -> torch.FloatTensor:
    """One target forward over the uncached tail of `candidate_ids`; float32 logits of the last k + 1 positions."""
    cache = model_kwargs["past_key_values"]
    model_inputs = model.prepare_inputs_for_generation(
        candidate_ids,
        next_sequence_length=candidate_ids.shape[1] - cache.get_seq_length(),
        is_first_iteration=first_round,
        **model_kwargs,
    )
    if "logits_to_keep" in model_inputs:
        model_inputs["logits_to_keep"] = num_drafted + 1
    outputs = model(**model_inputs, return_dict=True)
    return outputs.logits[:, -num_drafted - 1 :].to(  # [batch, k + 1, vocab]
        dtype=torch.float32, device=candidate_ids.device, copy=True
    )


def verify(do_sample: bool, draft_tokens, draft_probs, target_scores, options: SpeculativeOptions):
    """Algorithm 1 on standardized scores `[batch, k + 1, vocab]`: (accepted [batch], next token [batch], betas)."""
    num_drafted = draft_tokens.shape[1]
    if do_sample:
        target_probs = target_scores.softmax(dim=-1)  # [batch, k + 1, vocab]
        accepted, next_tokens = verify_sampling(
            draft_tokens, draft_probs, target_probs, lenience=options.speculative_lenience
        )
        betas = draft_target_overlap(draft_tokens, draft_probs, target_probs)  # [batch, k]
    else:
        accepted, next_tokens = verify_greedy(draft_tokens, target_scores, lenience=options.speculative_lenience)
        betas = (draft_tokens == target_scores[:, :num_drafted].argmax(dim=-1)).float()  # [batch, k]
    return accepted, next_tokens, betas


def _check_supported(model, input_ids, generation_config, model_kwargs, streamer) -> None:
    """One capability check, before any forward: everything speculation cannot honour fails here, clearly."""
    if generation_config.num_beams > 1:
        raise ValueError(
            f"`num_beams` > 1 cannot be combined with a drafter, got num_beams={generation_config.num_beams}. "
            "Speculative beam search is not supported yet: use `num_beams=1`, or drop `assistant_model`/`drafter` "
            "for plain beam search."
        )
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
    if cache is None:
        raise ValueError(
            f"{type(model).__name__} generates without a `Cache` object, so rejected drafts cannot be rolled back. "
            "Speculative decoding needs a model that supports `DynamicCache`."
        )
    if not getattr(cache, "is_croppable", False):
        raise ValueError(
            f"The target's cache ({type(cache).__name__}, cache_implementation="
            f"{generation_config.cache_implementation!r}) cannot be rolled back. Static, quantized and linear-attention "
            "caches are not supported with a drafter; use the default dynamic cache (`cache_implementation=None`)."
        )


def checked_tokens(
    proposal: DraftProposal, drafter: Drafter, input_ids: torch.LongTensor, gamma: int, vocab_size: int
) -> torch.LongTensor:
    """Validates a proposal at the boundary, so a faulty drafter fails here rather than deep inside torch."""
    tokens = proposal.tokens
    name = type(drafter).__name__
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[0] != input_ids.shape[0]:
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"{name}.propose must return tokens of shape [batch={input_ids.shape[0]}, k], got {shape}.")
    if tokens.shape[1] > gamma:
        raise ValueError(f"{name}.propose returned {tokens.shape[1]} tokens, more than the {gamma} asked for.")
    if tokens.shape[1] and bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        raise ValueError(
            f"{name}.propose returned token ids outside the target's vocabulary [0, {vocab_size}): "
            f"{tokens.tolist()}. Build the drafter for the target's tokenizer."
        )
    if proposal.probs is not None and tuple(proposal.probs.shape) != (*tokens.shape, vocab_size):
        raise ValueError(
            f"{name}.propose returned probs of shape {tuple(proposal.probs.shape)}, expected "
            f"{(*tokens.shape, vocab_size)} ([batch, k, vocab]) or None."
        )
    return tokens.to(device=input_ids.device, dtype=torch.long)
