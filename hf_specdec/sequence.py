"""The speculative loop for one sequence (batches: `batching.py`), in chains or token trees.

Each round (`rounds.Round` runs the stages; `SequenceLane` is this loop's side of them):

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

from typing import TYPE_CHECKING

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from .caches import CACHE_KWARG, cached_length, record_past, static_capacity
from .capture import capture_for
from .configuration import SpeculativeOptions
from .drafters.base import Drafter, DraftProposal
from .forward import TargetForward, per_token_prefix, standardize, target_logits
from .layouts import layout_for
from .modeling import logits_width
from .proposals import checked_proposal
from .recurrent import (
    RecurrentCheckpoints,
    finish_recording,
    held_positions,
    is_recording,
    rolls_back_from_checkpoints,
)
from .rounds import Draft, Lane, Round, Scores
from .stats import SpeculativeStats
from .verdicts import Verdict, first_draft_acceptance, first_stops

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.generation.streamers import BaseStreamer

__all__ = ["SequenceLane", "decode_sequence"]

# after a recurrent cache's rollback, kept tokens up to this many are fed again in the next round's forward, before
# its drafts (no forward of their own); a longer tail is fed in a forward of its own first
FOLDED_TAIL = 8


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
    lane = SequenceLane(
        model,
        input_ids,
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        generation_config=generation_config,
        drafter=drafter,
        options=options,
        policy=policy,
        stats=stats,
        streamer=streamer,
        continuing=continuing,
        model_kwargs=model_kwargs,
    )
    round_ = Round(model, policy, stats)
    try:
        while not round_.run(lane):
            pass
    finally:
        lane.close()
    return lane.input_ids, lane.scores, lane.raw_logits


class SequenceLane(Lane):
    """One sequence's side of a round: its drafts a chain or a tree, its cache dynamic or static."""

    def __init__(
        self,
        model,
        input_ids,
        *,
        logits_processor,
        stopping_criteria,
        generation_config,
        drafter,
        options,
        policy,
        stats,
        streamer,
        continuing,
        model_kwargs,
    ):
        super().__init__(generation_config, options)
        self.model, self.input_ids, self.drafter, self.stats, self.streamer = model, input_ids, drafter, stats, streamer
        self.logits_processor, self.stopping_criteria = logits_processor, stopping_criteria
        self.generation_config, self.model_kwargs = generation_config, model_kwargs
        self.cache = model_kwargs[CACHE_KWARG]
        # recorded while decoding (what a rollback restores), and no longer once done, unless the caller's was
        self.was_recording = is_recording(self.cache)
        record_past(self.cache)
        # the positions the cache holds, counted on the host after the first round (None: read it then)
        self.cached = None if not continuing else input_ids.shape[1] - 1
        self.carried = 0  # kept tokens the current round's forward carries again (see `score`)
        # a recurrent (linear-attention / SSM) cache goes back to the checkpoint taken before a round's forward when
        # the round rejected drafts; the tokens it kept are fed again before the next round's drafts
        # (a cache passed in holding an earlier call's positions is counted by its attention layers)
        self.recurrent = (
            RecurrentCheckpoints(
                self.cache, held_positions(self.cache) if self.cached is None else self.cached, model=model
            )
            if rolls_back_from_checkpoints(model, self.cache)
            else None
        )
        self.hidden_given = 0 if self.cached is None else self.cached  # positions the drafter has hidden states of
        self.vocab_size, self.dtype = logits_width(model), model.dtype
        self.tree_budget = options.speculative_tree_budget
        return_dict = bool(generation_config.return_dict_in_generate)
        self.output_scores = return_dict and bool(generation_config.output_scores)
        self.output_logits = return_dict and bool(generation_config.output_logits)
        self.scores = () if self.output_scores else None
        self.raw_logits = () if self.output_logits else None
        self.is_encoder_decoder = model.config.is_encoder_decoder
        self.max_length = generation_config.max_length
        self.first_round = not continuing
        # an encoder-decoder's decoder prompt is a token or a few: the encoder's inputs are not chunked by generate
        self.chunked_prefill = generation_config.prefill_chunk_size is not None and not self.is_encoder_decoder
        self.capacity = static_capacity(self.cache)  # None: the cache grows
        # compiled where plain generate compiles (a static cache), in a few padded shapes
        self.forward = TargetForward.for_call(
            model,
            generation_config,
            model_kwargs,
            1 + (self.tree_budget if self.tree_budget is not None else policy.max_gamma),
            reads_hidden_states=getattr(drafter, "target_hidden_layers", None) is not None,
        )
        # a drafter that reads the target's hidden states gets those of the positions each round keeps (hooks on
        # the target's layers, set last: `close` removes them)
        self.capture = capture_for(model, drafter)
        policy.shadow_drafts = True  # this loop can take a plain step with a one-token guess beside it
        policy.trees = self.tree_budget is not None
        policy.one_token_kernels = self.recurrent is not None
        self.policy = policy

    def close(self) -> None:
        if self.recurrent is not None and self.finished and self.cached < self.input_ids.shape[1] - 1:
            # a recurrent cache rolled back in the last round: it is brought back to holding every token but the
            # newest, as plain generate leaves it (a returned cache, a row that goes on growing)
            self._feed_tail()
        if self.was_recording:  # as the caller's was (the rounds stop it on linear-attention layers)
            record_past(self.cache)
        elif is_recording(self.cache):
            finish_recording(self.cache)
        if self.capture is not None:
            self.capture.close()
        self.stats.target_compilations += self.forward.compilations
        self.stats.compiled_rounds += self.forward.compiled_rounds

    def room(self, gamma: int) -> int:
        if self.first_round and self.recurrent is not None and self.input_ids.shape[1] - self.recurrent.length == 2:
            # a prompt of two: fed whole in a plain step (the first token alone would be a one-token forward, which
            # transformers gives no padding mask, and it may be padding)
            return 0
        return max(0, min(gamma, self.max_length - self.input_ids.shape[1] - 1))

    def draft(self, gamma: int, chosen_gamma: int) -> Draft:
        drafter, input_ids, tree_budget = self.drafter, self.input_ids, self.tree_budget
        guess = None
        if chosen_gamma == 0 and self.policy.shadow_draft_wanted:
            # a shadow draft: a plain step with a one-token guess beside it, never verified or emitted; the policy
            # learns whether the drafter would have been right at the cost of the guess alone (the drafter sees a
            # round whose draft was rejected)
            guess, guess_check = checked_proposal(
                drafter.propose(input_ids, 1), drafter, input_ids, 1, self.vocab_size, tree_budget
            )
            guess_check.read()
            proposal, check = checked_proposal(
                DraftProposal.empty(1, input_ids.device), drafter, input_ids, 0, self.vocab_size
            )
        else:
            proposal, check = checked_proposal(
                drafter.propose(input_ids, gamma), drafter, input_ids, gamma, self.vocab_size, tree_budget
            )
        room = self.capacity - input_ids.shape[1] if self.capacity is not None else None
        if room is not None and proposal.tokens.shape[1] > room:
            # a static cache holds max_length - 1 positions: a tree's last nodes may not fit. Its first `room` nodes
            # are a tree of their own (parents come first), drafted as before: still exact
            proposal = DraftProposal(
                *(
                    None if part is None else part[:, :room]
                    for part in (proposal.tokens, proposal.probs, proposal.parents)
                )
            )
        return Draft(proposal, check, layout_for(proposal, check, gamma), chosen_gamma, guess)

    def score(self, draft: Draft) -> Scores:
        model, input_ids, layout = self.model, self.input_ids, draft.layout
        cur_len, num_drafted = input_ids.shape[1], draft.proposal.tokens.shape[1]
        context_mask = self.model_kwargs.get("attention_mask")  # [1, cur_len] or None
        # after the first round the length is counted on the host (a read would be a device sync for a static
        # cache on an accelerator)
        if self.cached is None:
            self.cached = self.recurrent.length if self.recurrent is not None else cached_length(self.cache)
        cached = self.round_start = self.cached
        # kept tokens fed again after the round before rolled a recurrent cache back (the policy's plain steps that
        # carry some are no plain steps)
        self.carried = 0 if self.first_round else max(0, cur_len - cached - 1)
        prefilled = False
        # a recurrent cache rolls back to a checkpoint taken before the round's forward: the prompt, and a tail of
        # kept tokens longer than `FOLDED_TAIL`, go in a forward of their own first, so that the checkpoint comes
        # after them
        tail_apart = self.recurrent is not None and cur_len - cached > (2 if self.first_round else FOLDED_TAIL)
        if (layout.prefills_context or self.chunked_prefill or tail_apart) and cur_len - cached > 1:
            # the prompt is prefilled apart (a tree: with the model's own causal mask; `prefill_chunk_size`: in
            # chunks, as plain generate's `_prefill`); the round's forward then carries the newest token and the
            # drafts only, a decode step (per-token inputs, such as the mask and the positions generate prepared,
            # lose their last column too)
            prefill_kwargs = per_token_prefix(self.model_kwargs, cur_len, cur_len - 1)
            if self.chunked_prefill and self.first_round:
                model._prefill(
                    input_ids[:, :-1], self.generation_config, prefill_kwargs, is_first_iteration=self.first_round
                )
                if self.recurrent is not None:
                    self.recurrent.fed(cur_len - 1 - cached)
                self.cached = cur_len - 1
            else:
                self._feed_tail()
            cached, prefilled = cur_len - 1, True
        if self.recurrent is not None and num_drafted:  # without drafts every position fed is kept
            self.recurrent.save()
        candidate_ids = torch.cat([input_ids, draft.proposal.tokens], dim=-1)  # [1, cur_len + k]
        forward_kwargs = self.model_kwargs
        if num_drafted:
            forward_kwargs = model._update_model_kwargs_for_generation(
                {}, dict(self.model_kwargs), is_encoder_decoder=self.is_encoder_decoder, num_new_tokens=num_drafted
            )
        overrides = layout.forward_overrides(cached, cur_len, self.dtype, context_mask, self.capacity)
        logits = target_logits(
            model,
            candidate_ids,
            num_drafted,
            forward_kwargs,
            self.first_round and not prefilled,
            overrides,
            self.forward,
            cached=cached,
        )  # [1, k + 1, V]
        if self.recurrent is not None:
            self.recurrent.fed(candidate_ids.shape[1] - cached)
        scores = logits
        if len(self.logits_processor):
            scores = standardize(
                logits,
                lambda row: self.logits_processor,
                lambda row, j: layout.prefix(candidate_ids, cur_len, j),
                check_stateless=self.first_round,
            )
        return Scores(logits, scores, candidate_ids)

    def _feed_tail(self) -> None:
        """One forward over the uncached tokens of `input_ids` but the newest (the per-token inputs cut with them):
        the cache then holds every token but the newest."""
        cur_len = self.input_ids.shape[1]
        kwargs = per_token_prefix(self.model_kwargs, cur_len, cur_len - 1)
        target_logits(self.model, self.input_ids[:, :-1], 0, kwargs, self.first_round, cached=self.cached)
        if self.recurrent is not None:
            self.recurrent.fed(cur_len - 1 - self.cached)
        self.cached = cur_len - 1

    def emit(self, draft: Draft, verdict: Verdict, scores: Scores) -> None:
        layout, input_ids = draft.layout, self.input_ids
        cur_len, num_accepted = input_ids.shape[1], verdict.accepted_counts[0]
        self.stats.record_round(
            draft.chosen_gamma,
            draft.proposal.tokens.shape[1],
            num_accepted,
            verdict.beta_values[0][: num_accepted + 1],
            depth=verdict.depth,
        )
        # through the stopping criteria, checked after every token as plain generate checks them (any criterion,
        # custom ones too, may fire in the middle of an accepted block): the round's second read
        new_tokens = layout.accepted_tokens(verdict)  # [1, n + 1]
        positions = layout.emitted_positions(verdict) if self.output_scores or self.output_logits else None
        round_ids = torch.cat([input_ids, new_tokens], dim=-1)
        round_scores = tuple(scores.scores[:, p] for p in positions) if self.output_scores else ()
        (stop,) = first_stops(
            self.stopping_criteria,
            [(round_ids, cur_len, num_accepted + 1)],
            (lambda e: self.scores + round_scores[:e]) if self.output_scores else None,
        )
        emitted, self.finished = (num_accepted + 1, False) if stop is None else (stop, True)
        if self.output_scores:
            self.scores += round_scores[:emitted]
        if self.output_logits:
            self.raw_logits += tuple(scores.logits[:, p] for p in positions[:emitted])
        self.input_ids = round_ids[:, : cur_len + emitted]
        self.emitted = emitted
        if draft.guess is not None:  # what the shadow draft's guess is judged against
            self.root = (scores.scores[0, 0], new_tokens[0, 0])
        self.stats.emitted_tokens += emitted
        if self.streamer is not None:
            for token in new_tokens[:, :emitted].cpu().unbind(dim=1):
                self.streamer.put(token)

    def keep(self, draft: Draft, verdict: Verdict, scores: Scores) -> None:
        # the cache keeps everything but the newest token (a crop still trims sliding windows)
        kept = self.emitted - 1
        context_length = self.input_ids.shape[1] - self.emitted
        if self.recurrent is not None:  # a chain: kept everything it fed, or back to the round's checkpoint
            self.cached = self.recurrent.rewind(context_length + kept)
        else:
            draft.layout.keep_accepted(self.cache, context_length, verdict, kept)
            self.cached = context_length + kept
        self.model_kwargs = self.model._update_model_kwargs_for_generation(
            {}, self.model_kwargs, is_encoder_decoder=self.is_encoder_decoder, num_new_tokens=self.emitted
        )
        extra = {}
        if self.capture is not None:
            # the forwards' positions start at the round's first uncached one; those the drafter was given before
            # (tokens fed again after a recurrent cache's rollback) are not given twice
            states = self.capture.take()[:, self.hidden_given - self.round_start :]
            extra["target_hidden_states"] = draft.layout.kept_hidden_states(states, verdict, kept)
            self.hidden_given = context_length + kept
        draft.layout.tell_drafter(self.drafter, self.input_ids, verdict, **extra)

    def observe(self, policy, draft: Draft, verdict: Verdict, draft_s: float, verify_s: float) -> None:
        if draft.guess is not None:
            policy.observe_shadow(
                first_draft_acceptance(
                    draft.guess,
                    self.root[0],
                    int(self.root[1]),
                    self.do_sample,
                    self.options.speculative_lenience,
                )
            )
        policy.carried_tokens = self.carried
        super().observe(policy, draft, verdict, draft_s, verify_s)
