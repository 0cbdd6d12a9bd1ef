"""What `ModelDrafter` (in `model.py`) sets up once per call besides its own bookkeeping: the source that the draft
model of an encoder-decoder target reads, and a static draft cache (kept from call to call) with transformers' compiled
forward over it."""

from __future__ import annotations

import inspect
import threading
import weakref

from transformers import PreTrainedModel, StaticCache
from transformers.modeling_outputs import BaseModelOutput
from transformers.utils import logging

from ..caches import CACHE_KWARG, is_static, static_rewind_problem
from .base import DraftContext

__all__ = ["StaticCachePool", "compiled_forward", "encoder_inputs", "static_draft_capacity", "static_draft_cache"]

logger = logging.get_logger(__name__)

_COMPILED_TOKENS = 2  # a static draft cache's compiled forwards over the context: this many tokens each, one graph


def encoder_inputs(model: PreTrainedModel, context: DraftContext, device, forward_params) -> dict:
    """The forward kwargs that carry the source to `model` (on `device`, taking `forward_params`), the drafter of an
    encoder-decoder target: its own encoding of the source, or the target's encoder outputs for a decoder with
    cross-attention. Computed once per call."""
    target = context.target
    encoder_mask = context.model_kwargs.get("attention_mask")  # [batch, src_len] or None
    if encoder_mask is not None:
        encoder_mask = encoder_mask.to(device)
    if model.config.is_encoder_decoder:
        # its own encoder, once, on the same source the target encoded, under the encoder's own input name
        # (a composite model's is not the encoder's: SpeechEncoderDecoderModel takes `inputs`, Wav2Vec2
        # `input_values`)
        encoder = model.get_encoder()
        input_name = getattr(encoder, "main_input_name", None) or model.main_input_name
        source = context.inputs_tensor
        # without a source, generate passes a placeholder of -100s
        token_ids = source is not None and not source.is_floating_point()
        if (
            input_name == "input_ids"
            and source is not None
            and not token_ids
            and source.shape[-1] == model.config.get_text_config(decoder=False).hidden_size
            and "inputs_embeds" in inspect.signature(encoder.forward).parameters
        ):
            # a source given as embeddings (Pop2Piano's `generate` always passes `inputs_embeds`), of the
            # width the drafter's encoder takes: encoded as embeddings
            input_name = "inputs_embeds"
        if source is None or (token_ids and bool((source < 0).any())) or (input_name == "input_ids" and not token_ids):
            raise ValueError(
                f"The encoder-decoder `assistant_model` ({type(model).__name__}) needs the source as "
                f"`{input_name}`, but the target was called with "
                f"{'no input tensor' if source is None else 'a different kind of input'}. Call `generate` with "
                "the tokenized source (e.g. `input_ids=...`, not `encoder_outputs=` or `inputs_embeds=`)."
            )
        source = source.to(device=device, dtype=model.dtype if input_name == "inputs_embeds" else None)
        encoder_outputs = encoder(**{input_name: source}, attention_mask=encoder_mask, return_dict=True)
        return {"encoder_outputs": encoder_outputs, "attention_mask": encoder_mask}
    # a decoder-only drafter reads the target's encoder outputs through its cross-attention (distil-whisper)
    hidden_size = model.config.get_text_config(decoder=True).hidden_size
    target_states = context.model_kwargs["encoder_outputs"].last_hidden_state  # [batch, src_len, hidden]
    takes_states = "encoder_hidden_states" in forward_params
    if not takes_states and "encoder_outputs" in forward_params and target_states.shape[-1] == hidden_size:
        # WhisperForCausalLM takes the encoder's output object itself
        return {
            "encoder_outputs": BaseModelOutput(last_hidden_state=target_states.to(device=device, dtype=model.dtype))
        }
    if not takes_states or getattr(model.config, "add_cross_attention", True) is False:
        raise ValueError(
            f"`assistant_model` ({type(model).__name__}) is decoder-only without cross-attention, so it cannot "
            f"read the source of the encoder-decoder target ({type(context.target).__name__}). Use an "
            "encoder-decoder drafter, or a decoder with cross-attention (e.g. `BartForCausalLM`, or a config "
            "with `add_cross_attention=True`)."
        )
    if target_states.shape[-1] != hidden_size:
        raise ValueError(
            f"`assistant_model` ({type(model).__name__}) has cross-attention for encoder states of size "
            f"{hidden_size}, but the target's encoder ({type(target).__name__}) outputs size "
            f"{target_states.shape[-1]}. A decoder-only drafter shares the target's encoder outputs only when "
            "its hidden size matches; use an encoder-decoder drafter instead."
        )
    return {
        "encoder_hidden_states": target_states.to(device=device, dtype=model.dtype),
        "encoder_attention_mask": encoder_mask,
    }


def static_draft_cache(model: PreTrainedModel, capacity: int) -> StaticCache:
    """A `StaticCache` of `capacity` positions for one sequence of `model`, checked to roll back by moving its write
    position."""
    cache = StaticCache(config=model.config, max_cache_len=capacity)
    if not is_static(cache):
        layers = sorted({type(layer).__name__ for layer in cache.layers})
        raise ValueError(
            f"`ModelDrafter(cache_implementation='static')`: the drafter model ({type(model).__name__}) gets "
            f"cache layers {layers} from `StaticCache`, not preallocated attention layers that can be rolled back "
            "by moving their write position. Leave the drafter's cache dynamic (`cache_implementation=None`)."
        )
    problem = static_rewind_problem(cache, capacity + 1)
    if problem is not None:
        raise ValueError(
            f"`ModelDrafter(cache_implementation='static')` cannot roll the drafter's static cache of "
            f"{capacity} positions back: {problem}. Leave the drafter's cache dynamic "
            "(`cache_implementation=None`), which keeps what a sliding window needs."
        )
    return cache


def static_draft_capacity(context: DraftContext, tree_top_k: int, tree_budget: int | None) -> int:
    """The positions a static draft cache needs for one sequence of this call. A round feeds at most
    `max_length - 1` positions of context and drafts; a tree's expanded nodes (at most `tree_top_k` per depth, each
    among the best `tree_budget`, so at most `tree_top_k * tree_budget`) sit after the context until `on_verified`;
    and a padded compiled forward's filler positions sit after its last token until it returns."""
    nodes = tree_top_k * tree_budget if tree_budget is not None else 0
    return context.generation_config.max_length + nodes + max(_COMPILED_TOKENS, tree_top_k)


class StaticCachePool:
    """The static draft caches of one `ModelDrafter`, shared by its per-call copies. A call takes an idle cache that
    is large enough (emptied in place) or builds one, and holds it alone: concurrent calls never share one. The cache
    is idle again once that call's copy is gone. Reuse keeps the tensors' addresses, so a compiled step captured as a
    CUDA graph (`mode="reduce-overhead"`) replays instead of recording again. One idle cache is kept, the larger, as
    transformers keeps one static cache per model."""

    def __init__(self):
        self.lock = threading.Lock()
        self.idle: list[tuple[tuple, int, StaticCache]] = []  # ((device, dtype), capacity, cache)

    def take(self, owner, model: PreTrainedModel, device, capacity: int) -> tuple[StaticCache, int]:
        """A cache of at least `capacity` positions for `owner` (the call's drafter) alone, and its capacity."""
        key = (str(device), model.dtype)
        with self.lock:
            found = next((i for i, (k, size, _) in enumerate(self.idle) if k == key and size >= capacity), None)
            entry = self.idle.pop(found) if found is not None else None
        if entry is None:
            cache = static_draft_cache(model, capacity)
        else:
            _, capacity, cache = entry
            cache.reset()
        weakref.finalize(owner, self._give_back, key, capacity, cache)
        return cache, capacity

    def _give_back(self, key: tuple, capacity: int, cache: StaticCache) -> None:
        with self.lock:  # the larger of the idle cache and this one stays idle
            if not self.idle or self.idle[0][1] < capacity:
                self.idle[:] = [(key, capacity, cache)]


def compiled_forward(model: PreTrainedModel, cache: StaticCache, generation_config):
    """transformers' own compiled forward of `model` over the static `cache`, where transformers would compile one
    (`model._valid_auto_compile_criteria` with the call's `compile_config` and `disable_compile`), else None."""
    if not (
        hasattr(model, "_valid_auto_compile_criteria")
        and model._valid_auto_compile_criteria({CACHE_KWARG: cache}, generation_config)
    ):
        return None
    # transformers' own compiled call, cached on the model by transformers as for plain decoding
    compiled = model.get_compiled_call(generation_config.compile_config)
    if getattr(getattr(compiled, "__wrapped__", None), "__self__", model) is model:
        return compiled
    logger.warning_once(
        f"The draft model ({type(model).__name__}) holds a compiled forward that transformers made for "
        "another model (`copy.deepcopy` of a model that has generated with a static cache copies its "
        "`_compiled_call`, which runs the original's weights), so the drafter drafts eagerly. Delete it "
        "(`del draft._compiled_call`) to compile the draft model's own forward."
    )
    return None
