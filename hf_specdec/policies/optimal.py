"""`OptimalGammaPolicy` (`optimal`): Theorem 3.8 with online estimates of acceptance and costs.

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
import statistics

from .base import GammaPolicy, at_least_a_tick, count_positions, expected_tokens

__all__ = ["OptimalGammaPolicy"]


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
