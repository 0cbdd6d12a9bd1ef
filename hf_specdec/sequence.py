"""The speculative loop for one sequence (batches: `batching.py`), in chains or token trees.

Each round (see `rounds.py` for the shared stages):

1. the drafter proposes up to γ tokens, or a tree of at most `speculative_tree_budget` nodes and depth γ;
2. the target runs one forward over its uncached tail plus the drafts (a tree with its 4D mask and depth-based
   positions) and standardizes the distributions with its own logits processors, each with its exact prefix;
3. `hf_specdec.sampling` decides which drafts are accepted and draws the recovered or bonus token;
4. the new tokens are appended one at a time through the stopping criteria (EOS, max length, stop strings, custom
   criteria, max time), so the output stops exactly where plain `generate` would;
5. the target's cache keeps the accepted drafts (a crop for a chain, a compaction for a tree; a static cache moves
   its write position back in place) and the drafter is told what was kept (with the target's hidden states of the
   kept positions, for a drafter that reads them: `Drafter.target_hidden_layers`).

Invariant between rounds: the target cache holds every token of `input_ids` but the last.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from .caches import CACHE_KWARG, cached_length, static_capacity
from .configuration import SpeculativeOptions
from .devices import seconds_agreement
from .drafters.base import Drafter, DraftProposal
from .modeling import logits_width
from .rounds import (
    TargetForward,
    capture_for,
    checked_proposal,
    compiled_graphs,
    first_draft_acceptance,
    first_stops,
    layout_for,
    per_token_prefix,
    read_verdict,
    standardize,
    target_logits,
)
from .stats import SpeculativeStats

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.generation.streamers import BaseStreamer

__all__ = ["decode_sequence"]


def decode_sequence(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,  # [1, prompt_len]
    *,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    drafter: Drafter,
    options: SpeculativeOptions,
    policy,
    stats: SpeculativeStats,
    streamer: BaseStreamer | None = None,
    continuing: bool = False,
    **model_kwargs,
):
    """The loop for one sequence; `drafter` is already reset for it. Returns (sequences, scores, logits).
    `continuing`: the cache already holds all of `input_ids` but the newest token (a row that goes on growing after
    it stopped), so no forward of this call carries a prompt."""
    cache = model_kwargs[CACHE_KWARG]
    cache.activate_past_recording()
    vocab_size = logits_width(model)
    tree_budget = options.speculative_tree_budget
    do_sample = bool(generation_config.do_sample)
    return_dict = bool(generation_config.return_dict_in_generate)
    output_scores = return_dict and bool(generation_config.output_scores)
    output_logits = return_dict and bool(generation_config.output_logits)
    scores = () if output_scores else None
    raw_logits = () if output_logits else None
    is_encoder_decoder = model.config.is_encoder_decoder
    max_length = generation_config.max_length
    first_round = not continuing
    finished = False
    # an encoder-decoder's decoder prompt is a token or a few: the encoder's inputs are not chunked by generate
    chunked_prefill = generation_config.prefill_chunk_size is not None and not is_encoder_decoder

    # a drafter that reads the target's hidden states gets those of the positions each round keeps
    capacity = static_capacity(cache)  # None: the cache grows
    capture = capture_for(model, drafter)
    # compiled where plain generate compiles (a static cache), in a few padded shapes
    forward = TargetForward.for_call(
        model,
        generation_config,
        model_kwargs,
        1 + (tree_budget if tree_budget is not None else policy.max_gamma),
        reads_hidden_states=capture is not None,
    )
    policy.shadow_drafts = True  # this loop can take a plain step with a one-token guess beside it
    policy.trees = tree_budget is not None
    agree = seconds_agreement(model)  # a tensor-parallel target's processes decide from the same seconds
    try:
        while not finished:
            cur_len = input_ids.shape[1]
            chosen_gamma = policy.next_gamma()
            # never emit past max_length: a round emits at most gamma + 1 tokens
            gamma = max(0, min(chosen_gamma, max_length - cur_len - 1))

            # 1. draft
            draft_start = time.perf_counter()
            graphs = compiled_graphs()
            guess = None
            if chosen_gamma == 0 and policy.shadow_draft_wanted:
                # a shadow draft: a plain step with a one-token guess beside it, never verified or emitted; the
                # policy learns whether the drafter would have been right at the cost of the guess alone (the
                # drafter sees a round whose draft was rejected)
                guess, guess_check = checked_proposal(
                    drafter.propose(input_ids, 1), drafter, input_ids, 1, vocab_size, tree_budget
                )
                guess_check.read()
                proposal, check = checked_proposal(
                    DraftProposal.empty(1, input_ids.device), drafter, input_ids, 0, vocab_size
                )
            else:
                proposal, check = checked_proposal(
                    drafter.propose(input_ids, gamma), drafter, input_ids, gamma, vocab_size, tree_budget
                )
            room = capacity - cur_len if capacity is not None else None
            if room is not None and proposal.tokens.shape[1] > room:
                # a static cache holds max_length - 1 positions: a tree's last nodes may not fit. Its first `room`
                # nodes are a tree of their own (parents come first), drafted as before: still exact
                proposal = DraftProposal(
                    *(
                        None if part is None else part[:, :room]
                        for part in (proposal.tokens, proposal.probs, proposal.parents)
                    )
                )
            layout = layout_for(proposal, check, gamma)
            num_drafted = proposal.tokens.shape[1]
            stats.drafter_compilations += compiled_graphs() - graphs
            verify_start = time.perf_counter()

            # 2. one target forward over the uncached tail and the drafts
            context_mask = model_kwargs.get("attention_mask")  # [1, cur_len] or None
            # after the first round the invariant gives the cache's length without reading it (a device sync for
            # a static cache on an accelerator)
            cached = cached_length(cache) if first_round else cur_len - 1
            prefilled = False
            if (layout.prefills_context or chunked_prefill) and cur_len - cached > 1:
                # the prompt is prefilled apart (a tree: with the model's own causal mask; `prefill_chunk_size`: in
                # chunks, as plain generate's `_prefill`); the round's forward then carries the newest token and the
                # drafts only, a decode step (per-token inputs, such as the mask and the positions generate
                # prepared, lose their last column too)
                prefill_kwargs = per_token_prefix(model_kwargs, cur_len, cur_len - 1)
                if chunked_prefill:
                    model._prefill(input_ids[:, :-1], generation_config, prefill_kwargs, is_first_iteration=first_round)
                else:
                    target_logits(model, input_ids[:, :-1], 0, prefill_kwargs, first_round)
                cached, prefilled = cur_len - 1, True
            candidate_ids = torch.cat([input_ids, proposal.tokens], dim=-1)  # [1, cur_len + k]
            forward_kwargs = model_kwargs
            if num_drafted:
                forward_kwargs = model._update_model_kwargs_for_generation(
                    {}, dict(model_kwargs), is_encoder_decoder=is_encoder_decoder, num_new_tokens=num_drafted
                )
            overrides = layout.forward_overrides(cached, cur_len, model.dtype, context_mask, capacity)
            new_logits = target_logits(
                model, candidate_ids, num_drafted, forward_kwargs, first_round and not prefilled, overrides, forward
            )  # [1, k + 1, V]
            new_scores = new_logits
            if len(logits_processor):
                new_scores = standardize(
                    new_logits,
                    lambda row: logits_processor,
                    lambda row, j: layout.prefix(candidate_ids, cur_len, j),
                    check_stateless=first_round,
                )

            # 3. verify (Algorithm 1, or multi-candidate rejection along a tree); the round's first host read
            verdict = read_verdict(layout.verify(do_sample, new_scores, options), check)
            num_accepted = verdict.accepted_counts[0]
            stats.record_round(
                chosen_gamma,
                num_drafted,
                num_accepted,
                verdict.beta_values[0][: num_accepted + 1],
                depth=verdict.depth,
            )

            # 4. append through the stopping criteria, checked after every token as plain generate checks them (any
            # criterion, custom ones too, may fire in the middle of an accepted block): the round's second read
            new_tokens = layout.accepted_tokens(verdict)  # [1, n + 1]
            positions = layout.emitted_positions(verdict) if output_scores or output_logits else None
            round_ids = torch.cat([input_ids, new_tokens], dim=-1)
            new_round_scores = tuple(new_scores[:, position] for position in positions) if output_scores else ()
            (stop,) = first_stops(
                stopping_criteria,
                [(round_ids, cur_len, num_accepted + 1)],
                (lambda e: scores + new_round_scores[:e]) if output_scores else None,
            )
            emitted, finished = (num_accepted + 1, False) if stop is None else (stop, True)
            if output_scores:
                scores += new_round_scores[:emitted]
            if output_logits:
                raw_logits += tuple(new_logits[:, position] for position in positions[:emitted])
            input_ids = round_ids[:, : cur_len + emitted]
            stats.emitted_tokens += emitted
            if streamer is not None:
                for token in new_tokens[:, :emitted].cpu().unbind(dim=1):
                    streamer.put(token)

            # 5. the cache keeps everything but the newest token (a crop still trims sliding windows)
            layout.keep_accepted(cache, cur_len, verdict, emitted - 1)
            model_kwargs = model._update_model_kwargs_for_generation(
                {}, model_kwargs, is_encoder_decoder=is_encoder_decoder, num_new_tokens=emitted
            )
            extra = {}
            if capture is not None:
                extra["target_hidden_states"] = layout.kept_hidden_states(capture.take(), verdict, emitted - 1)
            graphs = compiled_graphs()
            layout.tell_drafter(drafter, input_ids, verdict, **extra)
            stats.drafter_compilations += compiled_graphs() - graphs
            if guess is not None:
                policy.observe_shadow(
                    first_draft_acceptance(
                        guess, new_scores[0, 0], int(new_tokens[0, 0]), do_sample, options.speculative_lenience
                    )
                )
            draft_s, verify_s = agree(verify_start - draft_start, time.perf_counter() - verify_start)
            stats.draft_time_s += draft_s
            stats.verify_time_s += verify_s
            policy.observe(
                drafted=verdict.depth,
                accepted=num_accepted,
                draft_time_s=draft_s,
                verify_time_s=verify_s,
                first_round=first_round,
            )
            first_round = False
    finally:
        if capture is not None:
            capture.close()
        stats.target_compilations += forward.compilations
        stats.compiled_rounds += forward.compiled_rounds
    return input_ids, scores, raw_logits
