"""How a round's drafts sit after the context: a chain (`ChainLayout`) or a token tree (`TreeLayout`). A layout says
what differs between them: the prefix each drafted position is conditioned on, the extra forward inputs (a tree's
4D attention mask and depth-based positions), how verification runs, which tokens are emitted, and how the
target's cache keeps the accepted drafts (a chain crops its tail; a tree compacts the accepted path's keys and
values into place; a static cache is rewound in place).
"""

from __future__ import annotations

import torch

from .caches import compact_cache, rewind_cache
from .configuration import SpeculativeOptions
from .drafters.base import Drafter, DraftProposal
from .proposals import ProposalCheck
from .sampling import verify_tree_greedy, verify_tree_sampling
from .trees import bounded_ancestor_mask, tree_attention_bias
from .verdicts import Verdict, verify_round

__all__ = ["ChainLayout", "TreeLayout", "layout_for"]


class ChainLayout:
    """Drafts in a row after the context: the model's own causal mask, and a crop rolls the cache back."""

    prefills_context = False
    """Whether an uncached context longer than the root is prefilled by a forward of its own first (a tree's mask
    then stays `[1 + k, context + k]`, and the prompt keeps the model's causal fast path)."""

    def __init__(self, proposal: DraftProposal):
        self.proposal = proposal
        self.depth = proposal.tokens.shape[1]

    def verify(self, do_sample: bool, target_scores: torch.FloatTensor, options: SpeculativeOptions) -> Verdict:
        return verify_round(do_sample, self.proposal, target_scores, options)

    def forward_overrides(
        self,
        cache_length: int,
        context_length: int,
        dtype: torch.dtype,
        context_mask: torch.LongTensor | None = None,
        key_length: int | None = None,
    ) -> dict:
        """Inputs that replace the prepared ones; `key_length`: the columns a static cache attends over."""
        return {}

    def prefix(self, candidate_ids: torch.LongTensor, context_length: int, j: int) -> torch.LongTensor:
        """The ids that position j (0: after the context, i: after draft i - 1) follows, `[rows, len]`."""
        return candidate_ids[:, : context_length + j]

    def accepted_tokens(self, verdict: Verdict) -> torch.LongTensor:
        """`[1, accepted + 1]` of row 0: its accepted drafts, then the next token (after `read_verdict`)."""
        n = verdict.accepted_counts[0]
        return torch.cat([self.proposal.tokens[:1, :n], verdict.next_tokens[:1, None]], dim=-1)

    def emitted_positions(self, verdict: Verdict) -> list[int]:
        """Which of the k + 1 scored positions each emitted token of row 0 was chosen from."""
        return list(range(verdict.accepted_counts[0] + 1))

    def keep_accepted(self, cache, context_length: int, verdict: Verdict, kept: int) -> None:
        """Leaves the cache holding the context and the first `kept` accepted drafts, nothing after."""
        rewind_cache(cache, context_length + kept)

    def kept_nodes(self, verdict: Verdict, kept: int) -> torch.LongTensor:
        """The indices of the `kept` drafts of row 0 that stay, in sequence order."""
        return torch.arange(kept, device=self.proposal.tokens.device)

    def kept_hidden_states(self, states: torch.Tensor, verdict: Verdict, kept: int) -> torch.Tensor:
        """Of the hidden states of a round's forwards (`[1, positions, H]`, the drafts last), those of the positions
        whose next token is now known: every context position, then the `kept` accepted drafts."""
        num_drafted = self.proposal.tokens.shape[1]
        if not num_drafted:
            return states
        return torch.cat([states[:, :-num_drafted], states[:, -num_drafted:][:, self.kept_nodes(verdict, kept)]], dim=1)

    def tell_drafter(self, drafter: Drafter, input_ids: torch.LongTensor, verdict: Verdict, **extra) -> None:
        drafter.on_verified(input_ids, verdict.accepted, **extra)


class TreeLayout(ChainLayout):
    """A token tree after the context: a 4D mask lets each node see the context and its ancestors, positions go by
    depth, and the accepted path's keys and values are compacted into place."""

    prefills_context = True

    def __init__(self, proposal: DraftProposal, max_depth: int):
        super().__init__(proposal)
        # [1, k, k]: node i sees node j (an ancestor, or itself); `too_deep`: some node is deeper than `max_depth`
        self.sees, self.too_deep = bounded_ancestor_mask(proposal.parents, max_depth)
        self.depths = self.sees.sum(dim=-1)  # [1, k]
        self.depth = max_depth  # a bound; the drafted depth is read with the verdict (`Verdict.depth`)

    def verify(self, do_sample: bool, target_scores: torch.FloatTensor, options: SpeculativeOptions) -> Verdict:
        """Multi-candidate rejection along the tree (lenience is refused for trees when options are built)."""
        tokens, parents = self.proposal.tokens, self.proposal.parents
        if do_sample:
            accepted, nodes, next_tokens = verify_tree_sampling(
                tokens, parents, self.proposal.probs, target_scores.softmax(dim=-1)
            )
        else:
            accepted, nodes, next_tokens = verify_tree_greedy(tokens, parents, target_scores, self.depths, self.depth)
        depths = torch.arange(self.depth, device=tokens.device)[None, :]
        betas = depths < accepted[:, None]  # [batch, depth bound]: 1 for each accepted depth
        depth = self.depths.max() if self.depths.numel() else self.depths.new_zeros(())  # an empty tree: 0
        index = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
        in_place = ((nodes == index) | (index >= accepted[:, None])).all(dim=-1)  # [batch]
        return Verdict(accepted, next_tokens, nodes, betas, tree_depth=depth, tree_path_in_place=in_place)

    def forward_overrides(
        self,
        cache_length: int,
        context_length: int,
        dtype: torch.dtype,
        context_mask: torch.LongTensor | None = None,
        key_length: int | None = None,
    ) -> dict:
        """The 4D mask and positions of a forward over the uncached context tail and the nodes; `context_mask`
        (`[1, context_length]`, 0 on left padding) as plain `generate` has it: padding is neither seen nor counted.
        `key_length`: a static cache's size, whose columns past the nodes (stale or empty) nobody sees."""
        if context_mask is None:
            context_mask = torch.ones(1, context_length, dtype=torch.long, device=self.depths.device)
        context_positions = (context_mask.long().cumsum(-1) - 1).clamp(min=0)  # [1, context_length]
        positions = torch.cat([context_positions[:, cache_length:], context_positions[:, -1:] + self.depths], dim=-1)
        bias = tree_attention_bias(
            self.proposal.parents,
            cache_length,
            context_length - cache_length,
            dtype,
            sees=self.sees,
            context_mask=context_mask,
        )
        if key_length is not None:
            bias = torch.nn.functional.pad(bias, (0, key_length - bias.shape[-1]), value=torch.finfo(dtype).min)
        return {"attention_mask": bias, "position_ids": positions}  # [1, 1, tail + k, context + k], [1, tail + k]

    def prefix(self, candidate_ids: torch.LongTensor, context_length: int, j: int) -> torch.LongTensor:
        if j == 0:
            return candidate_ids[:, :context_length]
        path = self.proposal.tokens[:, self.sees[0, j - 1]]  # [1, depth of node j - 1]: root side first
        return torch.cat([candidate_ids[:, :context_length], path], dim=-1)

    def accepted_tokens(self, verdict: Verdict) -> torch.LongTensor:
        n = verdict.accepted_counts[0]
        path = self.proposal.tokens[:1, verdict.accepted_nodes[0, :n]]
        return torch.cat([path, verdict.next_tokens[:1, None]], dim=-1)

    def emitted_positions(self, verdict: Verdict) -> list[int]:
        # the root's position, then each accepted node's
        return [0] + (verdict.accepted_nodes[0, : verdict.accepted_counts[0]] + 1).tolist()

    def keep_accepted(self, cache, context_length: int, verdict: Verdict, kept: int) -> None:
        compact_cache(cache, context_length, self.kept_nodes(verdict, kept), in_place=verdict.path_in_place[0])

    def kept_nodes(self, verdict: Verdict, kept: int) -> torch.LongTensor:
        return verdict.accepted_nodes[0, :kept]

    def tell_drafter(self, drafter: Drafter, input_ids: torch.LongTensor, verdict: Verdict, **extra) -> None:
        path = verdict.accepted_nodes[:, : max(verdict.accepted_counts)]  # [batch, longest accepted path]
        drafter.on_verified(input_ids, verdict.accepted, accepted_nodes=path, **extra)


def layout_for(proposal: DraftProposal, check: ProposalCheck, gamma: int) -> ChainLayout:
    """The layout of a checked proposal; a tree deeper than the `gamma` tokens asked for fails its `check` (read
    with the round's verdict)."""
    if proposal.parents is None:
        return ChainLayout(proposal)
    layout = TreeLayout(proposal, gamma)
    check.max_depth = gamma
    check.fail_if(layout.too_deep)
    return layout
