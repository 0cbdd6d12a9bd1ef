"""The `Drafter` interface and the open drafter registry.

A drafter proposes up to γ tokens per round. A drafter that samples from a distribution returns the standardized
probabilities it sampled from (q in the paper), so that sampling stays exact; a deterministic drafter (prompt
lookup, a greedy table) returns `probs=None` and the sampler treats q as a point mass on each proposed token.
"No proposal" is always an empty `[batch, 0]` token tensor, never `None`; the loop then decodes one plain step.

A proposal may be a **token tree** (`DraftProposal.parents`): several candidate continuations that the target
verifies in one forward, each node seeing the context and its ancestors only. Drafters learn the most nodes a
round may verify from `DraftContext.tree_budget` (`None`: chains only); `num_tokens` bounds the tree's depth.

What a drafter promises, so that verification stays exact:
- each proposed token lies in the target's vocabulary, and a node's parent comes before it (`parents[b, i] < i`);
- `probs[b, i]` is the standardized distribution node i was *sampled* from, given its ancestors, and node i was
  drawn from it independently of its siblings (the same q for i.i.d. siblings is fine); a node chosen
  deterministically (argmax, top-k, a table or a copy) has no q: pass `probs=None` for the whole proposal;
- so `probs` is `[batch, k, vocab]`, finite, non-negative, sums to 1 over the vocabulary at every position, and
  gives each drafted token q(x) > 0 (it was drawn from q). `checked_proposal` checks exactly this at the boundary
  (one fused check, one host sync per round) and raises a `ValueError` naming the drafter: a q of 0 or below on a
  drafted token would otherwise make rejection sampling accept tokens the target never samples;
- which nodes a tree has may depend on the drafter's scores of nodes above them, never on the values drawn for
  the nodes themselves (no pruning of sampled siblings by what they turned out to be);
- `propose` returns a `DraftProposal` (`DraftProposal.empty(batch, device)` for none); anything else is a
  `TypeError` at the boundary.

What the check cannot see, and stays the drafter's promise: that q really is the distribution the tokens were
drawn from. Likewise the target's logits processors (`DraftContext.logits_processor`, and any `logits_processor=`
passed to `generate`) must be functions of the prefix they are given: speculation calls them for drafted
positions that may be rejected, more than once per position and out of step order, so a processor that keeps
state between calls (counts calls, remembers the last step) sees extra positions and the output differs from
plain `generate`.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel

from ..registry import Registry

__all__ = ["DraftContext", "DraftProposal", "Drafter", "get_drafter_class", "list_drafters", "register_drafter"]


@dataclasses.dataclass
class DraftContext:
    """What a drafter may know about the `generate` call it serves; handed to `Drafter.reset` once per call."""

    target: PreTrainedModel
    """The target model (read it, never modify it)."""
    input_ids: torch.LongTensor  # [batch, prompt_len]
    """The prompt (decoder prompt for encoder-decoder targets)."""
    logits_processor: LogitsProcessorList
    """The target's prepared processors: apply them to drafter logits to standardize q exactly like p."""
    generation_config: GenerationConfig
    """The call's resolved generation config (read only)."""
    vocab_size: int
    """Width of the target's logits; proposed token ids must lie in [0, vocab_size)."""
    tree_budget: int | None = None
    """`speculative_tree_budget`: the most draft nodes one proposal may hold when it is a tree (`None`: the call
    verifies chains only, so a proposal must not set `parents`)."""
    model_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The target's prepared model kwargs at the start of decoding (attention mask, encoder outputs...). Their cache
    (`model_kwargs["cache"]`, or `past_key_values`) is the object the rounds keep updating in place: at each
    `propose` it holds every token of `input_ids` but the newest (a drafter may read it, never change it)."""
    inputs_tensor: torch.Tensor | None = None
    """The tensor `generate` was called with (encoder input for encoder-decoder targets)."""

    @property
    def do_sample(self) -> bool:
        """Whether the call samples (`generation_config.do_sample`) rather than decoding greedily."""
        return bool(self.generation_config.do_sample)


@dataclasses.dataclass
class DraftProposal:
    """The drafter's answer for one round."""

    tokens: torch.LongTensor  # [batch, num_drafted]; num_drafted may be 0
    probs: torch.FloatTensor | None = None  # [batch, num_drafted, vocab] standardized q, or None (deterministic)
    parents: torch.LongTensor | None = None
    """`[batch, num_drafted]`: for a token tree, the index of each node's parent node, -1 for the children of the
    last token of the context (a chain is `[-1, 0, 1, ...]`); parents come before their children. `None`: a chain.
    Trees are verified only when `speculative_tree_budget` is set (then `DraftContext.tree_budget` is not `None`)."""

    @classmethod
    def empty(cls, batch_size: int, device: torch.device | str) -> DraftProposal:
        """A proposal of no tokens for `batch_size` rows (`tokens` of shape `[batch_size, 0]`): "nothing to propose"
        is always this, never `None`."""
        return cls(tokens=torch.empty(batch_size, 0, dtype=torch.long, device=device))


class Drafter:
    """Base class of every drafter.

    Subclasses implement `propose`; `reset` and `on_verified` are optional hooks. A drafter object passed to
    `generate(drafter=...)` is shallow-copied at the start of each call and `reset` runs on the copy, so per-call
    state (caches, indices) never lands on the user's object: assign new attributes in `reset`, don't mutate shared
    ones in place.
    """

    free_drafts: bool = False
    """Drafts that cost next to nothing to make and end where the drafter's evidence ends (copied from text, no model
    forward: prompt lookup, suffix decoding): the default `auto` γ policy then drafts the user's γ from the first
    round on instead of starting at one token and choosing γ by cost. A drafter that does not pay is stopped all the
    same."""

    supports_padded_batches: bool = False
    """Batches of several sequences: a drafter that sets this gets the whole left-padded batch, with
    `attention_mask=` in `propose` and `on_verified` and a `select_rows` call when finished rows leave the batch
    (see `ModelDrafter`). Any other drafter gets one copy per sequence, each `reset` for and called with that one
    sequence, unpadded, exactly as at batch size 1."""

    default_gamma: int | None = None
    """The γ this drafter drafts when the call leaves `speculative_gamma` unset (in the call and in every generation
    config): None keeps the library's default (5). A drafter whose drafts cost nothing and come in long runs sets a
    longer one (`PromptLookupDrafter`: 10). An explicit `speculative_max_gamma` caps it."""

    reads_target_hidden_states: bool = False
    """A drafter that reads the target's hidden states (`EagleDrafter`) sets this and, in `reset`,
    `self.target_hidden_layers` to the entries of the target's `output_hidden_states` it reads (0: the embeddings'
    output, i: the output of decoder layer i - 1). After each verification `on_verified` then also gets
    `target_hidden_states` (`[1, n, sum of hidden sizes]`): the states of the positions whose next token became known
    in that round, in order, captured during the round's own target forwards. In a left-padded batch each row's copy
    gets its own row's states, cut from the batch's one verify forward."""

    reads_target_cache: bool = False
    """A drafter that reads the target's own key/value cache (`Gemma4AssistantDrafter`, from the call's
    `DraftContext.model_kwargs`) sets this: batches are then decoded one row at a time, each row with a cache of its
    own, since a left-padded batch's cache is shared by the rows and realigned every round."""

    def reset(self, context: DraftContext) -> None:
        """Called once at the start of each `generate` call, before the first `propose`."""

    def propose(
        self, input_ids: torch.LongTensor, num_tokens: int, attention_mask: torch.LongTensor | None = None
    ) -> DraftProposal:
        """Proposes up to `num_tokens` tokens to follow `input_ids` (`[batch, seq_len]`, prompt + emitted so far).
        `attention_mask` (`[batch, seq_len]`, 0 on left padding) is only passed with `supports_padded_batches`."""
        raise NotImplementedError(f"{type(self).__name__} must implement `propose(input_ids, num_tokens)`.")

    def on_verified(
        self,
        input_ids: torch.LongTensor,
        num_accepted: torch.LongTensor,
        attention_mask: torch.LongTensor | None = None,
        accepted_nodes: torch.LongTensor | None = None,
    ) -> None:
        """Called after each verification: `num_accepted` (`[batch]`) of the last proposal were kept, and
        `input_ids` is the sequence after this round's tokens were appended. Roll back state here. With
        `supports_padded_batches`, `input_ids` is re-padded so that rows end together, described by
        `attention_mask`. After a tree proposal, `accepted_nodes` (`[batch, num_accepted.max()]`) holds the indices
        of the nodes on the accepted path, root side first (entries past a row's `num_accepted` are -1); it is
        passed only after a proposal verified as a tree (one whose `parents` form a chain is verified, and
        reported, as a chain), so chain-only drafters need not declare it."""

    def select_rows(self, indices: torch.LongTensor) -> None:
        """With `supports_padded_batches`: keep only these rows of the batch (the others have finished). A drafter
        whose `select_rows` takes a `rows` argument also gets the kept rows as a list on the host (no read of the
        device needed to select host-side state)."""

    @classmethod
    def from_options(cls, **options) -> Drafter:
        """Builds the drafter for `generate(drafter=<registered name>, drafter_kwargs=options)`; unknown and missing
        options fail naming what the constructor takes."""
        check_options(cls, options)
        return cls(**options)

    def for_call(self, context: DraftContext) -> Drafter:
        """A per-call copy of this drafter, reset for `context` (the user's object stays untouched)."""
        drafter = copy.copy(self)
        drafter.reset(context)
        return drafter


def chain_proposal(ids: torch.LongTensor, start: int, usable: list, probs: list) -> DraftProposal:
    """The chain drafted step by step into `ids[:, start:]`, cut before the first step at which the logits
    processors left no token (`usable`: one 0-dim bool per step; one host read for all of them), with the q of each
    kept step (`probs`: `[batch, vocab]` per step; empty when the drafts were chosen deterministically)."""
    kept = int(torch.stack(usable).long().cumprod(0).sum()) if usable else 0
    tokens = ids[:, start : start + kept]  # [batch, kept]
    return DraftProposal(tokens=tokens, probs=torch.stack(probs[:kept], dim=1) if probs else None)


def require_hidden_states(drafter: Drafter, target_hidden_states) -> None:
    """Fails clearly when a drafter that reads the target's hidden states (`reads_target_hidden_states`) is told of
    a verification without them: a loop other than hf_specdec's must capture them."""
    if target_hidden_states is None:
        raise ValueError(
            f"{type(drafter).__name__} needs the target's hidden states after each verification "
            "(`target_hidden_states`), but the caller did not pass them. hf_specdec's loops do; a custom loop must "
            "capture them (`hf_specdec.capture.HiddenStateCapture`)."
        )


def check_options(cls: type, options: dict[str, Any], signature_of=None) -> None:
    """Fails unless `options` (a drafter's `drafter_kwargs`) bind to `signature_of` (default: `cls`'s constructor):
    an unknown key is a typo that would otherwise be ignored or end as a bare `TypeError`."""
    parameters = inspect.signature(signature_of or cls).parameters.values()
    accepted = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind == p.VAR_KEYWORD for p in parameters):
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise TypeError(
                f"Unknown `drafter_kwargs` key(s) {unknown} for {cls.__name__}, got drafter_kwargs={options!r}. "
                f"{cls.__name__} accepts {accepted}."
            )
    missing = [
        p.name
        for p in parameters
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in options
    ]
    if missing:
        raise TypeError(
            f"{cls.__name__} needs {missing} in `drafter_kwargs`, got drafter_kwargs={options!r}. Pass "
            f"`drafter_kwargs={{{', '.join(repr(name) + ': ...' for name in missing)}}}`, or build the drafter "
            "yourself and pass it as `drafter=`."
        )


_REGISTRY: Registry[type[Drafter]] = Registry(Drafter, "drafter", "drafter", "hf_specdec.register_drafter")


def register_drafter(name: str, cls: type[Drafter]) -> type[Drafter]:
    """Registers `cls` so that `generate(drafter=name)` builds it. A name can be registered once.

    Example:

    ```python
    >>> import hf_specdec
    >>> class EchoDrafter(hf_specdec.Drafter):
    ...     def propose(self, input_ids, num_tokens):
    ...         return hf_specdec.DraftProposal(tokens=input_ids[:, -1:].repeat(1, num_tokens))
    >>> _ = hf_specdec.register_drafter("echo-doc-example", EchoDrafter)
    >>> "echo-doc-example" in hf_specdec.list_drafters()
    True
    >>> # names stay registered for the life of the process; this example removes its own again
    >>> del hf_specdec.drafters.base._REGISTRY._classes["echo-doc-example"]

    ```
    """
    return _REGISTRY.register(name, cls)


def list_drafters() -> list[str]:
    """Names of all registered drafters, built-in and user-registered, sorted."""
    return _REGISTRY.names()


def get_drafter_class(name: str) -> type[Drafter]:
    """The drafter class registered under `name`; unknown names fail with the list of known ones."""
    return _REGISTRY.get(name)
