"""The γ policy base class (`constant`), the `heuristic` policy, and the estimates `auto` and `optimal` share.

A policy is created for one `generate` call, so nothing it learns outlives the call or lands on a user object.
Before each round `next_gamma()` says how many tokens to draft (0 = a plain decoding step); after it `observe(...)`
reports what the round drafted, accepted and cost.
"""

from __future__ import annotations

__all__ = ["GammaPolicy", "HeuristicGammaPolicy", "at_least_a_tick", "count_positions", "expected_tokens"]


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
    free_drafts = False  # set from the drafter's `free_drafts`: its drafts cost next to nothing (copied from text)
    shadow_draft_wanted = False  # set by the policy with a γ = 0 that should carry one
    # set by the one-sequence loop before each `observe`: kept tokens its forward carried again because the round
    # before rolled a recurrent cache back (0 otherwise); a plain step that carried some cost more than a plain step
    carried_tokens = 0
    # set by the one-sequence loop for a target whose forward over one token runs other kernels than over several (a
    # recurrent cache: transformers' layers branch on `seq_len == 1`), so that verify forwards tell nothing of what a
    # plain step costs (transformers' reference CPU scan of Mamba2 pads a few tokens to 256 positions: 9x one token)
    one_token_kernels = False

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
