"""The functional capability check every speculative call runs first: does the target's cached forward over several
new tokens compute what step-by-step decoding computes, and can its cache be rolled back? Shared by the chain and
tree loops (`decoding.py`) and beam search (`beam.py`)."""

from __future__ import annotations

import weakref

import torch

from .batch_rows import slice_kwargs
from .caches import CACHE_KWARG, cached_length, decoder_layers, is_static, record_past, rewind_cache, static_layers
from .forward import per_token_prefix, target_logits
from .modeling import logits_width
from .recurrent import (
    RecurrentCheckpoints,
    forgo_chunk_size,
    pad_conv_windows,
    recurrent_layers,
    rolls_back_from_checkpoints,
    stop_recording_windows,
    takes_chunk_size,
)

__all__ = ["check_multi_token_forward"]


# model -> {(dtype, attention implementation, cache kind): refusal reason or None}: nothing is written onto the
# user's model
_MULTI_TOKEN_VERDICTS: weakref.WeakKeyDictionary[torch.nn.Module, dict] = weakref.WeakKeyDictionary()
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
    # the verdict holds for the kind of cache it was probed with: a static cache masks and rolls back otherwise
    key = (model.dtype, getattr(model.config, "_attn_implementation", None), _cache_kind(model_kwargs))
    verdicts = _MULTI_TOKEN_VERDICTS.setdefault(model, {})
    if key in verdicts:
        reason = verdicts[key]
    else:
        try:
            reason = verdicts[key] = _probe_multi_token_forward(model, input_ids, model_kwargs, generation_config)
        except _ProbeFailed as failure:
            # a forward that raised may be this call's inputs' doing, not the model's: refused, not remembered
            reason = str(failure)
    if reason is None:
        limit = _attention_limit(model, model_kwargs.get(CACHE_KWARG))
        if limit is not None and generation_config.max_length > limit[1]:
            reason = (
                f"{limit[0]}, which makes a forward over several new tokens compute something else than "
                f"step-by-step decoding once the sequence is longer than {limit[1]} tokens (this generation may "
                f"reach max_length={generation_config.max_length})"
            )
    if reason is not None:
        raise ValueError(
            f"{type(model).__name__} cannot be verified exactly by speculative decoding: {reason}. Drop "
            "`assistant_model`/`drafter` and use plain `generate` for this model."
        )


def _cache_kind(model_kwargs) -> tuple:
    """The call's cache as the probe's verdict depends on it: its class and its layers' classes."""
    cache = model_kwargs.get(CACHE_KWARG)
    layers = decoder_layers(cache)
    return type(cache).__name__, tuple(sorted({type(layer).__name__ for layer in layers}))


class _ProbeFailed(Exception):
    """The probe's forwards raised: a refusal for this call (its reason is the message), not a verdict kept."""


def _attention_limit(model, cache) -> tuple[str, int] | None:
    """What a sparse-attention indexer's top-k selects, and the longest sequence over which a multi-token forward
    still selects as step-by-step decoding does (transformers' assisted generation differs past it as well):

    - over the cache's key columns (its layers keep indexer keys: DeepSeek-V3.2, GLM-MoE-DSA, ...), `index_topk`
      tokens: a multi-token forward picks its keys per chunk, not per token;
    - over something else (DeepSeek-V4's compressors' entries, each of `compress_rates` tokens), while every entry
      is selected: past `index_topk` entries, scores tied at the top-k's boundary (exact zeros of its ReLU scores)
      are broken by their place in the row, which a forward over several tokens makes longer than a one-token one.

    A cache whose layers are not built yet is taken to be of the first kind."""
    config = model.config.get_text_config(decoder=True)
    value = getattr(config, "index_topk", None)
    if not isinstance(value, int):
        return None
    layers = decoder_layers(cache)
    if not layers or any(hasattr(layer, "indexer_keys") for layer in layers):
        return f"its attention selects at most index_topk={value} keys per query", value
    rates = getattr(config, "compress_rates", None)
    rate = min(rates.values()) if isinstance(rates, dict) and rates else 1
    return (
        f"its indexer selects at most index_topk={value} compressed entries per query (of {rate} tokens or more "
        "each) and breaks ties at that boundary by an entry's place in the row",
        value * rate,
    )


@torch.no_grad()
def _probe_multi_token_forward(model, input_ids, model_kwargs, generation_config) -> str | None:
    """The reason `model` cannot be speculated on exactly, or None; see `check_multi_token_forward`."""
    is_encoder_decoder = model.config.is_encoder_decoder
    row_kwargs = slice_kwargs(model_kwargs, 0, input_ids.shape[0], model)
    prompt = input_ids[:1]  # [1, prompt_len]
    mask = row_kwargs.get("attention_mask")
    if (
        not is_encoder_decoder
        and isinstance(mask, torch.Tensor)
        and mask.dim() == 2
        and mask.shape[1] == prompt.shape[1]
    ):
        # the row's left padding is left out: a verdict is the model's, not this input's (a state that saw padding
        # only is zero, which would make a model that reads its state look as if it ignored it)
        start = int((mask[0] == 0).cumprod(0).sum())  # one host read, once per model
        if 0 < start < prompt.shape[1]:
            length = prompt.shape[1]
            row_kwargs = {
                key: value[..., start:]
                if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[-1] == length
                else value
                for key, value in row_kwargs.items()
            }
            prompt = prompt[:, start:]
    chunk = generation_config.prefill_chunk_size
    if chunk is not None and not is_encoder_decoder and prompt.shape[1] + _PROBE_DRAFTS > chunk:
        # the call bounds its forwards (`prefill_chunk_size`): so does the probe, on the prompt's first tokens
        # (per-token inputs, such as the mask and the positions, cut with it)
        keep = min(max(1, chunk - _PROBE_DRAFTS), prompt.shape[1])
        row_kwargs = per_token_prefix(row_kwargs, prompt.shape[1], keep)
        prompt = prompt[:, :keep]
    vocab = logits_width(model)

    def advance(kwargs, new_tokens):
        return model._update_model_kwargs_for_generation(
            {}, dict(kwargs), is_encoder_decoder=is_encoder_decoder, num_new_tokens=new_tokens
        )

    if prompt.shape[1] == 1 and (
        getattr(model, "_is_stateful", False) or rolls_back_from_checkpoints(model, row_kwargs.get(CACHE_KWARG))
    ):
        # a recurrent cache's rounds must continue a state the prompt left: after a one-token prompt the first round
        # would be a prefill, which cannot show a forward over several tokens that ignores the cached state (nor
        # does a verdict remembered from it hold for longer prompts): a second prompt token
        prompt = torch.cat([prompt, (prompt + 3) % vocab], dim=-1)
        row_kwargs = advance(row_kwargs, 1)
    # tokens that differ from each other and from the prompt's last one
    extra = (prompt[:, -1:] + torch.arange(1, _PROBE_DRAFTS + 1, device=prompt.device) * 7) % vocab  # [1, 4]
    sequence = torch.cat([prompt, extra], dim=-1)
    prompt_len = prompt.shape[1]

    def fresh():
        kwargs = slice_kwargs(row_kwargs, 0, 1, model)  # a cache of its own
        cache = kwargs[CACHE_KWARG]
        record_past(cache)
        if is_static(cache):  # an empty copy, sized for the probe (the call's may hold fewer positions)
            for layer in static_layers(cache):
                if not layer.is_sliding:
                    layer.max_cache_len = max(layer.max_cache_len, prompt_len + _PROBE_DRAFTS + 1)
        return kwargs

    try:
        # step by step, as plain generate decodes: the logits after the prompt and after each extra token
        kwargs = fresh()
        if rolls_back_from_checkpoints(model, kwargs[CACHE_KWARG]):  # as the decoding loops set it
            stop_recording_windows(kwargs[CACHE_KWARG])
        # every probe forward runs with the same kernels (outside `decode_step`): it compares forward shapes only
        module_tensors = _module_tensors(model)
        steps = [target_logits(model, prompt, 0, kwargs, True, cached=0)[:, -1]]
        recurrent = rolls_back_from_checkpoints(model, kwargs[CACHE_KWARG])
        if recurrent:
            # as the decoding loops leave a prompt shorter than a convolution's kernel (as plain generate does)
            pad_conv_windows(kwargs[CACHE_KWARG])
            # state a forward leaves on the modules (not parameters or buffers) is beyond the cache's checkpoints
            moved = [name for name, tensor in _module_tensors(model).items() if module_tensors.get(name) is not tensor]
            if moved:
                return (
                    f"it keeps recurrent state on its modules (`{moved[0]}`), outside the cache, so a rollback of the "
                    "cache cannot restore it"
                )
        # a pure state-space cache does not count its positions: its owner does
        cached = prompt_len if recurrent else cached_length(kwargs[CACHE_KWARG])
        if cached == 0:
            return (
                f"it does not keep its keys and values in the cache (after a forward over {prompt_len} tokens "
                "the cache is empty), so there is nothing to roll rejected drafts back from"
            )
        if cached != prompt_len:
            return (
                f"its cache holds {cached} positions after a forward over {prompt_len} tokens, so rolling it back "
                "by a number of rejected tokens would misalign it"
            )
        for i in range(_PROBE_DRAFTS):
            kwargs = advance(kwargs, 1)
            steps.append(
                target_logits(
                    model,
                    sequence[:, : prompt_len + i + 1],
                    0,
                    kwargs,
                    False,
                    decode_kernels=False,
                    cached=prompt_len + i,
                )[:, -1]
            )
        want = torch.stack(steps, dim=1)  # [1, 5, vocab]

        if recurrent:
            step_cache = kwargs[CACHE_KWARG]
            chunked = takes_chunk_size(model)  # the verify forwards then pass the kernel's `chunk_size`: probed so
            reason = _recurrent_verdict(model, sequence, prompt_len, fresh, advance, want, step_cache)
            if reason is not None and chunked:
                # whatever the difference is, the model's default chunking gets its own verdict (and is kept)
                forgo_chunk_size(model)
                reason = _recurrent_verdict(model, sequence, prompt_len, fresh, advance, want, step_cache)
            return reason
        # as speculation runs: the prompt and 4 drafts in one forward; 1 accepted, the second replaced (a rollback of
        # 3); then the remaining 2 drafts after it in one forward
        kwargs = fresh()
        cache = kwargs[CACHE_KWARG]
        first = target_logits(model, sequence, _PROBE_DRAFTS, advance(kwargs, _PROBE_DRAFTS), True)  # [1, 5, vocab]
        if not cache.is_croppable and not is_static(cache):
            return (
                "its cache keeps recurrent state that cannot be rolled back to an earlier token, so rejected "
                "drafts could not be undone"
            )
        rewind_cache(cache, prompt_len + 1)
        kwargs = advance(kwargs, 2)
        second = target_logits(
            model, sequence, _PROBE_DRAFTS - 2, advance(kwargs, _PROBE_DRAFTS - 2), False, decode_kernels=False
        )
    except Exception as error:
        message = str(error).splitlines()[0] if str(error) else ""
        raise _ProbeFailed(
            f"a cached forward over several new tokens fails ({type(error).__name__}: {message[:200]})"
        ) from error
    return _disagreement(model, first, second, want)


def _recurrent_verdict(model, sequence, prompt_len: int, fresh, advance, want, step_cache) -> str | None:
    """Why speculative rounds on a recurrent cache (`_recurrent_rounds`) do not compute what step-by-step decoding
    computes (`want`: its logits; `step_cache`: its cache after the same tokens), or None."""
    first, second, cache, ignores_state = _recurrent_rounds(model, sequence, prompt_len, fresh, advance)
    if ignores_state:
        return (
            "its recurrent layers' forward over several new tokens ignores the state in the cache (it ends "
            "in the same state from a zeroed one: a scan that starts from zeros), so a verify forward after "
            "the prompt does not continue the sequence as one-token decoding does"
        )
    return _disagreement(model, first, second, want, recurrent=True) or _state_disagreement(model, cache, step_cache)


def _recurrent_rounds(model, sequence, prompt_len: int, fresh, advance):
    """The probe's speculative rounds on a recurrent cache, as `SequenceLane` runs them: the prompt but its last token
    in a forward of its own, a checkpoint, the last token and 4 drafts in one forward; 1 accepted, so back to the
    checkpoint; then the kept tokens (the last prompt token, the accepted draft and the replacement) fed again
    before the 2 remaining drafts, in one forward. Returns the logits of both rounds' forwards, as the
    key/value probe's."""
    kwargs = fresh()
    cache = kwargs[CACHE_KWARG]
    checkpoints = RecurrentCheckpoints(cache, model=model)
    if prompt_len > 1:
        prefix = per_token_prefix(kwargs, prompt_len, prompt_len - 1)
        target_logits(model, sequence[:, : prompt_len - 1], 0, prefix, True, cached=0)
        checkpoints.fed(prompt_len - 1)
    checkpoints.save()
    first = target_logits(
        model, sequence, _PROBE_DRAFTS, advance(kwargs, _PROBE_DRAFTS), prompt_len == 1, cached=prompt_len - 1
    )
    checkpoints.fed(_PROBE_DRAFTS + 1)
    verified = [state.clone() for state in _recurrent_states(cache)]
    kept = checkpoints.rewind(prompt_len + 1)
    # the same forward from zeroed recurrent states: a layer whose several-token forward ignores the cached state
    # (a scan that starts from zeros) ends in bitwise the same state, whatever the dtype's rounding, and computes
    # bitwise the same logits (a state that only delays the last input, Zaya's, also ends the same, but is read)
    ignores_state = False
    if prompt_len > 1:
        for state in _recurrent_states(cache):
            state.zero_()
        zeroed = target_logits(model, sequence, _PROBE_DRAFTS, advance(kwargs, _PROBE_DRAFTS), False, cached=kept)
        ignores_state = torch.equal(zeroed, first) and any(
            torch.equal(state, before) for state, before in zip(_recurrent_states(cache), verified, strict=True)
        )
        checkpoints.fed(_PROBE_DRAFTS + 1)
        kept = checkpoints.rewind(prompt_len + 1)
    kwargs = advance(kwargs, 2)
    second = target_logits(
        model, sequence, _PROBE_DRAFTS - 2, advance(kwargs, _PROBE_DRAFTS - 2), False, decode_kernels=False, cached=kept
    )
    return first, second, cache, ignores_state


def _module_tensors(model) -> dict[str, torch.Tensor]:
    """The tensors `model`'s modules hold as plain attributes (not parameters or buffers), by qualified name."""
    return {
        f"{prefix}.{name}" if prefix else name: value
        for prefix, module in model.named_modules()
        for name, value in vars(module).items()
        if isinstance(value, torch.Tensor)
    }


def _recurrent_states(cache) -> list[torch.Tensor]:
    return [
        state
        for layer in recurrent_layers(cache)
        for index, state in layer.recurrent_states.items()
        if state is not None and layer.has_previous_state[index]
    ]


def _state_disagreement(model, cache, step_cache) -> str | None:
    """Why the recurrent states after the probe's speculative rounds differ from those after step-by-step decoding
    of the same tokens, or None: more sensitive than the logits where a layer's contribution is small. Float32 only:
    in lower precision a state's rounding over a prompt (chunked and one-token kernels round differently) is as
    large as what this could tell apart; the structural checks and the logits' comparison remain."""
    if model.dtype != torch.float32:
        return None
    for layer, step_layer in zip(recurrent_layers(cache), recurrent_layers(step_cache), strict=True):
        for index, state in layer.recurrent_states.items():
            expected = step_layer.recurrent_states[index]
            if state is None or expected is None:
                continue
            scale = float(expected.abs().max().clamp(min=1.0))
            tolerance = 1e-4 * scale
            error = float((state.float() - expected.float()).abs().max())
            if not error <= tolerance:
                return (
                    "its recurrent layers do not continue from the state in the cache over several tokens as they "
                    f"do over one (largest state difference {error:.3g} after a rollback and several-token forwards, "
                    f"against {tolerance:.3g} of rounding)"
                )
    return None


def _disagreement(model, first, second, want, recurrent: bool = False) -> str | None:
    """The reason the speculative rounds' logits (`first`: the prompt's last position and 4 drafts; `second`: the
    logits after extra tokens 1, 2 and 3) differ from step-by-step decoding's (`want`), or None."""
    # 'second' holds the logits after extra tokens 1, 2 and 3: positions 2-4 of `want`
    error = max(float((first - want).abs().max()), float((second - want[:, 2:]).abs().max()))
    scale = float(want.abs().max().clamp(min=1.0))
    tolerance = (1e-4 if model.dtype == torch.float32 else 3e-2) * scale
    if not error <= tolerance:
        return (
            f"a cached forward over several new tokens disagrees with step-by-step decoding (largest logit "
            f"difference {error:.3g}, against {tolerance:.3g} of rounding)"
            + (
                ": its recurrent layers do not continue from the state in the cache over several tokens as they do "
                "over one"
                if recurrent
                else ""
            )
        )
    return None
