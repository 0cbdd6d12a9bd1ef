"""Block verification (Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro & Suresh, "Block Verification Accelerates
Speculative Decoding", ICLR 2025): the γ drafts of a chain verified jointly rather than token by token, as pure tensor
functions (`speculative_verification="block"`; `hf_specdec.sampling.verify_sampling` is the token-wise rule).

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
an earlier ratio lost (p_i(x_i) < q_i(x_i) followed by p_j(x_j) > q_j(x_j)). Greedy decoding is unaffected (there is
no ratio to compensate); token trees keep SpecInfer's multi-candidate rejection (`hf_specdec.sampling`), for which
the paper gives no block rule. Lenience (Appendix A.5 of Leviathan et al.) is defined for the token-wise rule only.
"""

from __future__ import annotations

import torch

from .sampling import sample_tokens

__all__ = ["block_next_distribution", "block_thresholds", "verify_block"]


def _draft_rows(
    draft_tokens: torch.LongTensor, draft_probs: torch.FloatTensor | None, like: torch.Tensor
) -> torch.Tensor:
    """q_1..q_γ as `[batch, gamma, vocab]` in `like`'s dtype: the drafter's rows, or point masses on the drafts."""
    if draft_probs is not None:
        return draft_probs.to(like.dtype)
    return torch.nn.functional.one_hot(draft_tokens, like.shape[-1]).to(like.dtype)


def block_thresholds(
    draft_tokens: torch.LongTensor,  # [batch, gamma]
    draft_probs: torch.FloatTensor | None,  # [batch, gamma, vocab], or None for point masses
    target_probs: torch.FloatTensor,  # [batch, gamma + 1, vocab]
) -> tuple[torch.FloatTensor, torch.FloatTensor]:
    """`(h, w)`, both `[batch, gamma]`: the acceptance threshold h_i of accepting exactly i drafts and the prefix
    weight w_i, i = 1..γ (column i - 1)."""
    gamma = draft_tokens.shape[1]
    p = target_probs  # float32 from the loop (float64 in the exact tests)
    q = _draft_rows(draft_tokens, draft_probs, p)  # [batch, gamma, vocab]
    tiny = torch.finfo(p.dtype).tiny
    p_x = p[:, :gamma].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, gamma]: p_i(x_i)
    q_x = q.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, gamma]: q_i(x_i)
    # p_i(x_i) / q_i(x_i); a draft the drafter gave no mass (never sampled) counts as certain, as in the ratio test
    ratio = torch.where(q_x > 0, p_x / q_x.clamp(min=tiny), torch.ones_like(p_x))
    # w_i = min(1, w_{i-1} r_i) in one pass: in logs, L_i = min(0, L_{i-1} + log r_i) = s_i - max(s_0..s_i) with
    # s_i = log r_1 + ... + log r_i and s_0 = 0 (a ratio of 0 gives -inf: w stays 0 from there on, as the product)
    s = torch.nn.functional.pad(ratio.log().cumsum(dim=-1), (1, 0))  # [batch, gamma + 1]: s_0..s_γ
    w = (s - s.cummax(dim=-1).values)[:, 1:].exp()  # [batch, gamma]: w_1..w_γ (exactly 1 where s_i is the max)
    # m_i over the next position's rows, i = 1..γ - 1: p_{i+1} is target_probs[:, i], q_{i+1} is q[:, i]
    mass = (w[:, :-1, None] * p[:, 1:gamma] - q[:, 1:gamma]).clamp(min=0.0).sum(dim=-1)  # [batch, gamma - 1]
    denominator = mass + 1.0 - w[:, :-1]
    h_inner = torch.where(denominator > 0, mass / denominator.clamp(min=tiny), 1.0)
    return torch.cat([h_inner, w[:, -1:]], dim=1), w


def block_next_distribution(
    accepted: torch.LongTensor,  # [batch]: τ
    draft_tokens: torch.LongTensor,
    draft_probs: torch.FloatTensor | None,
    target_probs: torch.FloatTensor,
    weights: torch.FloatTensor,  # [batch, gamma]: w_1..w_γ from `block_thresholds`
) -> torch.FloatTensor:
    """The next token's distribution after τ accepted drafts, `[batch, vocab]`: p_{γ+1} when τ = γ, else the block
    residual norm(max(0, w_τ p_{τ+1} - q_{τ+1})) (p_{τ+1} itself where the residual has no mass: p = q there)."""
    batch, gamma = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    p_next = target_probs[rows, accepted]  # [batch, vocab]: p_{τ+1}
    at = accepted.clamp(max=gamma - 1)  # q_{τ+1}'s index (ignored where τ = γ)
    q_next = _draft_rows(draft_tokens[rows, at], None if draft_probs is None else draft_probs[rows, at], p_next)
    w_prev = torch.cat([torch.ones_like(weights[:, :1]), weights], dim=1)[rows, accepted]  # [batch]: w_τ, w_0 = 1
    residual = (w_prev[:, None] * p_next - q_next).clamp(min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    recovered = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p_next)
    return torch.where((accepted < gamma)[:, None], recovered, p_next)


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
    h, weights = block_thresholds(draft_tokens, draft_probs, target_probs)
    eta = torch.rand(h.shape, device=h.device, dtype=h.dtype, generator=generator)  # [batch, gamma]
    positions = torch.arange(1, gamma + 1, device=h.device)
    accepted = torch.where(eta < h, positions, 0).amax(dim=-1)  # [batch]: τ, the last passing position
    next_dist = block_next_distribution(accepted, draft_tokens, draft_probs, target_probs, weights)
    return accepted, sample_tokens(next_dist, generator)
