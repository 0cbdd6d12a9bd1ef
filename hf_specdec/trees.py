"""Token trees: the structure a tree proposal has and the attention it needs, as pure tensor functions.

A tree of k draft **nodes** is given by `parents` (`[batch, k]`): the index of each node's parent, -1 for the
children of the **root** (the last token of the context, whose successor the target predicts first). Parents come
before their children, so index order is a topological order. A chain of k drafts is `[-1, 0, ..., k - 2]`.

The target verifies every node in one forward: each node attends to the cached context, the uncached tail (the
root and, in the first round, the prompt) and its own ancestors, and sits at position `root_position + depth`,
where the root's children have depth 1. Nothing here sees a model or a cache.
"""

from __future__ import annotations

import torch

__all__ = [
    "ancestor_mask",
    "best_subtree",
    "bounded_ancestor_mask",
    "chain_parents",
    "check_parents",
    "tree_attention_bias",
    "tree_depths",
]


def chain_parents(batch: int, length: int, device=None) -> torch.LongTensor:
    """The `parents` of a chain of `length` drafts: `[batch, length]`, each row `[-1, 0, ..., length - 2]`."""
    return (torch.arange(length, device=device) - 1).expand(batch, length)


def check_parents(parents: torch.LongTensor) -> str | None:
    """Why `parents` (`[batch, k]`) is not a valid tree, or None: each entry in [-1, own index)."""
    index = torch.arange(parents.shape[1], device=parents.device)
    bad = (parents < -1) | (parents >= index)
    if bool(bad.any()):
        row, node = (int(i) for i in bad.nonzero()[0])
        return (
            f"node {node} of row {row} has parent {int(parents[row, node])}, but each node's parent must be -1 "
            "(the last context token) or an earlier node (parents[b, i] < i)"
        )
    return None


def tree_depths(parents: torch.LongTensor) -> torch.LongTensor:
    """Depth of each node (`[batch, k]`), 1 for the children of the root; one gather per level of the tree."""
    return ancestor_mask(parents).sum(dim=-1)


def ancestor_mask(parents: torch.LongTensor) -> torch.BoolTensor:
    """`[batch, k, k]`: entry (i, j) is True when node j is node i or one of its ancestors (what node i may see).
    One gather per level of the tree: every node climbs one ancestor at a time (one host read per level to stop at
    the deepest; `bounded_ancestor_mask` reads nothing when the caller knows a bound on the depth)."""
    return _climb(parents, None)[0]


def bounded_ancestor_mask(parents: torch.LongTensor, max_depth: int) -> tuple[torch.BoolTensor, torch.BoolTensor]:
    """`ancestor_mask` for a tree the caller expects at most `max_depth` deep, with no host read: returns the mask
    and a 0-dim bool tensor, True when some node is deeper (its mask then misses the ancestors above that depth, so
    the caller must refuse the tree once it reads the flag)."""
    return _climb(parents, max_depth)


def _climb(parents: torch.LongTensor, max_depth: int | None):
    batch, k = parents.shape
    # column k collects the writes of nodes that have climbed past the root
    mask = torch.eye(k, k + 1, dtype=torch.bool, device=parents.device).expand(batch, k, k + 1).clone()
    ancestor = parents  # [batch, k]: each node's ancestor at the current height, -1 past the root
    # a valid tree is at most k deep; a node at depth d has d - 1 ancestors among the nodes
    for _ in range(k if max_depth is None else min(k, max(0, max_depth - 1))):
        has = ancestor >= 0  # [batch, k]
        if max_depth is None and not bool(has.any()):
            break
        mask.scatter_(2, torch.where(has, ancestor, k)[..., None], True)
        ancestor = torch.where(has, parents.gather(1, ancestor.clamp(min=0)), ancestor)
    return mask[..., :k], (ancestor >= 0).any() if max_depth is not None else None


def additive_bias(allowed: torch.BoolTensor, dtype: torch.dtype) -> torch.FloatTensor:
    """0 where `allowed`, the dtype's minimum elsewhere: the mask form both eager and SDPA attention add to scores."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def tree_attention_bias(
    parents: torch.LongTensor,  # [batch, k]
    past_length: int,
    tail_length: int,
    dtype: torch.dtype,
    sees: torch.BoolTensor | None = None,  # [batch, k, k]: ancestor_mask(parents), when already computed
    context_mask: torch.LongTensor | None = None,  # [batch, past_length + tail_length]: 0 on (left) padding
) -> torch.FloatTensor:
    """The additive 4D attention mask `[batch, 1, tail_length + k, past_length + tail_length + k]` of one tree
    forward: `past_length` cached tokens, then `tail_length` uncached context tokens (causal among themselves; the
    last is the root), then the k nodes, each seeing the whole context and its ancestors; context columns that
    `context_mask` marks as padding are seen by none."""
    batch, k = parents.shape
    device = parents.device
    context = past_length + tail_length
    queries, keys = tail_length + k, context + k
    allowed = torch.zeros(batch, queries, keys, dtype=torch.bool, device=device)
    allowed[:, :, :past_length] = True
    allowed[:, :tail_length, past_length:context] = torch.ones(
        tail_length, tail_length, dtype=torch.bool, device=device
    ).tril()
    allowed[:, tail_length:, past_length:context] = True
    allowed[:, tail_length:, context:] = ancestor_mask(parents) if sees is None else sees
    if context_mask is not None:
        allowed[:, :, :context] &= context_mask[:, None, :].bool()
    return additive_bias(allowed[:, None], dtype)


def best_subtree(parents: torch.LongTensor, scores: torch.FloatTensor, budget: int):
    """The `budget` best nodes of a tree by score, as a tree of their own (EAGLE-2's rerank).

    `parents` (`[batch, k]`, topological) and `scores` (`[batch, k]`) must have scores that never increase from a
    node to its children (cumulative log-probabilities do). Ties go to the earlier node, so a parent always ranks
    before its children and the kept set holds every kept node's ancestors. Returns `(kept, kept_parents)`, both
    `[batch, min(budget, k)]`: the kept nodes' indices in increasing (topological) order, and their parents
    reindexed into `kept` (-1 for children of the root)."""
    batch, k = parents.shape
    size = min(budget, k)
    # a stable sort leaves tied nodes in index order: a parent before a child of equal score
    best = scores.sort(dim=-1, descending=True, stable=True).indices[:, :size]  # [batch, size]
    kept = best.sort(dim=-1).values  # [batch, size]
    new_index = torch.full_like(parents, -1).scatter_(
        1, kept, torch.arange(size, device=parents.device).expand(batch, size).contiguous()
    )  # [batch, k]
    old_parents = parents.gather(1, kept)  # [batch, size]
    kept_parents = torch.where(old_parents >= 0, new_index.gather(1, old_parents.clamp(min=0)), old_parents)
    return kept, kept_parents
