"""Token trees for deterministic drafters: `TokenTree` builds one node by node (a drafter that lists continuations),
`DynamicTree` grows one best-first from a drafter's scores (EAGLE-2, for drafters that run a forward per depth).

`TokenTree` adds nodes within a node budget and a depth bound.

Nodes get their indices in the order they are added, so parents always come before their children (the order
`DraftProposal.parents` needs), and siblings carry distinct tokens (a duplicate sibling would spend budget on a
node the target verifies twice). Paths are merged like in a trie: inserting a continuation that starts like one
already in the tree only adds the tokens where it differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..trees import best_subtree
from .base import DraftProposal

__all__ = ["DynamicTree", "TokenTree"]


class TokenTree:
    """A token tree under construction: at most `budget` nodes, none deeper than `max_depth` (the root's children
    have depth 1). Node -1 is the root: the last token of the context.

    Example:

    ```python
    >>> from hf_specdec.drafters.tree_builder import TokenTree
    >>> tree = TokenTree(budget=5, max_depth=3)
    >>> tree.insert([7, 8, 9]), tree.insert([7, 5, 6]), tree.insert([4, 4])
    (3, 2, 0)
    >>> tree.tokens, tree.parents
    ([7, 8, 9, 5, 6], [-1, 0, 1, 0, 3])

    ```
    """

    def __init__(self, budget: int, max_depth: int):
        self.budget, self.max_depth = budget, max_depth
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self._children: dict[int, dict[int, int]] = {-1: {}}  # node -> {token: child node}

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.budget

    def child(self, parent: int, token: int) -> int | None:
        """The child of `parent` that carries `token`, or None."""
        return self._children[parent].get(token)

    def add(self, parent: int, token: int) -> int:
        """Adds a new child `token` under `parent` (-1: the root) and returns its index."""
        depth = self.depths[parent] + 1 if parent >= 0 else 1
        assert not self.full, "the tree is full"
        assert depth <= self.max_depth, f"a node at depth {depth} exceeds max_depth={self.max_depth}"
        assert token not in self._children[parent], f"node {parent} already has a child {token}"
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(depth)
        self._children[parent][token] = node
        self._children[node] = {}
        return node

    def insert(self, path: Sequence[int], parent: int = -1) -> int:
        """Merges `path` (tokens following `parent`) into the tree: follows the nodes that already carry its first
        tokens, then adds the rest, as far as the budget and the depth bound allow. Returns how many nodes it added."""
        added = 0
        for token in path:
            node = self.child(parent, token)
            if node is None:
                if self.full or (self.depths[parent] if parent >= 0 else 0) >= self.max_depth:
                    break
                node = self.add(parent, token)
                added += 1
            parent = node
        return added

    def path(self, node: int) -> list[int]:
        """The tokens from the root's child down to `node` (empty for the root, -1)."""
        tokens = []
        while node >= 0:
            tokens.append(self.tokens[node])
            node = self.parents[node]
        return tokens[::-1]

    def is_chain(self) -> bool:
        return all(parent == node - 1 for node, parent in enumerate(self.parents))

    def proposal(self, device: torch.device | str) -> DraftProposal:
        """The tree as a batch-1 proposal (probs=None: the nodes are chosen deterministically). A tree without
        branches is returned as a plain chain (`parents=None`), which the loop verifies without a tree mask."""
        if not self.tokens:
            return DraftProposal.empty(1, device)
        tokens = torch.tensor([self.tokens], dtype=torch.long, device=device)  # [1, k]
        if self.is_chain():
            return DraftProposal(tokens=tokens)
        return DraftProposal(tokens=tokens, parents=torch.tensor([self.parents], dtype=torch.long, device=device))


class DynamicTree:
    """EAGLE-2's dynamic token tree (Li et al., 2024) for one sequence, grown best-first by cumulative log q.

    The drafter gives the root's log q (`[1, vocab]`). Then, depth by depth, `expand()` picks the nodes to expand
    (the newest nodes among the best `budget` so far, at most `top_k`) and returns them with their attention
    among the expanded nodes; the drafter runs its forward over them and hands their children's log q to `grow()`,
    which adds each one's `top_k` best children. `proposal()` keeps the best `budget` nodes as a tree.

    Nodes are numbered in the order they are grown (depth by depth), which is topological. Node tensors live on the
    device of the log q; the attention rows on `device` (the drafter's). Children with log q = -inf (masked by a
    logits processor) are never kept. The one host sync per depth is the size of the frontier.

    Example:

    ```python
    >>> import torch
    >>> from hf_specdec.drafters.tree_builder import DynamicTree
    >>> tree = DynamicTree(torch.tensor([[0.7, 0.2, 0.1]]).log(), budget=3, top_k=2, device="cpu")
    >>> expansion = tree.expand()
    >>> expansion.tokens.tolist(), expansion.mask.tolist()
    ([0, 1], [[True, False], [False, True]])
    >>> tree.grow(torch.tensor([[0.9, 0.05, 0.05], [0.5, 0.5, 0.0]]).log())
    >>> proposal = tree.proposal()
    >>> proposal.tokens.tolist(), proposal.parents.tolist()
    ([[0, 1, 0]], [[-1, -1, 0]])

    ```
    """

    class Expansion:
        """The nodes to expand at one depth: `nodes` `[f]`, their `tokens` `[f]`, their `paths` below the root
        `[f, depth]`, and `mask` `[f, expanded + f]`: which of the expanded nodes so far (in expansion order, these
        last) each may attend to: its ancestors and itself."""

        def __init__(self, nodes, tokens, paths, mask):
            self.nodes, self.tokens, self.paths, self.mask = nodes, tokens, paths, mask

    def __init__(self, log_q: torch.FloatTensor, budget: int, top_k: int, device: torch.device | str):
        self.budget, self.top_k, self.device = budget, min(top_k, log_q.shape[-1]), device
        child_log_q, child_tokens = log_q.topk(self.top_k, dim=-1)  # [1, top_k]
        finite = torch.isfinite(child_log_q[0])
        self.tokens = child_tokens[0][finite]  # [n]
        self.parents = torch.full_like(self.tokens, -1)  # [n]
        self.scores = child_log_q[0][finite].clamp(max=0.0)  # [n]: never increasing along a path
        self.newest_start = 0  # the newest depth's nodes are tokens[newest_start:]
        self.newest_paths = self.tokens[:, None]  # [newest, depth]: each newest node's path below the root
        # row r + 1 says which expanded nodes the r-th expanded node sees; row 0 is the root, which sees none
        self.visible = torch.zeros(1, 0, dtype=torch.bool, device=device)  # [1 + expanded, expanded]
        self.rows = torch.zeros(self.tokens.shape[0], dtype=torch.long, device=device)  # [n]: an expanded node's row
        self.frontier = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def expand(self) -> DynamicTree.Expansion | None:
        """The next depth's nodes to expand, or None when none can be kept."""
        # only a node among the best `budget` so far can be kept (its children rank below it); taken in rank order,
        # the newest nodes that can are the best of their depth
        ranked = self.scores.sort(descending=True, stable=True).indices[: self.budget]  # [<= budget]
        frontier = ranked[ranked >= self.newest_start][: self.top_k]  # [f]
        size = frontier.shape[0]  # host sync
        if size == 0:
            return None
        device = self.device
        parents = self.parents[frontier].to(device)  # [f]
        parent_rows = torch.where(parents >= 0, self.rows[parents.clamp(min=0)], 0)  # [f]
        expanded = self.visible.shape[1]
        mask = torch.cat([self.visible[parent_rows], torch.eye(size, dtype=torch.bool, device=device)], dim=1)
        self.visible = torch.cat([torch.cat([self.visible, self.visible.new_zeros(1 + expanded, size)], dim=1), mask])
        self.rows[frontier.to(device)] = torch.arange(1 + expanded, 1 + expanded + size, device=device)
        self.frontier = frontier
        return self.Expansion(frontier, self.tokens[frontier], self.newest_paths[frontier - self.newest_start], mask)

    def grow(self, log_q: torch.FloatTensor) -> None:
        """Adds the `top_k` best children of each node of the last `expand()`, from their log q `[f, vocab]`."""
        frontier, top_k = self.frontier, self.top_k
        child_log_q, child_tokens = log_q.topk(top_k, dim=-1)  # [f, top_k]
        child_scores = self.scores[frontier][:, None] + child_log_q.clamp(max=0.0)  # [f, top_k]: -inf never kept
        paths = self.newest_paths[frontier - self.newest_start]  # [f, depth]
        self.newest_start = self.tokens.shape[0]
        self.newest_paths = torch.cat([paths.repeat_interleave(top_k, dim=0), child_tokens.reshape(-1, 1)], dim=-1)
        self.tokens = torch.cat([self.tokens, child_tokens.reshape(-1)])
        self.parents = torch.cat([self.parents, frontier.repeat_interleave(top_k)])
        self.scores = torch.cat([self.scores, child_scores.reshape(-1)])
        self.rows = torch.cat([self.rows, self.rows.new_zeros(frontier.shape[0] * top_k)])

    def proposal(self) -> DraftProposal:
        """The best `budget` nodes with a finite score, as a batch-1 tree proposal (probs None: chosen
        deterministically, so sampling treats each node as a point mass)."""
        finite = torch.isfinite(self.scores)
        if not self.tokens.numel():
            return DraftProposal.empty(1, self.tokens.device)
        scores = torch.where(finite, self.scores, torch.finfo(self.scores.dtype).min)
        kept, parents = best_subtree(self.parents[None], scores[None], min(self.budget, int(finite.sum())))
        return DraftProposal(tokens=self.tokens[kept], parents=parents)
