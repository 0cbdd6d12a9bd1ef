"""A drafter's proposal at the boundary of a round: validated shapes on the host, and its values checked on the
device (`ProposalCheck`), read with the round's verdict so validation costs no host read of its own.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from transformers import LogitsProcessorList, PrefixConstrainedLogitsProcessor

from .drafters.base import DraftContext, Drafter, DraftProposal
from .modeling import logits_width
from .trees import ancestor_mask, check_parents

__all__ = ["ProposalCheck", "checked_proposal", "draft_context"]


def draft_context(
    model, input_ids, logits_processor, generation_config, model_kwargs, inputs_tensor, tree_budget: int | None = None
) -> DraftContext:
    return DraftContext(
        target=model,
        input_ids=input_ids,
        logits_processor=_for_draft_rows(logits_processor, input_ids.shape[0]),
        generation_config=generation_config,
        vocab_size=logits_width(model),
        tree_budget=tree_budget,
        model_kwargs=model_kwargs,
        inputs_tensor=inputs_tensor,
    )


def _for_draft_rows(logits_processor, rows: int) -> LogitsProcessorList:
    """The target's processors as a drafter calls them: on more rows than the call's `rows` (a tree's frontier, a
    draft beam search's beams), each row drafting for one of its prompts. transformers' prefix-function processor
    (`prefix_allowed_tokens_fn`) numbers the prompts from the rows (`row // num_beams`), and would hand the function
    prompt numbers past the call's; a copy that groups the rows by prompt replaces it."""
    if not any(isinstance(processor, PrefixConstrainedLogitsProcessor) for processor in logits_processor):
        return logits_processor
    return LogitsProcessorList(
        _DraftRowsPrefix(processor, max(1, rows // processor._num_beams))
        if isinstance(processor, PrefixConstrainedLogitsProcessor)
        else processor
        for processor in logits_processor
    )


class _DraftRowsPrefix(PrefixConstrainedLogitsProcessor):
    """`PrefixConstrainedLogitsProcessor` for a drafter's rows: `prompts` prompts, each with the same number of rows
    in a block (a tree's frontier of one sequence, u draft beams per prompt), so that the function gets each row's
    prompt number as plain `generate` gives it. Rows that do not divide into the prompts (a padded batch whose
    finished rows left) are numbered as transformers numbers them."""

    def __init__(self, processor: PrefixConstrainedLogitsProcessor, prompts: int):
        super().__init__(processor._prefix_allowed_tokens_fn, processor._num_beams)
        self.prompts = prompts

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = input_ids.shape[0]
        grouped = self
        if rows > self.prompts and rows % self.prompts == 0:
            grouped = copy.copy(self)
            grouped._num_beams = rows // self.prompts
        return PrefixConstrainedLogitsProcessor.__call__(grouped, input_ids, scores)


@dataclasses.dataclass
class ProposalCheck:
    """The check of a proposal's values (token ids in the vocabulary; q a distribution giving each drafted token
    q(x) > 0; a tree's parents valid and its depth within γ), still on the device: a round reads it in the same
    transfer as its verdict (`read_verdict`), so validation costs no host read of its own. Until then the proposal
    carries safe stand-ins (ids clamped into the vocabulary, a uniform q and root parents where the check failed),
    so nothing downstream fails inside torch or on the device."""

    failed: torch.Tensor | None  # a 0-dim bool tensor; None when there is nothing to check (no drafts)
    drafter_name: str
    tokens: torch.Tensor  # [batch, k]: the tokens as the drafter returned them
    probs: torch.Tensor | None  # [batch, k, vocab] as returned
    vocab_size: int
    parents: torch.Tensor | None = None  # [batch, k]: a tree's parents as returned
    max_depth: int | None = None  # the γ a tree's depth is bounded by

    def fail_if(self, flag: torch.Tensor) -> None:
        """Adds a condition (a 0-dim bool tensor) under which the proposal fails."""
        self.failed = flag if self.failed is None else self.failed | flag.to(self.failed.device)

    def raise_if(self, failed: bool) -> None:
        """Raises the error that says what is wrong, once the flag has been read as `failed`."""
        if failed:
            _reject_proposal(self)

    def read(self) -> None:
        """Reads the flag on its own (one host read) and raises if the proposal failed."""
        self.raise_if(self.failed is not None and bool(self.failed))


def checked_proposal(
    proposal: DraftProposal,
    drafter: Drafter,
    input_ids: torch.LongTensor,
    gamma: int,
    vocab_size: int,
    tree_budget: int | None = None,
) -> tuple[DraftProposal, ProposalCheck]:
    """Validates a proposal at the boundary, so a faulty drafter fails with a clear error rather than deep inside
    torch; returns it with its tokens (and parents) as long tensors on the target's device, and the check of its
    values (`ProposalCheck`), to be read with the round's verdict. Shapes and trees are checked here, on the host."""
    name = type(drafter).__name__
    if not isinstance(proposal, DraftProposal):
        raise TypeError(
            f"{name}.propose must return a `hf_specdec.DraftProposal`, got {type(proposal).__name__}. Return "
            "`DraftProposal(tokens=...)`, or `DraftProposal.empty(batch_size, device)` to propose nothing."
        )
    tokens = proposal.tokens
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[0] != input_ids.shape[0]:
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"{name}.propose must return tokens of shape [batch={input_ids.shape[0]}, k], got {shape}.")
    parents, probs = proposal.parents, proposal.probs
    if probs is not None and (not isinstance(probs, torch.Tensor) or tuple(probs.shape) != (*tokens.shape, vocab_size)):
        shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise ValueError(
            f"{name}.propose returned probs of shape {shape}, expected {(*tokens.shape, vocab_size)} "
            "([batch, k, vocab]) or None."
        )
    check = ProposalCheck(None, name, tokens, probs, vocab_size)
    if tokens.shape[1]:
        # one fused check, read later with the verdict: q that is not a distribution, or gives a drafted token
        # q(x) = 0, would make rejection sampling accept what the target never samples
        clamped = tokens.clamp(0, vocab_size - 1)  # ids stay valid for the embedding until the read raises
        bad = (clamped != tokens).any()
        if probs is not None:
            drafted = clamped.to(device=probs.device, dtype=torch.long)
            q_x = probs.gather(-1, drafted[..., None])  # [batch, k, 1]
            total = probs.sum(dim=-1, dtype=torch.float64)  # [batch, k]: NaN or inf if any entry is
            tolerance = 1e-3 if probs.element_size() >= 4 else 2e-2
            bad = bad | (probs.amin(dim=-1) < 0).any() | ~((total - 1).abs() <= tolerance).all() | ~(q_x > 0).all()
            probs = torch.where(bad.to(probs.device), 1.0 / vocab_size, probs)  # a stand-in until the read raises
        check.failed = bad
        tokens = clamped
    tokens = tokens.to(device=input_ids.device, dtype=torch.long)
    if parents is not None:
        if not isinstance(parents, torch.Tensor) or tuple(parents.shape) != tuple(tokens.shape):
            shape = tuple(parents.shape) if isinstance(parents, torch.Tensor) else type(parents).__name__
            raise ValueError(f"{name}.propose returned parents of shape {shape}, expected {tuple(tokens.shape)}.")
        parents = parents.to(device=input_ids.device, dtype=torch.long)
        index = torch.arange(tokens.shape[1], device=parents.device)
        if tree_budget is None:
            # a call that verifies chains only takes chain-shaped parents as a chain (one read, on this path only)
            if not bool((parents == index - 1).all()):
                raise ValueError(
                    f"{name}.propose returned a token tree (`parents`), but this call verifies chains only. Pass "
                    "`speculative_tree_budget=N` to verify trees of up to N nodes."
                )
            parents = None
    if parents is not None:
        if tokens.shape[1] > tree_budget:
            raise ValueError(
                f"{name}.propose returned a tree of {tokens.shape[1]} nodes, more than speculative_tree_budget="
                f"{tree_budget}."
            )
        invalid = (parents < -1) | (parents >= index)  # [batch, k]: each parent must be -1 or an earlier node
        check.parents = parents
        check.fail_if(invalid.any())
        parents = torch.where(invalid, -1, parents)  # a stand-in until the read raises
    elif tokens.shape[1] > gamma:
        raise ValueError(f"{name}.propose returned {tokens.shape[1]} tokens, more than the {gamma} asked for.")
    return DraftProposal(tokens=tokens, probs=probs, parents=parents), check


def _reject_proposal(check: ProposalCheck):
    """Says what is wrong with a proposal that failed its `ProposalCheck` (the slow path: it reads what it needs)."""
    name, tokens, probs, vocab_size = check.drafter_name, check.tokens, check.probs, check.vocab_size
    if bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        raise ValueError(
            f"{name}.propose returned token ids outside the target's vocabulary [0, {vocab_size}): "
            f"{tokens.tolist()}. Build the drafter for the target's tokenizer."
        )
    promise = (
        "`probs[b, i]` must be the standardized distribution q that token i was sampled from (see "
        "`hf_specdec.Drafter`); return `probs=None` for tokens chosen deterministically"
    )
    if probs is not None:
        total = probs.sum(dim=-1, dtype=torch.float64)
        tolerance = 1e-3 if probs.element_size() >= 4 else 2e-2
        if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
            raise ValueError(f"{name}.propose returned probs with negative, NaN or infinite entries: {promise}.")
        q_x = probs.gather(-1, tokens.to(device=probs.device, dtype=torch.long)[..., None])[..., 0]
        if not bool((q_x > 0).all()):
            raise ValueError(
                f"{name}.propose returned probs with q(x) = 0 for drafted tokens (q(x) per position: "
                f"{q_x.tolist()}, tokens {tokens.tolist()}): a token sampled from q has q(x) > 0; {promise}."
            )
        if not bool(((total - 1).abs() <= tolerance).all()):
            raise ValueError(
                f"{name}.propose returned probs that do not sum to 1 over the vocabulary (sums: {total.tolist()}): "
                f"{promise}, e.g. `scores.softmax(dim=-1)` after the target's logits processors."
            )
    if check.parents is not None:
        problem = check_parents(check.parents)
        if problem is not None:
            raise ValueError(f"{name}.propose returned invalid parents {check.parents.tolist()}: {problem}.")
        depth = int(ancestor_mask(check.parents).sum(dim=-1).max())
        if check.max_depth is not None and depth > check.max_depth:
            raise ValueError(
                f"{name}.propose returned a tree {depth} nodes deep, deeper than the {check.max_depth} tokens asked "
                "for: `num_tokens` bounds a tree's depth."
            )
    raise AssertionError(f"a proposal of {name} failed its check, but no condition explains it")
