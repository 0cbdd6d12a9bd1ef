"""`PromptLookupDrafter`: copies the continuation of the latest earlier occurrence of the context's suffix."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch

from .base import DraftContext, Drafter, DraftProposal, register_drafter
from .tree_builder import TokenTree

__all__ = ["PromptLookupDrafter"]


class _SuffixIndex:
    """For one row: n-gram -> start of the continuation after its most recent occurrence, and the copy under way.

    Grows incrementally: each token is indexed once, when it stops being the last token of the context (the
    continuation of the current suffix is unknown, so the suffix itself must never match itself).

    With `follow_copies`, the position a proposal was copied from is remembered and followed along the tokens the
    target then writes (one comparison per written token, no rescan). A copy that has predicted at least two
    tokens in a row survives one mismatch: the written token stands in for the copied one (a renamed identifier, a
    fixed typo) and the copy resumes after it. If the next token matches again, the substitution is learned and
    applied to later proposals; it is forgotten when the target writes the original token again. A second mismatch
    in a row ends the copy, and so does a mismatch after which the new suffix has a full-length match elsewhere (the
    text moved on to another passage or a loop); the n-gram lookup then starts over (also trying the suffix with
    learned substitutions undone, so a renamed suffix still finds its original).

    With `max_occurrences > 0` (token trees), it also remembers the starts of that many most recent occurrences of
    each n-gram (`starts`, `source_starts`), for `continuations`; chains never pay for these lists.
    """

    confirm_after = 2  # tokens a copy must predict in a row before it may survive a mismatch or teach a substitution

    def __init__(
        self, ngram_sizes: range, source: list[int] | None = None, follow_copies: bool = True, max_occurrences: int = 0
    ):
        self.ngram_sizes = ngram_sizes
        self.tokens: list[int] = []
        self.next_start: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `next_start`
        self.max_occurrences = max_occurrences
        self.starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> starts of its latest continuations, oldest first
        # an encoder-decoder target's source text: a separate document (no n-gram spans into the output), indexed
        # once; its continuations stop at its end
        self.source = source or []
        self.source_next_start: dict[tuple[int, ...], int] = {}
        self.source_starts: dict[tuple[int, ...], list[int]] = {}
        for end in range(len(self.source) - 1):
            for n in ngram_sizes:
                if end + 1 >= n:
                    key = tuple(self.source[end + 1 - n : end + 1])
                    self.source_next_start[key] = end + 1
                    if max_occurrences:
                        self._remember(self.source_starts, key, end + 1)
        self.follow_copies = follow_copies
        self.copy: tuple[list[int], int] | None = None  # (document, position of the token it predicts next)
        self.copy_run = 0  # tokens the copy predicted right in a row, until it is confirmed (then it stays so)
        self.copy_confirmed = False
        self.pending: tuple[int, int] | None = None  # (copied, written) at a mismatch, learned if the copy resumes
        self.followed = 0  # written tokens up to here have been compared with the copy
        self.substitutions: dict[int, int] = {}  # copied token -> the token the target writes in its place
        self.originals: dict[int, int] = {}  # the inverse, for matching a suffix that contains substitutions

    def _remember(self, starts: dict[tuple[int, ...], list[int]], key: tuple[int, ...], start: int) -> None:
        known = starts.get(key)
        if known is None:
            starts[key] = [start]
        else:
            known.append(start)
            if len(known) > self.max_occurrences:
                del known[0]

    def extend(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        for end in range(self.indexed, len(self.tokens) - 1):  # every position but the newest
            for n in self.ngram_sizes:
                if end + 1 >= n:
                    key = tuple(self.tokens[end + 1 - n : end + 1])
                    self.next_start[key] = end + 1  # most recent wins
                    if self.max_occurrences:  # trees only: chains never pay for the occurrence lists
                        self._remember(self.starts, key, end + 1)
        self.indexed = max(self.indexed, len(self.tokens) - 1)

    def _follow(self) -> None:
        """Compares the tokens written since the last proposal with what the copy predicted."""
        for at in range(self.followed, len(self.tokens)):
            if self.copy is None:
                break
            document, position = self.copy
            if position >= len(document):  # the source text ended (the output's own copy is periodic instead)
                self.copy = None
                break
            copied, written = document[position], self.tokens[at]
            if written == self.substitutions.get(copied, copied):
                if self.pending is not None:  # the copy resumed right after the mismatch: a substitution
                    self._learn(*self.pending)
                    self.pending = None
                self.copy_run += 1
                self.copy_confirmed |= self.copy_run >= self.confirm_after
            else:
                if written == copied:  # the target wrote the original token: the substitution no longer holds
                    self._learn(copied, written)
                if not self.copy_confirmed or self.pending is not None:  # unproven, or a second mismatch in a row
                    self.copy, self.pending = None, None
                    break
                self.pending = (copied, written)
            self.copy = (document, position + 1)
        self.followed = len(self.tokens)

    def _learn(self, copied: int, written: int) -> None:
        old = self.substitutions.pop(copied, None)
        if old is not None and self.originals.get(old) == copied:
            del self.originals[old]
        if written != copied:
            self.substitutions[copied] = written
            self.originals[written] = copied

    def _read(self, document: list[int], start: int, num_tokens: int) -> list[int]:
        if document is self.tokens:
            # a match close to the end overlaps what it predicts (an overlapping LZ77-style copy): the text
            # repeats with period len - start, so the copy continues periodically instead of stopping short
            period = len(self.tokens) - start
            draft = [self.tokens[start + j % period] for j in range(num_tokens)]
        else:
            draft = document[start : start + num_tokens]
        return [self.substitutions.get(token, token) for token in draft] if self.substitutions else draft

    def _match(self) -> tuple[tuple[list[int], int] | None, int]:
        """((document, start), n): the continuation of the longest suffix (n tokens) that occurred before, its most
        recent occurrence first; (None, 0) when none did."""
        for n in reversed(self.ngram_sizes):  # longest suffix first
            if len(self.tokens) < n:
                continue
            for candidate in self._suffix_candidates(n):
                start = self.next_start.get(candidate)
                if start is not None:
                    return (self.tokens, start), n
                if candidate in self.source_next_start:  # the output's own history is more recent
                    return (self.source, self.source_next_start[candidate]), n
        return None, 0

    def _suffix_candidates(self, n: int) -> list[tuple[int, ...]]:
        suffix = tuple(self.tokens[-n:])
        candidates = [suffix]
        if self.originals:
            undone = tuple(self.originals.get(token, token) for token in suffix)
            if undone != suffix:
                candidates.append(undone)
        return candidates

    def continuations(self, num_tokens: int) -> Iterator[list[int]]:
        """With `max_occurrences`: the continuations (up to `num_tokens` each) of the remembered earlier occurrences
        of the context's suffix, longest suffix first, then the most recent occurrence first (the output's own
        history before the source text); each occurrence once, even when several suffix sizes end there."""
        seen: set[tuple[bool, int]] = set()
        for n in reversed(self.ngram_sizes):
            if len(self.tokens) < n:
                continue
            for candidate in self._suffix_candidates(n):
                for document, starts in ((self.tokens, self.starts), (self.source, self.source_starts)):
                    for start in reversed(starts.get(candidate, ())):
                        where = (document is self.tokens, start)
                        if where not in seen:
                            seen.add(where)
                            yield self._read(document, start, num_tokens)

    def lookup(self, num_tokens: int) -> list[int]:
        if not self.follow_copies:
            match, _ = self._match()
            return self._read(*match, num_tokens) if match else []
        self._follow()  # first: it may learn a substitution that the lookup undoes
        match, length = self._match()
        copy = self.copy
        # a copy under way goes on, even where a more recent occurrence of the suffix repeats inside it; but when it
        # has just mismatched, a full-length match of the new suffix elsewhere says the text moved on (a loop,
        # another passage) rather than substituted one token
        if (
            copy is not None
            and self.pending is not None
            and length == self.ngram_sizes[-1]
            and not (match[0] is copy[0] and match[1] == copy[1])
        ):
            copy = None
        if copy is not None:
            draft = self._read(*copy, num_tokens)
            if draft:
                return draft
        if match is None:
            self.copy = None
            return []
        self.copy, self.copy_run, self.copy_confirmed, self.pending = match, 0, False, None
        return self._read(*match, num_tokens)


class PromptLookupDrafter(Drafter):
    r"""
    Prompt lookup ("copy") drafting: finds the longest suffix n-gram of prompt + generated text that occurred
    before, prefers its most recent occurrence, and proposes the tokens that followed it. For encoder-decoder
    targets it also copies from the source text (the encoder input), e.g. for grammar correction or extraction;
    the longest match wins, and at equal length a match in the generated text (more recent) wins over the source.
    When that occurrence is so recent that its continuation reaches the end of the text, the copy overlaps itself
    and continues periodically (the text is repeating with that period). Costs no model forward (c ≈ 0), and
    shines when the output repeats the input: code edits, summaries, extraction, grammar fixes.

    A copy under way is followed (`follow_copies`): the next proposal continues from where the last one left off,
    even past one token the target wrote differently (a renamed identifier, a corrected word), and a substitution
    that the copy confirms by matching again right after it is applied to later proposals (the rename's next
    occurrences are drafted renamed). Two mismatches in a row end the copy, and so does a mismatch after which the
    new suffix has a full-length match elsewhere (the text moved on); the n-gram lookup then starts over.

    With `speculative_tree_budget` set, the proposal is a token tree (a trie of copies): its main branch is the
    chain above, truncated to the budget; then the continuations of the other remembered occurrences (the
    `max_occurrences` most recent of each n-gram) of the longest matched suffix, and then of shorter suffixes, are
    merged in, most recent first: a continuation that starts like a branch already in the tree adds only the tail
    where it differs, as a sub-branch. Each continuation is cut where the budget runs out, and none is longer than
    `num_tokens`. A tree without branches (every occurrence continues alike) is proposed as a chain.

    The index is built incrementally (each token is indexed once per call). Drafts are deterministic, so when
    sampling q is a point mass and each draft x is accepted with probability p(x): the output distribution stays
    exactly the target's (for a tree, the sampler tries the siblings one by one against the target's residual).

    Args:
        max_ngram_size (`int`, *optional*, defaults to 3):
            The longest suffix to match.
        min_ngram_size (`int`, *optional*, defaults to 2):
            The shortest suffix to match. 1 matches any repeated token, which proposes often and is right rarely.
        follow_copies (`bool`, *optional*, defaults to `True`):
            Follow a copy through single-token substitutions and apply the substitutions it learned. `False` looks
            every proposal up afresh (transformers' prompt lookup does that, with the earliest match).

    Left unset, `speculative_gamma` is 10 with this drafter (`default_gamma`), not the library's 5.

    Example:

    ```python
    >>> import torch, hf_specdec
    >>> drafter = hf_specdec.PromptLookupDrafter(max_ngram_size=2, min_ngram_size=1)
    >>> drafter.propose_for(torch.tensor([[5, 6, 7, 8, 5, 6]]), num_tokens=3).tokens
    tensor([[7, 8, 5]])
    >>> tree = drafter.propose_for(torch.tensor([[1, 2, 3, 4, 1, 2, 5, 6, 1, 2]]), num_tokens=2, tree_budget=4)
    >>> tree.tokens, tree.parents  # after [1, 2]: 5 6 (the latest), or 3 4
    (tensor([[5, 6, 3, 4]]), tensor([[-1,  0, -1,  2]]))

    ```
    """

    default_gamma = 10
    free_drafts = True  # copied from text: the `auto` policy drafts the full γ from the first round
    """γ when the call leaves `speculative_gamma` unset: copies run long and cost nothing to draft, and 10 is
    transformers' recommended `prompt_lookup_num_tokens`. On a small instruct model's code edits and extractions, γ = 10
    decodes 1.2-1.4x faster than γ = 5, in bfloat16 and float32."""
    max_occurrences = 8
    """Tree proposals: how many of the most recent occurrences of each n-gram the index remembers."""
    tree_budget: int | None = None  # set per call by `reset`

    def __init__(self, max_ngram_size: int = 3, min_ngram_size: int = 2, follow_copies: bool = True):
        for name, value in (("max_ngram_size", max_ngram_size), ("min_ngram_size", min_ngram_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
        if min_ngram_size > max_ngram_size:
            raise ValueError(
                f"`min_ngram_size` ({min_ngram_size}) must not exceed `max_ngram_size` ({max_ngram_size})."
            )
        if not isinstance(follow_copies, bool):
            raise ValueError(f"`follow_copies` must be a bool, got {follow_copies!r}.")
        self.max_ngram_size = max_ngram_size
        self.min_ngram_size = min_ngram_size
        self.follow_copies = follow_copies

    def reset(self, context: DraftContext) -> None:
        sources = None
        source = context.inputs_tensor  # [batch, src_len] token ids for text encoder-decoder targets
        # (generate passes a placeholder of -100s when called without a source)
        if (
            context.target.config.is_encoder_decoder
            and source is not None
            and not source.is_floating_point()
            and not bool((source < 0).any())
        ):
            mask = context.model_kwargs.get("attention_mask")  # [batch, src_len]; padding is not text
            sources = [
                row[mask[i].bool()].tolist() if mask is not None else row.tolist() for i, row in enumerate(source)
            ]
        self.tree_budget = context.tree_budget
        self.rows = self._new_rows(context.input_ids.shape[0], sources)

    def _new_rows(self, batch_size: int, sources: list[list[int]] | None = None) -> list[_SuffixIndex]:
        sizes = range(self.min_ngram_size, self.max_ngram_size + 1)
        occurrences = self.max_occurrences if self.tree_budget is not None else 0
        return [
            _SuffixIndex(sizes, sources[row] if sources else None, self.follow_copies, occurrences)
            for row in range(batch_size)
        ]

    def propose(self, input_ids: torch.LongTensor, num_tokens: int, attention_mask=None) -> DraftProposal:
        if not hasattr(self, "rows"):
            raise RuntimeError("PromptLookupDrafter.propose was called before reset(); use `propose_for`.")
        batch = input_ids.shape[0]
        if num_tokens == 0:
            return DraftProposal.empty(batch, input_ids.device)
        if self.tree_budget is not None and batch == 1:
            index = self.rows[0]
            index.extend(input_ids[0, len(index.tokens) :].tolist())
            tree = TokenTree(self.tree_budget, num_tokens)
            if tree.insert(index.lookup(num_tokens)):  # the main branch: exactly the chain proposal
                for continuation in index.continuations(num_tokens):
                    if tree.full:
                        break
                    tree.insert(continuation)
            return tree.proposal(input_ids.device)
        drafts = []  # chains (trees are proposed at batch size 1 only, the only size the loop verifies them at)
        for row, index in enumerate(self.rows):
            index.extend(input_ids[row, len(index.tokens) :].tolist())  # only the tokens added since last round
            drafts.append(index.lookup(num_tokens))
        # rows draft the same number of tokens: the shortest proposal bounds them all
        length = min(len(d) for d in drafts)
        tokens = torch.tensor([d[:length] for d in drafts], dtype=torch.long).reshape(batch, length)
        return DraftProposal(tokens=tokens.to(input_ids.device))

    def propose_for(
        self, input_ids: torch.LongTensor, num_tokens: int, tree_budget: int | None = None
    ) -> DraftProposal:
        """One stand-alone proposal for `input_ids` (a fresh index), handy for inspecting the drafter; a token tree
        of at most `tree_budget` nodes when it is given."""
        drafter = copy.copy(self)
        drafter.tree_budget = tree_budget
        drafter.rows = drafter._new_rows(input_ids.shape[0])
        return drafter.propose(input_ids, num_tokens)


register_drafter("prompt_lookup", PromptLookupDrafter)
