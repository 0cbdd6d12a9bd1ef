"""`TokenTree`: builds a deterministic drafter's token tree node by node, within a node budget and a depth bound.

Nodes get their indices in the order they are added, so parents always come before their children (the order
`DraftProposal.parents` needs), and siblings carry distinct tokens (a duplicate sibling would spend budget on a
node the target verifies twice). Paths are merged like in a trie: inserting a continuation that starts like one
already in the tree only adds the tokens where it differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import DraftProposal

__all__ = ["TokenTree"]


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
