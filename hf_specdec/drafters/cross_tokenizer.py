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
  with x's string, a function of the prefix (a drawn x outside the intersection, which only a processor forcing it
  can give, ends the draft). The proposal returns `probs=q`, which `checked_proposal` validates.

Variables follow the paper: p (the target's standardized distribution), q (the drafter's), γ (tokens per round).

`IncrementalDetokenizer`, `IncrementalRetokenizer` and `shared_vocabulary` live in `retokenization.py`.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, EncoderDecoderCache, PreTrainedModel

from ..caches import cache_argument
from ..modeling import logits_width
from ..sampling import sample_tokens
from .base import DraftContext, Drafter, DraftProposal, register_drafter
from .retokenization import (
    CONTEXT_TOKENS,
    IncrementalDetokenizer,
    IncrementalRetokenizer,
    cached_shared_vocabulary,
    check_tokenizer,
    decode_ids,
    encode_text,
    shared_vocabulary,
)

__all__ = ["CrossTokenizerDrafter", "IncrementalDetokenizer", "IncrementalRetokenizer", "shared_vocabulary"]


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
        target_ids, assistant_ids = cached_shared_vocabulary(self.tokenizer, self.assistant_tokenizer)
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
        self.can_draft = True  # False when the drafter cannot read this call's source: it then proposes nothing
        if model.config.is_encoder_decoder:
            self._encode_source(context.inputs_tensor)
            prefix = [self._decoder_start_token_id()]
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

    def _encode_source(self, source: torch.LongTensor | None) -> None:
        """Runs the drafter's encoder on the source text re-encoded with `assistant_tokenizer`; a source with no text
        for it, or longer than its encoder's positions, leaves `can_draft` False (the target decodes alone)."""
        model = self.model
        if source is None or source.is_floating_point() or bool((source < 0).any()):
            raise ValueError(
                f"The encoder-decoder `assistant_model` ({type(model).__name__}) re-encodes the source text with "
                "`assistant_tokenizer`, but the target was not called with token ids. Call `generate` with the "
                "tokenized source as `input_ids`."
            )
        source_text = decode_ids(self.tokenizer, source[0].tolist())
        encoded = self.assistant_tokenizer(source_text, return_tensors="pt").to(self.device)
        length = encoded.input_ids.shape[1]
        if length == 0 or (self.max_positions is not None and length > self.max_positions):
            self.can_draft = False
            return
        encoder_outputs = model.get_encoder()(
            input_ids=encoded.input_ids, attention_mask=encoded.attention_mask, return_dict=True
        )
        self.encoder_inputs = {"encoder_outputs": encoder_outputs, "attention_mask": encoded.attention_mask}

    def _decoder_start_token_id(self) -> int:
        """The drafter's first decoder token, found as transformers' `generate` finds it."""
        model = self.model
        for start in (
            model.generation_config.decoder_start_token_id,
            getattr(model.config, "decoder_start_token_id", None),
            model.generation_config.bos_token_id,
        ):
            if start is not None:
                return int(start)
        raise ValueError(
            f"The encoder-decoder `assistant_model` ({type(model).__name__}) has no `decoder_start_token_id` (nor a "
            "`bos_token_id`) in its generation config or config, so its decoder cannot start. Set "
            "`assistant_model.generation_config.decoder_start_token_id` to the id its decoder was trained to start "
            "with."
        )

    def _special_prefix(self) -> list[int]:
        """The special tokens the assistant tokenizer puts before a text (a BOS), as the drafter was trained."""
        with_special = self.assistant_tokenizer("a")["input_ids"]
        plain = encode_text(self.assistant_tokenizer, "a")
        for start in range(len(with_special) - len(plain) + 1):
            if with_special[start : start + len(plain)] == plain:
                return with_special[:start]
        return []

    def propose(
        self, input_ids: torch.LongTensor, num_tokens: int, attention_mask: torch.LongTensor | None = None
    ) -> DraftProposal:
        if not self.can_draft:
            return DraftProposal.empty(1, input_ids.device)
        # the target's tokens emitted since the last round, as text, into the drafter's ids
        new_ids = input_ids[0, self.consumed :].tolist()
        self.consumed = input_ids.shape[1]
        self.retokenizer.extend(self.detokenizer.advance(new_ids))
        if num_tokens == 0:
            return DraftProposal.empty(1, input_ids.device)
        context = self.retokenizer.ids()
        if not context:  # no text yet (a prompt of special tokens only) and no start token: nothing to draft from
            return DraftProposal.empty(1, input_ids.device)
        steps = num_tokens if self.do_sample else (self.max_draft_steps or num_tokens)
        if self.max_positions is not None and len(context) + steps > self.max_positions:
            return DraftProposal.empty(1, input_ids.device)  # the drafter has no positions left
        if self.do_sample:
            return self._propose_shared(input_ids, num_tokens, context)
        return self._propose_text(input_ids, num_tokens, context)

    def _propose_text(self, input_ids: torch.LongTensor, gamma: int, context: list[int]) -> DraftProposal:
        """Greedy: the drafter's own argmax text, spelled in target tokens; deterministic (no q)."""
        anchor = input_ids[0, -CONTEXT_TOKENS:].tolist()  # the target's last tokens, as context for the encoding
        tail = context[-CONTEXT_TOKENS:]
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
        tail_text = decode_ids(self.assistant_tokenizer, tail)
        text = decode_ids(self.assistant_tokenizer, tail + drafted)
        text = text[len(tail_text) :] if text.startswith(tail_text) else decode_ids(self.assistant_tokenizer, drafted)
        while text.endswith("\ufffd"):  # a character cut at the end of the draft
            text = text[:-1]
        if not text:
            return []
        anchor_text = decode_ids(self.tokenizer, anchor)
        ids, offsets = encode_text(self.tokenizer, anchor_text + text, offsets=True)
        boundary = len(anchor_text)
        first = next((j for j, (start, _) in enumerate(offsets) if start >= boundary), len(ids))
        if first == 0 or offsets[first - 1][1] <= boundary:
            return ids[first:]
        # the context's last token would merge with the draft ("…ca" + "t sat"): the draft spelled on its own, if
        # the target's tokens then still read as the text (byte-level: yes; a tokenizer that prepends "▁": no)
        tokens = encode_text(self.tokenizer, text)
        return tokens if decode_ids(self.tokenizer, anchor + tokens) == anchor_text + text else []

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
            assistant_token = self.assistant_of.get(target_token)
            if target_token == self.target_eos or assistant_token is None:
                break  # drawn from q, so a valid last draft; a token outside the intersection has no drafter id
            drafted.append(assistant_token)
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
