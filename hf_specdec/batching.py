"""Speculative decoding for a batch of several sequences (left-padded prompts, `num_return_sequences`).

Each row accepts its own number of drafts each round. Three layouts, chosen by one capability check:

**Padded batch (decoder-only targets with a dynamic cache of full or sliding-window attention, and `position_ids`).**
Rows stay in one left-padded rectangle whose rows all *end* in the same column, which is exactly the layout plain
batched `generate` uses. Each round every row drafts (up to) γ tokens, the target verifies all rows in one forward of
γ + 1 tokens per row, and each row emits its own number e_r of tokens. The rectangle then grows by max_r e_r columns
and every row with fewer new tokens is moved right by the difference (more left padding), in the token ids, the
attention mask and the target's key/value cache (`realign_cache`: one gather per layer when rows moved by different
amounts, a slice when they all moved alike). Positions come from the attention mask (cumulative sum), as in plain
generation, and rotary keys are stored already rotated, so moving a row does not change what it computes. A
sliding-window layer keeps the last columns of its window: its cache records its past
(`Cache.activate_past_recording`), so a verify forward leaves the window's older columns in place until the
realignment moves each row and trims the layer, and a row's tokens stay contiguous and end with the rectangle, so its
window covers the tokens plain generate's does.
Columns that are padding in every row are dropped, and rows that finish (EOS, stop strings, max length) leave the
batch at once, so they stop costing compute.
Costs: one gather of the cache per uneven round (about one extra read of the cache, small next to the forward);
attention runs over the longest row, so a row that accepts less carries more padding; a draft position is computed
for every row, so a row whose drafter proposed fewer tokens fills the gap with rejected filler.

**Padded batch in lockstep (hybrid models: a stateful model's recurrent layers in a dynamic cache, beside attention
layers that take `position_ids`).** A recurrent state summarizes a row's tokens whatever their columns, and a padded
column inside a row would move it, so no row may be realigned by a different amount: every row keeps as many drafts
as the row that accepted fewest (m), a row that accepted more emitting its (m + 1)-th accepted draft as its next
token (`_lockstep`). Rows then still end together, and the recurrent state is rolled back for all rows at once
(`recurrent.RecurrentCheckpoints`: a checkpoint before each verify forward, restored after a round that kept fewer
positions than it fed; the kept tokens are fed again before the next round's drafts, in its one forward; the prompt
is prefilled in a forward of its own first). Exact: a row emits a prefix of the tokens it accepted, cut where the
other rows decide (for sampling, a prefix of a sequence distributed as the target's, whose continuation the next
rounds sample again). Cost: a round keeps the batch's fewest accepted drafts. Drafters run one copy per row (a
stateful draft model rolls back its own state); drafters that read the target's hidden states run one row at a time.

**One row at a time (encoder-decoder targets, static caches, state-space models without `position_ids`,
`prefill_chunk_size`, drafters that read the target's own cache or, on a hybrid, its hidden states).** Their decoders
derive positions from cache slots, which left padding would shift (a static cache's preallocated rows cannot be
realigned without copies either), so each row runs the single-sequence loop with its own cache, sharing the batch's
encoder outputs. Exact, but without the batching speedup.

In every layout each row is token for token what plain batched `generate` returns for it (greedy), and each row's
distribution is the target's (sampling): the logits processors see each row's own prefix exactly as plain
`generate` lays it out (its original left padding, then its tokens).

Drafters that set `supports_padded_batches` (`ModelDrafter`) draft for the whole rectangle in one forward per
token; every other drafter gets a copy per row, called with that row's unpadded tokens, exactly as at batch size 1.
A copy that reads the target's hidden states (MTP layers, EAGLE heads, DFlash blocks) gets its own row's, cut from
the batch's one verify forward (its left padding and rejected drafts left out), as the one-sequence loop gives them.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from .batch_rows import decode_rows, padded_batch_processors, processors_for_row, row_context
from .caches import CACHE_KWARG, realign_cache, slice_cache
from .capture import capture_for
from .devices import to_device
from .drafters.base import Drafter, DraftProposal
from .forward import standardize, target_logits
from .layouts import ChainLayout
from .modeling import logits_width
from .proposals import ProposalCheck, checked_proposal, draft_context
from .recurrent import RecurrentCheckpoints, held_positions, is_recurrent, rolls_back_from_checkpoints, snapshot_layers
from .rounds import Draft, Lane, Round, Scores
from .stats import SpeculativeStats
from .verdicts import Verdict, first_stops

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["PaddedBatchLane", "decode_batch"]


def decode_batch(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    model_kwargs: dict,
    *,
    drafter: Drafter,
    inputs_tensor=None,
    **run,
):
    """Decodes a batch `[batch, prompt_len]` (`run`: the loop's processors, criteria, config, options, policy and
    stats); returns the sequences. The target's cache is not returned: rows realigned or left the batch, or each row
    had a cache of its own, so no cache holds the returned rows as plain generate's does."""
    cache = model_kwargs[CACHE_KWARG]
    # a drafter that reads the target's own cache (each row's is its own there), one that would read a padded batch's
    # hidden states whole, and `prefill_chunk_size` (each row's prompt prefilled in chunks): rows one at a time
    recurrent = _rolls_back_rows(model, cache)
    if (
        _supports_padded_batch(model, cache, recurrent)
        and not drafter.reads_target_cache
        and not (drafter.reads_target_hidden_states and (drafter.supports_padded_batches or recurrent))
        and run["generation_config"].prefill_chunk_size is None
    ):
        return _decode_padded(model, input_ids, drafter=drafter, inputs_tensor=inputs_tensor, **run, **model_kwargs)
    return decode_rows(model, input_ids, drafter=drafter, inputs_tensor=inputs_tensor, **run, **model_kwargs)


def _supports_padded_batch(model, cache, recurrent: bool = False) -> bool:
    """Left padding leaves positions intact only for decoder-only models that take `position_ids`, and the cache
    can be realigned only when every layer holds per-column state alone (full or sliding-window attention), or
    (`recurrent`: rows in lockstep) recurrent state that `RecurrentCheckpoints` rolls back."""
    return (
        not model.config.is_encoder_decoder
        and isinstance(cache, DynamicCache)
        and all(
            _moves_by_column(layer) or (recurrent and isinstance(layer, LinearAttentionCacheLayerMixin))
            for layer in cache.layers
        )
        and "position_ids" in inspect.signature(model.forward).parameters
    )


def _rolls_back_rows(model, cache) -> bool:
    """Whether a padded batch runs in lockstep (see the module docstring): a stateful model's recurrent layers, rolled
    back from checkpoints, in a cache that holds nothing yet, and no layer of the model's own kept whole
    (DeepSeek-V4's, refused on padded rows)."""
    return (
        rolls_back_from_checkpoints(model, cache)
        and is_recurrent(cache)
        and not snapshot_layers(model, cache)
        and held_positions(cache) == 0
    )


def _moves_by_column(layer) -> bool:
    """Whether everything `layer` holds is per-column state that `realign_cache` moves: keys and values of full or
    sliding-window attention (`DynamicSlidingWindowLayer`, the last columns of its window), and no convolution or
    recurrent state (which summarizes the last tokens of each row, whatever their columns)."""
    if hasattr(layer, "conv_states") or hasattr(layer, "recurrent_states"):
        return False
    return not getattr(layer, "is_sliding", False) or type(layer) is DynamicSlidingWindowLayer


def _decode_padded(model, input_ids, *, drafter, inputs_tensor, policy, stats, **run):
    lane = PaddedBatchLane(model, input_ids, drafter=drafter, inputs_tensor=inputs_tensor, stats=stats, **run)
    policy.one_token_kernels = lane.recurrent is not None
    try:
        round_ = Round(model, policy, stats)
        while not round_.run(lane):
            pass
        return lane.result()
    finally:
        lane.close()


class PaddedBatchLane(Lane):
    """A padded batch's side of a round: every row drafts (one batch drafter, or a copy per row), one forward
    verifies all rows, each row emits its own number of tokens, and the rectangle is realigned so that rows end
    together again (see the module docstring)."""

    def __init__(
        self,
        model,
        input_ids,
        *,
        drafter,
        inputs_tensor,
        logits_processor,
        stopping_criteria,
        generation_config,
        options,
        stats,
        **model_kwargs,
    ):
        super().__init__(generation_config, options)
        self.model, self.stats, self.stopping_criteria = model, stats, stopping_criteria
        self.logits_processor = logits_processor
        self.device = input_ids.device
        batch, self.prompt_len = input_ids.shape
        self.cache = model_kwargs.pop(CACHE_KWARG)
        # a sliding-window layer keeps its window's older columns through a forward, until the realignment trims it
        # (a row that emitted fewer tokens moves right and needs them)
        self.cache.activate_past_recording()
        # recurrent layers: rows in lockstep, rolled back from checkpoints (the positions the cache holds, counted)
        self.recurrent = (
            RecurrentCheckpoints(self.cache, 0, model=model) if _rolls_back_rows(model, self.cache) else None
        )
        model_kwargs.pop("position_ids", None)  # rebuilt from the mask every round
        mask = model_kwargs.pop("attention_mask", None)
        mask = torch.ones_like(input_ids) if mask is None else mask.long()  # [batch, prompt_len]
        if bool((mask[:, 1:] < mask[:, :-1]).any()):
            raise ValueError(
                "Speculative decoding of a batch needs left padding, but the attention mask has padding after text. "
                "Pad on the left (`tokenizer.padding_side = 'left'`), as plain batched generation of decoder-only "
                "models also requires."
            )
        self.model_kwargs = model_kwargs
        self.vocab_size = logits_width(model)
        # like plain generate: rows end early (then padded) only with an EOS criterion; otherwise every row keeps
        # growing until all rows are done
        pad = generation_config._pad_token_tensor
        pad_token_id = None if pad is None else int(pad.reshape(-1)[0])
        self.rows_leave_when_done = pad_token_id is not None and any(
            hasattr(c, "eos_token_id") for c in stopping_criteria
        )
        self.filler = pad_token_id if pad_token_id is not None else 0
        self.text_start = (mask == 0).sum(-1).tolist()  # [batch]: where each row's text starts in its padded prompt
        self.row_processors = [processors_for_row(logits_processor, row, batch) for row in range(batch)]
        draft_processors, self.padding_aware = padded_batch_processors(logits_processor)
        context = draft_context(
            model,
            input_ids,
            draft_processors,
            generation_config,
            {**model_kwargs, "attention_mask": mask},
            inputs_tensor,
        )
        if drafter.supports_padded_batches and self.recurrent is None:
            self.batch_drafter, self.row_drafters = drafter.for_call(context), None
            # a drafter that takes it gets each row's padding on the host (to realign without a read of its own)
            parameters = inspect.signature(self.batch_drafter.on_verified).parameters
            self.host_padding = "padding" in parameters or any(p.kind == p.VAR_KEYWORD for p in parameters.values())
            # and, as rows finish, the kept rows on the host too (to select its own host state without a read)
            parameters = inspect.signature(self.batch_drafter.select_rows).parameters
            self.host_rows = "rows" in parameters or any(p.kind == p.VAR_KEYWORD for p in parameters.values())
        else:
            self.batch_drafter = None
            self.row_drafters = [
                drafter.for_call(row_context(context, row, self.text_start[row], self.row_processors[row]))
                for row in range(batch)
            ]
        # copies that read the target's hidden states get their rows' from the one verify forward (hooks on the
        # target's layers, set last: `close` removes them)
        self.capture = capture_for(model, self.row_drafters[0]) if self.row_drafters is not None else None
        self.batch = batch
        self.prompts = input_ids  # plain generate's view of row r: prompts[r] + generated[r]
        self.generated = [input_ids.new_empty(0) for _ in range(batch)]
        self.rows = list(range(batch))  # original index of each row still in the batch
        self.row_stats = [SpeculativeStats(lenience=stats.lenience) for _ in range(batch)]
        stats.rows.extend(self.row_stats)
        self.done_length: dict[int, int] = {}  # row -> its length when its stopping criteria fired
        # row -> its left padding columns in `ids` (known here, never read back)
        self.padding = dict(enumerate(self.text_start))
        self.ids, self.mask = input_ids, mask
        self.max_length = generation_config.max_length

    def room(self, gamma: int) -> int:
        self.round_rows = list(self.rows)  # rows may leave the batch during the round
        self.lengths = [self.prompt_len + len(self.generated[r]) for r in self.rows]
        if self.first_round and self.recurrent is not None and self.ids.shape[1] == 2:
            return 0  # its first column alone would be a one-token forward: no padding mask from transformers
        return max(0, min(gamma, self.max_length - min(self.lengths) - 1))

    def draft(self, gamma: int, chosen_gamma: int) -> Draft:
        # every row at once, or one copy per row
        if self.batch_drafter is not None:
            for processor in self.padding_aware:
                processor.prompt_ignore_length = (self.mask == 0).sum(-1)  # [rows]
            proposal, check = checked_proposal(
                self.batch_drafter.propose(self.ids, gamma, attention_mask=self.mask),
                self.batch_drafter,
                self.ids,
                gamma,
                self.vocab_size,
            )
        else:
            row_ids = [torch.cat([self.prompts[r, self.text_start[r] :], self.generated[r]])[None] for r in self.rows]
            proposal, check = _row_proposals(
                [self.row_drafters[r] for r in self.rows], row_ids, gamma, self.vocab_size, self.filler, self.device
            )
        return Draft(proposal, check, ChainLayout(proposal), chosen_gamma)

    def score(self, draft: Draft) -> Scores:
        # one target forward for all rows: the uncached tail plus the drafts
        draft_tokens, rows = draft.proposal.tokens, self.rows  # [rows, k]
        num_drafted = draft_tokens.shape[1]
        candidate_ids = torch.cat([self.ids, draft_tokens], dim=-1)  # [rows, width + k]
        full_mask = torch.cat([self.mask, self.mask.new_ones(len(rows), num_drafted)], dim=-1)
        # drafts past max_length are never emitted: clamping their positions keeps learned position tables in range
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0, max=self.max_length - 1)
        kwargs = {**self.model_kwargs, CACHE_KWARG: self.cache, "attention_mask": full_mask, "position_ids": positions}
        first_round, cached = self.first_round, None
        if self.recurrent is not None:
            # the prompt goes in a forward of its own, so that a rollback's checkpoint comes after it; kept tokens
            # fed again after a rollback go before the drafts, in the round's forward
            cached, width = self.recurrent.length, self.ids.shape[1]
            if first_round and width > 2:  # (a prompt of two columns: a plain step over both, `room`)
                prefix = {**kwargs, "attention_mask": self.mask[:, :-1], "position_ids": positions[:, : width - 1]}
                target_logits(self.model, self.ids[:, :-1], 0, prefix, True, cached=0)
                self.recurrent.fed(width - 1)
                first_round, cached = False, width - 1
            if num_drafted:
                self.recurrent.save()
        logits = target_logits(self.model, candidate_ids, num_drafted, kwargs, first_round, cached=cached)
        if self.recurrent is not None:
            self.recurrent.fed(candidate_ids.shape[1] - cached)
        scores = logits
        if len(self.logits_processor):
            # each row with its own prefix, laid out as plain generate lays it out
            views = [torch.cat([self.prompts[r], self.generated[r], draft_tokens[i]])[None] for i, r in enumerate(rows)]
            scores = standardize(
                logits,
                lambda i: self.row_processors[rows[i]],
                lambda i, j: views[i][:, : self.lengths[i] + j],
                check_stateless=self.first_round,
            )
        return Scores(logits, scores, candidate_ids)

    def emit(self, draft: Draft, verdict: Verdict, scores: Scores) -> None:
        # each row appends through the stopping criteria, checked after every token as plain generate checks them;
        # one host read for every row's checks
        draft_tokens, rows, lengths = draft.proposal.tokens, self.rows, self.lengths
        num_drafted = draft_tokens.shape[1]
        if self.recurrent is not None:
            _lockstep(verdict, draft_tokens)
        new_tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(len(rows), 1)], dim=-1)  # [rows, k + 1]
        new_tokens[torch.arange(len(rows)), verdict.accepted] = verdict.next_tokens
        self.new_tokens = new_tokens
        accepted = verdict.accepted_counts
        views = []
        for i, r in enumerate(rows):
            n = accepted[i]
            row_betas = verdict.beta_values[i][: min(n + 1, num_drafted)]
            self.stats.record_round(draft.chosen_gamma, num_drafted, n, row_betas, new_forward=i == 0)
            self.row_stats[r].record_round(draft.chosen_gamma, num_drafted, n, row_betas)
            views.append(torch.cat([self.prompts[r], self.generated[r], new_tokens[i, : n + 1]])[None])
        # a row already done (it grows on with the batch) checks nothing more
        checked = [i for i, r in enumerate(rows) if r not in self.done_length]
        stops = first_stops(self.stopping_criteria, [(views[i], lengths[i], accepted[i] + 1) for i in checked])
        self.emitted = [n + 1 for n in accepted]
        for i, stop in zip(checked, stops):
            if stop is not None:
                self.done_length[rows[i]] = lengths[i] + stop
                if self.rows_leave_when_done:
                    self.emitted[i] = stop
        for i, r in enumerate(rows):
            self.generated[r] = views[i][0, self.prompt_len : lengths[i] + self.emitted[i]]

    def keep(self, draft: Draft, verdict: Verdict, scores: Scores) -> None:
        # realign: rows end together again; the cache keeps everything but each row's newest token
        rows, emitted, device, cache = self.rows, self.emitted, self.device, self.cache
        num_drafted = draft.proposal.tokens.shape[1]
        width = self.ids.shape[1]
        row_states = self._kept_hidden_states(num_drafted) if self.capture is not None else {}
        most = max(emitted)
        # a recurrent cache: everything fed kept, or back to the checkpoint before the round's forward (the kept
        # tokens are then fed again); every row still in the batch emitted `most` tokens
        held = self.recurrent.rewind(width - 1 + most) if self.recurrent is not None else width - 1 + most
        for i, r in enumerate(rows):
            self.padding[r] += most - emitted[i]
        shift = to_device([most - e for e in emitted], device)  # [rows]: extra left padding per row
        columns = torch.arange(width + most, device=device)[None, :] - shift[:, None]  # [rows, width + most]
        source_ids = torch.cat([self.ids, self.new_tokens], dim=-1)
        source_mask = torch.cat([self.mask, self.mask.new_ones(len(rows), num_drafted + 1)], dim=-1)
        ids = source_ids.gather(1, columns.clamp(min=0)).masked_fill(columns < 0, self.filler)
        mask = source_mask.gather(1, columns.clamp(min=0)).masked_fill(columns < 0, 0)
        # finished rows leave; columns that are padding in every row go
        if self.rows_leave_when_done:
            keep = [i for i, r in enumerate(rows) if r not in self.done_length]
        else:
            # no EOS criterion: as in plain generate, every row grows until all rows are done, then all are cut to
            # the longest finished length (a row at max_length is done for good: nothing past it is ever kept)
            stop = max(self.done_length.values()) if len(self.done_length) == self.batch else self.max_length
            keep = [i for i, r in enumerate(rows) if self.prompt_len + len(self.generated[r]) < stop]
            # every row, those that left at max_length before the last row was done too
            for r in range(self.batch):
                self.generated[r] = self.generated[r][: stop - self.prompt_len]
        if len(keep) < len(rows):
            index = to_device(keep, device)
            ids, mask, columns = ids[index], mask[index], columns[index]
            if self.recurrent is not None:  # the recurrent layers' rows too (and no checkpoint of the old rows)
                cache.reorder_cache(index)
                self.recurrent.saved = {}
            else:
                cache.batch_select_indices(index)
            if self.batch_drafter is not None and keep:
                self.batch_drafter.select_rows(index, **({"rows": keep} if self.host_rows else {}))
            rows = self.rows = [rows[i] for i in keep]
        self.finished = not rows
        if rows:
            lead = min(self.padding[r] for r in rows)  # all-padding columns on the left (padding is left only)
            for r in rows:
                self.padding[r] -= lead
            ids, mask = ids[:, lead:], mask[:, lead:]
            # one move of the target's cache: each row to its new columns, the all-padding ones dropped, the newest
            # token (never cached) left out; a slice, not a copy, when every row moved alike
            shifts = {most - emitted[i] for i in keep}
            if len(shifts) == 1:
                slice_cache(cache, lead - shifts.pop(), held - lead)
            else:
                realign_cache(cache, columns[:, lead:-1])
            if self.recurrent is not None:  # its positions, counted from the first column kept
                self.recurrent.length, self.recurrent.saved = held - lead, {}
            accepted = verdict.accepted
            kept_accepted = accepted[index] if len(keep) < len(accepted) else accepted
            if self.batch_drafter is not None:
                hints = {"padding": [self.padding[r] for r in rows]} if self.host_padding else {}
                self.batch_drafter.on_verified(ids, kept_accepted, attention_mask=mask, **hints)
            else:
                for i, r in enumerate(rows):
                    self.row_drafters[r].on_verified(
                        torch.cat([self.prompts[r, self.text_start[r] :], self.generated[r]])[None],
                        kept_accepted[i : i + 1],
                        **({"target_hidden_states": row_states[r]} if r in row_states else {}),
                    )
        self.ids, self.mask = ids, mask

    def _kept_hidden_states(self, num_drafted: int) -> dict[int, torch.Tensor]:
        """Each row's hidden states of this round's forward, `{row: [1, n, H]}`, as the one-sequence loop gives them:
        the positions the target's cache now keeps for the row and its drafter has not had (its uncached text
        columns, then its kept drafts). The forward fed every row the same columns, the uncached tail of the
        rectangle (all of it in the first round, its newest column after) and then the drafts; a row's left padding
        among them, and its drafts past those it kept, are left out."""
        states = self.capture.take()  # [round rows, tail + num_drafted, H]
        tail = states.shape[1] - num_drafted
        fed_from = self.ids.shape[1] - tail  # the columns cached before the forward
        return {
            r: states[i : i + 1, max(0, self.padding[r] - fed_from) : tail + self.emitted[i] - 1]
            for i, r in enumerate(self.rows)
        }

    def close(self) -> None:
        """Removes the hidden-state hooks, if any (the call is over, or failed)."""
        if self.capture is not None:
            self.capture.close()

    def observe(self, policy, draft: Draft, verdict: Verdict, draft_s: float, verify_s: float) -> None:
        for r in self.round_rows:  # each row took part in the whole round
            self.row_stats[r].draft_time_s += draft_s
            self.row_stats[r].verify_time_s += verify_s
        # the policy sees one round of the whole batch: its time, and each row's accepted drafts
        policy.observe_rows(
            drafted=draft.proposal.tokens.shape[1],
            accepted_per_row=verdict.accepted_counts,
            draft_time_s=draft_s,
            verify_time_s=verify_s,
            first_round=self.first_round,
        )

    def result(self) -> torch.LongTensor:
        """Plain generate's output once every row is done."""
        for r, tokens in enumerate(self.generated):  # what each row keeps (a row that grew past its end was cut back)
            self.row_stats[r].emitted_tokens = len(tokens)
        self.stats.emitted_tokens += sum(len(tokens) for tokens in self.generated)
        return _assemble(self.prompts, self.generated, self.filler)


def _lockstep(verdict: Verdict, draft_tokens: torch.LongTensor) -> None:
    """Cuts every row's accepted drafts to the fewest any row accepted, m: a row that accepted more emits its first
    m + 1 accepted drafts (the last one in place of its next token), so that every row keeps as many positions and
    one rollback of the recurrent state serves them all. Exact: the first m + 1 tokens of a row's accepted drafts
    are those it would emit, and where the cut falls depends on the other rows alone once it is below the row's own
    count (a prefix of a sequence sampled from the target, whose next tokens the next rounds sample again)."""
    counts = verdict.accepted_counts
    fewest = min(counts)
    over = [i for i, n in enumerate(counts) if n > fewest]
    if not over:
        return
    index = to_device(over, draft_tokens.device)
    verdict.next_tokens = verdict.next_tokens.clone()
    verdict.next_tokens[index] = draft_tokens[index, fewest]
    verdict.accepted = verdict.accepted.clamp(max=fewest)
    verdict.accepted_counts = [min(n, fewest) for n in counts]


def _row_proposals(row_drafters, row_ids, gamma, vocab_size, filler, device):
    """Each row's own proposal, padded to the longest with filler drafts (rejected unless the target agrees), as one
    `DraftProposal` for the batch."""
    proposals = []
    for drafter, ids in zip(row_drafters, row_ids):
        proposal, check = checked_proposal(drafter.propose(ids, gamma), drafter, ids, gamma, vocab_size)
        check.read()
        proposals.append((proposal.tokens, proposal.probs))
    length = max(tokens.shape[1] for tokens, _ in proposals)
    tokens = torch.full((len(row_ids), length), filler, dtype=torch.long, device=device)
    any_probs = any(probs is not None for _, probs in proposals)
    probs = torch.zeros(len(row_ids), length, vocab_size, device=device) if any_probs else None
    for i, (row_tokens, row_probs) in enumerate(proposals):
        tokens[i, : row_tokens.shape[1]] = row_tokens[0]
        if probs is not None:
            # deterministic rows and filler drafts: q is a point mass on the proposed token
            probs[i] = torch.nn.functional.one_hot(tokens[i], vocab_size).float()
            if row_probs is not None:
                probs[i, : row_tokens.shape[1]] = row_probs[0]
    proposal = DraftProposal(tokens=tokens, probs=probs)
    return proposal, ProposalCheck(None, "row drafters", tokens, probs, vocab_size)  # each row read its own


def _assemble(prompts, generated, pad_token_id: int):
    """Plain generate's output: every row its prompt and its tokens, finished rows padded on the right."""
    longest = max(len(g) for g in generated)
    out = prompts.new_full((prompts.shape[0], prompts.shape[1] + longest), pad_token_id)
    out[:, : prompts.shape[1]] = prompts
    for r, tokens in enumerate(generated):
        out[r, prompts.shape[1] : prompts.shape[1] + len(tokens)] = tokens
    return out
