"""Draft-length (γ) policies: `auto` (the default: the γ up to the user's that `optimal`'s estimates predict pays
best; plain steps when drafting is measured not to pay), `constant`, `heuristic` (+2 / -1) and `optimal` (Theorem 3.8
with online estimates).

A policy is created for one `generate` call, so nothing it learns outlives the call or lands on a user object.
Before each round `next_gamma()` says how many tokens to draft (0 = a plain decoding step); after it `observe(...)`
reports what the round drafted, accepted and cost.

The `optimal` policy generalizes section 3.5 of the paper. Theorem 3.8 picks γ maximising
E[tokens per round] / (γ c + 1) under i.i.d. acceptance and a verify forward as cheap as one decoding step. Here:

- E[tokens per round](γ) = 1 + sum_{i=1..γ} prod_{j<=i} a_j, with a_j the acceptance rate at draft position j given
  that position was reached (Beta-smoothed towards the pooled rate, with exponential forgetting per drafting round:
  plain steps say nothing about acceptance, so they do not age it), so acceptance that falls off along the draft is
  accounted for;
- the round's cost is γ t_draft + t_verify(γ), with t_draft the median of the last measured seconds per drafted
  token and t_verify(γ) the median of the last verify times of rounds that drafted γ tokens (per γ, because on CPUs
  the cost of a k-token forward is jagged in k), shrunk towards a line fitted to all rounds (weighted least squares,
  slope >= 0, ridged towards slope 0), which alone serves γ not tried yet. A verify time above 1.5x its estimate (a
  stall: another process, a page fault) counts as 1.5x, and a plain step is never estimated dearer than a verify
  forward (over more tokens). With t_verify flat this is exactly Theorem 3.8 with c = t_draft / t_verify(0).

It drafts the γ in {1, ..., speculative_max_gamma} maximising tokens per second when that is predicted to beat a
plain step by 3% (so timing noise cannot make it flip-flop). Otherwise it stops drafting (γ = 0) only when that is
sure, on measurements rather than the fitted line: γ = 1 has been measured three times (a median one stall cannot
move) and, at the median costs of its rounds and of plain steps, would not beat a plain step by 3% even if one more of
its first drafts had been accepted than were. Until then it drafts 1 token, the cheapest way to learn more, so one
unlucky round (all drafts rejected, a stall, a line fitted to a stall) cannot switch drafting off.

The first round drafts the user's γ and includes the prompt's prefill in both models: it trains the acceptance
estimates and gives a first c (drafting time / verifying time), but no costs. The second round applies Theorem 3.8
with that c, up to twice the user's γ (or takes a plain step, measuring its cost, if nothing was accepted). If it
drafted k tokens, the third drafts k // 2: a line through one point is flat, which would make long drafts look free.
Every 8th round it tries a neighbour of its choice (γ ± 1) to keep the cost estimates of nearby γ fresh. When it
settles on γ = 0 it probes γ = 1 after 32, 64, 128, ... plain steps, so a drafter that becomes useful again is noticed
while a useless one costs almost nothing.
"""

from __future__ import annotations

import collections
import math
import statistics

import torch

from .registry import Registry

__all__ = ["GammaPolicy", "get_gamma_policy_class", "list_gamma_policies", "register_gamma_policy"]


def expected_tokens(rates: list[float]) -> list[float]:
    """E[tokens per round] for γ = 0 ... len(rates), with rates[j] the acceptance rate at draft position j given that
    position was reached: 1 + sum_{i<=γ} prod_{j<=i} rates[j], in one pass."""
    tokens, survive = [1.0], 1.0
    for rate in rates:
        survive *= rate
        tokens.append(tokens[-1] + survive)
    return tokens


def count_positions(
    reached: list[float], accepted: list[float], drafted: int, accepted_per_row: list[int], decay: float
) -> tuple[list[float], list[float]]:
    """Decayed counts, per draft position, of the rounds that reached it and that accepted its draft, after one more
    round of `drafted` drafts; a round of a batch counts as one round, its rows as fractions. Returns the new
    (reached, accepted)."""
    reached = [decay * value for value in reached]
    accepted = [decay * value for value in accepted]
    weight = 1.0 / len(accepted_per_row)
    for row_accepted in accepted_per_row:
        for position in range(min(row_accepted + 1, drafted, len(reached))):
            reached[position] += weight
            if position < row_accepted:
                accepted[position] += weight
    return reached, accepted


TICK_S = 1e-9  # the shortest time a round is taken to last


def at_least_a_tick(*seconds: float) -> tuple[float, ...]:
    """Measured seconds, each at least `TICK_S`: a clock that reads a round as lasting no time (a coarse clock, a
    custom loop reporting zeros) must not divide by zero in a policy's rates."""
    return tuple(max(float(value), TICK_S) for value in seconds)


class GammaPolicy:
    """Base class: a constant γ. Subclasses override `next_gamma` and `observe`.

    Shadow drafts: a loop that can take them (the one-sequence loop) sets `shadow_drafts = True`. A policy that
    returns γ = 0 with `shadow_draft_wanted` true then gets a plain step with a one-token guess of the drafter beside
    it (never verified or emitted), and `observe_shadow(acceptance)` before `observe`: how likely verification would
    have accepted the guess (None when the drafter guessed nothing). It costs the guess alone, where a real γ = 1
    round also costs a verify forward over two tokens."""

    shadow_drafts = False  # set by loops that can take shadow drafts
    trees = False  # set by loops that verify token trees (`speculative_tree_budget`): γ is then the trees' depth
    shadow_draft_wanted = False  # set by the policy with a γ = 0 that should carry one

    def __init__(self, gamma: int, max_gamma: int):
        self.gamma = min(gamma, max_gamma)
        self.max_gamma = max_gamma

    def next_gamma(self) -> int:
        """How many tokens the next round drafts (0: a plain decoding step)."""
        return self.gamma

    def observe_shadow(self, acceptance: float | None) -> None:
        """Called after a shadow draft (see the class docstring), before `observe` for the same plain step."""

    def observe(
        self, *, drafted: int, accepted: int, draft_time_s: float, verify_time_s: float, first_round: bool
    ) -> None:
        """Called after each round with what it drafted, accepted, and cost (seconds, host wall clock)."""

    def observe_rows(
        self, *, drafted: int, accepted_per_row: list[int], draft_time_s: float, verify_time_s: float, first_round: bool
    ) -> None:
        """Called instead of `observe` after a round of a padded batch, with each row's accepted drafts (the rows
        share the round's γ and its cost). By default: `observe` with the rows' mean, rounded; the built-in `auto`
        and `optimal` policies use every row."""
        self.observe(
            drafted=drafted,
            accepted=round(sum(accepted_per_row) / len(accepted_per_row)),
            draft_time_s=draft_time_s,
            verify_time_s=verify_time_s,
            first_round=first_round,
        )


class HeuristicGammaPolicy(GammaPolicy):
    """transformers' schedule: +2 after a fully accepted round, -1 (not below 1) otherwise; per call only."""

    def observe(self, *, drafted, accepted, draft_time_s, verify_time_s, first_round) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.gamma = min(self.max_gamma, self.gamma + 2)
        else:
            self.gamma = max(1, self.gamma - 1)


class AutoGammaPolicy(GammaPolicy):
    """The default: while drafting, the γ in 1 ... the user's γ that `optimal`'s estimates (acceptance per draft
    position, drafting and verifying costs measured per γ; `OptimalGammaPolicy.drafting_gamma`) predict emits the most
    tokens per second, so the user's γ is the most a round drafts; unless what the call measures says drafting loses to
    plain steps, then plain steps (γ = 0), with a probe after 16, 32, 64, ... of them (a stop decided on noisy timings,
    or a drafter that becomes useful later in the text, is found again). A useless drafter costs a few rounds. The γ
    is chosen rather than always the user's because verify cost grows with γ: on a memory-bound pair whose best γ is 2
    and where γ = 5 loses 10%, drafting the user's γ = 5 whenever it does not lose runs at 0.86 of the best constant γ.

    Drafting loses when its tokens per second fall below 95% of a plain step's. Its rate is emitted tokens over
    drafting plus verifying time, summed over the drafting rounds with each older round weighing `decay` times less
    (about the last ten rounds; what was measured before a stop counts at half weight after a resume), and it is
    judged from the third drafting round on, half a standard error of its mean tokens per round more optimistic than
    measured: a drafter whose rounds emit 1, 2 or 4 tokens pays on average yet has runs of unlucky rounds, and a
    decision on the last three rounds alone would stop such a drafter (e.g. an EAGLE tree that pays 1.4x) for most of
    its call. A drafting round's seconds count for at most 1.5x the median of the last five rounds, as a plain step's
    cost is a median: stalls of another process, on a loaded machine every few steps, must not stop a drafter that
    pays. A plain step costs at most a verify forward (it has fewer tokens), so a rate below one token per verify
    forward stops without a plain step to compare; when the two are close, one plain step is measured. Once plain
    steps are measured, the rate is compared with theirs alone: on a CPU a bfloat16 model's forward over 2 tokens may
    cost less than over 1, and a verify forward is then no bound on a plain step.

    A probe, where the loop takes shadow drafts (one sequence), is a run of plain steps, each with the drafter's
    one-token guess beside it, compared with the target's token (for sampling, accepted with Algorithm 1's
    probability, drawn from the policy's own generator). A guess that would have been accepted resumes drafting. The
    run ends without one once its guesses have cost `shadow_budget` (half) of a plain step: a drafter whose guess
    costs a third of a step (an early exit on a compute-bound CPU) gets one guess, a cheap feature head several, a
    nearly free one (prompt lookup) many. A guess of nothing (prompt lookup without a match) decides nothing. Loops
    without shadow drafts (padded batches) probe with a γ = 1 round instead, and resume on any accepted draft.

    The first round drafts one token (`first_gamma`), the next ones the user's γ: nothing is known yet of the
    drafter, and a first round of γ drafts costs a useless drafter (e.g. an early exit of a 135M model in bfloat16)
    γ - 1 drafting steps and a wider prefill, 1.5-2.5 plain steps, about 9% of a 26-token answer. Its times include
    the prompt's prefill, so it counts for acceptance only; if it accepted nothing, the drafter is probed at once.

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
        self.plain_s = collections.deque(maxlen=5)  # seconds of recent plain steps
        self.cautious = False  # no shadow drafts: the first round accepted nothing, measure with one drafted token
        self.stopped = False
        self.probing = False  # no shadow drafts: this round is a γ = 1 probe
        self.shadow = False  # in a shadow phase: plain steps with a guess each
        self.shadow_spent = 0.0  # seconds of the current shadow phase's guesses
        self.shadow_outcome = None  # the current step's guess: accepted (bool) or None (nothing guessed)
        self.measure_plain = False
        self.plain_rounds = 0
        self.probe_after = self.first_probe_after
        self.shadow_draft_wanted = False
        self.generator = None  # torch.Generator for sampled shadow acceptances, made on first use
        self.observed = False  # whether a round was seen
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
            if not self.observed:
                return min(self.gamma, self.first_gamma)
            return self.gamma if self.trees else self.chooser.drafting_gamma(self.gamma)
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
        if not self.trees:  # a shadow step reaches it as a plain step (drafted 0): a plain step's cost
            self.chooser.observe_rows(
                drafted=drafted,
                accepted_per_row=accepted_per_row,
                draft_time_s=draft_time_s,
                verify_time_s=verify_time_s,
                first_round=first_round,
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
        self.observed = True
        if not drafted:
            if self.shadow_draft_wanted:  # a shadow step: its drafting time is the guess's, the rest a plain step's
                self.plain_s.append(verify_time_s)
                self._observe_guess(draft_time_s)
                return
            if not first_round:
                self.plain_s.append(draft_time_s + verify_time_s)
            if self.measure_plain:
                self.measure_plain = False
                self._decide()
            return
        if first_round:  # its times include the prefill; if it accepted nothing, probe at once (or a γ = 1 round)
            if accepted == 0:
                self.shadow, self.shadow_spent = self.shadow_drafts, 0.0
                self.cautious = not self.shadow_drafts
            return
        if self.probing:  # a γ = 1 probe: resume on any accepted draft
            self.probing = False
            if accepted:
                self._resume()
            return
        measured = spent = draft_time_s + verify_time_s
        if len(self.round_s) >= 2:  # a stall counts for at most `max_jump` times the median of recent rounds
            spent = min(measured, self.max_jump * statistics.median(self.round_s))
        self.round_s.append(measured)
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
        if self.drafting_rounds >= self.min_rounds:
            self._decide()

    def _observe_guess(self, guess_s: float) -> None:
        if self.shadow_outcome is None:  # nothing guessed (or no guess reported): guess again
            return
        if self.shadow_outcome:
            self._resume()
            return
        self.shadow_spent += guess_s
        if self.shadow_spent + guess_s > self.shadow_budget * statistics.median(self.plain_s):
            self.shadow, self.stopped, self.plain_rounds = False, True, 0  # one more guess would pass the budget

    def _resume(self) -> None:
        self.stopped = self.shadow = self.cautious = False
        # what the last drafting stretch measured still counts, at less weight: a guess that hit says the drafter may
        # pay again, not that it does (one that needs several rounds to lose again would cost them on every resume)
        self.weight, self.tokens, self.squares, self.seconds = (
            value * self.resume_weight for value in (self.weight, self.tokens, self.squares, self.seconds)
        )

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
            self.stopped = drafting_rate < self.stop_below / statistics.median(self.plain_s)
        elif drafting_rate < 1.0 / verify:  # loses even to a plain step as dear as a verify forward
            self.stopped = True
        elif drafting_rate < 2.0 / verify:  # close: a plain step may cost half a verify forward; measure one
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


class OptimalGammaPolicy(GammaPolicy):
    """Maximises expected tokens per second from online estimates of acceptance per position and of costs."""

    decay = 0.95  # forgetting per drafting round (costs: per round): acceptance and costs drift along a generation
    prior_strength = 2.0  # pseudo-rounds pulling each position's rate towards the pooled rate
    explore_every = 8  # rounds between probes of a neighbour of the chosen γ
    first_probe_after = 32  # plain steps before the first probe of γ = 1 (then doubled each time)
    min_gain = 1.03  # draft only when predicted to beat a plain step by this factor: hysteresis against timing noise
    max_jump = 1.5  # a verify time counts for at most this times its current estimate: one stall moves it little

    def __init__(self, gamma: int, max_gamma: int):
        super().__init__(gamma, max_gamma)
        self.reached = [0.0] * max_gamma  # decayed count of rounds whose draft reached position i
        self.accepted = [0.0] * max_gamma
        self.prior_c = None  # drafter / target time of the first round (both include the prompt)
        self.draft_s = collections.deque(maxlen=5)  # seconds per drafted token of the last drafting rounds
        self.verify_s: dict[int, collections.deque] = {}  # k -> last verify times of rounds drafting k (jagged in k)
        self.fit = [0.0] * 5  # decayed weighted sums for the fallback line t_verify(k) = a + b k: w, wk, wkk, wt, wkt
        self.rounds = 0
        self.plain_rounds = 0
        self.probe_after = self.first_probe_after

    def acceptance_rates(self) -> list[float]:
        """The acceptance rate at each draft position given that it was reached, smoothed towards the pooled rate
        by `prior_strength` pseudo-rounds."""
        total_reached, total_accepted = sum(self.reached), sum(self.accepted)
        pooled = (total_accepted + 1.0) / (total_reached + 2.0)
        s = self.prior_strength
        return [(acc + s * pooled) / (reach + s) for acc, reach in zip(self.accepted, self.reached)]

    def verify_line(self) -> tuple[float, float]:
        """(intercept, slope) of the fallback line t_verify(k) = intercept + slope * k, in seconds."""
        w, wk, wkk, wt, wkt = self.fit
        mean_k, mean_t = wk / w, wt / w
        spread = wkk - w * mean_k * mean_k  # weighted sum of squares of k around its mean
        covariance = wkt - w * mean_k * mean_t
        slope = max(0.0, covariance / (spread + 1.0))  # +1: a pseudo-observation of slope 0 (Theorem 3.8)
        # rounds that all drafted about the same k say little about the slope, and noise between them must not
        # extrapolate to a free plain step: a forward over k + 1 tokens costs at most k + 1 one-token forwards
        slope = min(slope, mean_t / (mean_k + 1.0))
        return mean_t - slope * mean_k, slope

    def verify_seconds(self, gamma: int, line: tuple[float, float] | None = None) -> float:
        """The median of recent verify times of rounds that drafted `gamma` (robust to stalls), shrunk towards the
        fitted line by how many there are."""
        intercept, slope = line or self.verify_line()
        fitted = intercept + slope * gamma
        recent = self.verify_s.get(gamma, ())
        if not recent:
            return fitted
        return (len(recent) * statistics.median(recent) + 2.0 * fitted) / (len(recent) + 2.0)  # 2 pseudo-rounds

    def round_seconds(self) -> list[float]:
        """Expected seconds of a round for γ = 0 ... max_gamma."""
        line = self.verify_line()
        # a plain step is a forward over fewer tokens than any verify: a stall must not make it look dearer than one
        measured = [statistics.median(times) for drafted, times in self.verify_s.items() if drafted]
        plain = max(min([self.verify_seconds(0, line), self.verify_seconds(1, line), *measured]), 1e-9)
        # until a drafting round is measured, the first round's cost ratio stands in for the drafter's cost
        draft = statistics.median(self.draft_s) if self.draft_s else (self.prior_c or 0.0) * plain
        return [plain] + [
            gamma * draft + max(self.verify_seconds(gamma, line), 1e-9) for gamma in range(1, self.max_gamma + 1)
        ]

    def tokens_per_second(self, rates: list[float]) -> list[float]:
        """Expected tokens per second for γ = 0 ... max_gamma."""
        return [tokens / seconds for tokens, seconds in zip(expected_tokens(rates), self.round_seconds())]

    def drafting_hopeless(self) -> bool:
        """Whether to stop drafting: only on measured costs (medians of plain steps and of at least three γ = 1 rounds:
        a stall, or a line fitted to one, cannot decide), and only if γ = 1 would not beat a plain step even with one
        more accepted first draft than seen."""
        plain, one_draft = self.verify_s.get(0, ()), self.verify_s.get(1, ())
        if not plain or len(one_draft) < 3:
            return False
        optimistic = (self.accepted[0] + 1.0) / (self.reached[0] + 1.0)
        one_draft_s = statistics.median(self.draft_s) + statistics.median(one_draft)
        plain_s = min(statistics.median(plain), statistics.median(one_draft))  # never dearer than γ = 1's forward
        return (1.0 + optimistic) / one_draft_s < self.min_gain / plain_s

    def next_gamma(self) -> int:
        if self.prior_c is None:
            return self.gamma  # nothing measured yet: the user's γ
        if not self.fit[0]:  # only the first round seen: its costs include the prompt's prefill, so only c is usable
            if sum(self.accepted) == 0:
                return 0  # its drafts all failed: take a plain step, which also measures its cost
            # Theorem 3.8, at most doubling the user's γ: a few drafts and prefill-laden costs extrapolate poorly
            return self._theorem_gamma(0, min(2 * self.gamma, self.max_gamma))
        if self.rounds == 2 and 0 not in self.verify_s:  # one measured γ = k: the fitted line is flat
            return next(iter(self.verify_s)) // 2  # measure a second point (k = 1: a plain step) before trusting it
        rate = self.tokens_per_second(self.acceptance_rates())
        best = self._best(rate, self.max_gamma)
        if rate[best] < self.min_gain * rate[0]:  # drafting seems not to pay
            if 0 not in self.verify_s:
                return 0  # a plain step's cost was extrapolated: measure one
            if self.drafting_hopeless():
                self.plain_rounds += 1
                if self.plain_rounds >= self.probe_after:  # is the drafter useful again?
                    self.plain_rounds, self.probe_after = 0, self.probe_after * 2
                    return 1
                return 0
            best = 1  # but that is not sure yet: the cheapest draft measures more
        self.plain_rounds, self.probe_after = 0, self.first_probe_after
        return self._explored(best, self.max_gamma)

    def drafting_gamma(self, cap: int) -> int:
        """The γ in 1 ... `cap` predicted to emit the most tokens per second, for a policy that decides apart whether
        to draft at all (`auto`): Theorem 3.8 at the first round's cost ratio while only that round is known, half the
        γ measured so far while one γ alone is (a line through one point is flat), then the estimates, with a
        neighbour tried every `explore_every` rounds."""
        cap = min(cap, self.max_gamma)
        if self.prior_c is None:
            return cap
        if not self.fit[0]:
            return self._theorem_gamma(1, cap)
        measured = [gamma for gamma in self.verify_s if gamma]
        if len(self.verify_s) == 1 and measured and measured[0] > 1:
            return min(cap, measured[0] // 2)
        return self._explored(self._best(self.tokens_per_second(self.acceptance_rates()), cap), cap)

    def _theorem_gamma(self, low: int, cap: int) -> int:
        """The γ in low ... cap of Theorem 3.8's best speedup at the first round's cost ratio (the smaller of
        equals)."""
        speedups = [
            tokens / (gamma * self.prior_c + 1.0)
            for gamma, tokens in enumerate(expected_tokens(self.acceptance_rates()))
        ]
        return max(range(low, cap + 1), key=lambda g: (speedups[g], -g))

    @staticmethod
    def _best(rate: list[float], cap: int) -> int:
        """The γ in 1 ... cap of the highest rate (the smaller of equals)."""
        return max(range(1, cap + 1), key=lambda g: (rate[g], -g))

    def _explored(self, best: int, cap: int) -> int:
        """`best`, or every `explore_every` rounds a neighbour of it in 1 ... cap (alternating sides), which keeps
        the cost estimates of nearby γ fresh."""
        if self.rounds % self.explore_every == self.explore_every - 1:
            side = 1 if (self.rounds // self.explore_every) % 2 == 0 else -1
            return min(cap, max(1, best + side))
        return best

    def observe(self, *, drafted, accepted, draft_time_s, verify_time_s, first_round) -> None:
        self._observe(drafted, [accepted], draft_time_s, verify_time_s, first_round)

    def observe_rows(self, *, drafted, accepted_per_row, draft_time_s, verify_time_s, first_round) -> None:
        self._observe(drafted, accepted_per_row, draft_time_s, verify_time_s, first_round)

    def _observe(
        self, drafted: int, accepted_per_row: list[int], draft_time_s: float, verify_time_s: float, first_round: bool
    ) -> None:
        draft_time_s, verify_time_s = at_least_a_tick(draft_time_s, verify_time_s)
        self.rounds += 1
        if drafted:  # plain steps say nothing about acceptance, so they do not age what is known about it
            self.reached, self.accepted = count_positions(
                self.reached, self.accepted, drafted, accepted_per_row, self.decay
            )
        if first_round:  # its times include the prompt's prefill, in both models: only their ratio is usable
            self.prior_c = draft_time_s / verify_time_s / max(drafted, 1) if verify_time_s > 0 else 0.0
            return
        if drafted:
            self.draft_s.append(draft_time_s / drafted)
        if self.fit[0] > 0:  # a stall (another process, a page fault) moves the per-γ median and the line little
            verify_time_s = min(verify_time_s, self.max_jump * self.verify_seconds(drafted))
        self.verify_s.setdefault(drafted, collections.deque(maxlen=5)).append(verify_time_s)
        k, t = float(drafted), verify_time_s
        self.fit = [v * self.decay for v in self.fit]
        for index, value in enumerate((1.0, k, k * k, t, k * t)):
            self.fit[index] += value


_POLICIES: Registry[type[GammaPolicy]] = Registry(
    GammaPolicy, "γ policy", "speculative_gamma_policy", "hf_specdec.policies.register_gamma_policy"
)


def register_gamma_policy(name: str, cls: type[GammaPolicy]) -> type[GammaPolicy]:
    """Registers a γ policy under `name` for `speculative_gamma_policy=name`; a name can be registered once."""
    return _POLICIES.register(name, cls)


def list_gamma_policies() -> list[str]:
    """Names of the registered γ policies."""
    return _POLICIES.names()


def get_gamma_policy_class(name: str) -> type[GammaPolicy]:
    """The policy class registered under `name`; unknown names fail with the list of known ones."""
    return _POLICIES.get(name)


register_gamma_policy("auto", AutoGammaPolicy)
register_gamma_policy("constant", GammaPolicy)
register_gamma_policy("heuristic", HeuristicGammaPolicy)
register_gamma_policy("optimal", OptimalGammaPolicy)
