"""`resolve_drafter`: the `drafter` / `assistant_model` arguments of one `generate` call, as a `Drafter`; and
`refuse_unused_arguments`: the call's drafting arguments that nothing would use."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from transformers import PreTrainedModel

from .drafters.base import Drafter, get_drafter_class
from .drafters.cross_tokenizer import CrossTokenizerDrafter
from .drafters.gemma4_assistant import Gemma4AssistantDrafter, is_gemma4_assistant
from .drafters.model import ModelDrafter
from .modeling import logits_width

__all__ = ["refuse_unused_arguments", "resolve_drafter"]


def resolve_drafter(
    drafter,
    assistant_model,
    drafter_kwargs: dict[str, Any] | None = None,
    *,
    tokenizer=None,
    assistant_tokenizer=None,
    target: PreTrainedModel | None = None,
) -> Drafter:
    """Turns the `drafter` / `assistant_model` arguments of one `generate` call into a `Drafter`: with
    `assistant_tokenizer` (and the target's `tokenizer`), a model with another vocabulary becomes a
    `CrossTokenizerDrafter`; `target` lets a vocabulary mismatch without `assistant_tokenizer` fail naming the fix."""
    if assistant_tokenizer is not None:
        return _cross_tokenizer_drafter(
            drafter, assistant_model, drafter_kwargs, tokenizer, assistant_tokenizer, target
        )
    if target is not None and isinstance(assistant_model if assistant_model is not None else drafter, PreTrainedModel):
        model = assistant_model if assistant_model is not None else drafter
        width, target_width = logits_width(model), logits_width(target)
        if width != target_width:
            raise ValueError(
                f"`assistant_model` ({type(model).__name__}) has a vocabulary of {width} tokens but the target has "
                f"{target_width} ({type(target).__name__}): they do not share a tokenizer. To draft with "
                "another tokenizer, pass both tokenizers: `generate(..., assistant_model=draft, tokenizer=tokenizer, "
                "assistant_tokenizer=draft_tokenizer)`; or use a drafter with the target's vocabulary."
            )
    if drafter is not None and assistant_model is not None:
        raise ValueError(
            f"Pass either `assistant_model` or `drafter`, not both (got assistant_model={type(assistant_model).__name__} "
            f"and drafter={drafter!r})."
        )
    if drafter_kwargs is not None and not isinstance(drafter, str):
        raise ValueError(
            f"`drafter_kwargs` only applies when `drafter` is a registered name, got drafter={drafter!r}. "
            "Configure a drafter instance through its constructor instead."
        )
    if assistant_model is not None:
        return _model_drafter(assistant_model)
    if isinstance(drafter, Drafter):
        return drafter
    if isinstance(drafter, PreTrainedModel):
        return _model_drafter(drafter)
    if isinstance(drafter, str):
        if drafter_kwargs is not None and not isinstance(drafter_kwargs, Mapping):
            raise TypeError(
                f"`drafter_kwargs` must be a dict of options for the drafter {drafter!r}, got "
                f"{type(drafter_kwargs).__name__} {drafter_kwargs!r}. For example `drafter_kwargs={{'max_ngram_size': "
                "4}` with `drafter='prompt_lookup'`."
            )
        return get_drafter_class(drafter).from_options(**(drafter_kwargs or {}))
    raise TypeError(
        f"`drafter` must be a registered drafter name, a `hf_specdec.Drafter` or a `PreTrainedModel`, got "
        f"{type(drafter).__name__}. Registered names: see `hf_specdec.list_drafters()`."
    )


def _model_drafter(model: PreTrainedModel) -> Drafter:
    """A draft model as its drafter: a Gemma 4 assistant drafts from the target's shared key/value states, any other
    model as a `ModelDrafter`."""
    return Gemma4AssistantDrafter(model) if is_gemma4_assistant(model) else ModelDrafter(model)


def _cross_tokenizer_drafter(
    drafter, assistant_model, drafter_kwargs, tokenizer, assistant_tokenizer, target
) -> Drafter:
    """`assistant_tokenizer`: a `CrossTokenizerDrafter`, or a `ModelDrafter` when the two tokenizers are the same."""
    model = assistant_model if assistant_model is not None else drafter
    if not isinstance(model, PreTrainedModel) or (assistant_model is not None and drafter is not None):
        raise ValueError(
            f"`assistant_tokenizer` ({type(assistant_tokenizer).__name__}) is the tokenizer of `assistant_model`, "
            f"so it needs an `assistant_model` (a `PreTrainedModel`) and no `drafter`, got assistant_model="
            f"{type(assistant_model).__name__ if assistant_model is not None else None} and drafter={drafter!r:.80}. "
            "Pass `assistant_model=draft_model`, or drop `assistant_tokenizer`."
        )
    if drafter_kwargs is not None:
        raise ValueError(
            f"`drafter_kwargs` ({drafter_kwargs!r}) only applies when `drafter` is a registered name. Build a "
            "`hf_specdec.CrossTokenizerDrafter(...)` yourself to set its options."
        )
    if tokenizer is None:
        raise ValueError(
            f"`assistant_tokenizer` ({type(assistant_tokenizer).__name__}) needs the target's tokenizer as well, to "
            "move text between the two vocabularies: pass `tokenizer=tokenizer` to `generate` (as with transformers' "
            "universal assisted generation)."
        )
    same = (
        target is not None
        and hasattr(tokenizer, "get_vocab")
        and hasattr(assistant_tokenizer, "get_vocab")
        and tokenizer.get_vocab() == assistant_tokenizer.get_vocab()
    )
    if is_gemma4_assistant(model):
        if same:
            return Gemma4AssistantDrafter(model)
        raise ValueError(
            f"{type(model).__name__} is a Gemma 4 assistant, which drafts in its target's vocabulary, but "
            "`assistant_tokenizer` differs from the target's tokenizer. Drop `assistant_tokenizer`."
        )
    if same:  # one vocabulary: token ids need no translation (the models' logits may be padded to other widths)
        return ModelDrafter(model, same_tokenizer=True)
    return CrossTokenizerDrafter(model, tokenizer, assistant_tokenizer)


def refuse_unused_arguments(
    called: list[tuple[str, Any]],
    assistant_tokenizer,
    drafting: bool,
    num_beams: int | None,
    built_with: Callable[[str], bool],
) -> None:
    """Refuses what one `generate` call sets that nothing would use, as transformers refuses unused arguments:
    without a drafter, its `speculative_*` arguments (`called`: those not None) and `assistant_tokenizer` (which
    transformers drops without a word); with one but without beams, `speculative_draft_beams`. A pipeline hands every
    call what its construction set, also to a call that does not draft (`assistant_model=None`) or has no beams:
    there it waits for the calls that use it (`built_with(name)`)."""
    if not drafting:
        if assistant_tokenizer is not None:
            called = [*called, ("assistant_tokenizer", f"<{type(assistant_tokenizer).__name__}>")]
        unused = [(name, value) for name, value in called if not built_with(name)]
        if unused:
            name, value = unused[0]
            shown = value if name == "assistant_tokenizer" else repr(value)
            raise ValueError(
                f"`{name}={shown}` was given without a drafter, so nothing would use it and `generate` would decode "
                'plainly. Pass `assistant_model=...` or `drafter=...` (e.g. `drafter="prompt_lookup"`), or drop it.'
            )
        return
    draft_beams = dict(called).get("speculative_draft_beams")
    if draft_beams is not None and (num_beams or 1) <= 1 and not built_with("speculative_draft_beams"):
        raise ValueError(
            f"`speculative_draft_beams={draft_beams!r}` sets the draft model's beam width in speculative beam search, "
            f"but this call decodes with num_beams={num_beams or 1}, so nothing would use it. Drop it, or pass "
            "`num_beams` > 1."
        )
