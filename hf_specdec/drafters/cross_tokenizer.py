"""`CrossTokenizerDrafter`: drafting with a model whose tokenizer is not the target's (Universal Assisted Generation).

Two vocabularies meet at the text. The drafter keeps its own token ids and its own cache; between rounds it learns
what the target emitted as **text**, incrementally:

- `IncrementalDetokenizer` turns the target's new tokens into the text they add, decoding them with a few tokens of
  left context (so leading-space conventions come out as in the whole text) and holding back a token whose bytes
  end inside a character (byte fallback, byte-level BPE);
- `IncrementalRetokenizer` keeps the drafter's ids as a **frozen** part (tokens that no later text can change) and a
  short **pending** text after it, re-encoded each round; text moves from pending to frozen only at a *safe point*:
  a token boundary where encoding the two sides separately gives the same tokens as encoding them together (no
  merge across it, no start-of-text convention such as a prepended "▁" or a missing "##"). Nothing re-encodes the
  whole context; the drafter's cache keeps the longest prefix of ids it has already seen.

The proposal is in the target's token ids, so verification is the usual one:

- **greedy**: the drafter decodes γ tokens greedily in its own vocabulary; their text is encoded with the target's
  tokenizer after the text of the target's last few tokens, and the target tokens that start at the context's end
  are proposed (at most γ). A proposal is deterministic (`probs=None`), so the output is plain greedy decoding
  token for token, whatever the tokenizers do at boundaries: a draft only changes how many target tokens one
  forward yields.
- **sampling**: the token-level intersection of Timor et al. (ICML 2025, "Accelerating LLM Inference with Lossless
  Speculative Decoding Algorithms for Heterogeneous Vocabularies"): the drafter's logits over the tokens whose
  string both vocabularies hold are placed at the matching target ids (every other target id gets -inf), the
  target's own logits processors standardize them with the target-token prefix, and the drafted target token is
  sampled from the result, q. The argument for exactness: Algorithm 1 (Leviathan et al., 2023) samples exactly from
  the target's p for *any* q that is a distribution over the target's vocabulary computed from the prefix, as long
  as the drafted token was drawn from q and q is returned with it; here q is such a distribution (its support is
  the shared tokens that survive the processors), x ~ q, and the drafter's next step conditions on the drafter token
  with x's string, a function of the prefix. The proposal returns `probs=q`, which `checked_proposal` validates.

Variables follow the paper: p (the target's standardized distribution), q (the drafter's), γ (tokens per round).
"""

from __future__ import annotations

import re
import weakref

import torch
from transformers import DynamicCache, EncoderDecoderCache, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from ..caches import cache_argument
from ..modeling import logits_width
from ..sampling import sample_tokens
from .base import DraftContext, Drafter, DraftProposal, register_drafter

__all__ = ["CrossTokenizerDrafter", "IncrementalDetokenizer", "IncrementalRetokenizer", "shared_vocabulary"]

_CONTEXT_TOKENS = 4  # tokens of left context when decoding a piece (leading spaces, byte sequences)
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
        # a text made of the tokenizer's own tokens encodes and decodes back to itself when it has a decoder
        special = set(tokenizer.all_special_ids)
        plain = [i for i in range(len(tokenizer)) if i not in special]
        probe = [i for i in plain[:: max(1, len(plain) // 32)] if "\ufffd" not in _decode(tokenizer, [i])][:24]
        text = _decode(tokenizer, probe)
        decoded = _decode(tokenizer, _encode(tokenizer, text))
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


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _encode(tokenizer, text: str, offsets: bool = False):
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=offsets)
    return (encoded["input_ids"], encoded["offset_mapping"]) if offsets else encoded["input_ids"]


class IncrementalDetokenizer:
    """Target tokens in, the text they add out, one round at a time.

    A piece is decoded after the last `_CONTEXT_TOKENS` tokens already turned into text, so that it reads as it does
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
        prefix = _decode(self.tokenizer, self.context)
        for cut in range(len(pending), 0, -1):
            text = _decode(self.tokenizer, self.context + pending[:cut])
            if not text.startswith(prefix):  # a decoder that rewrites earlier text: take the piece alone
                text, prefix = _decode(self.tokenizer, pending[:cut]), ""
            if not text.endswith("\ufffd") or len(pending) > self.max_held:
                break
        else:
            self.held = pending
            return ""
        self.context = (self.context + pending[:cut])[-_CONTEXT_TOKENS:]
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
            self._pending_ids = _encode(self.tokenizer, self.pending)
        return self._pending_ids

    def ids(self) -> list[int]:
        return self.frozen + self.pending_ids()

    def _freeze(self) -> None:
        tokens, offsets = _encode(self.tokenizer, self.pending, offsets=True)
        self._pending_ids = tokens
        if len(tokens) <= 2 * self.window:
            return
        for i in range(len(tokens) - self.window, 0, -1):
            start = offsets[i][0]
            if offsets[i - 1][1] > start or start == 0:  # a character split across tokens, or no text before it
                continue
            after = _encode(self.tokenizer, self.pending[start:])
            if after == tokens[i:] and _encode(self.tokenizer, self.pending[:start]) == tokens[:i]:
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
        anchor = _encode(tokenizer, "a")[-1:]
        anchor_text = _decode(tokenizer, anchor)
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


def _cached_shared_vocabulary(tokenizer, assistant_tokenizer):
    per_target = _SHARED.setdefault(tokenizer, weakref.WeakKeyDictionary())
    if assistant_tokenizer not in per_target:
        per_target[assistant_tokenizer] = shared_vocabulary(tokenizer, assistant_tokenizer)
    return per_target[assistant_tokenizer]


class CrossTokenizerDrafter(Drafter):
    r"""
    Drafts with a causal LM that has its own tokenizer (transformers' Universal Assisted Generation), exactly:
    greedy output is plain greedy decoding token for token, sampled output follows the target's distribution.
    `generate(assistant_model=draft, tokenizer=tokenizer, assistant_tokenizer=draft_tokenizer)` builds one.

    The drafter keeps its own ids and cache for one `generate` call and learns the target's accepted text
    incrementally (see the module docstring: text crosses between the vocabularies, nothing re-encodes the whole
    context). Greedy: it decodes greedily and proposes the target tokens of its text (deterministic, `probs=None`).
    Sampling: it samples from its distribution restricted to the tokens both vocabularies hold with the same string,
    standardized by the target's logits processors, and returns that q (Timor et al., 2025, token-level
    intersection): Algorithm 1 is exact for any q the drafted token was drawn from. Batches are drafted one row at a
    time (one drafter per sequence).

    Args:
        model ([`~transformers.PreTrainedModel`]):
            The drafter: a causal LM (an encoder-decoder model for an encoder-decoder target) for
            `assistant_tokenizer`. Never modified.
        tokenizer ([`~transformers.PreTrainedTokenizerBase`]):
            The target's tokenizer (a fast tokenizer that decodes).
        assistant_tokenizer ([`~transformers.PreTrainedTokenizerBase`]):
            The drafter's tokenizer (a fast tokenizer that decodes).
        max_draft_steps (`int`, *optional*):
            Greedy: drafter tokens per round (defaults to γ, as transformers); their text is proposed as at most γ
            target tokens.
        window (`int`, *optional*, defaults to 8):
            Drafter tokens kept as re-encodable pending text between rounds (see `IncrementalRetokenizer`).

    Example:

    ```python
    >>> import torch, hf_specdec
    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> from hf_specdec import zoo
    >>> tokenizer = zoo.load_tokenizer()
    >>> config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    >>> target = hf_specdec.enable(AutoModelForCausalLM.from_config(config))
    >>> drafter = hf_specdec.CrossTokenizerDrafter(AutoModelForCausalLM.from_config(config), tokenizer, tokenizer)
    >>> ids = tokenizer("def add(a, b):", return_tensors="pt").input_ids
    >>> out = target.generate(ids, drafter=drafter, max_new_tokens=8, do_sample=False)
    >>> torch.equal(out, target.generate(ids, max_new_tokens=8, do_sample=False))
    True

    ```
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer,
        assistant_tokenizer,
        max_draft_steps: int | None = None,
        window: int = 8,
    ):
        if not isinstance(model, PreTrainedModel):
            raise TypeError(
                f"`assistant_model` must be a transformers `PreTrainedModel`, got {type(model).__name__}. Load it with "
                "`AutoModelForCausalLM.from_pretrained(...)`."
            )
        check_tokenizer(tokenizer, "tokenizer")
        check_tokenizer(assistant_tokenizer, "assistant_tokenizer")
        width = logits_width(model)
        if len(assistant_tokenizer) > width:
            raise ValueError(
                f"`assistant_tokenizer` has {len(assistant_tokenizer)} tokens but `assistant_model` "
                f"({type(model).__name__}) scores only {width}: it is not the drafter's tokenizer. Pass the tokenizer "
                "the assistant model was trained with."
            )
        if max_draft_steps is not None and (
            isinstance(max_draft_steps, bool) or not isinstance(max_draft_steps, int) or max_draft_steps < 1
        ):
            raise ValueError(f"`max_draft_steps` must be a positive int or None, got {max_draft_steps!r}.")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"`window` must be a positive int, got {window!r}. Use the default, 8.")
        self.model = model
        self.cache_argument = cache_argument(model)  # `cache` or `past_key_values`: what its forward takes
        self.tokenizer = tokenizer
        self.assistant_tokenizer = assistant_tokenizer
        self.max_draft_steps = max_draft_steps
        self.window = window

    def reset(self, context: DraftContext) -> None:
        model, target = self.model, context.target
        if len(self.tokenizer) > context.vocab_size:
            raise ValueError(
                f"`tokenizer` has {len(self.tokenizer)} tokens but the target ({type(target).__name__}) scores only "
                f"{context.vocab_size}: it is not the target's tokenizer. Pass the target's own tokenizer as "
                "`tokenizer=`."
            )
        target_ids, assistant_ids = _cached_shared_vocabulary(self.tokenizer, self.assistant_tokenizer)
        if target_ids.numel() == 0:
            raise ValueError(
                f"`tokenizer` ({type(self.tokenizer).__name__}, {len(self.tokenizer)} tokens) and "
                f"`assistant_tokenizer` ({type(self.assistant_tokenizer).__name__}, {len(self.assistant_tokenizer)} "
                "tokens) share no token string, so the drafter's text cannot be spelled in the target's vocabulary. "
                "Use an assistant whose tokenizer covers the same script and conventions."
            )
        self.device = model.device
        self.target_device = context.input_ids.device
        self.do_sample = context.do_sample
        self.logits_processor = context.logits_processor
        self.target_width = context.vocab_size
        self.shared_target = target_ids.to(self.target_device)  # [n]
        self.shared_assistant = assistant_ids.to(self.device)  # [n]
        self.assistant_of = dict(zip(target_ids.tolist(), assistant_ids.tolist()))
        eos = context.generation_config.eos_token_id
        self.target_eos = (eos[0] if isinstance(eos, (list, tuple)) else eos) if eos is not None else None
        if isinstance(self.target_eos, torch.Tensor):
            self.target_eos = int(self.target_eos.flatten()[0])
        self.assistant_eos = self.assistant_tokenizer.eos_token_id
        config = model.config
        self.max_positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)

        if target.config.is_encoder_decoder != model.config.is_encoder_decoder:
            kind = "an encoder-decoder" if target.config.is_encoder_decoder else "a decoder-only"
            raise ValueError(
                f"`assistant_model` ({type(model).__name__}) must be of the target's kind: the target "
                f"({type(target).__name__}) is {kind} model. With a different tokenizer, use an encoder-decoder "
                "assistant for an encoder-decoder target and a causal LM for a decoder-only one."
            )
        self.encoder_inputs = None
        if model.config.is_encoder_decoder:
            source = context.inputs_tensor
            if source is None or source.is_floating_point() or bool((source < 0).any()):
                raise ValueError(
                    f"The encoder-decoder `assistant_model` ({type(model).__name__}) re-encodes the source text with "
                    "`assistant_tokenizer`, but the target was not called with token ids. Call `generate` with the "
                    "tokenized source as `input_ids`."
                )
            source_text = _decode(self.tokenizer, source[0].tolist())
            encoded = self.assistant_tokenizer(source_text, return_tensors="pt").to(self.device)
            encoder_outputs = model.get_encoder()(
                input_ids=encoded.input_ids, attention_mask=encoded.attention_mask, return_dict=True
            )
            self.encoder_inputs = {"encoder_outputs": encoder_outputs, "attention_mask": encoded.attention_mask}
            prefix = [model.config.decoder_start_token_id]
            self.cache = EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
        else:
            prefix = self._special_prefix()
            self.cache = DynamicCache(config=config)
        if not self.cache.is_croppable:
            raise ValueError(
                f"`assistant_model` ({type(model).__name__}) uses a cache that cannot be rolled back. Use a drafter "
                "with standard (full or sliding-window) attention."
            )
        self.fed: list[int] = []  # the drafter ids the cache holds, in order
        self.fed_frozen = 0  # how many of them were frozen ids when fed (a prefix no later round changes)
        self.retokenizer = IncrementalRetokenizer(self.assistant_tokenizer, prefix, window=self.window)
        self.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self.consumed = 0  # target tokens turned into text so far

    def _special_prefix(self) -> list[int]:
        """The special tokens the assistant tokenizer puts before a text (a BOS), as the drafter was trained."""
        with_special = self.assistant_tokenizer("a")["input_ids"]
        plain = _encode(self.assistant_tokenizer, "a")
        for start in range(len(with_special) - len(plain) + 1):
            if with_special[start : start + len(plain)] == plain:
                return with_special[:start]
        return []

    def propose(
        self, input_ids: torch.LongTensor, num_tokens: int, attention_mask: torch.LongTensor | None = None
    ) -> DraftProposal:
        # the target's tokens emitted since the last round, as text, into the drafter's ids
        new_ids = input_ids[0, self.consumed :].tolist()
        self.consumed = input_ids.shape[1]
        self.retokenizer.extend(self.detokenizer.advance(new_ids))
        if num_tokens == 0:
            return DraftProposal.empty(1, input_ids.device)
        context = self.retokenizer.ids()
        if self.max_positions is not None and len(context) + num_tokens * 2 + 2 > self.max_positions:
            return DraftProposal.empty(1, input_ids.device)  # the drafter has no positions left
        if self.do_sample:
            return self._propose_shared(input_ids, num_tokens, context)
        return self._propose_text(input_ids, num_tokens, context)

    def _propose_text(self, input_ids: torch.LongTensor, gamma: int, context: list[int]) -> DraftProposal:
        """Greedy: the drafter's own argmax text, spelled in target tokens; deterministic (no q)."""
        anchor = input_ids[0, -_CONTEXT_TOKENS:].tolist()  # the target's last tokens, as context for the encoding
        tail = context[-_CONTEXT_TOKENS:]
        drafted: list[int] = []
        eos = False
        for _ in range(self.max_draft_steps or gamma):
            token = int(self._next_logits(context + drafted).argmax())
            if token == self.assistant_eos:
                eos = True
                break
            drafted.append(token)
        tokens = self._target_tokens(anchor, tail, drafted) if drafted else []
        if eos and self.target_eos is not None:
            tokens = tokens + [self.target_eos]
        return DraftProposal(tokens=torch.tensor([tokens[:gamma]], dtype=torch.long, device=input_ids.device))

    def _target_tokens(self, anchor: list[int], tail: list[int], drafted: list[int]) -> list[int]:
        """The text of the drafter tokens `drafted` (which follow the drafter tokens `tail`) as target tokens that
        follow the target tokens `anchor`: the target's encoding of the anchor's text and the draft's text together,
        from the first token that starts at the draft; empty when no spelling of the draft follows the anchor."""
        tail_text = _decode(self.assistant_tokenizer, tail)
        text = _decode(self.assistant_tokenizer, tail + drafted)
        text = text[len(tail_text) :] if text.startswith(tail_text) else _decode(self.assistant_tokenizer, drafted)
        while text.endswith("\ufffd"):  # a character cut at the end of the draft
            text = text[:-1]
        if not text:
            return []
        anchor_text = _decode(self.tokenizer, anchor)
        ids, offsets = _encode(self.tokenizer, anchor_text + text, offsets=True)
        boundary = len(anchor_text)
        first = next((j for j, (start, _) in enumerate(offsets) if start >= boundary), len(ids))
        if first == 0 or offsets[first - 1][1] <= boundary:
            return ids[first:]
        # the context's last token would merge with the draft ("…ca" + "t sat"): the draft spelled on its own, if
        # the target's tokens then still read as the text (byte-level: yes; a tokenizer that prepends "▁": no)
        tokens = _encode(self.tokenizer, text)
        return tokens if _decode(self.tokenizer, anchor + tokens) == anchor_text + text else []

    def _propose_shared(self, input_ids: torch.LongTensor, gamma: int, context: list[int]) -> DraftProposal:
        """Sampling: q is the drafter's distribution on the shared tokens, standardized like p (token-level
        intersection); each drafted token is drawn from q and returned with it."""
        ids = input_ids  # [1, seq_len + drafted so far], target ids
        drafted: list[int] = []  # drafter ids of the drafted tokens
        probs = []
        for _ in range(gamma):
            logits = self._next_logits(context + drafted)  # [assistant vocab]
            scores = torch.full((1, self.target_width), float("-inf"), device=self.target_device)  # [1, V]
            scores[0, self.shared_target] = logits[self.shared_assistant].to(self.target_device)
            q = self.logits_processor(ids, scores).softmax(dim=-1)  # [1, V]
            if not bool(torch.isfinite(q).all()):
                break  # the processors left no shared token (e.g. EOS only, suppressed): draft no further
            token = self._draw(q)  # [1]
            probs.append(q)
            ids = torch.cat([ids, token[:, None]], dim=-1)
            target_token = int(token)
            if target_token == self.target_eos:
                break
            drafted.append(self.assistant_of[target_token])
        start = input_ids.shape[1]
        return DraftProposal(tokens=ids[:, start:], probs=torch.stack(probs, dim=1) if probs else None)

    def _draw(self, q: torch.FloatTensor) -> torch.LongTensor:
        """One drafted target token from q (`[1, V]`): `[1]`. The promise of `probs`: the token is drawn from q."""
        return sample_tokens(q)

    def _next_logits(self, ids: list[int]) -> torch.FloatTensor:
        """The drafter's float32 logits after `ids` (`[assistant vocab]`), feeding only what its cache lacks: the
        cache keeps the longest common prefix of `ids` and what it holds (never the last id, whose logits we need)."""
        limit = min(len(self.fed), len(ids) - 1)
        keep = min(self.fed_frozen, limit)  # the frozen ids fed last time are still a prefix of `ids`
        while keep < limit and self.fed[keep] == ids[keep]:
            keep += 1
        excess = self.cache.get_seq_length() - keep
        if excess > 0:
            self.cache.crop(-excess)
        new = torch.tensor([ids[keep:]], dtype=torch.long, device=self.device)  # [1, n]
        if self.encoder_inputs is not None:
            outputs = self.model(
                decoder_input_ids=new, use_cache=True, **{self.cache_argument: self.cache}, **self.encoder_inputs
            )
        else:
            outputs = self.model(input_ids=new, use_cache=True, **{self.cache_argument: self.cache})
        self.fed = list(ids)
        self.fed_frozen = len(self.retokenizer.frozen)
        return outputs.logits[0, -1].float()


register_drafter("cross_tokenizer", CrossTokenizerDrafter)
