"""`ModelDrafter`: a smaller causal LM drafts γ tokens autoregressively (the paper's M_q), or a token tree.

The tree follows EAGLE-2's dynamic tree: every node's **score** is the sum of log q along its path (its cumulative
log-probability under the drafter's standardized q); each depth expands the best-scoring nodes of the depth before
(the **frontier**) with their top-k tokens, in one drafter forward per depth, and the proposal keeps the best
`tree_budget` nodes of everything grown (the **rerank**).

The module is over 500 lines because one draft cache serves every layout the loop verifies (dynamic, static and
compiled, padded batches realigned per row, recurrent state rolled back from checkpoints, trees), and those paths
share the cache's bookkeeping (its host-counted length, its rewinds): split, one cache's invariants would be spread
over several modules.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, EncoderDecoderCache, PreTrainedModel
from transformers.utils import logging

from ..caches import (
    cache_argument,
    cached_length,
    croppable_after_first_forward,
    no_state_yet,
    realign_cache,
    rewind_cache,
    slice_cache,
)
from ..devices import execution_device, to_device
from ..modeling import logits_width
from ..recurrent import chunk_kwargs, draft_checkpoints, takes_chunk_size
from ..sampling import sample_tokens
from ..tree_attention import check_tree_attention
from ..trees import additive_bias
from .base import DraftContext, Drafter, DraftProposal, register_drafter
from .batch_realignment import batch_realignment
from .model_setup import _COMPILED_TOKENS, StaticCachePool, compiled_forward, encoder_inputs, static_draft_capacity
from .tree_builder import DynamicTree

__all__ = ["ModelDrafter"]

logger = logging.get_logger(__name__)


class ModelDrafter(Drafter):
    r"""
    Drafts with a (small) causal language model that shares the target's tokenizer, the paper's approximation
    model M_q. `generate(assistant_model=draft)` builds one.

    The drafter keeps its own cache for the duration of one `generate` call (a `DynamicCache`, or a `StaticCache`
    with `cache_implementation="static"`). Each round it feeds only the tokens it has not seen (including the
    target's recovered or bonus token) and, after verification, rolls the rejected drafts back. Its logits go through
    the target's own logits processors with the same prefix, so q is standardized exactly like p (section 2.2).

    When the call verifies token trees (`speculative_tree_budget` set, one sequence, a decoder-only target), the
    drafter grows a dynamic tree instead of a chain (EAGLE-2): the `tree_top_k` most likely tokens after the context
    are the first depth; each further depth, up to the round's γ, expands the `tree_top_k` best nodes of the depth
    before (by cumulative log q along their path, and only nodes that can still make the budget) with their own
    `tree_top_k` most likely tokens, all in one drafter forward with a tree attention mask; the proposal keeps the
    `speculative_tree_budget` best nodes. Nodes are chosen deterministically (top-k), so the proposal has no q
    (`probs=None`) also when sampling, and sampling stays exact: the verifier treats each node as a point mass and
    tries siblings in turn, which samples the target's distribution restricted to the siblings not yet rejected.
    The drafter model must take a custom 4D attention mask with `position_ids` (most decoder-only models in
    transformers do); otherwise a tree budget is refused with a clear error. Padded batches and encoder-decoder
    targets always get chains.

    Args:
        model ([`~transformers.PreTrainedModel`]):
            A causal LM with the same vocabulary as the target. It may sit on another device or use another dtype,
            or be dispatched by accelerate (`device_map=...`, with layers offloaded to the CPU or disk): its inputs
            go to the device it computes on and its logits come back to the target's. It is never modified.
        tree_top_k (`int`, *optional*, defaults to 4):
            With `speculative_tree_budget`: how many children each expanded node gets, and how many nodes of each
            depth are expanded. Unused for chains.
        same_tokenizer (`bool`, *optional*, defaults to `False`):
            The drafter shares the target's tokenizer, but its vocabulary is padded to another number of logits
            (Qwen2.5-0.5B has 151936, Qwen2.5-7B 152064). Its logits are then cut to the target's, or filled up with
            `-inf` (it never drafts a token it has no logit for), and a context token past its own vocabulary (one
            of the target's padding ids) reaches it as its last id. Both only change what is drafted, never the
            output. `generate(..., assistant_model=draft, tokenizer=tok, assistant_tokenizer=draft_tok)` sets it
            when the two tokenizers have the same vocabulary; without it, a drafter of another width is refused.
        cache_implementation (`str`, *optional*):
            `None` or `"dynamic"` (the default): the drafter's cache grows as it drafts. `"static"`: it preallocates a
            `StaticCache` for the call (`max_length` positions, plus room for a tree's expanded nodes) and rolls
            rejected drafts back by moving the write position, as the target's static cache does. The drafter keeps
            it for later calls (emptied, when large enough; concurrent calls each take their own), so that graphs
            captured over its tensors (CUDA graphs) replay rather than record again. Where transformers
            would compile a forward over that cache (`model._valid_auto_compile_criteria` with the call's
            `compile_config` and `disable_compile`: CUDA and other accelerators, or any device when the config asks
            for it), the drafter's forwards after its first run through transformers' own compiled call
            (`model.get_compiled_call`) in two shapes at most: 2 tokens for every forward over the context (a longer
            tail is fed 2 at a time, the last forward padded), and `tree_top_k` nodes for a tree's depths, so kernels
            launch from a bounded number of graphs. Graphs built are counted in
            `speculative_stats.drafter_compilations`. For decoder-only targets; a batch of several sequences is
            drafted one sequence at a time (each with its own cache), and speculative beam search (`num_beams` > 1),
            which runs the draft model's own beams, refuses it. The draft cache changes what is drafted at most by
            rounding, never the output.

    Example:

    ```python
    >>> import torch, hf_specdec
    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> target = hf_specdec.enable(AutoModelForCausalLM.from_config(config))
    >>> out = target.generate(torch.tensor([[1, 2, 3]]), drafter=hf_specdec.ModelDrafter(target), max_new_tokens=5)
    >>> out.shape
    torch.Size([1, 8])

    ```
    """

    supports_padded_batches = True

    def __init__(
        self,
        model: PreTrainedModel,
        tree_top_k: int = 4,
        same_tokenizer: bool = False,
        cache_implementation: str | None = None,
    ):
        if not isinstance(model, PreTrainedModel):
            raise TypeError(
                f"`assistant_model` must be a transformers `PreTrainedModel`, got {type(model).__name__}. "
                "Load it with `AutoModelForCausalLM.from_pretrained(...)`."
            )
        if isinstance(tree_top_k, bool) or not isinstance(tree_top_k, int) or tree_top_k < 1:
            raise ValueError(
                f"`tree_top_k` must be a positive int (children per expanded tree node), got {tree_top_k!r}. "
                "Use `tree_top_k=4` (the default), or any int >= 1."
            )
        if not isinstance(same_tokenizer, bool):
            raise TypeError(f"`same_tokenizer` must be a bool, got {type(same_tokenizer).__name__} {same_tokenizer!r}.")
        if cache_implementation not in (None, "dynamic", "static"):
            raise ValueError(
                f"`cache_implementation` of a `ModelDrafter` must be None, 'dynamic' or 'static', got "
                f"{cache_implementation!r}. Use `cache_implementation='static'` for a preallocated draft cache "
                "(compiled where transformers compiles), or leave it unset for a dynamic one."
            )
        self.model = model
        self.cache_implementation = cache_implementation
        # a static draft cache holds one sequence, and a recurrent state cannot be moved between the columns of a
        # padded rectangle: a batch's rows get one drafter each
        self.supports_padded_batches = cache_implementation != "static" and not getattr(model, "_is_stateful", False)
        self.cache_argument = cache_argument(model)  # `cache` or `past_key_values`: what its forward takes
        self.tree_top_k = tree_top_k
        self.same_tokenizer = same_tokenizer
        self.static_caches = StaticCachePool()  # shared by the per-call copies (`for_call`)

    def reset(self, context: DraftContext) -> None:
        model = self.model
        target = context.target
        width = logits_width(model)
        if width != context.vocab_size and not self.same_tokenizer:
            raise ValueError(
                f"`assistant_model` has a vocabulary of {width} tokens but the target has {context.vocab_size}. "
                "Speculative decoding needs a drafter that shares the target's tokenizer and vocabulary; use a "
                "drafter from the same model family, pass both tokenizers (`tokenizer=`, `assistant_tokenizer=`), "
                "or, if only the padding of their vocabularies differs, `ModelDrafter(draft, same_tokenizer=True)`."
            )
        # a vocabulary padded to another width (`same_tokenizer`): logits cut or filled up to the target's, and the
        # target's ids past the drafter's vocabulary fed as its last one
        self.width, self.target_width = width, context.vocab_size
        self.device = execution_device(model)  # not `model.device`: `meta` for an offloaded model
        self.target_device = context.input_ids.device
        self.logits_processor = context.logits_processor
        self.do_sample = context.do_sample
        # drafts past max_length are never kept; clamped positions keep learned position tables in range
        self.max_position = context.generation_config.max_length - 1
        forward_params = inspect.signature(model.forward).parameters
        self.accepts_position_ids = "position_ids" in forward_params
        self.accepts_logits_to_keep = "logits_to_keep" in forward_params
        # three ways to condition on the input: a causal LM on the prompt; an encoder-decoder drafter on its own
        # encoding of the source; a decoder-only drafter with cross-attention on the target's encoder outputs
        self.encoder_inputs = None  # the extra forward kwargs that carry the source, for the last two
        static = self.cache_implementation == "static"
        if not target.config.is_encoder_decoder:
            if model.config.is_encoder_decoder:
                raise ValueError(
                    f"`assistant_model` ({type(model).__name__}) is an encoder-decoder model but the target "
                    f"({type(target).__name__}) is decoder-only. Use a decoder-only (causal LM) drafter with the "
                    "target's vocabulary."
                )
            self.attention_mask = context.model_kwargs.get("attention_mask")  # [batch, prompt_len] or None
            if self.attention_mask is not None and bool((self.attention_mask != 0).all()):
                # no padding: the causal mask over the cache (one shape for every forward of a static cache), and no
                # mask to extend and check at each drafted token; a padded batch passes its mask every round
                self.attention_mask = None
            cache = None if static else DynamicCache(config=model.config)
            # a padded batch: what the cache holds, per row (nothing yet: a round may come before any drafting)
            batch = context.input_ids.shape[0]
            self.fed_ids = context.input_ids.new_zeros(batch, 0)  # [batch, cached]
            self.fed_mask = context.input_ids.new_zeros(batch, 0)  # [batch, cached]
            self.host_padding = None  # each row's left padding in what the cache holds, on the host, once known
        else:
            if static:
                raise ValueError(
                    f"`ModelDrafter(cache_implementation='static')` drafts for decoder-only targets, but the target "
                    f"({type(target).__name__}) is an encoder-decoder model, whose drafter also keeps a "
                    "cross-attention cache over the source. Leave the drafter's cache dynamic "
                    '(`cache_implementation=None`); the target itself may still use `cache_implementation="static"`.'
                )
            self.attention_mask = None  # decoder prompts (start tokens) are never padded
            self.encoder_inputs = encoder_inputs(model, context, self.device, forward_params)
            # cross-attention reads the whole encoder output: no sliding-window layers there, whatever the decoder's
            # self-attention uses (as t5gemma's own generate builds it; a windowed cross cache drops encoder keys)
            cache = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache())
        # trees: one sequence of a decoder-only target (the loop verifies no trees for encoder-decoder targets);
        # padded batches get chains
        one_sequence = self.encoder_inputs is None and context.input_ids.shape[0] == 1
        self.tree_budget = context.tree_budget if one_sequence else None
        self.tree_context_length = None  # cache length before the last tree's nodes, until `on_verified`
        self.compiled, self.capacity = None, None  # a static cache's compiled forward and size
        self.static_length = 0  # the positions a static cache holds, counted on the host (`_cached`)
        self.keep_index = {}  # tokens in a compiled forward -> its `logits_to_keep` index tensor, on the device
        if static:
            if context.input_ids.shape[0] != 1:
                raise ValueError(
                    f"`ModelDrafter(cache_implementation='static')` drafts one sequence per cache, but this call "
                    f"handed it a batch of {context.input_ids.shape[0]}. Leave the drafter's cache dynamic for this "
                    "call (`cache_implementation=None`)."
                )
            capacity = static_draft_capacity(context, self.tree_top_k, self.tree_budget)
            cache, self.capacity = self.static_caches.take(self, model, self.device, capacity)
        cache.activate_past_recording()
        # a recurrent draft cache: a checkpoint after every forward, rolled back to the one at the kept length
        self.recurrent = draft_checkpoints(model, cache, static, context.tree_budget)
        if self.recurrent is not None:  # its refed tails then run as one chunk of its kernel, where it takes that
            takes_chunk_size(model)
        # a convolution-only linear-attention cache (lfm2) proves itself croppable at its first forward: checked
        # again in `on_verified`
        self.check_croppable = (
            self.recurrent is None and not cache.is_croppable and croppable_after_first_forward(cache)
        )
        if self.recurrent is None and not cache.is_croppable and not self.check_croppable:
            raise ValueError(
                f"`assistant_model` ({type(model).__name__}) uses a cache that cannot be rolled back, so rejected "
                "drafts could not be undone. Use a drafter with standard (full or sliding-window) attention."
            )
        self.cache = cache
        if self.tree_budget is not None:
            check_tree_attention(model, "speculative_tree_budget", role="the drafter model (`assistant_model`)")
            # a single prompt may still carry left padding: its nodes must not see it, and positions skip it
            mask = self.attention_mask
            self.tree_padding = 0 if mask is None else int((mask == 0).sum())
        if static:
            self.compiled = compiled_forward(model, cache, context.generation_config)

    def _compiled(self, inputs: dict):
        """Runs the compiled forward; past torch's recompile limit (graphs of other models built in this process
        count too), this call drafts eagerly from here on."""
        try:
            return self.compiled(**inputs)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            logger.warning_once(
                "The drafter's compiled forward reached torch._dynamo's recompile limit (graphs of every model "
                "compiled in this process count towards it), so the drafter runs eagerly for the rest of this call. "
                "Raise `torch._dynamo.config.recompile_limit`, or use a `compile_config` with `fullgraph=False`."
            )
            self.compiled = None
            return self.model(**inputs)

    def propose(
        self, input_ids: torch.LongTensor, num_tokens: int, attention_mask: torch.LongTensor | None = None
    ) -> DraftProposal:
        if attention_mask is not None:
            self.attention_mask = attention_mask  # [batch, seq_len]: a left-padded batch
        if num_tokens == 0:
            return DraftProposal.empty(input_ids.shape[0], input_ids.device)
        if self.tree_budget is not None and attention_mask is None and input_ids.shape[0] == 1:
            return self._propose_tree(input_ids, num_tokens)
        start = input_ids.shape[1]
        ids = input_ids  # [batch, seq_len + drafted so far], on the target's device
        probs = []
        for _ in range(num_tokens):
            scores = self.logits_processor(ids, self._next_logits(ids))  # [batch, vocab]: standardized q
            if self.do_sample:
                q = scores.softmax(dim=-1)
                token = sample_tokens(q)[:, None]  # [batch, 1]
                probs.append(q)
            else:
                token = scores.argmax(dim=-1, keepdim=True)  # [batch, 1]
            ids = torch.cat([ids, token], dim=-1)
        return DraftProposal(tokens=ids[:, start:], probs=torch.stack(probs, dim=1) if probs else None)

    def on_verified(
        self,
        input_ids: torch.LongTensor,
        num_accepted: torch.LongTensor,
        attention_mask: torch.LongTensor | None = None,
        accepted_nodes: torch.LongTensor | None = None,
        padding: list[int] | None = None,
    ) -> None:
        """See `Drafter.on_verified`. In a padded batch, `padding` (each row's left padding in `input_ids`, on the
        host) lets the cache be realigned without reading the device."""
        # (a round told before the drafter's first forward, e.g. a plain step, finds the cache still empty)
        if self.check_croppable and not no_state_yet(self.cache):
            if not self.cache.is_croppable:
                raise ValueError(
                    f"`assistant_model` ({type(self.model).__name__}) keeps recurrent state in its cache, which "
                    "cannot be rolled back, so rejected drafts could not be undone. Use a drafter with standard (full "
                    "or sliding-window) attention."
                )
            self.check_croppable = False
        if attention_mask is None:
            # everything but the newest token (the target's, never fed to the drafter) may stay in the cache; a
            # tree's nodes sit after the context in expansion order, not in sequence order, so they all go and the
            # accepted ones are fed again as the next round's uncached tail
            keep = input_ids.shape[1] - 1
            if self.tree_context_length is not None:
                keep, self.tree_context_length = min(keep, self.tree_context_length), None
            if self.recurrent is not None:  # back to the checkpoint at `keep`, or kept as it is
                self.recurrent.rewind(min(keep, self.recurrent.length))
            elif self._cached() > keep:  # after a fully accepted chain it holds one position less
                rewind_cache(self.cache, keep)  # a crop, or a static cache's write position moved back
                self.static_length = keep
            return
        if not self.fed_ids.shape[1]:  # a padded batch whose rounds have not drafted yet: nothing is cached
            self.host_padding = padding
            return
        # a padded batch, re-padded so that rows end together: keep, per row, the cached tokens that are still its
        # prefix, moved to the row's new columns (the same realignment as the target's cache)
        kept, shift, alike, columns = batch_realignment(
            self.fed_ids, self.fed_mask, input_ids, attention_mask, self.host_padding, padding
        )
        if alike and shift <= 0:  # every row moved alike (left, or not at all): a slice of the cache
            slice_cache(self.cache, -shift, kept)
        else:
            realign_cache(self.cache, columns[:, :kept])
        self.fed_ids, self.fed_mask = input_ids[:, :kept], attention_mask[:, :kept]
        self.host_padding = padding

    def select_rows(self, indices: torch.LongTensor, rows: list[int] | None = None) -> None:
        self.cache.batch_select_indices(indices.to(self.device))
        self.fed_ids, self.fed_mask = self.fed_ids[indices], self.fed_mask[indices]
        if self.host_padding is not None:  # the kept rows on the host, from the loop: no read of the device
            self.host_padding = [self.host_padding[i] for i in (indices.tolist() if rows is None else rows)]

    def _propose_tree(self, input_ids: torch.LongTensor, num_tokens: int) -> DraftProposal:
        """EAGLE-2's dynamic tree ([`DynamicTree`]) for one sequence (`input_ids`: `[1, seq_len]`), at most
        `num_tokens` deep. The expanded nodes are fed to the drafter's cache depth by depth, each seeing the context
        and its ancestors."""
        device = self.device
        # depth 1: the chain's own first step over the uncached tail
        logits = self._next_logits(input_ids)  # [1, vocab]
        context_length = input_ids.shape[1]  # every context token is cached now
        self.tree_context_length = context_length
        tree = DynamicTree(
            self.logits_processor(input_ids, logits).log_softmax(dim=-1), self.tree_budget, self.tree_top_k, device
        )
        root_position = context_length - 1 - self.tree_padding
        context_visible = torch.ones(context_length, dtype=torch.bool, device=device)  # [context_length]
        if self.tree_padding:
            context_visible[: self.attention_mask.shape[1]] = self.attention_mask[0].to(device) != 0
        for depth in range(1, num_tokens):  # expand the nodes at `depth`
            expansion = tree.expand()
            if expansion is None:
                break
            size = expansion.tokens.shape[0]
            tokens = expansion.tokens  # [f]
            allowed = torch.cat([context_visible.expand(size, -1), expansion.mask], dim=1)  # [f, keys]
            cached = allowed.shape[1] - size
            # a static cache's compiled forward: every depth padded to `tree_top_k` nodes, one graph
            filler = self.tree_top_k - size if self.compiled is not None else 0
            if filler:
                # filler nodes after the real ones, invisible to them; each sees the context and itself, so that the
                # keys it leaves in the cache's stale slots stay finite
                rows = torch.cat(
                    [
                        context_visible.expand(filler, -1),
                        allowed.new_zeros(filler, allowed.shape[1] - context_length),
                        torch.eye(filler, dtype=torch.bool, device=device),
                    ],
                    dim=1,
                )
                allowed = torch.cat([torch.cat([allowed, allowed.new_zeros(size, filler)], dim=1), rows])
                tokens = torch.cat([tokens, tokens[-1:].expand(filler)])
            if self.capacity is not None:  # a static cache attends over all its columns: those past the nodes hidden
                allowed = torch.nn.functional.pad(allowed, (0, self.capacity - allowed.shape[1]), value=False)
            inputs = {
                "input_ids": self.drafter_ids(tokens[None]).to(device),
                "attention_mask": additive_bias(allowed[None, None], self.model.dtype),  # [1, 1, f, keys]
                "position_ids": torch.full(
                    (1, size + filler), min(root_position + depth, self.max_position), dtype=torch.long, device=device
                ),
                self.cache_argument: self.cache,
                "use_cache": True,
            }
            outputs = self._compiled(inputs) if self.compiled is not None else self.model(**inputs)
            logits = outputs.logits[0, :size]  # [f, vocab]
            if filler:
                rewind_cache(self.cache, cached + size)
            self.static_length = cached + size
            logits = self.target_logits(logits)
            # each row standardized with its own prefix: the context and its path (all paths have length `depth`)
            prefixes = torch.cat([input_ids.expand(size, -1), expansion.paths], dim=-1)  # [f, seq_len + depth]
            tree.grow(self.logits_processor(prefixes, logits).log_softmax(dim=-1))
        return tree.proposal()

    def _cached(self) -> int:
        """The positions the draft cache holds. A static cache keeps its length in a tensor, whose read would wait for
        the device: its length is counted on the host instead (`static_length`, set after each write and rewind)."""
        if self.recurrent is not None:  # a pure state-space cache does not count its positions
            return self.recurrent.length
        return self.static_length if self.capacity is not None else cached_length(self.cache)

    def _next_logits(self, ids: torch.LongTensor) -> torch.FloatTensor:
        """Feeds the uncached tail of `ids` and returns the float32 logits of the last position, `[batch, vocab]`."""
        cached = self._cached()
        if self.compiled is not None and cached:
            return self._compiled_next_logits(ids, cached)
        batch, seq_len = ids.shape
        inputs = {
            "input_ids": self.drafter_ids(ids[:, cached:]).to(self.device),
            self.cache_argument: self.cache,
            "use_cache": True,
        }
        if self.encoder_inputs is not None:
            inputs.update(self.encoder_inputs)
            if self.model.config.is_encoder_decoder:
                inputs["decoder_input_ids"] = inputs.pop("input_ids")
        elif self.attention_mask is not None:
            mask = self.attention_mask
            mask = torch.cat([mask, mask.new_ones(batch, seq_len - mask.shape[1])], dim=-1)  # [batch, seq_len]
            inputs["attention_mask"] = mask.to(self.device)
            if self.accepts_position_ids:
                positions = (mask.long().cumsum(-1) - 1).clamp(min=0, max=self.max_position)[:, cached:]
                inputs["position_ids"] = positions.to(self.device)
            self.fed_ids, self.fed_mask = ids, mask
        elif self.accepts_position_ids:
            inputs["position_ids"] = torch.arange(cached, seq_len, device=self.device).expand(batch, -1)
        if self.accepts_logits_to_keep:
            inputs["logits_to_keep"] = 1
        if cached:
            inputs.update(chunk_kwargs(self.model, seq_len - cached))
        try:
            logits = self.model(**inputs).logits[:, -1]
            self.static_length = seq_len
            if self.recurrent is not None:
                self.recurrent.fed(seq_len - cached)
                self.recurrent.save()
        except (RuntimeError, TypeError, ValueError) as error:
            if cached:
                raise
            # the drafter's first forward: a model that cannot draft this way fails here
            raise ValueError(
                f"`assistant_model` ({type(self.model).__name__}) failed in its first forward as a drafter "
                f"({type(error).__name__}: {error}). hf_specdec runs a draft model's forward directly on the "
                "drafted tokens, with its cache (and, for an encoder-decoder drafter, its encoder outputs); a model "
                "whose own `generate` feeds it more per step (audio frames, ...) cannot draft that way. Use prompt "
                "lookup, an n-gram table, or another draft model."
            ) from error
        return self.target_logits(logits)

    def _compiled_next_logits(self, ids: torch.LongTensor, cached: int) -> torch.FloatTensor:
        """`_next_logits` through the compiled forward of a static draft cache, in one shape: the uncached tail in
        forwards of `_COMPILED_TOKENS` tokens, the last one padded with filler positions after the last token (the
        causal mask hides them from it; the cache is rewound past them). The positions' mask is the whole cache's,
        `[1, capacity]`, when the prompt is left-padded, and none otherwise (the causal mask over the cache)."""
        device, seq_len = self.device, ids.shape[1]
        mask = self.attention_mask
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(1, self.capacity - mask.shape[1])], dim=-1).to(device)
            all_positions = (mask.long().cumsum(-1) - 1).clamp(min=0, max=self.max_position)  # [1, capacity]
        start = cached
        while start < seq_len:
            count = min(_COMPILED_TOKENS, seq_len - start)
            chunk = ids[:, start : start + count]
            chunk = torch.cat([chunk, chunk[:, -1:].expand(-1, _COMPILED_TOKENS - count)], dim=-1)
            inputs = {
                "input_ids": self.drafter_ids(chunk).to(device),
                self.cache_argument: self.cache,
                "use_cache": True,
            }
            if self.accepts_position_ids:
                inputs["position_ids"] = (
                    torch.arange(start, start + _COMPILED_TOKENS, device=device).clamp(max=self.max_position)[None]
                    if mask is None
                    else all_positions[:, start : start + _COMPILED_TOKENS]
                )
            if mask is not None:
                inputs["attention_mask"] = mask
            if self.accepts_logits_to_keep:  # an index tensor, not an int: its value is no guard of the graph
                if count not in self.keep_index:  # made once per call: no copy to the device per step
                    self.keep_index[count] = to_device([count - 1], device)
                inputs["logits_to_keep"] = self.keep_index[count]
            logits = self._compiled(inputs).logits
            logits = logits[:, 0] if self.accepts_logits_to_keep else logits[:, count - 1]
            start += count
        if count < _COMPILED_TOKENS:
            rewind_cache(self.cache, seq_len)
        self.static_length = seq_len
        return self.target_logits(logits)

    def drafter_ids(self, target_ids: torch.LongTensor) -> torch.LongTensor:
        """Target token ids (`[batch, n]`) as the draft model can embed them. With a vocabulary padded to fewer
        logits than the target's (`same_tokenizer=True`), an id past the drafter's vocabulary (one of the target's
        padding ids) becomes the drafter's last id; otherwise the ids are returned as they are. Valid after `reset`.

        For code that runs the draft model itself (speculative beam search), with `target_logits` for its output.
        """
        return target_ids.clamp(max=self.width - 1) if self.width < self.target_width else target_ids

    def target_logits(self, drafter_logits: torch.Tensor) -> torch.FloatTensor:
        """The draft model's logits (`[..., drafter_width]`) as logits over the target's vocabulary (`[..., vocab]`):
        float32 on the target's device (a copy when the forward is compiled: it may reuse its buffer), cut to the
        target's width or filled up with `-inf` (the drafter never drafts a token it has no logit for). Valid after
        `reset`."""
        logits = drafter_logits.to(device=self.target_device, dtype=torch.float32, copy=self.compiled is not None)
        if self.width > self.target_width:
            return logits[..., : self.target_width]
        if self.width < self.target_width:
            return torch.nn.functional.pad(logits, (0, self.target_width - self.width), value=float("-inf"))
        return logits


register_drafter("model", ModelDrafter)
