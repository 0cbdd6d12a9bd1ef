"""The speculative sampling step: Algorithm 1 of Leviathan, Kalman & Matias (ICML 2023), as pure tensor functions.

Nothing here sees a model, a cache or a config: standardized probabilities go in, the number of accepted drafts and
the next token come out. Variable names follow the paper:

- `gamma` (γ): how many tokens the drafter proposed this round.
- `draft_tokens` (x_1..x_γ): the **drafted** tokens, sampled from the drafter's standardized distributions q_i
  (or chosen deterministically, in which case q_i is a point mass on x_i and `draft_probs` is `None`).
- `target_probs` (p_1..p_{γ+1}): the target's standardized distributions, p_i conditioned on prefix + x_1..x_{i-1}.
- **accepted**: the leading drafted tokens that pass the ratio test r_i < p_i(x_i) / q_i(x_i); `accepted` is n.
- **rejected**: the first drafted token that fails the test (position n + 1); everything after it is discarded.
- **recovered** token: after a rejection, the token resampled from norm(max(0, p_{n+1} - q_{n+1})).
- **bonus** token: when all γ drafts are accepted, the extra token sampled from p_{γ+1}.

Lenience `l` (Appendix A.5) scales q before the comparison: accept with min(1, p / (l q)) and recover from
norm(max(0, p - l q)). With l = 1 this is exactly Algorithm 1; with l < 1 no token is emitted with probability above
p(x) / l. The greedy variant accepts a draft token x when p(x) >= l * max(p).
"""

from __future__ import annotations

import torch

__all__ = ["draft_target_overlap", "sample_tokens", "verify_greedy", "verify_sampling"]


def sample_tokens(probs: torch.FloatTensor, generator: torch.Generator | None = None) -> torch.LongTensor:
    """One token per row of `probs` (`[batch, vocab]`, non-negative, rows need not sum to 1): `[batch]`.

    On a CPU: inverse-CDF sampling, a float64 cumulative sum and a binary search, exact in distribution up to
    float64 rounding. `torch.multinomial` draws a single sample by an exponential race over the whole vocabulary
    (one logarithm per entry), which on a CPU costs about 0.18 ms for 8k entries, as much as a few layers of a small
    model; this costs about 0.04 ms. Like `torch.multinomial`, it raises on rows that are not a distribution (on a
    CPU that check costs no device sync). On accelerators `torch.multinomial` is fast and checks without a sync, so
    it is used there.
    """
    if probs.device.type != "cpu":
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [batch, vocab]
    total = cdf[:, -1:]  # [batch, 1]: NaN or inf anywhere in the row shows here
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise RuntimeError(
            "probability tensor contains `inf` or `nan`, or a row with no probability mass: "
            f"row sums {total.flatten().tolist()}. Check the logits processors and the model's dtype."
        )
    u = torch.rand(total.shape, dtype=torch.float64, generator=generator)  # [batch, 1]
    # strictly below the total, so the first i with cdf[i] > threshold exists and has p_i > 0
    threshold = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, threshold, right=True).squeeze(1)  # [batch]


def verify_greedy(
    draft_tokens: torch.LongTensor,  # [batch, gamma]
    target_scores: torch.FloatTensor,  # [batch, gamma + 1, vocab], standardized (processed) logits
    lenience: float = 1.0,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Greedy verification: accept drafts while they equal the target's argmax; the next token is the target's argmax.

    Returns `(accepted, next_tokens)`, both `[batch]`. With `lenience < 1` a draft token x is also accepted when
    p(x) >= lenience * max(p), where p = softmax(target_scores) (Appendix A.5, argmax variant).
    """
    gamma = draft_tokens.shape[1]
    if gamma == 0:  # nothing drafted: a plain greedy step
        next_tokens = target_scores[:, 0].argmax(dim=-1)
        return torch.zeros_like(next_tokens), next_tokens
    target_tokens = target_scores.argmax(dim=-1)  # [batch, gamma + 1]
    matches = draft_tokens == target_tokens[:, :gamma]  # [batch, gamma]
    if lenience < 1.0 and gamma > 0:
        target_probs = target_scores[:, :gamma].softmax(dim=-1)  # [batch, gamma, vocab]
        draft_prob = target_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, gamma]
        matches = matches | (draft_prob >= lenience * target_probs.amax(dim=-1))
    accepted = matches.long().cumprod(dim=-1).sum(dim=-1)  # [batch]
    next_tokens = target_tokens.gather(1, accepted[:, None]).squeeze(1)  # [batch]
    return accepted, next_tokens


def verify_sampling(
    draft_tokens: torch.LongTensor,  # [batch, gamma]
    draft_probs: torch.FloatTensor | None,  # [batch, gamma, vocab], or None for a deterministic (point-mass) drafter
    target_probs: torch.FloatTensor,  # [batch, gamma + 1, vocab]
    lenience: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Algorithm 1: the ratio test on each draft, then a recovered token (on rejection) or a bonus token.

    Returns `(accepted, next_tokens)`, both `[batch]`. The emitted tokens of row b are
    `draft_tokens[b, :accepted[b]]` followed by `next_tokens[b]`; they are distributed exactly as sampling from the
    target token by token (for `lenience=1`).
    """
    batch, gamma = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    if gamma == 0:
        accepted = torch.zeros(batch, dtype=torch.long, device=draft_tokens.device)
        return accepted, sample_tokens(target_probs[:, 0], generator)

    p_x = target_probs[:, :gamma].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, gamma]: p_i(x_i)
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, gamma]: q_i(x_i)
    r = torch.rand(p_x.shape, device=p_x.device, dtype=p_x.dtype, generator=generator)  # [batch, gamma]
    # r_i < p_i(x_i) / (l q_i(x_i)), multiplied out so that q_i(x_i) = 0 never divides
    passed = r * (lenience * q_x) < p_x  # [batch, gamma]
    accepted = passed.long().cumprod(dim=-1).sum(dim=-1)  # [batch]: n

    p_next = target_probs[rows, accepted]  # [batch, vocab]: p_{n+1}
    rejected_at = accepted.clamp(max=gamma - 1)  # index of the rejected draft (ignored for fully accepted rows)
    if draft_probs is None:
        q_next = torch.zeros_like(p_next)
        q_next[rows, draft_tokens[rows, rejected_at]] = 1.0
    else:
        q_next = draft_probs[rows, rejected_at]  # [batch, vocab]
    residual = (p_next - lenience * q_next).clamp(min=0.0)  # [batch, vocab]
    mass = residual.sum(dim=-1, keepdim=True)  # [batch, 1]
    # mass is 0 only when p == q to float precision, where a rejection has probability ~0: fall back to p
    recovered_dist = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p_next)
    next_dist = torch.where((accepted < gamma)[:, None], recovered_dist, p_next)
    next_tokens = sample_tokens(next_dist, generator)
    return accepted, next_tokens


def draft_target_overlap(
    draft_tokens: torch.LongTensor,  # [batch, gamma]
    draft_probs: torch.FloatTensor | None,  # [batch, gamma, vocab] or None (point mass on the drafted token)
    target_probs: torch.FloatTensor,  # [batch, gamma (+ 1), vocab]
) -> torch.FloatTensor:
    """β_i = sum_x min(p_i(x), q_i(x)) per drafted position (the paper's Corollary 3.6): `[batch, gamma]`.

    Its mean over positions estimates α. For a point-mass q it is p_i(x_i).
    """
    gamma = draft_tokens.shape[1]
    p = target_probs[:, :gamma]
    if draft_probs is None:
        return p.gather(-1, draft_tokens[..., None]).squeeze(-1)
    return torch.minimum(p, draft_probs).sum(dim=-1)
