"""`AutoGammaPolicy` (`auto`, the default): drafts the γ, up to the user's, that `optimal`'s estimates predict pays
best, and takes plain steps (probing the drafter now and then) when drafting is measured not to pay."""

from __future__ import annotations

import collections
import math
import statistics

import torch

from .base import GammaPolicy, at_least_a_tick, count_positions, expected_tokens
from .optimal import OptimalGammaPolicy

__all__ = ["AutoGammaPolicy"]


class AutoGammaPolicy(GammaPolicy):
    """The default: while drafting, the γ in 1 ... the user's γ that `optimal`'s estimates (acceptance per draft
    position, drafting and verifying costs measured per γ; `OptimalGammaPolicy.drafting_gamma`) predict emits the most
    tokens per second, so the user's γ is the most a round drafts; unless what the call measures says drafting loses to
    plain steps, then plain steps (γ = 0), with a probe after 16, 32, 64, ... of them (a stop decided on noisy timings,
    or a drafter that becomes useful later in the text, is found again). A useless drafter costs a few rounds. The γ
    is chosen rather than always the user's because verify cost grows with γ: on a memory-bound pair whose best γ is 2
    and where γ = 5 loses 10%, drafting the user's γ = 5 whenever it does not lose runs at 0.86 of the best constant γ.

    Drafting loses when its tokens per second fall below 95% of a plain step's. Its rate is emitted tokens over drafting
    plus verifying time, summed over the drafting rounds with each older round weighing `decay` times less (about the
    last ten rounds; what was measured before a stop counts at half weight after a resume), and it is judged from the
    third drafting round on (after a resume too: one round cannot outweigh the stretch before), half a standard error of
    its mean tokens per round more optimistic than measured: a drafter whose rounds emit 1, 2 or 4 tokens pays on
    average yet has runs of unlucky rounds, and a decision on the last three rounds alone would stop such a drafter
    (e.g. an EAGLE tree that pays 1.4x) for most of its call. A drafting round's seconds count for at most 1.5x the
    median of the last five rounds, and so do a plain step's in the plain steps' decayed mean: stalls (another process
    on a loaded machine; on a GPU, attention set up for each new shape) must not stop a drafter that pays, and they
    weigh alike on both sides. A plain step costs at most a verify forward (it has fewer tokens), so a rate below one
    token per verify forward stops without a plain step to compare; when the two are close, one plain step is measured.
    A target whose one-token forward runs other kernels than its verify forwards (`one_token_kernels`: a recurrent
    model, where transformers' reference scan may pad a few tokens to a long chunk and a plain step cost a ninth of a
    verify forward) starts with plain steps instead, until two are measured (they cost nothing: plain generate takes
    them too; a drafter of free drafts, below, drafts at once, and its rounds without a match measure them); after
    each drafting round it stops at once when drafts that were always right could not beat the fastest of them
    (`_could_pay`), rather than after three losing rounds. A plain step whose forward carried kept tokens again after
    a recurrent cache's rollback (`carried_tokens`) is no plain step's cost: it is not booked.
    Once plain steps are measured, the rate is compared with theirs alone: on a CPU a bfloat16 model's forward over 2
    tokens may cost less than over 1, and a verify forward is then no bound on a plain step.

    A probe, where the loop takes shadow drafts (one sequence), is a run of plain steps, each with the drafter's
    one-token guess beside it, compared with the target's token (for sampling, accepted with Algorithm 1's probability,
    drawn from the policy's own generator). A guess that would have been accepted resumes drafting, unless drafts that
    were always right could not beat plain steps at the costs measured (`_could_pay`). The run ends without
    one once its guesses have cost `shadow_budget` (half) of a plain step: a drafter whose guess costs a third of a step
    (an early exit on a compute-bound CPU) gets one guess, a cheap feature head several, a nearly free one (prompt
    lookup) many. A guess counts for at most 1.5x the usual one (the median of recent guesses, else of a drafted token's
    seconds): one stalled guess does not end the probe. A guess of nothing (prompt lookup without a match) decides
    nothing. Loops without shadow drafts (padded batches) probe with a γ = 1 round instead, and resume on any accepted
    draft.

    A drafter whose drafts cost next to nothing and stop where its match ends (`Drafter.free_drafts`: prompt lookup,
    suffix decoding) drafts the user's γ from the first round on and is not held below it by the chooser: a smaller γ
    saves no drafting, and starting from one token and exploring cost such drafters up to 10% against a constant γ.
    One that does not pay is still stopped, stepped down and probed as below.

    Otherwise the first round drafts one token (`first_gamma`), the next ones the user's γ: nothing is known yet of the
    drafter, and a first round of γ drafts costs a useless drafter (e.g. an early exit of a 135M model in bfloat16)
    γ - 1 drafting steps and a wider prefill, 1.5-2.5 plain steps, about 9% of a 26-token answer. Its times include
    the prompt's prefill, so it counts for acceptance only; if it accepted nothing, the drafter is probed at once.
    (On a recurrent target the first drafting round comes after its plain steps: it is measured, probed likewise, and
    is the γ chooser's first round, which is not fed the plain steps before it.)

    Before it stops, a chain steps down: where a verify forward's cost grows with its tokens (a batch on a CPU, where
    γ = 5 loses and γ = 1 pays), a smaller γ may pay where the user's does not. From the measured acceptance rate of
    each draft position (decayed like the rate; rows of a batch count as fractions of a round), a plain step's seconds
    P and the median seconds R of recent drafting rounds at γ, taken as linear in the drafts (P + g (R - P) / γ for g
    drafts), it predicts the tokens per second of each smaller γ; the best is tried, afresh, when predicted to beat a
    plain step by `step_down_gain` (it caps γ until drafting is measured to pay again; then the chooser may go back up
    to the user's γ), otherwise drafting stops (and a probe that resumes it resumes the smaller γ). A useless drafter
    is predicted to lose at every γ and stops. Trees do not step down, and their depth is not chosen: their
    cost is set by the tree budget, not by the depth; a tree drafts the user's γ as its depth."""

    decay = 0.9  # weight of the drafting round before, per drafting round, in the drafting rate
    min_rounds = 3  # drafting rounds (after the first) before the rate decides
    optimism = 0.5  # standard errors added to the measured rate before it is compared (a stop needs evidence)
    first_probe_after = 16  # plain steps before the first probe (then doubled after each probe)
    shadow_budget = 0.5  # a probe's guesses may cost this many plain steps in all
    resume_weight = 0.5  # weight, at a resume, of the rounds measured before the stop
    stop_below = 0.95  # stop when the drafting rate falls below this fraction of a plain step's rate
    first_gamma = 1  # tokens drafted in the first round, before anything is measured
    max_jump = 1.5  # a drafting round's seconds count for at most this times the median of the last five
    step_down_gain = 1.05  # a smaller γ is tried when predicted to beat a plain step by this factor
    first_plain_steps = 2  # plain steps measured before a recurrent target's first drafting round

    def __init__(self, gamma: int, max_gamma: int):
        super().__init__(gamma, max_gamma)
        # decayed sums over drafting rounds: rounds, emitted tokens, their squares, drafting plus verifying seconds
        self.weight = self.tokens = self.squares = self.seconds = 0.0
        # decayed sums over drafting rounds, per draft position: rounds that reached it, and that accepted its draft
        self.position_reached = [0.0] * self.gamma
        self.position_accepted = [0.0] * self.gamma
        self.drafting_rounds = 0
        self.verify_s = collections.deque(maxlen=5)  # verify seconds of recent drafting rounds
        self.round_s = collections.deque(maxlen=5)  # drafting plus verifying seconds of recent drafting rounds
        self.round_drafted = collections.deque(maxlen=5)  # and the drafts each of them verified
        self.plain_s = collections.deque(maxlen=5)  # seconds of recent plain steps
        self.plain_weight = self.plain_seconds = 0.0  # decayed sums over plain steps: steps, seconds (stalls capped)
        self.cautious = False  # no shadow drafts: the first round accepted nothing, measure with one drafted token
        self.stopped = False
        self.probing = False  # no shadow drafts: this round is a γ = 1 probe
        self.shadow = False  # in a shadow phase: plain steps with a guess each
        self.shadow_spent = 0.0  # seconds of the current shadow phase's guesses
        self.guess_s = collections.deque(maxlen=5)  # seconds of recent guesses, as measured
        self.shadow_outcome = None  # the current step's guess: accepted (bool) or None (nothing guessed)
        self.measure_plain = False
        self.plain_rounds = 0
        self.probe_after = self.first_probe_after
        self.shadow_draft_wanted = False
        self.generator = None  # torch.Generator for sampled shadow acceptances, made on first use
        self.drafted = False  # whether a drafting round was seen
        self.user_gamma = self.gamma  # the most a round drafts; a step down lowers `self.gamma` for a while
        # which γ in 1 ... self.gamma pays best while drafting: `optimal`'s estimates, fed every round
        self.chooser = OptimalGammaPolicy(self.gamma, self.gamma)

    def next_gamma(self) -> int:
        self.shadow_draft_wanted = False
        self.shadow_outcome = None
        if self.measure_plain:
            return 0
        if self.shadow:
            self.shadow_draft_wanted = True
            return 0
        if not self.stopped:
            if self.cautious:
                return 1
            if self.one_token_kernels and not self.free_drafts and len(self.plain_s) < self.first_plain_steps:
                # a recurrent target: a plain step's cost is not known from verify forwards, so plain steps first
                # (what plain generate does: they cost nothing) until two are measured (not the prefill's). A drafter
                # of free drafts drafts at once: its rounds without a match are plain steps
                return 0
            if not self.drafted:
                return self.gamma if self.free_drafts else min(self.gamma, self.first_gamma)
            return self.gamma if self.trees or self.free_drafts else self.chooser.drafting_gamma(self.gamma)
        if self.plain_rounds >= self.probe_after:
            self.plain_rounds, self.probe_after = 0, self.probe_after * 2
            if self.shadow_drafts:
                self.shadow, self.shadow_spent, self.shadow_draft_wanted = True, 0.0, True
                return 0
            self.probing = True
            return 1
        self.plain_rounds += 1
        return 0

    def observe_shadow(self, acceptance: float | None) -> None:
        if acceptance is None:  # nothing guessed: decides nothing
            self.shadow_outcome = None
            return
        if not 0.0 < acceptance < 1.0:
            self.shadow_outcome = acceptance >= 1.0
        else:
            if self.generator is None:
                self.generator = torch.Generator().manual_seed(0)
            self.shadow_outcome = bool(torch.rand((), generator=self.generator) < acceptance)
        # a guess is a first draft position's draft: what the γ chooser knows of acceptance there
        chooser = self.chooser
        chooser.reached, chooser.accepted = count_positions(
            chooser.reached, chooser.accepted, 1, [int(self.shadow_outcome)], chooser.decay
        )

    def observe(self, *, drafted, accepted, draft_time_s, verify_time_s, first_round) -> None:
        self.observe_rows(
            drafted=drafted,
            accepted_per_row=[accepted],
            draft_time_s=draft_time_s,
            verify_time_s=verify_time_s,
            first_round=first_round,
        )

    def observe_rows(self, *, drafted, accepted_per_row, draft_time_s, verify_time_s, first_round) -> None:
        self._count_positions(drafted, accepted_per_row)
        # a shadow step reaches the chooser as a plain step (drafted 0): a plain step's cost. A recurrent target's
        # plain steps before its first drafting round do not: that round is the chooser's first (its cost ratio, then
        # Theorem 3.8 at it), as the first round is elsewhere
        if not self.trees and (drafted or self.drafted or not self.one_token_kernels):
            self.chooser.observe_rows(
                drafted=drafted,
                accepted_per_row=accepted_per_row,
                draft_time_s=draft_time_s,
                verify_time_s=verify_time_s,
                first_round=first_round or (self.one_token_kernels and not self.drafted),
            )
        # a batch's tokens per second is the number of rows times a row's mean: the mean, unrounded, decides
        self._observe(drafted, sum(accepted_per_row) / len(accepted_per_row), draft_time_s, verify_time_s, first_round)

    def _count_positions(self, drafted: int, accepted_per_row: list[int]) -> None:
        """What a chain's drafts were worth, per position, whatever the round's kind; plain steps say nothing of it."""
        if drafted and not self.trees:
            self.position_reached, self.position_accepted = count_positions(
                self.position_reached, self.position_accepted, drafted, accepted_per_row, self.decay
            )

    def _observe(
        self, drafted: int, accepted: float, draft_time_s: float, verify_time_s: float, first_round: bool
    ) -> None:
        draft_time_s, verify_time_s = at_least_a_tick(draft_time_s, verify_time_s)
        if not drafted:
            # a step whose forward also carried kept tokens again (after a recurrent cache's rollback) costs what
            # the drafting round before left to do: not a plain step's cost (a measurement wanted waits for the next)
            clean = not first_round and not self.carried_tokens
            if self.shadow_draft_wanted:  # a shadow step: its drafting time is the guess's, the rest a plain step's
                if clean:
                    self._book_plain(verify_time_s)
                self._observe_guess(draft_time_s)
                return
            if clean:
                self._book_plain(draft_time_s + verify_time_s)
            if self.measure_plain and clean:
                self.measure_plain = False
                self._decide()
            return
        first_drafting, self.drafted = not self.drafted, True
        if first_round:  # its times include the prefill; if it accepted nothing, probe at once (or a γ = 1 round)
            if accepted == 0:
                self._probe_at_once()
            return
        if self.probing:  # a γ = 1 probe: resume on any accepted draft
            self.probing = False
            if accepted and self._could_pay():
                self._resume()
            return
        measured = spent = draft_time_s + verify_time_s
        if len(self.round_s) >= 2:  # a stall counts for at most `max_jump` times the median of recent rounds
            spent = min(measured, self.max_jump * statistics.median(self.round_s))
        self.round_s.append(measured)
        self.round_drafted.append(drafted)
        self.weight = self.decay * self.weight + 1.0
        self.tokens = self.decay * self.tokens + accepted + 1
        self.squares = self.decay * self.squares + (accepted + 1) ** 2
        self.seconds = self.decay * self.seconds + spent
        self.drafting_rounds += 1
        self.verify_s.append(verify_time_s)
        if self.cautious:  # a γ = 1 round after a first round that accepted nothing
            self.cautious = False
            if accepted == 0:
                self._decide(optimism=0.0)  # nothing accepted in two rounds: stops unless drafting is nearly free
            else:  # a γ = 1 round says little about the user's γ: start afresh
                self._restart_rate()
            return
        if self.one_token_kernels and not self._could_pay():
            # a recurrent target whose verify forward costs more than drafts that were always right could win back
            # (a reference scan padding a few tokens to a long chunk): no acceptance pays, stop now rather than after
            # `min_rounds` losing rounds
            self.stopped, self.plain_rounds = True, 0
            return
        if first_drafting and accepted == 0 and self.one_token_kernels and not self.free_drafts:
            # a recurrent target's first drafting round, after its plain steps (free drafts are judged as elsewhere)
            self._probe_at_once()
            return
        if self.drafting_rounds >= self.min_rounds:
            self._decide()

    def _probe_at_once(self) -> None:
        """The first drafting round accepted nothing: the drafter is probed at once (shadow guesses; without them, a
        γ = 1 round)."""
        self.shadow, self.shadow_spent = self.shadow_drafts, 0.0
        self.cautious = not self.shadow_drafts

    def _book_plain(self, seconds: float) -> None:
        """A plain step's seconds: its decayed mean with each step counted for at most `max_jump` times the median of
        the last five, as drafting rounds are (a stall then weighs alike on both sides of the comparison)."""
        spent = min(seconds, self.max_jump * statistics.median(self.plain_s)) if len(self.plain_s) >= 2 else seconds
        self.plain_s.append(seconds)
        self.plain_weight = self.decay * self.plain_weight + 1.0
        self.plain_seconds = self.decay * self.plain_seconds + spent

    def _observe_guess(self, guess_s: float) -> None:
        if self.shadow_outcome is None:  # nothing guessed (or no guess reported): guess again
            return
        # a stall (another process; on a GPU a kernel set up for a new shape) counts for at most `max_jump` times a
        # usual guess: the median of recent guesses, else of a drafted token's seconds in drafting rounds
        usual = list(self.guess_s or self.chooser.draft_s)
        self.guess_s.append(guess_s)
        if usual:
            guess_s = min(guess_s, self.max_jump * statistics.median(usual))
        if self.shadow_outcome:
            if self._could_pay():
                self._resume()
            else:  # right, but no acceptance pays at these costs: the probe ends as a failed one
                self.shadow, self.stopped, self.plain_rounds = False, True, 0
            return
        self.shadow_spent += guess_s
        if not self.plain_s:  # no plain step measured yet (this one carried kept tokens): the budget waits for one
            return
        if self.shadow_spent + guess_s > self.shadow_budget * statistics.median(self.plain_s):
            self.shadow, self.stopped, self.plain_rounds = False, True, 0  # one more guess would pass the budget

    def _could_pay(self) -> bool:
        """Whether drafting could beat plain steps if every draft were accepted: a right guess or probe resumes drafting
        only then. The bound: a recent drafting round (as measured, its seconds uncapped) emitting the user's γ + 1
        tokens, its extra drafts at the median drafted token's seconds and its verify forward no dearer; the most
        favourable of the last five (a stalled round cannot decide), against the fastest of the last five plain steps
        (nor can a stalled one). Where a verify forward costs several plain steps (a reference kernel that pads a few
        tokens to a long chunk), no acceptance pays, and each resume would cost `min_rounds` losing rounds (a recurrent
        target stops after any round where this is False). True until a plain step and a drafting round are measured,
        and for trees."""
        if self.trees or not self.plain_seconds or not self.round_s:
            return True
        draft_s = statistics.median(self.chooser.draft_s) if self.chooser.draft_s else 0.0
        ceiling = max(
            (self.user_gamma + 1) / max(seconds + max(self.user_gamma - drafted, 0) * draft_s, 1e-12)
            for drafted, seconds in zip(self.round_drafted, self.round_s, strict=True)
        )
        return ceiling >= self.stop_below / min(self.plain_s)

    def _resume(self) -> None:
        self.stopped = self.shadow = self.cautious = False
        # what the last drafting stretch measured still counts, at less weight: a guess that hit says the drafter may
        # pay again, not that it does (one that needs several rounds to lose again would cost them on every resume)
        self.weight, self.tokens, self.squares, self.seconds = (
            value * self.resume_weight for value in (self.weight, self.tokens, self.squares, self.seconds)
        )
        self.drafting_rounds = 0  # decided again after `min_rounds` rounds: one round cannot outweigh the stretch
        chooser = self.chooser  # and the acceptance per position that stretch measured weighs less in the γ chosen
        chooser.reached = [value * self.resume_weight for value in chooser.reached]
        chooser.accepted = [value * self.resume_weight for value in chooser.accepted]

    def _decide(self, optimism: float | None = None) -> None:
        # the measured rate, half a standard error (of the mean tokens per round) more optimistic: rounds that emit
        # 1, 1, 1 tokens may be bad luck for a drafter that averages 2 (a token's spread at least, so a few equal
        # rounds do not look certain)
        mean = self.tokens / self.weight
        spread = max(self.squares / self.weight - mean * mean, 0.25)
        optimism = self.optimism if optimism is None else optimism
        benefit_of_doubt = 1.0 + optimism * math.sqrt(spread / self.weight) / mean
        # seconds per round: their mean, at most `max_jump` times the median of the last five (the first rounds were
        # not capped one by one)
        seconds = min(self.seconds / self.weight, self.max_jump * statistics.median(self.round_s))
        drafting_rate = mean / max(seconds, 1e-12) * benefit_of_doubt
        verify = statistics.median(self.verify_s)
        if self.plain_s:  # measured: on a CPU a bf16 model's 2-token forward may beat its 1-token one
            self.stopped = drafting_rate < self.stop_below * self.plain_weight / self.plain_seconds
        elif drafting_rate < 1.0 / verify:  # loses even to a plain step as dear as a verify forward
            self.stopped = True
        elif drafting_rate < 2.0 / verify or self.one_token_kernels:
            # close (a plain step may cost half a verify forward), or a target whose one-token forward runs other
            # kernels than its verify forwards (a plain step may then cost a ninth of one): measure one
            self.measure_plain = True
        if self.stopped:
            self.plain_rounds = 0
            self._step_down()
        elif not self.measure_plain:  # a step down holds until drafting pays again: then the chooser may go back up
            self.gamma = self.user_gamma

    def _step_down(self) -> None:
        """Drafting at γ was measured to lose; tries the smaller γ predicted to pay best, if any (see the class
        docstring). Without a plain step measured yet, measures one first."""
        if self.trees or self.gamma <= 1:
            return
        # E[tokens per round] for γ = 0, 1, ..., γ - 1
        tokens = expected_tokens(
            [
                accepted / reached if reached else 0.0
                for reached, accepted in zip(self.position_reached[: self.gamma - 1], self.position_accepted)
            ]
        )
        if tokens[-1] < self.step_down_gain:
            return  # too few drafts accepted for any smaller γ to pay, even with free drafts
        if not self.plain_s:
            self.stopped, self.measure_plain = False, True  # decided again after it
            return
        plain = max(statistics.median(self.plain_s), 1e-12)
        # seconds each draft adds to a round, linear in γ (recent rounds' median: a stall must not decide the γ)
        per_draft = max(statistics.median(self.round_s) - plain, 0.0) / self.gamma

        def rate(gamma):  # tokens per second, at those costs
            return tokens[gamma] / (plain + gamma * per_draft)

        best = max(range(1, self.gamma), key=rate)
        if rate(best) < self.step_down_gain / plain:
            return
        # start afresh at the smaller γ: what drafting cost at the old one says little of the new one's costs
        self.gamma, self.stopped = best, False
        self._restart_rate()
        self.verify_s.clear()

    def _restart_rate(self) -> None:
        """Forgets the measured drafting rate (its decayed sums and recent round times): the next rounds draft a
        different γ."""
        self.weight = self.tokens = self.squares = self.seconds = 0.0
        self.drafting_rounds = 0
        self.round_s.clear()
        self.round_drafted.clear()
