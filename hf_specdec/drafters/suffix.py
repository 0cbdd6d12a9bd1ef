"""`SuffixDrafter`: suffix decoding (SuffixDecoding, Oliaro et al., 2024, arXiv 2411.04975; vLLM's
`speculative_config={"method": "suffix"}` through Arctic Inference).

The structures (the depth-bounded suffix trie and the shared `SuffixCache`) live in `suffix_tree.py`.
"""

from __future__ import annotations

import copy

import torch

from .base import DraftContext, Drafter, DraftProposal, register_drafter
from .suffix_tree import SuffixCache, SuffixTrie, check_int
from .tree_builder import TokenTree

__all__ = ["SuffixCache", "SuffixDrafter"]


class _Row:
    """One sequence's state for one call: its own trie (prompt + output so far), how much of it the trie and the
    shared cache have seen, and its request in the cache."""

    def __init__(self, depth: int, prompt_length: int):
        self.trie = SuffixTrie(depth)
        self.tokens: list[int] = []
        self.prompt_length = prompt_length
        self.cached = 0  # tokens of `tokens` added to the shared cache (counted from the start of the sequence)
        self.request: int | None = None

    def sync(self, input_ids: torch.LongTensor, cache: SuffixCache, cache_prompts: bool) -> None:
        """Adds the tokens of `input_ids` (`[seq_len]`, confirmed: prompt + emitted) not seen yet: to the trie, and
        the output (with `cache_prompts`, the prompt too) to the shared cache."""
        new = input_ids[len(self.tokens) :].tolist()
        if new:
            self.trie.append(0, new)
            self.tokens.extend(new)
        start = max(self.cached, 0 if cache_prompts else self.prompt_length)
        if start < len(self.tokens):
            self.request = cache.add(self.tokens[start:], self.request)
            self.cached = len(self.tokens)


class SuffixDrafter(Drafter):
    r"""
    Suffix decoding (SuffixDecoding, Oliaro et al., 2024): drafts from the continuations of the context's recent
    suffix, both in this call's own text (prompt + output so far) and in a shared cache of earlier outputs, with no
    model forward. Made for repetitive, agentic workloads (the same tool calls, SQL, code, reformatting) where
    earlier answers predict long stretches of the next one.

    Two suffix tries of bounded depth count every substring: one per call (per row of a batch) over its prompt and
    output, built incrementally (each token costs at most `max_pattern + max_depth` node updates), and the global
    one in a [`SuffixCache`], kept by the user across calls, batches and threads. Each round, for every pattern
    length m = 1 ... `max_pattern` whose last m context tokens occur in a trie, a speculation is grown from the
    matched node greedily by estimated probability (a child's count over its siblings' total, multiplied along the
    path): at most `min(max_spec_tokens, int(max_spec_factor * m))` nodes, at most `max_depth` (and the loop's γ)
    deep, no node whose estimated probability is below `min_token_prob`. The speculation with the highest expected
    number of accepted tokens (the sum of its nodes' probabilities) wins, over both tries.

    With `speculative_tree_budget` set, the proposal is the best-first token tree (at most `tree_budget` nodes);
    otherwise it is the chain of most frequent children. Drafts are deterministic (`probs=None`): when sampling, q is
    a point mass and each draft is accepted with the target's probability, so the output distribution stays exactly
    the target's; greedy output is token for token plain `generate`'s. The cache only changes how fast it goes.

    The cache learns as the call goes: the confirmed output tokens of each call (each row) are added to the cache as
    one request, a few at a time, after each round (the drafter has no end-of-call hook, so nothing waits for the
    end). A concurrent call therefore already sees the parts of other calls' outputs that are confirmed. Only
    tokens the target emitted are ever added (in a batch whose rows stay until all are done, a finished row may add
    a few tokens past its stop: they are still the target's). The prompt is added too with `cache_prompts=True`.

    Args:
        cache ([`SuffixCache`], *optional*):
            The shared cache of earlier outputs. Left out, the drafter creates one (`SuffixCache()`) and keeps it
            across the `generate` calls it serves (`drafter.cache`); `drafter="suffix"` without it starts empty.
        max_pattern (`int`, *optional*, defaults to 12):
            The longest suffix of the context that is matched.
        max_depth (`int`, *optional*, defaults to 12):
            The deepest a speculated node lies below the match (also capped by the γ the loop asks for, and, for
            the shared cache, by its `tree_depth` minus the match length).
        max_spec_factor (`float`, *optional*, defaults to 4.0):
            A match of m tokens speculates at most `int(max_spec_factor * m)` tokens: short matches propose little.
            (Arctic Inference defaults to 1.0; on short request streams 4.0 drafts more of what recurs, see
            `benchmarks/bench_suffix.py`.)
        max_spec_tokens (`int`, *optional*, defaults to 24):
            The most tokens one proposal holds (a tree also at most `speculative_tree_budget`).
        min_token_prob (`float`, *optional*, defaults to 0.1):
            Nodes whose estimated probability falls below this are not proposed.
        cache_prompts (`bool`, *optional*, defaults to `False`):
            Also add each call's prompt to the shared cache (the paper indexes outputs; prompts that repeat, such as
            a fixed system prompt followed by varying questions, gain from this).

    Left unset, `speculative_gamma` is 12 with this drafter (`default_gamma`).

    Example:

    ```python
    >>> import torch
    >>> from hf_specdec.drafters.suffix import SuffixCache, SuffixDrafter
    >>> cache = SuffixCache()
    >>> _ = cache.add([7, 8, 9, 10, 11])  # an earlier output
    >>> drafter = SuffixDrafter(cache=cache)
    >>> drafter.propose_for(torch.tensor([[1, 2, 7, 8]]), num_tokens=5).tokens  # "7 8" matched: up to 8 tokens
    tensor([[ 9, 10, 11]])
    >>> SuffixDrafter(cache=cache, max_spec_factor=1.0).propose_for(torch.tensor([[1, 2, 7, 8]]), num_tokens=5).tokens
    tensor([[ 9, 10]])

    ```
    """

    default_gamma = 12
    free_drafts = True  # copied from text: the `auto` policy drafts the full γ from the first round
    """γ when the call leaves `speculative_gamma` unset: drafts cost nothing, and the drafter proposes only as many
    tokens as its match supports."""

    def __init__(
        self,
        cache: SuffixCache | None = None,
        max_pattern: int = 12,
        max_depth: int = 12,
        max_spec_factor: float = 4.0,
        max_spec_tokens: int = 24,
        min_token_prob: float = 0.1,
        cache_prompts: bool = False,
    ):
        if cache is not None and not isinstance(cache, SuffixCache):
            raise TypeError(
                f"`cache` must be a SuffixCache, got {type(cache).__name__} ({cache!r:.100}). Pass "
                "`cache=SuffixCache(max_requests=..., max_tokens=...)`, or leave it out for a new one."
            )
        check_int("max_pattern", max_pattern)
        check_int("max_depth", max_depth)
        check_int("max_spec_tokens", max_spec_tokens)
        for name, value in (("max_spec_factor", max_spec_factor), ("min_token_prob", min_token_prob)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(f"`{name}` must be a number, got {value!r}.")
        if max_spec_factor <= 0:
            raise ValueError(
                f"`max_spec_factor` must be > 0, got {max_spec_factor!r}: a match of m tokens speculates up to "
                "`int(max_spec_factor * m)` tokens. Pass e.g. `max_spec_factor=1.0`."
            )
        if not 0 <= min_token_prob <= 1:
            raise ValueError(
                f"`min_token_prob` must lie in [0, 1], got {min_token_prob!r}: it is the lowest estimated "
                "probability a proposed node may have. Pass e.g. `min_token_prob=0.1`."
            )
        if not isinstance(cache_prompts, bool):
            raise ValueError(f"`cache_prompts` must be a bool, got {cache_prompts!r}.")
        # the shared cache: an attribute of this object, so the per-call copies (`for_call`) all share it
        self.cache = cache if cache is not None else SuffixCache()
        self.max_pattern, self.max_depth = max_pattern, max_depth
        self.max_spec_factor, self.max_spec_tokens = float(max_spec_factor), max_spec_tokens
        self.min_token_prob, self.cache_prompts = float(min_token_prob), cache_prompts
        self.tree_budget: int | None = None
        self.vocab_size: int | None = None
        self.rows: list[_Row] | None = None

    def __repr__(self) -> str:
        return (
            f"SuffixDrafter(cache={self.cache!r}, max_pattern={self.max_pattern}, max_depth={self.max_depth}, "
            f"max_spec_factor={self.max_spec_factor}, max_spec_tokens={self.max_spec_tokens}, "
            f"min_token_prob={self.min_token_prob}, cache_prompts={self.cache_prompts})"
        )

    def reset(self, context: DraftContext) -> None:
        # per-call state: new attributes on this copy, never the user's object
        self.tree_budget = context.tree_budget
        self.vocab_size = context.vocab_size
        self.rows = self._new_rows(context.input_ids.shape[0], context.input_ids.shape[1])

    def _new_rows(self, batch_size: int, prompt_length: int) -> list[_Row]:
        return [_Row(self.max_pattern + self.max_depth, prompt_length) for _ in range(batch_size)]

    def _sync(self, input_ids: torch.LongTensor) -> None:
        if self.rows is None:
            raise RuntimeError("SuffixDrafter.propose was called before reset(); use `propose_for`.")
        if input_ids.shape[0] != len(self.rows):
            raise ValueError(
                f"SuffixDrafter was reset for {len(self.rows)} sequence(s) but got input_ids of shape "
                f"{tuple(input_ids.shape)}; it drafts one row per copy (it has no `supports_padded_batches`)."
            )
        for row, state in zip(input_ids, self.rows):
            state.sync(row, self.cache, self.cache_prompts)

    def propose(self, input_ids: torch.LongTensor, num_tokens: int, attention_mask=None) -> DraftProposal:
        self._sync(input_ids)
        batch = input_ids.shape[0]
        if num_tokens == 0:
            return DraftProposal.empty(batch, input_ids.device)
        tree = self.tree_budget is not None and batch == 1  # the loop verifies trees at batch size 1 only
        limits = dict(
            max_pattern=self.max_pattern,
            max_depth=min(self.max_depth, num_tokens),
            max_spec_factor=self.max_spec_factor,
            max_spec_tokens=min(self.max_spec_tokens, self.tree_budget) if tree else self.max_spec_tokens,
            min_token_prob=self.min_token_prob,
            vocab_size=self.vocab_size,
            tree=tree,
        )
        speculations = []
        for state in self.rows:
            context = state.tokens[-self.max_pattern :]
            best = state.trie.speculate(context, **limits)
            shared = self.cache.speculate(context, **limits)
            if shared is not None and shared.better_than(best):
                best = shared
            speculations.append(best)
        if tree:
            best = speculations[0]
            if best is None:
                return DraftProposal.empty(1, input_ids.device)
            token_tree = TokenTree(len(best.tokens), num_tokens)
            for token, parent in zip(best.tokens, best.parents):
                token_tree.add(parent, token)  # best-first order: every parent comes before its children
            return token_tree.proposal(input_ids.device)
        # chains; rows draft the same number of tokens: the shortest proposal bounds them all
        drafts = [s.tokens if s is not None else [] for s in speculations]
        length = min(len(d) for d in drafts)
        tokens = torch.tensor([d[:length] for d in drafts], dtype=torch.long).reshape(batch, length)
        return DraftProposal(tokens=tokens.to(input_ids.device))

    def on_verified(self, input_ids, num_accepted, attention_mask=None, accepted_nodes=None) -> None:
        # the round's confirmed tokens go to the trie and the shared cache now: the call's last round has no
        # `propose` after it
        self._sync(input_ids)

    def propose_for(
        self, input_ids: torch.LongTensor, num_tokens: int, tree_budget: int | None = None
    ) -> DraftProposal:
        """One stand-alone proposal for `input_ids` (a fresh per-call trie over them, the shared cache as it is:
        nothing is added to it), handy for inspecting the drafter; a token tree of at most `tree_budget` nodes when
        it is given."""
        drafter = copy.copy(self)
        drafter.tree_budget = tree_budget
        input_ids = torch.as_tensor(input_ids, dtype=torch.long)
        drafter.rows = drafter._new_rows(input_ids.shape[0], input_ids.shape[1])
        drafter.cache_prompts = False  # the whole input counts as prompt: nothing reaches the cache
        return drafter.propose(input_ids, num_tokens)


register_drafter("suffix", SuffixDrafter)
