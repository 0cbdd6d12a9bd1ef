"""One speculative round, run the same way by every loop (one sequence, a padded batch, beam search).

A round is: the drafter proposes (`proposals.checked_proposal` validates it at the boundary) → the target runs one
forward over its uncached tail and the drafts, standardized by its own logits processors (`forward`) → verification
decides what is accepted (`layouts`, `verdicts`; one host read) → the tokens are emitted through the stopping criteria
(one more read) → the target's cache keeps the accepted drafts and the drafter is told → stats and the γ policy book
the round. `Round.run` runs these stages in this order, times them and feeds the policy; what differs between loops
sits behind one seam, the `Lane`:

- `SequenceLane` (`sequence.py`): one sequence, its drafts a chain or a token tree (`ChainLayout` / `TreeLayout`),
  its cache dynamic or static (rewound in place, the forward compiled in a few padded shapes);
- `PaddedBatchLane` (`batching.py`): several left-padded rows verified in one forward, each row accepting its own
  number of drafts, the rectangle realigned after the round;
- `BeamLane` (`beam.py`): the drafter's beam search verified by replaying the target's own beam search.

The loops only order rounds: `while not round.run(lane): pass`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from .configuration import SpeculativeOptions
from .devices import seconds_agreement
from .forward import compiled_graphs
from .layouts import ChainLayout
from .proposals import ProposalCheck
from .verdicts import Verdict, read_verdict

__all__ = ["Draft", "Lane", "Round", "Scores"]


@dataclasses.dataclass
class Draft:
    """What a lane drafted for one round."""

    proposal: Any  # a `DraftProposal` (beam search: its draft tree)
    check: ProposalCheck | None  # the proposal's deferred check, read with the verdict
    layout: ChainLayout | None  # how the drafts sit after the context (chain or tree)
    chosen_gamma: int  # the γ the policy chose (the lane may draft fewer, near the end)
    guess: Any = None  # a shadow draft beside a plain step (one sequence only), never verified


@dataclasses.dataclass
class Scores:
    """The round's target forward: float32 logits of the k + 1 scored positions and, after the logits processors,
    the standardized scores verification reads."""

    logits: torch.FloatTensor  # [rows, k + 1, vocab]
    scores: torch.FloatTensor  # [rows, k + 1, vocab]
    candidate_ids: torch.LongTensor | None = None  # [rows, context + k]: the context and the drafts


class Lane:
    """The stages of a round that differ between loops; `Round.run` calls them in order.

    `first_round` is true until the lane's first round has run (the prompt is then still uncached); `finished`
    becomes true when the stopping criteria end the call."""

    first_round = True
    finished = False

    def __init__(self, generation_config, options: SpeculativeOptions):
        self.do_sample = bool(generation_config.do_sample)
        self.options = options

    def room(self, gamma: int) -> int:
        """The γ this round may draft: never so many that a round could emit past `max_length`."""
        raise NotImplementedError

    def draft(self, gamma: int, chosen_gamma: int) -> Draft:
        """The drafter's proposal for up to `gamma` tokens, checked at the boundary."""
        raise NotImplementedError

    def score(self, draft: Draft) -> Scores:
        """One target forward over the uncached tail and the drafts, standardized."""
        raise NotImplementedError

    def verify(self, draft: Draft, scores: Scores) -> Verdict:
        """Verification by the draft's layout (Algorithm 1 for a chain, multi-candidate rejection for a tree), read
        on the host with the proposal's check in one transfer."""
        return read_verdict(draft.layout.verify(self.do_sample, scores.scores, self.options), draft.check)

    def emit(self, draft: Draft, verdict: Verdict, scores: Scores) -> None:
        """Books the round's stats and appends the new tokens through the stopping criteria."""
        raise NotImplementedError

    def keep(self, draft: Draft, verdict: Verdict, scores: Scores) -> None:
        """The target's cache keeps what was accepted; the drafter is told."""
        raise NotImplementedError

    def observe(self, policy, draft: Draft, verdict: Verdict, draft_s: float, verify_s: float) -> None:
        """Tells the γ policy how the round went (and books per-row time, where rows are kept apart)."""
        policy.observe(
            drafted=verdict.depth,
            accepted=verdict.accepted_counts[0],
            draft_time_s=draft_s,
            verify_time_s=verify_s,
            first_round=self.first_round,
        )


class Round:
    """Runs rounds of one call: the policy's γ, the lane's stages in order, the draft and verify times (the same
    seconds in every process of a tensor-parallel target), the drafter's compilations, and the policy's
    observations."""

    def __init__(self, model, policy, stats):
        self.policy = policy
        self.stats = stats
        self.agree = seconds_agreement(model)

    def run(self, lane: Lane) -> bool:
        """Runs one round of `lane`; returns whether the call is finished."""
        stats = self.stats
        chosen_gamma = self.policy.next_gamma()
        gamma = lane.room(chosen_gamma)
        draft_start = time.perf_counter()
        graphs = compiled_graphs()
        draft = lane.draft(gamma, chosen_gamma)
        stats.drafter_compilations += compiled_graphs() - graphs
        verify_start = time.perf_counter()
        scores = lane.score(draft)
        verdict = lane.verify(draft, scores)
        lane.emit(draft, verdict, scores)
        graphs = compiled_graphs()
        lane.keep(draft, verdict, scores)
        stats.drafter_compilations += compiled_graphs() - graphs
        draft_s, verify_s = self.agree(verify_start - draft_start, time.perf_counter() - verify_start)
        stats.draft_time_s += draft_s
        stats.verify_time_s += verify_s
        lane.observe(self.policy, draft, verdict, draft_s, verify_s)
        lane.first_round = False
        return lane.finished
