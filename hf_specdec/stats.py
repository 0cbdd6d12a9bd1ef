"""Acceptance statistics of one speculative `generate` call (`output.speculative_stats`)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["SpeculativeStats"]


@dataclasses.dataclass
class SpeculativeStats:
    """What happened in one speculative `generate` call.

    One round is one target forward: the drafter proposes up to γ tokens, the target verifies them, and the round
    emits the accepted drafts plus one token from the target (recovered or bonus).
    """

    target_calls: int = 0
    """Target forwards (rounds), including rounds where the drafter proposed nothing."""
    row_rounds: int = 0
    """Rounds of one sequence: equal to `target_calls` at batch size 1, `target_calls` x rows for a batch (the
    per-round counts below, `mean_accepted_length` and the histograms count rows' rounds)."""
    drafted_tokens: int = 0
    """Tokens proposed by the drafter and verified by the target (every node of a token tree)."""
    accepted_tokens: int = 0
    """Drafted tokens that passed verification (for a tree: the accepted path's length, its accepted depth)."""
    emitted_tokens: int = 0
    """Tokens appended to the output (after stopping criteria cut the last round short, if they did)."""
    beta_sum: float = 0.0
    """Sum of β = sum_x min(p(x), q(x)) over the positions counted in `beta_count`."""
    beta_count: int = 0
    """Verified positions that entered `beta_sum`: the accepted ones and the first rejected one of each round. For
    a token tree a position is a depth, with β = 1 when some node at that depth was accepted and 0 otherwise, so
    `alpha` is then the rate at which a reached depth is accepted."""
    accepted_length_histogram: list[int] = dataclasses.field(default_factory=list)
    """`accepted_length_histogram[n]`: rounds that accepted exactly n drafts."""
    position_drafted: list[int] = dataclasses.field(default_factory=list)
    """`position_drafted[i]`: rounds that drafted a token at position i (0-based; a tree's depth i + 1)."""
    position_accepted: list[int] = dataclasses.field(default_factory=list)
    """`position_accepted[i]`: rounds whose draft at position i was accepted."""
    gamma_history: list[int] = dataclasses.field(default_factory=list)
    """The γ the policy chose for each round (the drafter may propose fewer; the last round may be capped)."""
    drafted_history: list[int] = dataclasses.field(default_factory=list)
    """The number of tokens actually drafted in each round (a token tree's size: its number of nodes)."""
    beam_steps_history: list[int] = dataclasses.field(default_factory=list)
    """Beam search (`num_beams` > 1) only: the beam steps each round took (1 + the steps accepted from the drafter's
    beams; the first round is the prefill's plain step). Its mean is `mean_accepted_length`."""
    target_forward_tokens: list[int] = dataclasses.field(default_factory=list)
    """Beam search only: the positions each round's target forward computed (rows x (γ + 1): the drafter's paths;
    the first round: the prefill), against `num_beams` x batch per step of plain beam search."""
    lenience: float = 1.0
    """The lenience the call ran with (1.0: exact; below 1: lossy, Appendix A.5)."""
    draft_time_s: float = 0.0
    """Host wall-clock seconds spent in the drafter."""
    verify_time_s: float = 0.0
    """Host wall-clock seconds spent in target forwards and verification."""
    rows: list[SpeculativeStats] = dataclasses.field(default_factory=list)
    """For a batch of several sequences: each sequence's own statistics, in the order of the output rows (its rounds,
    drafts, accepted and emitted tokens; a padded batch's round, shared by its rows, counts as one round and one
    target call for each). Empty for one sequence, whose statistics are the call's. A class whose `generate` decodes
    several times (Whisper's long-form segments) appends one entry per row per decoding pass."""
    compiled_rounds: int = 0
    """Rounds whose target forward ran compiled (a static cache where `generate` compiles; see `TargetForward`)."""
    target_compilations: int = 0
    """Graphs `torch.compile` built for the target's forward during the call (new shapes and recompiles): bounded
    by the few padded round sizes, not by the number of rounds."""
    drafter_compilations: int = 0
    """Graphs `torch.compile` built while the drafter ran during the call (a `ModelDrafter` with
    `cache_implementation="static"` where transformers compiles; any drafter that compiles): bounded by the drafter's
    few padded forward sizes, not by the number of rounds."""

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens (0.0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def alpha(self) -> float:
        """Estimate of α = E[β] (Corollary 3.6): the mean of sum_x min(p(x), q(x)) over verified positions."""
        return self.beta_sum / self.beta_count if self.beta_count else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Mean tokens a sequence gains per round, counting the target's own token (vLLM's "mean acceptance length")."""
        return (self.accepted_tokens + self.row_rounds) / self.row_rounds if self.row_rounds else 0.0

    @property
    def position_acceptance_rate(self) -> list[float]:
        """Acceptance rate at each draft position, given that position was drafted."""
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    def record_round(
        self,
        gamma: int,
        drafted: int,
        accepted: int,
        betas: list[float],
        new_forward: bool = True,
        depth: int | None = None,
    ) -> None:
        """Books one sequence's verified round (`betas`: β of the positions up to and including the first
        rejection). `new_forward=False` for the other rows of a batch verified in the same forward. For a token
        tree, `drafted` is its number of nodes and `depth` its depth (positions count depths)."""
        depth = drafted if depth is None else depth
        self.target_calls += int(new_forward)
        self.row_rounds += 1
        if new_forward:
            self.gamma_history.append(gamma)
            self.drafted_history.append(drafted)
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.beta_sum += sum(betas)
        self.beta_count += len(betas)
        _grow(self.accepted_length_histogram, accepted + 1)
        self.accepted_length_histogram[accepted] += 1
        _grow(self.position_drafted, depth)
        _grow(self.position_accepted, depth)
        for i in range(depth):
            self.position_drafted[i] += 1
        for i in range(accepted):
            self.position_accepted[i] += 1

    def merge(self, other: SpeculativeStats) -> None:
        """Adds the rounds of `other` (another sequence decoded in the same call, with forwards of its own)."""
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if field.name in ("lenience", "rows"):
                continue
            if field.name.endswith("_history"):
                mine.extend(theirs)
            elif isinstance(mine, list):  # counts per length or position
                _grow(mine, len(theirs))
                for i, count in enumerate(theirs):
                    mine[i] += count
            else:
                setattr(self, field.name, mine + theirs)

    def to_dict(self) -> dict[str, Any]:
        """All fields plus the derived rates, as plain Python values (JSON-serializable); `rows` as a list of such
        dicts."""
        output = dataclasses.asdict(self)
        for name in ("acceptance_rate", "alpha", "mean_accepted_length", "position_acceptance_rate"):
            output[name] = getattr(self, name)
        output["rows"] = [row.to_dict() for row in self.rows]
        return output


def _grow(counts: list[int], length: int) -> None:
    counts.extend([0] * (length - len(counts)))
