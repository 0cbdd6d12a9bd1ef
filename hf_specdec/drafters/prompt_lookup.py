"""`PromptLookupDrafter`: copies the continuation of the latest earlier occurrence of the context's suffix."""

from __future__ import annotations

import copy

import torch

from .base import DraftContext, DraftProposal, Drafter, register_drafter

__all__ = ["PromptLookupDrafter"]


class _SuffixIndex:
    """For one row: n-gram -> start of the continuation after its most recent occurrence.

    Grows incrementally: each token is indexed once, when it stops being the last token of the context (the
    continuation of the current suffix is unknown, so the suffix itself must never match itself).
    """

    def __init__(self, ngram_sizes: range, source: list[int] | None = None):
        self.ngram_sizes = ngram_sizes
        self.tokens: list[int] = []
        self.next_start: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `next_start`
        # an encoder-decoder target's source text: a separate document (no n-gram spans into the output), indexed
        # once; its continuations stop at its end
        self.source = source or []
        self.source_next_start: dict[tuple[int, ...], int] = {}
        for end in range(len(self.source) - 1):
            for n in ngram_sizes:
                if end + 1 >= n:
                    self.source_next_start[tuple(self.source[end + 1 - n : end + 1])] = end + 1

    def extend(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        for end in range(self.indexed, len(self.tokens) - 1):  # every position but the newest
            for n in self.ngram_sizes:
                if end + 1 >= n:
                    self.next_start[tuple(self.tokens[end + 1 - n : end + 1])] = end + 1  # most recent wins
        self.indexed = max(self.indexed, len(self.tokens) - 1)

    def lookup(self, num_tokens: int) -> list[int]:
        for n in reversed(self.ngram_sizes):  # longest suffix first
            if len(self.tokens) < n:
                continue
            suffix = tuple(self.tokens[-n:])
            start = self.next_start.get(suffix)
            if start is None and suffix in self.source_next_start:  # the output's own history is more recent
                start = self.source_next_start[suffix]
                return self.source[start : start + num_tokens]
            if start is not None:
                # a match close to the end overlaps what it predicts (an overlapping LZ77-style copy): the text
                # repeats with period len - start, so the copy continues periodically instead of stopping short
                period = len(self.tokens) - start
                return [self.tokens[start + j % period] for j in range(num_tokens)]
        return []


class PromptLookupDrafter(Drafter):
    r"""
    Prompt lookup ("copy") drafting: finds the longest suffix n-gram of prompt + generated text that occurred
    before, prefers its most recent occurrence, and proposes the tokens that followed it. For encoder-decoder
    targets it also copies from the source text (the encoder input), e.g. for grammar correction or extraction;
    the longest match wins, and at equal length a match in the generated text (more recent) wins over the source.
    When that occurrence is so recent that its continuation reaches the end of the text, the copy overlaps itself
    and continues periodically (the text is repeating with that period). Costs no model forward (c ≈ 0), and
    shines when the output repeats the input: code edits, summaries, extraction, grammar fixes.

    The index is built incrementally (each token is indexed once per call). Drafts are deterministic, so when
    sampling q is a point mass and each draft x is accepted with probability p(x): the output distribution stays
    exactly the target's.

    Args:
        max_ngram_size (`int`, *optional*, defaults to 3):
            The longest suffix to match.
        min_ngram_size (`int`, *optional*, defaults to 2):
            The shortest suffix to match. 1 matches any repeated token, which proposes often and is right rarely.

    Example:

    ```python
    >>> import torch, hf_specdec
    >>> drafter = hf_specdec.PromptLookupDrafter(max_ngram_size=2, min_ngram_size=1)
    >>> drafter.propose_for(torch.tensor([[5, 6, 7, 8, 5, 6]]), num_tokens=3).tokens
    tensor([[7, 8, 5]])
    ```
    """

    def __init__(self, max_ngram_size: int = 3, min_ngram_size: int = 2):
        for name, value in (("max_ngram_size", max_ngram_size), ("min_ngram_size", min_ngram_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
        if min_ngram_size > max_ngram_size:
            raise ValueError(
                f"`min_ngram_size` ({min_ngram_size}) must not exceed `max_ngram_size` ({max_ngram_size})."
            )
        self.max_ngram_size = max_ngram_size
        self.min_ngram_size = min_ngram_size

    def reset(self, context: DraftContext) -> None:
        sources = None
        source = context.inputs_tensor  # [batch, src_len] token ids for text encoder-decoder targets
        # (generate passes a placeholder of -100s when called without a source)
        if (context.target.config.is_encoder_decoder and source is not None and not source.is_floating_point()
                and not bool((source < 0).any())):
            mask = context.model_kwargs.get("attention_mask")  # [batch, src_len]; padding is not text
            sources = [
                row[mask[i].bool()].tolist() if mask is not None else row.tolist() for i, row in enumerate(source)
            ]
        self.rows = self._new_rows(context.input_ids.shape[0], sources)

    def _new_rows(self, batch_size: int, sources: list[list[int]] | None = None) -> list[_SuffixIndex]:
        sizes = range(self.min_ngram_size, self.max_ngram_size + 1)
        return [_SuffixIndex(sizes, sources[row] if sources else None) for row in range(batch_size)]

    def propose(self, input_ids: torch.LongTensor, num_tokens: int, attention_mask=None) -> DraftProposal:
        if not hasattr(self, "rows"):
            raise RuntimeError("PromptLookupDrafter.propose was called before reset(); use `propose_for`.")
        batch = input_ids.shape[0]
        if num_tokens == 0:
            return DraftProposal.empty(batch, input_ids.device)
        drafts = []
        for row, index in enumerate(self.rows):
            index.extend(input_ids[row, len(index.tokens):].tolist())  # only the tokens added since last round
            drafts.append(index.lookup(num_tokens))
        # rows draft the same number of tokens: the shortest proposal bounds them all
        length = min(len(d) for d in drafts)
        tokens = torch.tensor([d[:length] for d in drafts], dtype=torch.long).reshape(batch, length)
        return DraftProposal(tokens=tokens.to(input_ids.device))

    def propose_for(self, input_ids: torch.LongTensor, num_tokens: int) -> DraftProposal:
        """One stand-alone proposal for `input_ids` (a fresh index), handy for inspecting the drafter."""
        drafter = copy.copy(self)
        drafter.rows = self._new_rows(input_ids.shape[0])
        return drafter.propose(input_ids, num_tokens)


register_drafter("prompt_lookup", PromptLookupDrafter)
