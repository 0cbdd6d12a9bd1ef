"""What verification decides in a round (`Verdict`), read on the host in one transfer (`read_verdict`), and where
the stopping criteria stop the emitted tokens (`first_stops`, one more read).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import MaxLengthCriteria, StoppingCriteriaList

from .block_verification import verify_block
from .configuration import SpeculativeOptions
from .drafters.base import DraftProposal
from .proposals import ProposalCheck
from .sampling import draft_target_overlap, verify_greedy, verify_sampling

__all__ = ["Verdict", "first_draft_acceptance", "first_stops", "read_verdict", "verify_round"]


@dataclasses.dataclass
class Verdict:
    """What verification decided for each row."""

    accepted: torch.LongTensor  # [batch]: drafts kept (the accepted path's length, for a tree)
    next_tokens: torch.LongTensor  # [batch]: the recovered or bonus token
    accepted_nodes: torch.LongTensor | None  # [batch, k]: a tree's accepted path (node ids, -1 padded); chains: None
    betas: torch.Tensor  # [batch, depth]: β per drafted position, float or bool (a tree: 1 per accepted depth, else 0)
    tree_depth: torch.LongTensor | None = None  # a tree's depth (0-dim), read with the verdict; chains: None
    tree_path_in_place: torch.BoolTensor | None = None  # [batch]: a tree's accepted path is nodes 0, 1, ... in order
    accepted_counts: list[int] | None = None  # `accepted` on the host, once `read_verdict` has read the round
    beta_values: list[list[float]] | None = None  # `betas` on the host, likewise, cut to the drafted depth
    depth: int | None = None  # the drafted depth on the host (a chain's drafts; a tree's deepest node), likewise
    path_in_place: list[bool] | None = None  # `tree_path_in_place` on the host, likewise; chains: None


def read_verdict(verdict: Verdict, check: ProposalCheck) -> Verdict:
    """The round's one host read of its verdict: every row's accepted count and β per drafted position, with the
    proposal's check and a tree's depth and path in the same transfer (a failed check raises here, before anything is
    emitted). Fills the verdict's host fields (`accepted_counts`, `beta_values`, `depth`, `path_in_place`) and
    returns it."""
    rows, device = verdict.accepted.shape[0], verdict.accepted.device
    tree = verdict.tree_depth is not None
    failed = check.failed if check.failed is not None else verdict.accepted.new_zeros((), dtype=torch.bool)
    # one column each: accepted, failed[, depth, in place], betas, in one `cat` that promotes them to one dtype
    # (int64, or float32 where β was computed: small counts and flags are exact either way). A chain's depth is its
    # drafts' count, known on the host (a tensor made from it would be a copy to the device)
    columns = [verdict.accepted[:, None], failed.to(device).expand(rows, 1)]
    if tree:
        columns += [verdict.tree_depth.to(device).expand(rows, 1), verdict.tree_path_in_place[:, None]]
    values = torch.cat([*columns, verdict.betas], dim=1).tolist()
    check.raise_if(bool(values[0][1]))
    verdict.depth = int(values[0][2]) if tree else verdict.betas.shape[1]
    if tree:
        verdict.path_in_place = [bool(row[3]) for row in values]
    verdict.accepted_counts = [int(row[0]) for row in values]
    verdict.beta_values = [[float(b) for b in row[len(columns) : len(columns) + verdict.depth]] for row in values]
    return verdict


def first_stops(stopping_criteria, rows: list[tuple[torch.LongTensor, int, int]], scores_at=None) -> list[int | None]:
    """Where the stopping criteria stop each row's new tokens: for each `(sequences, start, count)` (`sequences`:
    `[1, start + count]`, its last `count` tokens new), the 1-based index of the first new token after which a
    criterion fires, or None. Every prefix is checked as plain `generate` checks after each token (EOS, stop strings,
    custom criteria may fire inside an accepted block), with one host read for all rows; transformers' max-length
    criterion, a function of the length alone, is decided on the host (no read when it is the only criterion).
    `scores_at(e)`: the scores tuple plain `generate` would pass after a row's e-th new token (None: no scores)."""
    on_host = [criterion for criterion in stopping_criteria if type(criterion) is MaxLengthCriteria]
    on_device = StoppingCriteriaList([c for c in stopping_criteria if type(c) is not MaxLengthCriteria])
    checks = [
        on_device(sequences[:, : start + e], scores_at(e) if scores_at is not None else None).any()
        for sequences, start, count in rows
        for e in range(1, count + 1)
        if on_device
    ]
    fired = iter(torch.stack(checks).tolist() if checks else [])  # [sum of counts]
    stops = []
    for sequences, start, count in rows:
        row_fired = [next(fired) for _ in range(count)] if on_device else [False] * count
        for criterion in on_host:  # fires once the prefix is `max_length` long: after new token max_length - start
            first = max(1, criterion.max_length - start)
            if first <= count:
                row_fired[first - 1] = True
            limit = criterion.max_position_embeddings
            if limit is not None and start + count > limit:
                criterion(sequences, None)  # its own warning past the model's position table, as plain generate
        stops.append(row_fired.index(True) + 1 if any(row_fired) else None)
    return stops


def uses_block_verification(options: SpeculativeOptions, probs: torch.Tensor | None) -> bool:
    """Whether a sampled chain is verified jointly: always with `"block"`; with `"auto"` when its drafts were sampled
    (`probs` given: with point masses block accepts no more in expectation, `hf_specdec.block_verification`) and no
    lenience is asked for (defined for token-wise verification)."""
    verification = options.speculative_verification
    return verification == "block" or (
        verification == "auto" and probs is not None and options.speculative_lenience == 1.0
    )


def verify_round(
    do_sample: bool, proposal: DraftProposal, target_scores: torch.FloatTensor, options: SpeculativeOptions
) -> Verdict:
    """Algorithm 1 (or, sampling, block verification: `speculative_verification="block"`, or `"auto"` for sampled
    drafts) on a chain of drafts, on standardized scores `[batch, k + 1, vocab]` (trees: `TreeLayout.verify`)."""
    tokens, probs = proposal.tokens, proposal.probs
    num_drafted = tokens.shape[1]
    if do_sample:
        target_probs = target_scores.softmax(dim=-1)  # [batch, k + 1, vocab]
        if uses_block_verification(options, probs):
            accepted, next_tokens = verify_block(tokens, probs, target_probs)
        else:
            accepted, next_tokens = verify_sampling(tokens, probs, target_probs, lenience=options.speculative_lenience)
        betas = draft_target_overlap(tokens, probs, target_probs)  # [batch, k]
    else:
        target_tokens = target_scores.argmax(dim=-1)  # [batch, k + 1]
        betas = tokens == target_tokens[:, :num_drafted]  # [batch, k]: β is 1 where the draft is the argmax
        accepted, next_tokens = verify_greedy(
            tokens, target_scores, options.speculative_lenience, target_tokens=target_tokens, exact=betas
        )
    return Verdict(accepted, next_tokens, None, betas)


def first_draft_acceptance(
    guess: DraftProposal, target_scores: torch.FloatTensor, token: int, do_sample: bool, lenience: float = 1.0
) -> float | None:
    """How likely verification would have accepted the first drafted token of `guess` (one sequence) at a position
    where the target's standardized scores are `target_scores` (`[vocab]`) and it emitted `token`; None when the
    guess drafted nothing. Greedy: 1.0 when a first-level draft is `token` (or, with `lenience` < 1, has
    p(x) >= lenience * max(p)), else 0.0. Sampling: min(1, p(x) / (lenience * q(x))) for a sampled draft (Algorithm 1's
    acceptance probability, Appendix A.5's with lenience), p's mass on the distinct first-level drafts for
    deterministic ones. Used by the `auto` policy's shadow drafts, which verify nothing."""
    if not guess.tokens.shape[1]:
        return None
    first = guess.tokens[0] if guess.parents is None else guess.tokens[0][guess.parents[0] < 0]  # [n]
    if guess.parents is None:
        first = first[:1]
    if not do_sample and lenience >= 1.0:
        return float(bool((first == token).any()))
    p = target_scores.float().softmax(dim=-1)  # [vocab]
    if not do_sample:
        return float(bool((first == token).any() | (p[first] >= lenience * p.max()).any()))
    if guess.probs is not None and guess.parents is None:
        q = guess.probs[0, 0].float()
        return float(torch.clamp(p[first[0]] / (lenience * q[first[0]]), max=1.0))
    return float(p[first.unique()].sum().clamp(max=1.0))
