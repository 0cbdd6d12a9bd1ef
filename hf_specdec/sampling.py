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

**Trees** (SpecInfer's multi-step speculative sampling, Miao et al., ASPLOS 2024). A proposal of k draft **nodes**
has `parents` as in `hf_specdec.trees` (-1 for the children of the root, the last context token; parents come
first). `target_probs[:, 0]` predicts the root's children and `target_probs[:, i + 1]` node i's children;
`draft_probs[:, i]` is the q that node i was drawn from given its ancestors, or `None` for point masses. The
**accepted path** is a root path of accepted nodes; the emitted tokens are its tokens, then a recovered token (after
the last tested children were all rejected) or a bonus token (at an accepted leaf). Starting at the root with p its
target row, the children are tested in index order: child x (drawn from q) is accepted when r q(x) < p(x); then
the walk moves to it and p becomes its row. On a rejection p <- norm(max(0, p - q)) and the next sibling is tested
against that **residual**. With no child left, the next token is drawn from the current p. No lenience for trees.

Why it is exact. At one node, let p_1 = p and p_{j+1} = norm(max(0, p_j - q_j)). Testing sibling j against p_j is
one step of Algorithm 1 for target p_j and draft q_j. By backward induction over the m siblings (after the last
one the token is drawn from p_{m+1} itself), the token emitted at this depth once sibling j is tested has law
min(p_j, q_j) + (1 - β_j) p_{j+1} = p_j, with β_j = sum_x min(p_j(x), q_j(x)); for j = 1 that is p.
Conditional on the emitted token x coming from an accepted child, the walk continues in that child's subtree with
its row p(. | prefix, x), whose children were drawn given x only; conditional on x being recovered the round ends.
So by induction over depth each emitted token, given those before it and given that it is emitted, is distributed
as the target's p: the emitted sequence is a stopped sample of the target.

For deterministic siblings (q_j a point mass on x_j) the step accepts x_j with probability p_j(x_j) and else leaves
p_j with x_j removed and renormalized: the siblings try their tokens one by one against p restricted to the tokens
not yet rejected. A duplicate of a rejected token has p_j = 0 there and is always rejected. This holds for any
choice of tokens fixed before the test (top-k, deduplicated, pruned): passing `draft_probs=None` is always exact.

Sampled siblings must be drawn independently of each other, each exactly from its q_j. The step of Algorithm 1 at
sibling j needs P(x_j = x | siblings before it) = q_j(x); a sibling redrawn until it differs from its elder
siblings (sampling without replacement), or siblings kept or pruned by their values, has another law q'_j, so its
accepted mass q'_j(x) min(1, p_j(x) / q_j(x)) is not min(p_j(x), q_j(x)) and the sum no longer telescopes to p.
Such a drafter must report `draft_probs=None` (point masses) instead.
"""

from __future__ import annotations

import torch

from .trees import tree_depths

__all__ = [
    "draft_target_overlap",
    "sample_tokens",
    "verify_greedy",
    "verify_sampling",
    "verify_tree_greedy",
    "verify_tree_sampling",
]


def sample_tokens(probs: torch.FloatTensor, generator: torch.Generator | None = None) -> torch.LongTensor:
    """One token per row of `probs` (`[batch, vocab]`, non-negative, rows need not sum to 1): `[batch]`.

    On a CPU: inverse-CDF sampling, a float64 cumulative sum and a binary search, exact in distribution up to
    float64 rounding. `torch.multinomial` draws a single sample by an exponential race over the whole vocabulary
    (one logarithm per entry), which on a CPU costs about 0.18 ms for 8k entries, as much as a few layers of a small
    model; this costs about 0.04 ms. Like `torch.multinomial`, it raises on rows that are not a distribution
    (`torch._assert_async`: on a CPU the check is immediate, with no read through Python). On accelerators
    `torch.multinomial` is fast and checks without a sync, so it is used there.
    """
    if probs.device.type != "cpu":
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [batch, vocab]
    total = cdf[:, -1:]  # [batch, 1]: NaN or inf anywhere in the row shows here
    torch._assert_async(
        (torch.isfinite(total) & (total > 0)).all(),
        "probability tensor contains `inf` or `nan`, or a row with no probability mass. Check the logits processors "
        "and the model's dtype.",
    )
    u = torch.rand(total.shape, dtype=torch.float64, generator=generator)  # [batch, 1]
    # strictly below the total, so the first i with cdf[i] > threshold exists and has p_i > 0
    threshold = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, threshold, right=True).squeeze(1)  # [batch]


def verify_greedy(
    draft_tokens: torch.LongTensor,  # [batch, gamma]
    target_scores: torch.FloatTensor,  # [batch, gamma + 1, vocab], standardized (processed) logits
    lenience: float = 1.0,
    target_tokens: torch.LongTensor | None = None,  # [batch, gamma + 1]: target_scores' argmax, where computed
    exact: torch.BoolTensor | None = None,  # [batch, gamma]: draft_tokens == target_tokens[:, :gamma], likewise
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Greedy verification: accept drafts while they equal the target's argmax; the next token is the target's argmax.

    Returns `(accepted, next_tokens)`, both `[batch]`. With `lenience < 1` a draft token x is also accepted when
    p(x) >= lenience * max(p), where p = softmax(target_scores) (Appendix A.5, argmax variant). A caller that has the
    argmax and the exact matches already passes them (`target_tokens`, `exact`): fewer kernels per round.
    """
    gamma = draft_tokens.shape[1]
    if gamma == 0:  # nothing drafted: a plain greedy step
        next_tokens = target_scores[:, 0].argmax(dim=-1)
        return torch.zeros_like(next_tokens), next_tokens
    if target_tokens is None:
        target_tokens = target_scores.argmax(dim=-1)  # [batch, gamma + 1]
    matches = exact if exact is not None else draft_tokens == target_tokens[:, :gamma]  # [batch, gamma]
    if lenience < 1.0 and gamma > 0:
        target_probs = target_scores[:, :gamma].softmax(dim=-1)  # [batch, gamma, vocab]
        draft_prob = target_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, gamma]
        matches = matches | (draft_prob >= lenience * target_probs.amax(dim=-1))
    accepted = matches.cumprod(dim=-1).sum(dim=-1)  # [batch], int64 (a bool cumprod counts in int64)
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
    recovered_dist = _normalized_residual((p_next - lenience * q_next).clamp(min=0.0), p_next)  # [batch, vocab]
    next_dist = torch.where((accepted < gamma)[:, None], recovered_dist, p_next)
    next_tokens = sample_tokens(next_dist, generator)
    return accepted, next_tokens


def _normalized_residual(residual: torch.FloatTensor, p: torch.FloatTensor) -> torch.FloatTensor:
    """norm(`residual`) per row (`[batch, vocab]`), or `p` where the residual has no mass: that happens only when
    p == q to float precision, where a rejection has probability ~0."""
    mass = residual.sum(dim=-1, keepdim=True)  # [batch, 1]
    return torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p)


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


def verify_tree_greedy(
    draft_tokens: torch.LongTensor,  # [batch, k]
    parents: torch.LongTensor,  # [batch, k], -1 for the root's children, parents[b, i] < i
    target_scores: torch.FloatTensor,  # [batch, k + 1, vocab]: row 0 after the root, row i + 1 after node i
    depths: torch.LongTensor | None = None,  # [batch, k]: tree_depths(parents), when the caller has them
    max_depth: int | None = None,  # a bound on the tree's depth, when the caller knows one (saves a host read)
) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor]:
    """Greedy tree verification: the deepest root path of nodes that equal the target's argmax at their parent.

    Returns `(accepted, accepted_nodes, next_tokens)`: `accepted` (`[batch]`) is the length of the accepted path,
    `accepted_nodes` (`[batch, k]`) its node indices root side first, padded with -1, and `next_tokens` (`[batch]`)
    the target's argmax after the path's last node (after the root when nothing is accepted). Among paths of equal
    depth the one ending at the lowest node index wins. With a chain (`parents` `[-1, 0, ..., k - 2]`) this is
    `verify_greedy`.
    """
    batch, k = draft_tokens.shape
    target_tokens = target_scores.argmax(dim=-1)  # [batch, k + 1]
    if k == 0:
        return torch.zeros_like(target_tokens[:, 0]), draft_tokens.clone(), target_tokens[:, 0]
    right = draft_tokens == target_tokens.gather(1, parents + 1)  # [batch, k]: the argmax at the node's parent
    depth = tree_depths(parents) if depths is None else depths  # [batch, k]
    max_depth = int(depth.max()) if max_depth is None else max_depth  # passes beyond the depth change nothing
    is_root_child = parents < 0
    on_path = right  # [batch, k]: right, and so are all ancestors; exact up to depth level + 1 after each pass
    for _ in range(max_depth - 1):
        on_path = right & (is_root_child | on_path.gather(1, parents.clamp(min=0)))
    index = torch.arange(k, device=parents.device)
    key = torch.where(on_path, depth * (k + 1) + (k - index), -1)  # deepest first, then the lowest index
    best_key, best = key.max(dim=1)  # [batch]
    found = best_key >= 0
    last = torch.where(found, best, -1)  # [batch]: the path's last node, -1 for the root
    accepted = torch.where(found, depth.gather(1, best[:, None]).squeeze(1), 0)  # [batch]
    next_tokens = target_tokens.gather(1, (last + 1)[:, None]).squeeze(1)  # [batch]
    # walk up from the last node, writing each node at its depth - 1; column k collects the writes of finished rows
    padded = torch.full((batch, k + 1), -1, dtype=torch.long, device=parents.device)  # [batch, k + 1]
    node = last
    for level in range(max_depth):
        write = node >= 0
        column = torch.where(write, accepted - 1 - level, k)
        padded.scatter_(1, column[:, None], torch.where(write, node, -1)[:, None])
        node = torch.where(write, parents.gather(1, node.clamp(min=0)[:, None]).squeeze(1), node)
    return accepted, padded[:, :k], next_tokens


def verify_tree_sampling(
    draft_tokens: torch.LongTensor,  # [batch, k]
    parents: torch.LongTensor,  # [batch, k], -1 for the root's children, parents[b, i] < i
    draft_probs: torch.FloatTensor | None,  # [batch, k, vocab]: q of node i given its ancestors; None: point masses
    target_probs: torch.FloatTensor,  # [batch, k + 1, vocab]: row 0 after the root, row i + 1 after node i
    generator: torch.Generator | None = None,
) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor]:
    """Multi-step speculative sampling on a tree: the children of the current node are tested in index order, each
    against the residual left by its rejected elder siblings; an accepted child becomes the current node.

    Returns `(accepted, accepted_nodes, next_tokens)` as `verify_tree_greedy` does; `next_tokens` is the recovered
    token (drawn from the residual after the last child was rejected) or the bonus token (drawn from an accepted
    leaf's row). The emitted tokens are distributed exactly as sampling from the target token by token, when sibling
    nodes were drawn independently from their `draft_probs` (see the module docstring). With a chain this draws
    the same random numbers as `verify_sampling` and returns the same tokens.
    """
    batch, k = draft_tokens.shape
    device = draft_tokens.device
    rows = torch.arange(batch, device=device)
    # one uniform per node, drawn up front like verify_sampling's; a node's is used only if the node is tested
    r = torch.rand((batch, k), device=device, dtype=target_probs.dtype, generator=generator)  # [batch, k]
    p = target_probs[:, 0]  # [batch, vocab]: the current node's row, or its residual after rejected children
    current = torch.full((batch,), -1, dtype=torch.long, device=device)  # [batch]: the last accepted node
    accepted = torch.zeros(batch, dtype=torch.long, device=device)  # [batch]
    padded = torch.full((batch, k + 1), -1, dtype=torch.long, device=device)  # [batch, k + 1]; column k: no write
    # index order reaches every node after its parent and after its elder siblings; a node is tested when its
    # parent is the current node: its elder siblings were all rejected, and none of its parent's siblings accepted
    for i in range(k):
        x = draft_tokens[:, i : i + 1]  # [batch, 1]
        tested = parents[:, i] == current  # [batch]
        p_x = p.gather(1, x).squeeze(1)  # [batch]
        if draft_probs is None:
            q_x = torch.ones_like(p_x)
            residual = p.scatter(1, x, 0.0)  # max(0, p - point mass on x)
        else:
            q_x = draft_probs[:, i].gather(1, x).squeeze(1)
            residual = (p - draft_probs[:, i]).clamp(min=0.0)  # [batch, vocab]
        passed = r[:, i] * q_x < p_x  # [batch]: r < p(x) / q(x) without dividing by q(x) = 0
        accept = tested & passed
        reject = tested & ~passed
        recovered_dist = _normalized_residual(residual, p)  # [batch, vocab]
        p = torch.where(accept[:, None], target_probs[:, i + 1], torch.where(reject[:, None], recovered_dist, p))
        padded[rows, torch.where(accept, accepted, k)] = torch.where(accept, i, -1)
        current = torch.where(accept, i, current)
        accepted = accepted + accept.long()
    next_tokens = sample_tokens(p, generator)
    return accepted, padded[:, :k], next_tokens
