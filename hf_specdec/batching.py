"""Speculative decoding for a batch of several sequences (left-padded prompts, `num_return_sequences`).

Each row accepts its own number of drafts each round. Two layouts, chosen by one capability check:

**Padded batch (decoder-only targets with a dynamic full-attention cache and `position_ids`).** Rows stay in one
left-padded rectangle whose rows all *end* in the same column, which is exactly the layout plain batched `generate`
uses. Each round every row drafts (up to) γ tokens, the target verifies all rows in one forward of γ + 1 tokens per
row, and each row emits its own number e_r of tokens. The rectangle then grows by max_r e_r columns and every row
with fewer new tokens is moved right by the difference (more left padding), in the token ids, the attention mask
and the target's key/value cache (`realign_cache`: one gather per layer when rows moved by different amounts, a
slice when they all moved alike). Positions come from the attention mask (cumulative sum), as in plain generation,
and rotary keys are stored already rotated, so moving a row does not change what it computes. Columns that are
padding in every row are dropped, and rows that finish (EOS, stop strings, max length) leave the batch at once, so
they stop costing compute.
Costs: one gather of the cache per uneven round (about one extra read of the cache, small next to the forward);
attention runs over the longest row, so a row that accepts less carries more padding; a draft position is computed
for every row, so a row whose drafter proposed fewer tokens fills the gap with rejected filler.

**One row at a time (encoder-decoder targets, sliding-window and static caches, models without `position_ids`).**
Their decoders derive positions from cache slots, which left padding would shift (a static cache's preallocated rows
cannot be realigned without copies either), so each row runs the single-sequence loop with its own cache, sharing
the batch's encoder outputs. Exact, but without the batching speedup.

Either way each row is token for token what plain batched `generate` returns for it (greedy), and each row's
distribution is the target's (sampling): the logits processors see each row's own prefix exactly as plain
`generate` lays it out (its original left padding, then its tokens).

Drafters that set `supports_padded_batches` (`ModelDrafter`) draft for the whole rectangle in one forward per
token; every other drafter gets a copy per row, called with that row's unpadded tokens, exactly as at batch size 1.
"""

from __future__ import annotations

import copy
import inspect
import time
from typing import TYPE_CHECKING

import torch
from transformers import (
    DynamicCache,
    EncoderDecoderCache,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
)
from transformers.utils import ModelOutput

from .caches import CACHE_KWARG, realign_cache, slice_cache
from .devices import seconds_agreement
from .drafters.base import Drafter, DraftProposal
from .modeling import logits_width
from .rounds import (
    ProposalCheck,
    checked_proposal,
    compiled_graphs,
    draft_context,
    first_stops,
    read_verdict,
    standardize,
    target_logits,
    verify_round,
)
from .sequence import decode_sequence
from .stats import SpeculativeStats

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["decode_batch", "fresh_cache", "slice_kwargs"]


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
    stats); returns (sequences, the target's cache, or None when rows were decoded one at a time)."""
    cache = model_kwargs[CACHE_KWARG]
    # a drafter that reads the target's hidden states gets them from the one-sequence loop, and `prefill_chunk_size`
    # is honoured there (each row's prompt prefilled in chunks): rows one at a time
    if (
        _supports_padded_batch(model, cache)
        and not drafter.reads_target_hidden_states
        and run["generation_config"].prefill_chunk_size is None
    ):
        return _decode_padded(
            model, input_ids, drafter=drafter, inputs_tensor=inputs_tensor, **run, **model_kwargs
        ), cache
    return _decode_rows(model, input_ids, drafter=drafter, inputs_tensor=inputs_tensor, **run, **model_kwargs), None


def _supports_padded_batch(model, cache) -> bool:
    """Left padding leaves positions intact only for decoder-only models that take `position_ids`, and the cache
    can be realigned only when every layer keeps all columns (no sliding windows)."""
    return (
        not model.config.is_encoder_decoder
        and isinstance(cache, DynamicCache)
        and all(_moves_by_column(layer) for layer in cache.layers)
        and "position_ids" in inspect.signature(model.forward).parameters
    )


def _moves_by_column(layer) -> bool:
    """Whether everything `layer` holds is per-column state that `realign_cache` moves: no sliding window, and no
    convolution or recurrent state (which summarizes the last tokens of each row, whatever their columns)."""
    return not (
        getattr(layer, "is_sliding", False) or hasattr(layer, "conv_states") or hasattr(layer, "recurrent_states")
    )


def _decode_padded(
    model,
    input_ids,
    *,
    drafter,
    inputs_tensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    options,
    policy,
    stats,
    **model_kwargs,
):
    device = input_ids.device
    batch, prompt_len = input_ids.shape
    cache = model_kwargs.pop(CACHE_KWARG)
    model_kwargs.pop("position_ids", None)  # rebuilt from the mask every round
    mask = model_kwargs.pop("attention_mask", None)
    mask = torch.ones_like(input_ids) if mask is None else mask.long()  # [batch, prompt_len]
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError(
            "Speculative decoding of a batch needs left padding, but the attention mask has padding after text. "
            "Pad on the left (`tokenizer.padding_side = 'left'`), as plain batched generation of decoder-only "
            "models also requires."
        )
    vocab_size = logits_width(model)
    # like plain generate: rows end early (then padded) only with an EOS criterion; otherwise every row keeps
    # growing until all rows are done
    pad = generation_config._pad_token_tensor
    pad_token_id = None if pad is None else int(pad.reshape(-1)[0])
    rows_leave_when_done = pad_token_id is not None and any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    filler = pad_token_id if pad_token_id is not None else 0
    text_start = (mask == 0).sum(-1).tolist()  # [batch]: where each row's text starts in its padded prompt
    row_processors = [processors_for_row(logits_processor, row, batch) for row in range(batch)]
    draft_processors, padding_aware = _padded_batch_processors(logits_processor)
    context = draft_context(
        model, input_ids, draft_processors, generation_config, {**model_kwargs, "attention_mask": mask}, inputs_tensor
    )
    if drafter.supports_padded_batches:
        batch_drafter, row_drafters = drafter.for_call(context), None
    else:
        batch_drafter = None
        row_drafters = [
            drafter.for_call(_row_context(context, row, text_start[row], row_processors[row])) for row in range(batch)
        ]

    prompts = input_ids  # plain generate's view of row r: prompts[r] + generated[r]
    generated = [input_ids.new_empty(0) for _ in range(batch)]
    rows = list(range(batch))  # original index of each row still in the batch
    row_stats = [SpeculativeStats(lenience=stats.lenience) for _ in range(batch)]
    stats.rows.extend(row_stats)
    done_length: dict[int, int] = {}  # row -> its length when its stopping criteria fired
    padding = dict(enumerate(text_start))  # row -> its left padding columns in `ids` (known here, never read back)
    ids = input_ids
    do_sample = bool(generation_config.do_sample)
    max_length = generation_config.max_length
    first_round = True
    agree = seconds_agreement(model)  # a tensor-parallel target's processes decide from the same seconds

    while rows:
        round_rows = list(rows)  # rows may leave the batch during the round
        width = ids.shape[1]
        lengths = [prompt_len + len(generated[r]) for r in rows]
        chosen_gamma = policy.next_gamma()
        gamma = max(0, min(chosen_gamma, max_length - min(lengths) - 1))

        # 1. draft, every row at once or one copy per row
        draft_start = time.perf_counter()
        graphs = compiled_graphs()
        if batch_drafter is not None:
            for processor in padding_aware:
                processor.prompt_ignore_length = (mask == 0).sum(-1)  # [rows]
            proposal, check = checked_proposal(
                batch_drafter.propose(ids, gamma, attention_mask=mask), batch_drafter, ids, gamma, vocab_size
            )
        else:
            row_ids = [torch.cat([prompts[r, text_start[r] :], generated[r]])[None] for r in rows]
            proposal, check = _row_proposals(
                [row_drafters[r] for r in rows], row_ids, gamma, vocab_size, filler, device
            )
        draft_tokens = proposal.tokens  # [rows, k]
        num_drafted = draft_tokens.shape[1]
        stats.drafter_compilations += compiled_graphs() - graphs
        verify_start = time.perf_counter()

        # 2. one target forward for all rows: the uncached tail plus the drafts
        candidate_ids = torch.cat([ids, draft_tokens], dim=-1)  # [rows, width + k]
        full_mask = torch.cat([mask, mask.new_ones(len(rows), num_drafted)], dim=-1)
        # drafts past max_length are never emitted: clamping their positions keeps learned position tables in range
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0, max=max_length - 1)
        logits = target_logits(
            model,
            candidate_ids,
            num_drafted,
            {
                **model_kwargs,
                CACHE_KWARG: cache,
                "attention_mask": full_mask,
                "position_ids": positions,
            },
            first_round,
        )  # [rows, k + 1, vocab]
        scores = logits
        if len(logits_processor):
            # each row with its own prefix, laid out as plain generate lays it out
            views = [torch.cat([prompts[r], generated[r], draft_tokens[i]])[None] for i, r in enumerate(rows)]
            scores = standardize(
                logits,
                lambda i: row_processors[rows[i]],
                lambda i, j: views[i][:, : lengths[i] + j],
                check_stateless=first_round,
            )

        # 3. verify every row (Algorithm 1); one host read for all rows' verdicts and the proposal's check
        verdict = read_verdict(verify_round(do_sample, proposal, scores, options), check)
        accepted, next_tokens = verdict.accepted, verdict.next_tokens
        new_tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(len(rows), 1)], dim=-1)  # [rows, k + 1]
        new_tokens[torch.arange(len(rows)), accepted] = next_tokens

        # 4. each row appends through the stopping criteria, checked after every token as plain generate checks
        # them; one host read for every row's checks
        accepted_list = verdict.accepted_counts
        views = []
        for i, r in enumerate(rows):
            n = accepted_list[i]
            row_betas = verdict.beta_values[i][: min(n + 1, num_drafted)]
            stats.record_round(chosen_gamma, num_drafted, n, row_betas, new_forward=i == 0)
            row_stats[r].record_round(chosen_gamma, num_drafted, n, row_betas)
            views.append(torch.cat([prompts[r], generated[r], new_tokens[i, : n + 1]])[None])
        # a row already done (it grows on with the batch) checks nothing more
        checked = [i for i, r in enumerate(rows) if r not in done_length]
        stops = first_stops(stopping_criteria, [(views[i], lengths[i], accepted_list[i] + 1) for i in checked])
        emitted = [n + 1 for n in accepted_list]
        for i, stop in zip(checked, stops):
            if stop is not None:
                done_length[rows[i]] = lengths[i] + stop
                if rows_leave_when_done:
                    emitted[i] = stop
        for i, r in enumerate(rows):
            generated[r] = views[i][0, prompt_len : lengths[i] + emitted[i]]

        # 5. realign: rows end together again; the cache keeps everything but each row's newest token
        most = max(emitted)
        for i, r in enumerate(rows):
            padding[r] += most - emitted[i]
        shift = torch.tensor([most - e for e in emitted], device=device)  # [rows]: extra left padding per row
        columns = torch.arange(width + most, device=device)[None, :] - shift[:, None]  # [rows, width + most]
        source_ids = torch.cat([ids, new_tokens], dim=-1)
        source_mask = torch.cat([mask, mask.new_ones(len(rows), num_drafted + 1)], dim=-1)
        ids = source_ids.gather(1, columns.clamp(min=0)).masked_fill(columns < 0, filler)
        mask = source_mask.gather(1, columns.clamp(min=0)).masked_fill(columns < 0, 0)
        # finished rows leave; columns that are padding in every row go
        if rows_leave_when_done:
            keep = [i for i, r in enumerate(rows) if r not in done_length]
        else:
            # no EOS criterion: as in plain generate, every row grows until all rows are done, then all are cut to
            # the longest finished length (a row at max_length is done for good: nothing past it is ever kept)
            stop = max(done_length.values()) if len(done_length) == batch else max_length
            keep = [i for i, r in enumerate(rows) if prompt_len + len(generated[r]) < stop]
            for r in rows:
                generated[r] = generated[r][: stop - prompt_len]
        if len(keep) < len(rows):
            index = torch.tensor(keep, device=device, dtype=torch.long)
            ids, mask, columns = ids[index], mask[index], columns[index]
            cache.batch_select_indices(index)
            if batch_drafter is not None and keep:
                batch_drafter.select_rows(index)
            rows = [rows[i] for i in keep]
        if rows:
            lead = min(padding[r] for r in rows)  # all-padding columns on the left (padding is left only)
            for r in rows:
                padding[r] -= lead
            ids, mask = ids[:, lead:], mask[:, lead:]
            # one move of the target's cache: each row to its new columns, the all-padding ones dropped, the newest
            # token (never cached) left out; a slice, not a copy, when every row moved alike
            shifts = {most - emitted[i] for i in keep}
            if len(shifts) == 1:
                slice_cache(cache, lead - shifts.pop(), ids.shape[1] - 1)
            else:
                realign_cache(cache, columns[:, lead:-1])
            kept_accepted = accepted[keep] if len(keep) < len(accepted) else accepted
            graphs = compiled_graphs()
            if batch_drafter is not None:
                batch_drafter.on_verified(ids, kept_accepted, attention_mask=mask)
            else:
                for i, r in enumerate(rows):
                    row_drafters[r].on_verified(
                        torch.cat([prompts[r, text_start[r] :], generated[r]])[None], kept_accepted[i : i + 1]
                    )
            stats.drafter_compilations += compiled_graphs() - graphs
        draft_s, verify_s = agree(verify_start - draft_start, time.perf_counter() - verify_start)
        stats.draft_time_s += draft_s
        stats.verify_time_s += verify_s
        for r in round_rows:  # each row took part in the whole round
            row_stats[r].draft_time_s += draft_s
            row_stats[r].verify_time_s += verify_s
        # the policy sees one round of the whole batch: its time, and each row's accepted drafts
        policy.observe_rows(
            drafted=num_drafted,
            accepted_per_row=accepted_list,
            draft_time_s=draft_s,
            verify_time_s=verify_s,
            first_round=first_round,
        )
        first_round = False

    for r, tokens in enumerate(generated):  # what each row keeps (a row that grew past its end was cut back)
        row_stats[r].emitted_tokens = len(tokens)
    stats.emitted_tokens += sum(len(tokens) for tokens in generated)
    return _assemble(prompts, generated, filler)


def processors_for_row(logits_processor, row: int, batch: int):
    """A copy of the prepared processors for row `row` of the batch, called with that row alone (`[1, len]`).

    transformers' processors keep some per-row state sized to the whole batch (repetition penalty's prompt padding
    lengths, the encoder-side penalties' source ids, the prefix function's batch index); it is sliced to the row.
    """
    row_processors = LogitsProcessorList()
    for processor in logits_processor:
        ignore = getattr(processor, "prompt_ignore_length", None)
        sources = getattr(processor, "encoder_input_ids", None)
        ngrams = getattr(processor, "generated_ngrams", None)
        prefix_fn = getattr(processor, "_prefix_allowed_tokens_fn", None)
        if isinstance(ignore, torch.Tensor) or sources is not None or ngrams is not None or prefix_fn is not None:
            processor = copy.copy(processor)
        if isinstance(ignore, torch.Tensor):
            processor.prompt_ignore_length = ignore[row : row + 1]
        if sources is not None:  # one source per `batch // len(sources)` rows (num_return_sequences)
            source_row = row // (batch // sources.shape[0])
            processor.encoder_input_ids = sources[source_row : source_row + 1]
        if ngrams is not None:
            source_row = row // (batch // processor.batch_size)
            processor.generated_ngrams, processor.batch_size = ngrams[source_row : source_row + 1], 1
        if prefix_fn is not None:
            processor._prefix_allowed_tokens_fn = lambda batch_id, sent, fn=prefix_fn: fn(row + batch_id, sent)
        row_processors.append(processor)
    return row_processors


def _padded_batch_processors(logits_processor):
    """A copy of the processors whose repetition penalties (their per-row padding lengths) can be updated without
    touching the originals: (processors, those penalties). The padded batch updates them every round, as rows move
    and leave; per-row drafters, which see unpadded tokens, clear them."""
    processors, padding_aware = LogitsProcessorList(), []
    for processor in logits_processor:
        if isinstance(getattr(processor, "prompt_ignore_length", None), torch.Tensor):
            processor = copy.copy(processor)
            padding_aware.append(processor)
        processors.append(processor)
    return processors, padding_aware


def _row_context(context, row: int, text_start: int, row_processors):
    """The batch-1 context of one row: its unpadded prompt, and its processors with no padding to skip."""
    row_context = copy.copy(context)
    row_context.logits_processor, padding_aware = _padded_batch_processors(row_processors)
    for processor in padding_aware:
        processor.prompt_ignore_length = None
    row_context.input_ids = context.input_ids[row : row + 1, text_start:]
    row_context.model_kwargs = {}
    row_context.inputs_tensor = _source_row(context.inputs_tensor, row, context.input_ids.shape[0])
    return row_context


def _source_row(inputs_tensor, row: int, batch: int):
    """Row `row`'s slice of the tensor `generate` was called with (not expanded by `num_return_sequences`)."""
    if inputs_tensor is None:
        return None
    source = row // (batch // inputs_tensor.shape[0])
    return inputs_tensor[source : source + 1]


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


def fresh_cache(cache, model):
    """An empty cache of the same kind as `cache` (the model's own layer types: indexed, linear-attention, ...), for
    one row."""
    if cache.get_seq_length() == 0:
        return _for_one_row(copy.deepcopy(cache))
    config = model.config
    return (
        EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
        if isinstance(cache, EncoderDecoderCache)
        else DynamicCache(config=config)
    )


def _for_one_row(cache):
    """`cache` (an empty copy) with the layers that were allocated ahead for the whole batch reallocated for one row:
    transformers initializes a static cache early when `prefill_chunk_size` is set, while other static caches
    allocate on their first forward."""
    for part in (
        (cache.self_attention_cache, cache.cross_attention_cache)
        if isinstance(cache, EncoderDecoderCache)
        else (cache,)
    ):
        for layer in getattr(part, "layers", ()):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if (
                getattr(layer, "is_initialized", False)
                and isinstance(keys, torch.Tensor)
                and keys.dim() == 4
                and keys.shape[0] != 1
                and hasattr(layer, "lazy_initialization")
            ):
                layer.lazy_initialization(keys[:1], values[:1])
    return cache


def slice_kwargs(model_kwargs, row: int, batch: int, model):
    """Row `row` of the prepared model kwargs of a batch of `batch`, with a fresh cache of its own."""
    sliced = {}
    for key, value in model_kwargs.items():
        if key == CACHE_KWARG:
            value = fresh_cache(value, model)
        elif isinstance(value, ModelOutput):
            value = type(value)(
                **{
                    k: v[row : row + 1] if isinstance(v, torch.Tensor) and v.shape[0] == batch else v
                    for k, v in value.items()
                }
            )
        elif isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
            value = value[row : row + 1]
        sliced[key] = value
    return sliced


def _decode_rows(
    model,
    input_ids,
    *,
    drafter,
    inputs_tensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    options,
    policy,
    stats,
    **model_kwargs,
):
    batch = input_ids.shape[0]
    pad = generation_config._pad_token_tensor
    rows_end_early = pad is not None and any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    row_stats = [SpeculativeStats(lenience=stats.lenience) for _ in range(batch)]
    run = dict(generation_config=generation_config, options=options, policy=policy)
    outputs, states = [], []
    for row in range(batch):
        row_kwargs = slice_kwargs(model_kwargs, row, batch, model)
        row_ids = input_ids[row : row + 1]
        row_processors = processors_for_row(logits_processor, row, batch)
        row_drafter = drafter.for_call(
            draft_context(
                model, row_ids, row_processors, generation_config, row_kwargs, _source_row(inputs_tensor, row, batch)
            )
        )
        sequence, _, _ = decode_sequence(
            model,
            row_ids,
            logits_processor=row_processors,
            stopping_criteria=stopping_criteria,
            drafter=row_drafter,
            stats=row_stats[row],
            **run,
            **row_kwargs,
        )
        outputs.append(sequence)
        states.append((row_kwargs, row_processors, row_drafter))
    if not rows_end_early:
        # as in plain generate without an EOS criterion: rows that are done keep growing until every row is
        # done; each row continues from where it stopped (its cache holds all but its newest token)
        stop = max(s.shape[1] for s in outputs)
        until_stop = StoppingCriteriaList([MaxLengthCriteria(stop)])
        for row, (row_kwargs, row_processors, row_drafter) in enumerate(states):
            grown = outputs[row].shape[1] - input_ids.shape[1]
            if outputs[row].shape[1] < stop:
                row_kwargs = model._update_model_kwargs_for_generation(
                    {}, row_kwargs, is_encoder_decoder=model.config.is_encoder_decoder, num_new_tokens=grown
                )
                outputs[row], _, _ = decode_sequence(
                    model,
                    outputs[row],
                    logits_processor=row_processors,
                    stopping_criteria=until_stop,
                    drafter=row_drafter,
                    stats=row_stats[row],
                    continuing=True,
                    **run,
                    **row_kwargs,
                )
    for one_row in row_stats:  # rows decoded one after another: each forward is its own
        stats.merge(one_row)
    stats.rows.extend(row_stats)
    longest = max(s.shape[1] for s in outputs)
    out = input_ids.new_full((batch, longest), int(pad.reshape(-1)[0]) if pad is not None else 0)
    for row, sequence in enumerate(outputs):
        out[row, : sequence.shape[1]] = sequence[0]
    return out
