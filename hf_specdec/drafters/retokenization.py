"""Moving text between two tokenizers, for `CrossTokenizerDrafter` (see `cross_tokenizer.py` for how it drafts).

`IncrementalDetokenizer` turns one tokenizer's new tokens into the text they add; `IncrementalRetokenizer` keeps
another tokenizer's ids for a growing text, re-encoding only a short pending tail; `shared_vocabulary` pairs the tokens
two tokenizers both hold with the same string (the token-level intersection that sampled drafts are drawn over).
"""

from __future__ import annotations

import re
import weakref

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

__all__ = [
    "CONTEXT_TOKENS",
    "IncrementalDetokenizer",
    "IncrementalRetokenizer",
    "cached_shared_vocabulary",
    "check_tokenizer",
    "decode_ids",
    "encode_text",
    "shared_vocabulary",
    "token_strings",
]

CONTEXT_TOKENS = 4  # tokens of left context when decoding a piece (leading spaces, byte sequences)
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def check_tokenizer(tokenizer, argument: str) -> None:
    """Fails unless `tokenizer` is a transformers tokenizer that encodes with offsets and decodes back to its text."""
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(
            f"`{argument}` must be a transformers tokenizer, got {type(tokenizer).__name__} ({tokenizer!r:.80}). Load "
            f"it with `AutoTokenizer.from_pretrained(...)` and pass the object as `{argument}=`."
        )
    if not tokenizer.is_fast:
        raise ValueError(
            f"`{argument}` ({type(tokenizer).__name__}) is a slow (Python) tokenizer; drafting across tokenizers needs "
            "character offsets, which only fast tokenizers give. Load it with `AutoTokenizer.from_pretrained(..., "
            "use_fast=True)`."
        )
    try:
        # a text made of the tokenizer's own tokens encodes and decodes back to itself when it has a decoder; tokens
        # that decode to whitespace alone (T5's lone "▁") are left out, and so is the text's leading whitespace, which
        # start-of-text conventions add or drop (a prepended "▁", `add_prefix_space=True`)
        special = set(tokenizer.all_special_ids)
        plain = [i for i in range(len(tokenizer)) if i not in special]
        probe = [i for i in plain[:: max(1, len(plain) // 32)] if _readable(decode_ids(tokenizer, [i]))][:24]
        text = decode_ids(tokenizer, probe).lstrip()
        decoded = decode_ids(tokenizer, encode_text(tokenizer, text)).lstrip()
    except Exception as error:
        raise ValueError(
            f"`{argument}` ({type(tokenizer).__name__}) cannot encode and decode text ({type(error).__name__}: "
            f"{error}). Drafting across tokenizers moves text between the two: use a tokenizer with a decoder."
        ) from error
    if decoded != text:
        raise ValueError(
            f"`{argument}` ({type(tokenizer).__name__}) does not decode its tokens back to their text: "
            f"{text[:60]!r} re-encoded decodes to {decoded[:60]!r}. Drafting across tokenizers moves text between "
            "the two tokenizers; give the tokenizer a decoder (e.g. `tokenizer.backend_tokenizer.decoder = "
            "tokenizers.decoders.ByteLevel()` for byte-level BPE, `decoders.Metaspace()` for SentencePiece-style)."
        )


def _readable(piece: str) -> bool:
    """A token's decoded text is whole characters and more than whitespace."""
    return bool(piece.strip()) and "\ufffd" not in piece


def decode_ids(tokenizer, ids) -> str:
    """The text of `ids`, without special tokens, spaces as the tokenizer decodes them."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def encode_text(tokenizer, text: str, offsets: bool = False):
    """The ids of `text` without special tokens, and with `offsets` their character offsets too."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=offsets)
    return (encoded["input_ids"], encoded["offset_mapping"]) if offsets else encoded["input_ids"]


class IncrementalDetokenizer:
    """Target tokens in, the text they add out, one round at a time.

    A piece is decoded after the last `CONTEXT_TOKENS` tokens already turned into text, so that it reads as it does
    inside the whole text (a SentencePiece decoder drops the leading space of the first token only). Tokens whose
    decoded text ends in U+FFFD (a byte sequence cut inside a character) are held back until the character is
    complete; special tokens add no text.

    Example:

    ```python
    >>> from transformers import AutoTokenizer
    >>> from hf_specdec import zoo
    >>> from hf_specdec.drafters.cross_tokenizer import IncrementalDetokenizer
    >>> tokenizer = zoo.load_tokenizer()
    >>> ids = tokenizer("def add(a, b):").input_ids
    >>> detokenizer = IncrementalDetokenizer(tokenizer)
    >>> detokenizer.advance(ids[:3]) + detokenizer.advance(ids[3:]) == tokenizer.decode(ids)
    True

    ```
    """

    def __init__(self, tokenizer, max_held: int = 8):
        self.tokenizer = tokenizer
        self.max_held = max_held
        self.context: list[int] = []  # the last few tokens already turned into text
        self.held: list[int] = []  # tokens whose text is not complete yet

    def advance(self, new_ids: list[int]) -> str:
        """The text that `new_ids` (the target's tokens after those seen so far) add."""
        pending = self.held + list(new_ids)
        if not pending:
            return ""
        prefix = decode_ids(self.tokenizer, self.context)
        for cut in range(len(pending), 0, -1):
            text = decode_ids(self.tokenizer, self.context + pending[:cut])
            if not text.startswith(prefix):  # a decoder that rewrites earlier text: take the piece alone
                text, prefix = decode_ids(self.tokenizer, pending[:cut]), ""
            if not text.endswith("\ufffd") or len(pending) > self.max_held:
                break
        else:
            self.held = pending
            return ""
        self.context = (self.context + pending[:cut])[-CONTEXT_TOKENS:]
        self.held = pending[cut:]
        return text[len(prefix) :]


class IncrementalRetokenizer:
    """The drafter's token ids for a growing text: a frozen prefix and a short pending text, re-encoded each round.

    `extend(text)` appends text; `ids()` returns `prefix_ids + frozen + encode(pending)`. When the pending text holds
    more than `2 * window` tokens, its tokens up to a *safe point* are frozen: a token boundary with at least `window`
    tokens after it where encoding the text before it and the text after it separately gives exactly the tokens of
    encoding them together (so no merge crosses it and the pending text encodes as it does in context, whatever the
    pre-tokenizer does at the start of a text). A pending text of more than `8 * window` tokens without a safe point
    is frozen at a plain token boundary. Only the pending text is ever re-encoded.

    Example:

    ```python
    >>> from hf_specdec import zoo
    >>> from hf_specdec.drafters.cross_tokenizer import IncrementalRetokenizer
    >>> tokenizer = zoo.load_tokenizer()
    >>> text = "def add(a, b):\\n    return a + b\\n" * 4
    >>> retokenizer = IncrementalRetokenizer(tokenizer, window=4)
    >>> for start in range(0, len(text), 7):
    ...     retokenizer.extend(text[start : start + 7])
    >>> retokenizer.ids() == tokenizer(text).input_ids
    True

    ```
    """

    def __init__(self, tokenizer, prefix_ids: list[int] = (), window: int = 8):
        self.tokenizer = tokenizer
        self.window = window
        self.frozen: list[int] = list(prefix_ids)
        self.pending = ""
        self._pending_ids: list[int] | None = []

    def extend(self, text: str) -> None:
        if not text:
            return
        self.pending += text
        self._pending_ids = None
        self._freeze()

    def pending_ids(self) -> list[int]:
        if self._pending_ids is None:
            self._pending_ids = encode_text(self.tokenizer, self.pending)
        return self._pending_ids

    def ids(self) -> list[int]:
        return self.frozen + self.pending_ids()

    def _freeze(self) -> None:
        tokens, offsets = encode_text(self.tokenizer, self.pending, offsets=True)
        self._pending_ids = tokens
        if len(tokens) <= 2 * self.window:
            return
        for i in range(len(tokens) - self.window, 0, -1):
            start = offsets[i][0]
            if offsets[i - 1][1] > start or start == 0:  # a character split across tokens, or no text before it
                continue
            after = encode_text(self.tokenizer, self.pending[start:])
            if after == tokens[i:] and encode_text(self.tokenizer, self.pending[:start]) == tokens[:i]:
                self._move(tokens, i, start, after)
                return
        if len(tokens) > 8 * self.window:
            # no safe point in a long text (a script without spaces for a tokenizer that prepends "▁"): freeze at
            # a token boundary anyway, so the pending text stays short; the drafter's ids are only a proposal's input
            i = next((i for i in range(len(tokens) - self.window, 0, -1) if offsets[i - 1][1] <= offsets[i][0]), 0)
            if i:
                self._move(tokens, i, offsets[i][0], None)

    def _move(self, tokens: list[int], i: int, start: int, after: list[int] | None) -> None:
        """Freezes `tokens[:i]`, the encoding of the pending text's first `start` characters."""
        self.frozen += tokens[:i]
        self.pending = self.pending[start:]
        self._pending_ids = after


# tokenizer -> list of each id's string as it reads inside a text (None: no plain string), computed once
_TOKEN_STRINGS: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, list[str | None]] = weakref.WeakKeyDictionary()


def token_strings(tokenizer) -> list[str | None]:
    """Each token's text as it reads in the middle of a text (decoded after an anchor token, which keeps a
    SentencePiece "▁" as a space and a WordPiece "##" as a continuation); `None` for special tokens and tokens that
    are not whole characters (single bytes of a multi-byte character)."""
    strings = _TOKEN_STRINGS.get(tokenizer)
    if strings is None:
        anchor = encode_text(tokenizer, "a")[-1:]
        anchor_text = decode_ids(tokenizer, anchor)
        size = len(tokenizer)
        decoded = tokenizer.batch_decode(
            [anchor + [i] for i in range(size)], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        special = set(tokenizer.all_special_ids)
        strings = [None] * size
        for i, text in enumerate(decoded):
            piece = text[len(anchor_text) :] if text.startswith(anchor_text) else None
            if i not in special and piece and "\ufffd" not in piece:
                strings[i] = piece
        _TOKEN_STRINGS[tokenizer] = strings
    return strings


def _string_index(tokenizer) -> dict[str, int]:
    """String -> token id; where several ids read the same (a byte-fallback token and a plain one), the plain one,
    then the lowest id."""
    index: dict[str, int] = {}
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    for i, string in enumerate(token_strings(tokenizer)):
        if string is None:
            continue
        known = index.get(string)
        if known is None or (_BYTE_TOKEN.fullmatch(tokens[known] or "") and not _BYTE_TOKEN.fullmatch(tokens[i] or "")):
            index[string] = i
    return index


def shared_vocabulary(tokenizer, assistant_tokenizer) -> tuple[torch.LongTensor, torch.LongTensor]:
    """The token-level intersection of two vocabularies: `(target_ids, assistant_ids)`, two `[n]` tensors pairing
    each token the two tokenizers both hold with the same string (as it reads inside a text), one to one, plus the
    two end-of-sequence tokens. Empty tensors when they share nothing.

    Example:

    ```python
    >>> from hf_specdec import zoo
    >>> from hf_specdec.drafters.cross_tokenizer import shared_vocabulary
    >>> tokenizer = zoo.load_tokenizer()
    >>> target_ids, assistant_ids = shared_vocabulary(tokenizer, tokenizer)
    >>> bool((target_ids == assistant_ids).all()) and len(target_ids) > 8000
    True

    ```
    """
    target_index = _string_index(tokenizer)
    assistant_index = _string_index(assistant_tokenizer)
    pairs = sorted(
        (target_index[string], assistant_id)
        for string, assistant_id in assistant_index.items()
        if string in target_index
    )
    if pairs and tokenizer.eos_token_id is not None and assistant_tokenizer.eos_token_id is not None:
        pairs.append((tokenizer.eos_token_id, assistant_tokenizer.eos_token_id))
    target_ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
    assistant_ids = torch.tensor([a for _, a in pairs], dtype=torch.long)
    return target_ids, assistant_ids


_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cached_shared_vocabulary(tokenizer, assistant_tokenizer):
    """`shared_vocabulary`, computed once per pair of tokenizers."""
    per_target = _SHARED.setdefault(tokenizer, weakref.WeakKeyDictionary())
    if assistant_tokenizer not in per_target:
        per_target[assistant_tokenizer] = shared_vocabulary(tokenizer, assistant_tokenizer)
    return per_target[assistant_tokenizer]
