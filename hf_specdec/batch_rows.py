"""A batch's rows one at a time: each row's copy of the logits processors, its batch-1 draft context, its slice of
the prepared model kwargs with a fresh cache of its own, and the loop that decodes the rows one after another
(encoder-decoder targets, static caches, hybrid and state-space models, models without `position_ids`; see
`batching.py`)."""

from __future__ import annotations

import copy

import torch
from transformers import (
    DynamicCache,
    EncoderDecoderCache,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
)
from transformers.utils import ModelOutput

from .caches import CACHE_KWARG, holds_nothing
from .proposals import draft_context
from .sequence import decode_sequence
from .stats import SpeculativeStats

__all__ = [
    "decode_rows",
    "fresh_cache",
    "padded_batch_processors",
    "processors_for_row",
    "row_context",
    "slice_kwargs",
    "source_row",
]


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


def padded_batch_processors(logits_processor):
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


def row_context(context, row: int, text_start: int, row_processors):
    """The batch-1 context of one row: its unpadded prompt, and its processors with no padding to skip."""
    row_context = copy.copy(context)
    row_context.logits_processor, padding_aware = padded_batch_processors(row_processors)
    for processor in padding_aware:
        processor.prompt_ignore_length = None
    row_context.input_ids = context.input_ids[row : row + 1, text_start:]
    row_context.model_kwargs = {}
    row_context.inputs_tensor = source_row(context.inputs_tensor, row, context.input_ids.shape[0])
    return row_context


def source_row(inputs_tensor, row: int, batch: int):
    """Row `row`'s slice of the tensor `generate` was called with (not expanded by `num_return_sequences`)."""
    if inputs_tensor is None:
        return None
    source = row // (batch // inputs_tensor.shape[0])
    return inputs_tensor[source : source + 1]


def fresh_cache(cache, model):
    """An empty cache of the same kind as `cache` (the model's own layer types: indexed, linear-attention, ...), for
    one row."""
    if holds_nothing(cache):
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


def decode_rows(
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
                model, row_ids, row_processors, generation_config, row_kwargs, source_row(inputs_tensor, row, batch)
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
