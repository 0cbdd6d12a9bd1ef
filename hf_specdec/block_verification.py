"""Block verification (Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro & Suresh, "Block Verification Accelerates
Speculative Decoding", ICLR 2025): the γ drafts of a chain verified jointly rather than token by token, as pure tensor
functions (`speculative_verification="block"`, and `"auto"`, the default, for sampled drafts;
`hf_specdec.sampling.verify_sampling` is the token-wise rule).

Notation as in `hf_specdec.sampling`: drafts x_1..x_γ, the drafter's q_i (x_i was drawn from q_i given x_1..x_{i-1};
a point mass for deterministic drafters) and the target's p_i (given x_1..x_{i-1}), i = 1..γ + 1.

**The rule** (the paper's Algorithm 2). With w_0 = 1, the weight of each prefix of the block is

    w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i)),        i = 1..γ,

and the acceptance threshold of accepting exactly the first i drafts is

    h_i = m_i / (m_i + 1 - w_i),  m_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x)),   i = 1..γ - 1,
    h_γ = w_γ

(h_i = 1 where m_i + 1 - w_i = 0: then w_i = 1 and p_{i+1} = q_{i+1}). With η_1..η_γ independent uniforms, the round
accepts τ = max{i : η_i < h_i} drafts (0 when there is none): every position is tested, and a late pass accepts the
whole prefix before it even where an earlier test failed. The next token is drawn from p_{γ+1} when τ = γ (the bonus
token), else from the **block residual** norm(max(0, w_τ p_{τ+1} - q_{τ+1})) (with w_0 = 1 this is Algorithm 1's
residual when nothing is accepted).

**Why the output is the target's distribution** (the paper's Theorem 1, proved there by induction over the block).
w_i is the ratio of the target's to the drafter's probability of the prefix x_1..x_i, capped at 1 wherever it exceeds
1 along the way: how much of the target's mass on that prefix the drafted prefix can carry. Given the drafts, the
threshold h_i splits that mass between stopping after x_1..x_i (then the next token comes from the block residual,
whose mass m_i is exactly what the target puts after x_1..x_i beyond what the drafter carries on) and handing it on to
the longer prefixes; h_γ = w_γ stops the full block. Summed over the draft blocks that share a prefix, each emitted
prefix followed by its next token y gets the target's probability p(x_1..x_i, y), for any q: the emitted tokens are a
stopped sample of the target, like Algorithm 1's, and the next round continues from them as from any target sample.
`tests/test_block_verification.py` checks this equality by exact enumeration for γ = 1..4, sampled and point-mass
drafts, and that near misses of the rule fail it.

**Why it accepts at least as much** (the paper's Theorem 2, optimality among valid verifiers for a chain): token-wise
verification stops at the first failed test, so its accepted length is at most τ for coupled randomness; the
expected number of accepted drafts is never lower, and is strictly higher when some later prefix recovers the mass
an earlier ratio lost (p_i(x_i) < q_i(x_i) followed by p_j(x_j) > q_j(x_j)). With point-mass drafts no ratio
exceeds 1 and the two rules accept equally many in expectation (tested), so only sampled drafts gain (`"auto"`
verifies point masses token-wise, `hf_specdec.verdicts.uses_block_verification`). Greedy decoding
is unaffected (there is no ratio to compensate); token trees keep SpecInfer's multi-candidate rejection
(`hf_specdec.sampling`), for which the paper gives no block rule. Lenience (Appendix A.5 of Leviathan et al.) is defined for the token-wise rule only.
"""

from __future__ import annotations

import torch

from .sampling import sample_tokens

__all__ = ["block_next_distribution", "block_thresholds", "verify_block"]


def _prefix_weights(
    draft_tokens: torch.LongTensor,  # [batch, gamma]
    draft_probs: torch.FloatTensor | None,  # [batch, gamma, vocab], or None for point masses
    target_probs: torch.FloatTensor,  # [batch, gamma + 1, vocab]
) -> tuple[torch.FloatTensor, torch.FloatTensor]:
    """`(w, p_x)`: the prefix weights w_0 = 1..w_γ (`[batch, gamma + 1]`) and p_i(x_i) (`[batch, gamma]`)."""
    gamma = draft_tokens.shape[1]
    p = target_probs  # float32 from the loop (float64 in the exact tests)
    p_x = p[:, :gamma].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, gamma]: p_i(x_i)
    if draft_probs is None:  # q_i(x_i) = 1: the ratio is p_i(x_i)
        ratio = p_x
    else:
        q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1).to(p.dtype)  # [batch, gamma]: q_i(x_i)
        # p_i(x_i) / q_i(x_i); a draft the drafter gave no mass (never sampled) counts as certain, as in the ratio test
        ratio = torch.where(q_x > 0, p_x / q_x.clamp(min=torch.finfo(p.dtype).tiny), 1.0)
    # w_i = min(1, w_{i-1} r_i) in one pass: in logs, L_i = min(0, L_{i-1} + log r_i) = s_i - max(s_0..s_i) with
    # s_i = log r_1 + ... + log r_i and s_0 = 0 (a ratio of 0 gives -inf: w stays 0 from there on, as the product)
    s = torch.nn.functional.pad(ratio.log().cumsum(dim=-1), (1, 0))  # [batch, gamma + 1]: s_0..s_γ
    return (s - s.cummax(dim=-1).values).exp(), p_x  # w exactly 1 where s_i is the max


def _residuals(
    w: torch.FloatTensor,  # [batch, gamma + 1]: w_0..w_γ
    p_x: torch.FloatTensor,  # [batch, gamma]: p_i(x_i)
    draft_probs: torch.FloatTensor | None,  # [batch, gamma, vocab], or None for point masses
    target_probs: torch.FloatTensor,  # [batch, gamma + 1, vocab]
) -> tuple[torch.FloatTensor, torch.FloatTensor | None]:
    """The block residual's mass m_i after each i = 0..γ - 1 accepted drafts (`[batch, gamma]`) and, for sampled
    drafts, the residuals max(0, w_i p_{i+1} - q_{i+1}) themselves (`[batch, gamma, vocab]`; None for point masses,
    whose residual is p_{i+1} with x_{i+1} taken out, scaled by w_i). After i drafts the next position's rows are
    p_{i+1} = target_probs[:, i] and q_{i+1} = q[:, i]."""
    gamma = p_x.shape[1]
    if draft_probs is None:  # w_i p_{i+1}(x_{i+1}) <= 1 = q_{i+1}(x_{i+1}): nothing is left at x_{i+1}
        return w[:, :gamma] * (1.0 - p_x), None
    residuals = (w[:, :gamma, None] * target_probs[:, :gamma] - draft_probs.to(target_probs.dtype)).clamp(min=0.0)
    return residuals.sum(dim=-1), residuals


def _thresholds(w: torch.FloatTensor, masses: torch.FloatTensor) -> torch.FloatTensor:
    """h_i = m_i / (m_i + 1 - w_i), i = 1..γ - 1 (1 where the denominator is 0), and h_γ = w_γ: `[batch, gamma]`."""
    gamma = masses.shape[1]
    denominator = masses[:, 1:] + 1.0 - w[:, 1:gamma]
    inner = torch.where(denominator > 0, masses[:, 1:] / denominator.clamp(min=torch.finfo(w.dtype).tiny), 1.0)
    return torch.cat([inner, w[:, gamma:]], dim=1)


def block_thresholds(
    draft_tokens: torch.LongTensor,  # [batch, gamma]
    draft_probs: torch.FloatTensor | None,  # [batch, gamma, vocab], or None for point masses
    target_probs: torch.FloatTensor,  # [batch, gamma + 1, vocab]
) -> tuple[torch.FloatTensor, torch.FloatTensor]:
    """`(h, w)`, both `[batch, gamma]`: the acceptance threshold h_i of accepting exactly i drafts and the prefix
    weight w_i, i = 1..γ (column i - 1)."""
    w, p_x = _prefix_weights(draft_tokens, draft_probs, target_probs)
    masses, _ = _residuals(w, p_x, draft_probs, target_probs)
    return _thresholds(w, masses), w[:, 1:]


def _next_rows(
    accepted: torch.LongTensor,  # [batch]: τ
    draft_tokens: torch.LongTensor,  # [batch, gamma]
    target_probs: torch.FloatTensor,  # [batch, gamma + 1, vocab]
    masses: torch.FloatTensor,  # [batch, gamma]: m_0..m_{γ-1}
    residuals: torch.FloatTensor | None,  # [batch, gamma, vocab], or None for point masses
) -> torch.FloatTensor:
    """The next token's distribution after τ accepted drafts, unnormalized, `[batch, vocab]`: p_{γ+1} when τ = γ, else
    the block residual after τ (p_{τ+1} itself where it has no mass: p = q there)."""
    batch, gamma = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    p_next = target_probs[rows, accepted]  # [batch, vocab]: p_{τ+1}
    at = accepted.clamp(max=gamma - 1)  # the residual's index (ignored where τ = γ)
    residual = (accepted < gamma) & (masses[rows, at] > 0)  # [batch]: rows drawn from their residual
    if residuals is not None:
        return torch.where(residual[:, None], residuals[rows, at], p_next)
    # a point mass on x_{τ+1}: p_{τ+1} with x_{τ+1} taken out (w_τ only scales it; it is > 0 wherever the residual has
    # mass)
    drafted = draft_tokens[rows, at][:, None]  # [batch, 1]: x_{τ+1}
    kept = torch.where(residual[:, None], 0.0, p_next.gather(-1, drafted))  # [batch, 1]: what stays there
    return p_next.scatter(-1, drafted, kept)


def block_next_distribution(
    accepted: torch.LongTensor,  # [batch]: τ
    draft_tokens: torch.LongTensor,
    draft_probs: torch.FloatTensor | None,
    target_probs: torch.FloatTensor,
    weights: torch.FloatTensor,  # [batch, gamma]: w_1..w_γ from `block_thresholds`
) -> torch.FloatTensor:
    """The next token's distribution after τ accepted drafts, `[batch, vocab]`: p_{γ+1} when τ = γ, else the block
    residual norm(max(0, w_τ p_{τ+1} - q_{τ+1})) (p_{τ+1} itself where the residual has no mass: p = q there)."""
    gamma = draft_tokens.shape[1]
    w = torch.cat([torch.ones_like(weights[:, :1]), weights], dim=1)  # [batch, gamma + 1]: w_0 = 1..w_γ
    p_x = target_probs[:, :gamma].gather(-1, draft_tokens[..., None]).squeeze(-1)
    masses, residuals = _residuals(w, p_x, draft_probs, target_probs)
    rows = _next_rows(accepted, draft_tokens, target_probs, masses, residuals)
    return rows / rows.sum(dim=-1, keepdim=True)


def verify_block(
    draft_tokens: torch.LongTensor,  # [batch, gamma]
    draft_probs: torch.FloatTensor | None,  # [batch, gamma, vocab], or None for a deterministic (point-mass) drafter
    target_probs: torch.FloatTensor,  # [batch, gamma + 1, vocab]
    generator: torch.Generator | None = None,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Block verification: `(accepted, next_tokens)`, both `[batch]`, as `hf_specdec.sampling.verify_sampling`
    returns them; the emitted tokens of row b are `draft_tokens[b, :accepted[b]]` followed by `next_tokens[b]`."""
    batch, gamma = draft_tokens.shape
    if gamma == 0:
        accepted = torch.zeros(batch, dtype=torch.long, device=draft_tokens.device)
        return accepted, sample_tokens(target_probs[:, 0], generator)
    w, p_x = _prefix_weights(draft_tokens, draft_probs, target_probs)
    masses, residuals = _residuals(w, p_x, draft_probs, target_probs)
    h = _thresholds(w, masses)  # [batch, gamma]
    eta = torch.rand(h.shape, device=h.device, dtype=h.dtype, generator=generator)  # [batch, gamma]
    positions = torch.arange(1, gamma + 1, device=h.device)
    accepted = torch.where(eta < h, positions, 0).amax(dim=-1)  # [batch]: τ, the last passing position
    # the sampler takes unnormalized rows
    return accepted, sample_tokens(_next_rows(accepted, draft_tokens, target_probs, masses, residuals), generator)
