"""The target's one forward of a round: over its uncached tail and the drafts (`target_logits`), eagerly or compiled
in a few padded shapes where plain `generate` compiles (`TargetForward`), and the logits processors applied to
each position with its own prefix (`standardize`).
"""

from __future__ import annotations

import contextlib
import math

import torch

from .caches import CACHE_KWARG, cached_length, is_static, static_capacity
from .devices import decode_step
from .recurrent import chunk_kwargs, rolls_back_from_checkpoints

__all__ = ["TargetForward", "compiled_graphs", "per_token_prefix", "standardize", "target_logits"]


def per_token_prefix(model_kwargs: dict, length: int, keep: int) -> dict:
    """`model_kwargs` for the first `keep` of `length` tokens: per-token inputs (the attention mask, position ids:
    tensors whose last dimension is `length`) cut to their first `keep` columns, everything else as is."""
    return {
        key: value[..., :keep]
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[-1] == length
        else value
        for key, value in model_kwargs.items()
    }


def target_logits(
    model,
    candidate_ids,
    num_drafted: int,
    model_kwargs,
    first_round: bool,
    overrides: dict | None = None,
    forward: TargetForward | None = None,
    decode_kernels: bool = True,
    cached: int | None = None,
) -> torch.FloatTensor:
    """One target forward over the uncached tail of `candidate_ids`; float32 logits of the last k + 1 positions.
    `overrides` replaces prepared inputs (a tree's attention mask and position ids); `forward` says how to call the
    target (eagerly when None). Every forward but the first round's runs in plain decoding's context (`decode_step`)
    unless `decode_kernels` is False (beam search, as transformers' own). `cached`, the positions the cache holds,
    where the caller knows it: otherwise it is read (a device sync for a static cache on an accelerator)."""
    cache = model_kwargs[CACHE_KWARG]
    if cached is None:
        cached = cached_length(cache)
    new_tokens = candidate_ids.shape[1] - cached
    call, padding = None, 0
    if forward is not None and not first_round:
        # a tree's mask and positions are built for its exact size: compiled only when that is one of the sizes
        call, padding = forward.call_for(new_tokens, cached, pad=not overrides)
    if padding:
        # filler positions after the drafts: causally invisible to them, their logits dropped and their keys rewound
        candidate_ids = torch.cat([candidate_ids, candidate_ids[:, -1:].expand(-1, padding)], dim=-1)
        model_kwargs = model._update_model_kwargs_for_generation(
            {}, dict(model_kwargs), is_encoder_decoder=model.config.is_encoder_decoder, num_new_tokens=padding
        )
    model_inputs = model.prepare_inputs_for_generation(
        candidate_ids,
        next_sequence_length=new_tokens + padding,
        is_first_iteration=first_round,
        **model_kwargs,
    )
    if "logits_to_keep" in model_inputs:
        model_inputs["logits_to_keep"] = num_drafted + 1 + padding
    if overrides:
        model_inputs.update(overrides)
    if not first_round:  # a recurrent model's chunked kernel over these tokens in one chunk, where it takes that
        model_inputs.update(chunk_kwargs(model, new_tokens + padding))
    with decode_step(model) if decode_kernels and not first_round else contextlib.nullcontext():
        outputs = (call or model)(**model_inputs, return_dict=True)
    end = outputs.logits.shape[1] - padding
    # a compiled forward's outputs may be buffers the next call overwrites (CUDA graphs): copied; an eager forward's
    # are its own (a float32 model's logits are returned as they are: one kernel less per round)
    return outputs.logits[:, end - num_drafted - 1 : end].to(  # [batch, k + 1, vocab]
        dtype=torch.float32, device=candidate_ids.device, copy=call is not None
    )


class TargetForward:
    """How the rounds of one call run the target's forward: eagerly, or compiled where plain `generate` compiles.

    Plain `generate` compiles the target's decoding forward when the cache is static and the hardware is one it
    compiles for (or `compile_config` asks for every device): `model._valid_auto_compile_criteria`. The rounds then
    call transformers' own compiled forward (`model.get_compiled_call(compile_config)`, cached on the model by
    transformers as for plain decoding). The first round, which carries the prompt, runs eagerly, as plain
    `generate`'s prefill does. A round's forward covers 1 + k new tokens, and k varies (the policy's γ, a drafter
    that proposes fewer, the end of the sequence); each new length would compile a new graph, so the tokens are
    padded up to one of a few sizes (1, 2, 4, ..., and 1 + γ_max), with filler positions after the drafts that the
    causal mask keeps out of their logits and the rewind removes from the cache. A forward that no size fits into
    the cache's remaining room (the last rounds) runs eagerly. A hybrid model's recurrent layers would carry filler
    positions into their state, so its forwards are compiled at their exact sizes (1 to 1 + γ_max, at most dynamo's
    recompile limit; a longer one, such as one that carries kept tokens again after a rollback, runs eagerly).
    `compilations` counts the graphs compiled during the call (new shapes and recompiles alike), from torch's dynamo
    counters."""

    def __init__(self, compiled=None, sizes: tuple[int, ...] = (), max_cache_len: float = 0):
        self.compiled = compiled
        self.sizes = sizes
        self.max_cache_len = max_cache_len
        self.compiled_rounds = 0
        self.compilations = 0

    @classmethod
    def for_call(
        cls, model, generation_config, model_kwargs, max_new_tokens: int, reads_hidden_states: bool = False
    ) -> TargetForward:
        """`max_new_tokens`: the most tokens one round's forward carries after the first (1 + γ_max, or a tree's
        1 + budget)."""
        cache = model_kwargs.get(CACHE_KWARG)
        # hooks reading hidden states (`HiddenStateCapture`) would record the filler positions and break graphs
        if (
            reads_hidden_states
            or not is_static(cache)
            or not model._valid_auto_compile_criteria(model_kwargs, generation_config)
        ):
            return cls()
        if rolls_back_from_checkpoints(model, cache):
            # a filler position would run through the recurrence and change its state: every size is its own graph,
            # as many as dynamo compiles before it gives up (a longer forward runs eagerly)
            sizes = list(range(1, min(max_new_tokens, torch._dynamo.config.recompile_limit) + 1))
        else:
            sizes = sorted(
                {2**i for i in range(max_new_tokens.bit_length()) if 2**i < max_new_tokens} | {max_new_tokens}
            )
        capacity = static_capacity(cache)  # None: a static cache of recurrent layers only, which any length fits
        return cls(
            model.get_compiled_call(generation_config.compile_config),
            tuple(sizes),
            capacity if capacity is not None else math.inf,
        )

    def call_for(self, new_tokens: int, cached: int, pad: bool = True):
        """The compiled callable and the padding for a forward over `new_tokens` after `cached` positions, or
        `(None, 0)`: run it eagerly."""
        if self.compiled is None:
            return None, 0
        for size in self.sizes:
            if size >= new_tokens and cached + size <= self.max_cache_len and (pad or size == new_tokens):
                return self._counted, size - new_tokens
        return None, 0

    def _counted(self, **inputs):
        graphs = compiled_graphs()
        outputs = self.compiled(**inputs)
        self.compilations += compiled_graphs() - graphs
        self.compiled_rounds += 1
        return outputs


def compiled_graphs() -> int:
    """Graphs `torch.compile` has built in this process so far (torch's dynamo counters): the difference around a
    call counts the graphs that call built."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def standardize(logits: torch.FloatTensor, processors, prefix, check_stateless: bool = False) -> torch.FloatTensor:
    """Applies the target's logits processors to `logits` (`[rows, k + 1, vocab]`), each position with its own
    prefix: `processors(row)` gives a row's processors, `prefix(row, j)` the `[1, len]` ids position j follows.

    Processors are called for drafted positions that may be rejected, and more than once per position, so they must
    be functions of the prefix. `check_stateless` (the first round) catches what can be caught cheaply: the first
    position is processed a second time, and a different result is an error."""
    scores = logits.clone()
    for row in range(logits.shape[0]):
        row_processors = processors(row)
        for j in range(logits.shape[1]):
            scores[row : row + 1, j] = row_processors(prefix(row, j), scores[row : row + 1, j])
    if check_stateless:
        again = processors(0)(prefix(0, 0), logits[0:1, 0].clone())
        # NaN where the processors leave every token at -inf and renormalize: equal when both calls give it
        if not bool(torch.isclose(again, scores[0:1, 0], rtol=0, atol=0, equal_nan=True).all()):
            names = [type(p).__name__ for p in processors(0)]
            raise ValueError(
                f"A logits processor among {names} returned different scores for the same prefix and logits when "
                "called twice: it keeps state between calls. Speculative decoding calls processors for drafted "
                "positions that may be rejected, and more than once per position, so a stateful processor would "
                "change the output. Make it a function of the `input_ids` it is given (or drop the drafter)."
            )
    return scores
