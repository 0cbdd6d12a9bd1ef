"""Draft-length (γ) policies: `constant`, `heuristic` (+2 / -1) and `optimal` (Theorem 3.8 with online estimates).

A policy is created for one `generate` call, so nothing it learns outlives the call or lands on a user object.
Before each round `next_gamma()` says how many tokens to draft (0 = a plain decoding step); after it `observe(...)`
reports what the round drafted, accepted and cost.

The `optimal` policy generalizes section 3.5 of the paper. Theorem 3.8 picks γ maximising
E[tokens per round] / (γ c + 1) under i.i.d. acceptance and a verify forward as cheap as one decoding step. Here:

- E[tokens per round](γ) = 1 + sum_{i=1..γ} prod_{j<=i} a_j, with a_j the acceptance rate at draft position j given
  that position was reached (Beta-smoothed towards the pooled rate, with exponential forgetting), so acceptance that
  falls off along the draft is accounted for;
- the round's cost is γ t_draft + t_verify(γ), with t_draft the measured seconds per drafted token and t_verify(γ)
  the median of the last verify times of rounds that drafted γ tokens (per γ, because on CPUs the cost of a k-token
  forward is jagged in k; a median, so stalls do not count), shrunk towards a line fitted to all rounds (weighted
  least squares, slope >= 0, ridged towards slope 0), which alone serves γ not tried yet. With t_verify flat this is exactly Theorem 3.8 with c = t_draft / t_verify(0).

It picks γ in {0, ..., speculative_max_gamma} maximising tokens per second, and drafts at all only when that is
predicted to beat a plain step by 3% (so timing noise cannot make it flip-flop). The first round includes the prompt's
prefill: it trains the acceptance estimates and gives a first c (drafting time / verifying time), with which the
second round applies Theorem 3.8 directly (or takes a plain step, measuring its cost, if nothing was accepted). Every 8th round it tries a neighbour of its choice (γ ± 1) to keep the
cost estimates of nearby γ fresh. When it settles on γ = 0 it probes γ = 1 after 32, 64, 128, ... plain steps, so
a drafter that becomes useful again is noticed while a useless one costs almost nothing.
"""

from __future__ import annotations

import collections
import statistics

from .registry import Registry

__all__ = ["GammaPolicy", "get_gamma_policy_class", "list_gamma_policies", "register_gamma_policy"]


class GammaPolicy:
    """Base class: a constant γ. Subclasses override `next_gamma` and `observe`."""

    def __init__(self, gamma: int, max_gamma: int):
        self.gamma = min(gamma, max_gamma)
        self.max_gamma = max_gamma

    def next_gamma(self) -> int:
        return self.gamma

    def observe(self, *, drafted: int, accepted: int, draft_time_s: float, verify_time_s: float,
                first_round: bool) -> None:
        """Called after each round with what it drafted, accepted, and cost (seconds, host wall clock)."""


class HeuristicGammaPolicy(GammaPolicy):
    """transformers' schedule: +2 after a fully accepted round, -1 (not below 1) otherwise; per call only."""

    def observe(self, *, drafted, accepted, draft_time_s, verify_time_s, first_round) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.gamma = min(self.max_gamma, self.gamma + 2)
        else:
            self.gamma = max(1, self.gamma - 1)


class OptimalGammaPolicy(GammaPolicy):
    """Maximises expected tokens per second from online estimates of acceptance per position and of costs."""

    decay = 0.95  # forgetting per round: acceptance and costs drift along a generation
    prior_strength = 2.0  # pseudo-rounds pulling each position's rate towards the pooled rate
    explore_every = 8  # rounds between probes of a neighbour of the chosen γ
    first_probe_after = 32  # plain steps before the first probe of γ = 1 (then doubled each time)
    min_gain = 1.03  # draft only when predicted to beat a plain step by this factor: hysteresis against timing noise

    def __init__(self, gamma: int, max_gamma: int):
        super().__init__(gamma, max_gamma)
        self.reached = [0.0] * max_gamma  # decayed count of rounds whose draft reached position i
        self.accepted = [0.0] * max_gamma
        self.prior_c = None  # drafter / target time of the first round (both include the prompt)
        self.draft_s = None  # seconds per drafted token (EMA)
        self.verify_s: dict[int, collections.deque] = {}  # k -> last verify times of rounds drafting k (jagged in k)
        self.fit = [0.0] * 5  # decayed weighted sums for the fallback line t_verify(k) = a + b k: w, wk, wkk, wt, wkt
        self.rounds = 0
        self.plain_rounds = 0
        self.probe_after = self.first_probe_after

    def acceptance_rates(self) -> list[float]:
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

    def expected_tokens(self, rates: list[float]) -> list[float]:
        """E[tokens per round] for γ = 0 ... max_gamma: 1 + sum_{i<=γ} prod_{j<=i} a_j, in one pass."""
        tokens, survive = [1.0], 1.0
        for rate in rates:
            survive *= rate
            tokens.append(tokens[-1] + survive)
        return tokens

    def verify_seconds(self, gamma: int, line: tuple[float, float] | None = None) -> float:
        """The median of recent verify times of rounds that drafted `gamma` (robust to stalls), shrunk towards the
        fitted line by how many there are."""
        intercept, slope = line or self.verify_line()
        fitted = intercept + slope * gamma
        recent = self.verify_s.get(gamma, ())
        if not recent:
            return fitted
        return (len(recent) * statistics.median(recent) + 2.0 * fitted) / (len(recent) + 2.0)  # 2 pseudo-rounds

    def tokens_per_second(self, rates: list[float]) -> list[float]:
        """Expected tokens per second for γ = 0 ... max_gamma."""
        line = self.verify_line()
        return [tokens / (gamma * self.draft_s + max(self.verify_seconds(gamma, line), 1e-9))
                for gamma, tokens in enumerate(self.expected_tokens(rates))]

    def next_gamma(self) -> int:
        if self.draft_s is None:
            if self.prior_c is None:
                return self.gamma  # nothing measured yet: the user's γ
            if sum(self.accepted) == 0:
                return 0  # the first drafts all failed: take a plain step, which also measures its cost
            # one round seen: Theorem 3.8 with the first round's cost ratio
            speedups = [tokens / (gamma * self.prior_c + 1.0)
                        for gamma, tokens in enumerate(self.expected_tokens(self.acceptance_rates()))]
            return max(range(self.max_gamma + 1), key=lambda g: (speedups[g], -g))
        if self.plain_rounds:  # plain steps teach nothing about drafting: keep γ = 0 until the next probe
            best = 0
        else:
            rate = self.tokens_per_second(self.acceptance_rates())
            best = max(range(self.max_gamma + 1), key=lambda g: (rate[g], -g))
            if rate[best] < self.min_gain * rate[0]:
                best = 0
        if best == 0:
            if 0 not in self.verify_s:
                return 0  # a plain step's cost was extrapolated: measure one before settling on γ = 0
            self.plain_rounds += 1
            if self.plain_rounds >= self.probe_after:  # is the drafter useful again?
                self.plain_rounds, self.probe_after = 0, self.probe_after * 2
                return 1
            return 0
        self.plain_rounds, self.probe_after = 0, self.first_probe_after
        if self.rounds % self.explore_every == self.explore_every - 1:  # try a neighbour, alternating sides
            side = 1 if (self.rounds // self.explore_every) % 2 == 0 else -1
            return min(self.max_gamma, max(1, best + side))
        return best

    def observe(self, *, drafted, accepted, draft_time_s, verify_time_s, first_round) -> None:
        self.rounds += 1
        self.reached = [r * self.decay for r in self.reached]
        self.accepted = [a * self.decay for a in self.accepted]
        for position in range(min(accepted + 1, drafted)):
            self.reached[position] += 1.0
        for position in range(accepted):
            self.accepted[position] += 1.0
        if first_round:  # its times include the prompt's prefill, in both models: only their ratio is usable
            self.prior_c = draft_time_s / verify_time_s / max(drafted, 1) if verify_time_s > 0 else 0.0
            return
        if drafted:
            per_token = draft_time_s / drafted
            if self.draft_s is not None:  # a stall (another process, a page fault) counts for at most 3x
                per_token = min(per_token, 3.0 * self.draft_s)
            self.draft_s = per_token if self.draft_s is None else 0.8 * self.draft_s + 0.2 * per_token
        elif self.draft_s is None:
            self.draft_s = (self.prior_c or 0.0) * verify_time_s
        self.verify_s.setdefault(drafted, collections.deque(maxlen=5)).append(verify_time_s)
        if self.fit[0] > 0:
            verify_time_s = min(verify_time_s, 3.0 * self.verify_seconds(drafted))  # stalls count for at most 3x
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


register_gamma_policy("constant", GammaPolicy)
register_gamma_policy("heuristic", HeuristicGammaPolicy)
register_gamma_policy("optimal", OptimalGammaPolicy)
