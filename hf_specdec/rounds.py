"""One speculative round, shared by every layout (one sequence or a padded batch; a chain or a token tree).

A round is: the drafter proposes (`checked_proposal` validates it at the boundary) → the target runs one forward
over its uncached tail and the drafts (`target_logits`, with the layout's mask and positions) → the target's logits
processors standardize each position with its own prefix (`standardize`) → the layout's `verify` applies Algorithm 1
(a chain, `verify_round`) or multi-candidate rejection (a tree) from `hf_specdec.sampling` → the caller emits the
tokens through the stopping criteria and rolls the cache back.

What differs between layouts sits behind one small seam, `ChainLayout` / `TreeLayout`: the prefix each drafted
position is conditioned on, the extra forward inputs (a tree's 4D attention mask and depth-based positions), and
how the target's cache keeps the accepted drafts (a chain crops its tail; a tree compacts the accepted path's keys
and values into place; a static cache is rewound in place). `TargetForward` says how the forward is called: eagerly,
or compiled in a few padded shapes where plain `generate` compiles. The loops (`sequence.py` for one sequence,
`batching.py` for padded batches) only order these steps.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from .caches import CACHE_KWARG, cached_length, compact_cache, is_static, rewind_cache, static_capacity
from .configuration import SpeculativeOptions
from .devices import decode_step
from .drafters.base import DraftContext, Drafter, DraftProposal
from .modeling import logits_width
from .sampling import draft_target_overlap, verify_greedy, verify_sampling, verify_tree_greedy, verify_tree_sampling
from .trees import ancestor_mask, bounded_ancestor_mask, check_parents, tree_attention_bias

__all__ = [
    "ChainLayout",
    "HiddenStateCapture",
    "ProposalCheck",
    "TargetForward",
    "TreeLayout",
    "Verdict",
    "capture_for",
    "checked_proposal",
    "compiled_graphs",
    "draft_context",
    "first_stops",
    "layout_for",
    "per_token_prefix",
    "read_verdict",
    "standardize",
    "target_logits",
    "verify_round",
]


def draft_context(
    model, input_ids, logits_processor, generation_config, model_kwargs, inputs_tensor, tree_budget: int | None = None
) -> DraftContext:
    return DraftContext(
        target=model,
        input_ids=input_ids,
        logits_processor=logits_processor,
        generation_config=generation_config,
        vocab_size=logits_width(model),
        tree_budget=tree_budget,
        model_kwargs=model_kwargs,
        inputs_tensor=inputs_tensor,
    )


@dataclasses.dataclass
class ProposalCheck:
    """The check of a proposal's values (token ids in the vocabulary; q a distribution giving each drafted token
    q(x) > 0; a tree's parents valid and its depth within γ), still on the device: a round reads it in the same
    transfer as its verdict (`read_verdict`), so validation costs no host read of its own. Until then the proposal
    carries safe stand-ins (ids clamped into the vocabulary, a uniform q and root parents where the check failed),
    so nothing downstream fails inside torch or on the device."""

    failed: torch.Tensor | None  # a 0-dim bool tensor; None when there is nothing to check (no drafts)
    drafter_name: str
    tokens: torch.Tensor  # [batch, k]: the tokens as the drafter returned them
    probs: torch.Tensor | None  # [batch, k, vocab] as returned
    vocab_size: int
    parents: torch.Tensor | None = None  # [batch, k]: a tree's parents as returned
    max_depth: int | None = None  # the γ a tree's depth is bounded by

    def fail_if(self, flag: torch.Tensor) -> None:
        """Adds a condition (a 0-dim bool tensor) under which the proposal fails."""
        self.failed = flag if self.failed is None else self.failed | flag.to(self.failed.device)

    def raise_if(self, failed: bool) -> None:
        """Raises the error that says what is wrong, once the flag has been read as `failed`."""
        if failed:
            _reject_proposal(self)

    def read(self) -> None:
        """Reads the flag on its own (one host read) and raises if the proposal failed."""
        self.raise_if(self.failed is not None and bool(self.failed))


def checked_proposal(
    proposal: DraftProposal,
    drafter: Drafter,
    input_ids: torch.LongTensor,
    gamma: int,
    vocab_size: int,
    tree_budget: int | None = None,
) -> tuple[DraftProposal, ProposalCheck]:
    """Validates a proposal at the boundary, so a faulty drafter fails with a clear error rather than deep inside
    torch; returns it with its tokens (and parents) as long tensors on the target's device, and the check of its
    values (`ProposalCheck`), to be read with the round's verdict. Shapes and trees are checked here, on the host."""
    name = type(drafter).__name__
    if not isinstance(proposal, DraftProposal):
        raise TypeError(
            f"{name}.propose must return a `hf_specdec.DraftProposal`, got {type(proposal).__name__}. Return "
            "`DraftProposal(tokens=...)`, or `DraftProposal.empty(batch_size, device)` to propose nothing."
        )
    tokens = proposal.tokens
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[0] != input_ids.shape[0]:
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"{name}.propose must return tokens of shape [batch={input_ids.shape[0]}, k], got {shape}.")
    parents, probs = proposal.parents, proposal.probs
    if probs is not None and (not isinstance(probs, torch.Tensor) or tuple(probs.shape) != (*tokens.shape, vocab_size)):
        shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise ValueError(
            f"{name}.propose returned probs of shape {shape}, expected {(*tokens.shape, vocab_size)} "
            "([batch, k, vocab]) or None."
        )
    check = ProposalCheck(None, name, tokens, probs, vocab_size)
    if tokens.shape[1]:
        # one fused check, read later with the verdict: q that is not a distribution, or gives a drafted token
        # q(x) = 0, would make rejection sampling accept what the target never samples
        bad = ((tokens < 0) | (tokens >= vocab_size)).any()
        if probs is not None:
            drafted = tokens.to(device=probs.device, dtype=torch.long).clamp(0, vocab_size - 1)
            q_x = probs.gather(-1, drafted[..., None])  # [batch, k, 1]
            total = probs.sum(dim=-1, dtype=torch.float64)  # [batch, k]: NaN or inf if any entry is
            tolerance = 1e-3 if probs.element_size() >= 4 else 2e-2
            bad = bad | (probs.amin(dim=-1) < 0).any() | ~((total - 1).abs() <= tolerance).all() | ~(q_x > 0).all()
            probs = torch.where(bad.to(probs.device), 1.0 / vocab_size, probs)  # a stand-in until the read raises
        check.failed = bad
        tokens = tokens.clamp(0, vocab_size - 1)  # ids stay valid for the embedding until the read raises
    tokens = tokens.to(device=input_ids.device, dtype=torch.long)
    if parents is not None:
        if not isinstance(parents, torch.Tensor) or tuple(parents.shape) != tuple(tokens.shape):
            shape = tuple(parents.shape) if isinstance(parents, torch.Tensor) else type(parents).__name__
            raise ValueError(f"{name}.propose returned parents of shape {shape}, expected {tuple(tokens.shape)}.")
        parents = parents.to(device=input_ids.device, dtype=torch.long)
        index = torch.arange(tokens.shape[1], device=parents.device)
        if tree_budget is None:
            # a call that verifies chains only takes chain-shaped parents as a chain (one read, on this path only)
            if not bool((parents == index - 1).all()):
                raise ValueError(
                    f"{name}.propose returned a token tree (`parents`), but this call verifies chains only. Pass "
                    "`speculative_tree_budget=N` to verify trees of up to N nodes."
                )
            parents = None
    if parents is not None:
        if tokens.shape[1] > tree_budget:
            raise ValueError(
                f"{name}.propose returned a tree of {tokens.shape[1]} nodes, more than speculative_tree_budget="
                f"{tree_budget}."
            )
        invalid = (parents < -1) | (parents >= index)  # [batch, k]: each parent must be -1 or an earlier node
        check.parents = parents
        check.fail_if(invalid.any())
        parents = torch.where(invalid, -1, parents)  # a stand-in until the read raises
    elif tokens.shape[1] > gamma:
        raise ValueError(f"{name}.propose returned {tokens.shape[1]} tokens, more than the {gamma} asked for.")
    return DraftProposal(tokens=tokens, probs=probs, parents=parents), check


def _reject_proposal(check: ProposalCheck):
    """Says what is wrong with a proposal that failed its `ProposalCheck` (the slow path: it reads what it needs)."""
    name, tokens, probs, vocab_size = check.drafter_name, check.tokens, check.probs, check.vocab_size
    if bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        raise ValueError(
            f"{name}.propose returned token ids outside the target's vocabulary [0, {vocab_size}): "
            f"{tokens.tolist()}. Build the drafter for the target's tokenizer."
        )
    promise = (
        "`probs[b, i]` must be the standardized distribution q that token i was sampled from (see "
        "`hf_specdec.Drafter`); return `probs=None` for tokens chosen deterministically"
    )
    if probs is not None:
        total = probs.sum(dim=-1, dtype=torch.float64)
        tolerance = 1e-3 if probs.element_size() >= 4 else 2e-2
        if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
            raise ValueError(f"{name}.propose returned probs with negative, NaN or infinite entries: {promise}.")
        q_x = probs.gather(-1, tokens.to(device=probs.device, dtype=torch.long)[..., None])[..., 0]
        if not bool((q_x > 0).all()):
            raise ValueError(
                f"{name}.propose returned probs with q(x) = 0 for drafted tokens (q(x) per position: "
                f"{q_x.tolist()}, tokens {tokens.tolist()}): a token sampled from q has q(x) > 0; {promise}."
            )
        if not bool(((total - 1).abs() <= tolerance).all()):
            raise ValueError(
                f"{name}.propose returned probs that do not sum to 1 over the vocabulary (sums: {total.tolist()}): "
                f"{promise}, e.g. `scores.softmax(dim=-1)` after the target's logits processors."
            )
    if check.parents is not None:
        problem = check_parents(check.parents)
        if problem is not None:
            raise ValueError(f"{name}.propose returned invalid parents {check.parents.tolist()}: {problem}.")
        depth = int(ancestor_mask(check.parents).sum(dim=-1).max())
        if check.max_depth is not None and depth > check.max_depth:
            raise ValueError(
                f"{name}.propose returned a tree {depth} nodes deep, deeper than the {check.max_depth} tokens asked "
                "for: `num_tokens` bounds a tree's depth."
            )
    raise AssertionError(f"a proposal of {name} failed its check, but no condition explains it")


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
) -> torch.FloatTensor:
    """One target forward over the uncached tail of `candidate_ids`; float32 logits of the last k + 1 positions.
    `overrides` replaces prepared inputs (a tree's attention mask and position ids); `forward` says how to call the
    target (eagerly when None). Every forward but the first round's runs in plain decoding's context (`decode_step`)
    unless `decode_kernels` is False (beam search, as transformers' own)."""
    cache = model_kwargs[CACHE_KWARG]
    cached = cached_length(cache)  # read once: a device sync for a static cache on an accelerator
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
    with decode_step(model) if decode_kernels and not first_round else contextlib.nullcontext():
        outputs = (call or model)(**model_inputs, return_dict=True)
    end = outputs.logits.shape[1] - padding
    return outputs.logits[:, end - num_drafted - 1 : end].to(  # [batch, k + 1, vocab]
        dtype=torch.float32, device=candidate_ids.device, copy=True
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
    the cache's remaining room (the last rounds) runs eagerly. `compilations` counts the graphs compiled during the
    call (new shapes and recompiles alike), from torch's dynamo counters."""

    def __init__(self, compiled=None, sizes: tuple[int, ...] = (), max_cache_len: int = 0):
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
        sizes = sorted({2**i for i in range(max_new_tokens.bit_length()) if 2**i < max_new_tokens} | {max_new_tokens})
        return cls(model.get_compiled_call(generation_config.compile_config), tuple(sizes), static_capacity(cache))

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


def decoder_layers(model) -> torch.nn.ModuleList | None:
    """The target's decoder layers, in order, where the model keeps them in the usual place (`model.layers` of its
    decoder); `None` otherwise."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None) if decoder is not None else None
    return layers if isinstance(layers, torch.nn.ModuleList) and len(layers) else None


class HiddenStateCapture:
    """Records the target's hidden states at the few layers a drafter reads (`Drafter.target_hidden_layers`) during
    the target forwards a round already runs: one forward hook per layer read, removed by `close`. Nothing else is
    computed or kept (no `output_hidden_states` of every layer, no second forward).

    Layer `i` is entry `i` of transformers' `output_hidden_states`: 0 the embeddings' output, `i >= 1` the output
    of decoder layer `i - 1`."""

    def __init__(self, model, layers, owner: str = "the drafter"):
        blocks = decoder_layers(model)
        if blocks is None:
            raise ValueError(
                f"{owner} reads the target's hidden states, but {type(model).__name__} keeps no list of decoder "
                "layers where hf_specdec looks (`model.get_decoder().layers`). Use a drafter that does not read "
                "hidden states (an assistant model, prompt lookup) with this model."
            )
        layers = list(layers)
        if not layers or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= len(blocks) for i in layers
        ):
            raise ValueError(
                f"{owner} asked for the target's hidden states at layers {layers}, but {type(model).__name__} has "
                f"{len(blocks)} decoder layers: use indices in [0, {len(blocks)}] (0: the embeddings' output, i: "
                "the output of decoder layer i - 1)."
            )
        self.layers = layers
        self.records: list[list[torch.Tensor]] = [[] for _ in layers]
        self.handles = []
        for slot, index in enumerate(layers):
            module = model.get_input_embeddings() if index == 0 else blocks[index - 1]
            self.handles.append(module.register_forward_hook(self._recorder(slot)))

    def _recorder(self, slot: int):
        def record(module, args, output):
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            self.records[slot].append(hidden.detach())

        return record

    def take(self) -> torch.Tensor | None:
        """Everything recorded since the last call, `[batch, positions, sum of hidden sizes]`, layers side by side
        in the order asked for; `None` when no forward ran."""
        if not self.records[0]:
            return None
        states = torch.cat([torch.cat(records, dim=1) for records in self.records], dim=-1)
        self.records = [[] for _ in self.layers]
        return states

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __enter__(self) -> HiddenStateCapture:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def capture_for(model, drafter: Drafter) -> HiddenStateCapture | None:
    """The capture a reset drafter asks for, or `None` when it reads no hidden states."""
    layers = getattr(drafter, "target_hidden_layers", None)
    return None if layers is None else HiddenStateCapture(model, layers, owner=type(drafter).__name__)


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


@dataclasses.dataclass
class Verdict:
    """What verification decided for each row."""

    accepted: torch.LongTensor  # [batch]: drafts kept (the accepted path's length, for a tree)
    next_tokens: torch.LongTensor  # [batch]: the recovered or bonus token
    accepted_nodes: torch.LongTensor | None  # [batch, k]: a tree's accepted path (node ids, -1 padded); chains: None
    betas: torch.FloatTensor  # [batch, depth]: β per drafted position (a tree: 1 per accepted depth, else 0)
    tree_depth: torch.LongTensor | None = None  # a tree's depth (0-dim), read with the verdict; chains: None
    tree_path_in_place: torch.BoolTensor | None = None  # [batch]: a tree's accepted path is nodes 0, 1, ... in order
    accepted_counts: list[int] | None = None  # `accepted` on the host, once `read_verdict` has read the round
    beta_values: list[list[float]] | None = None  # `betas` on the host, likewise, cut to the drafted depth
    depth: int | None = None  # the drafted depth on the host (a chain's drafts; a tree's deepest node), likewise
    path_in_place: list[bool] | None = None  # `tree_path_in_place` on the host, likewise; chains: None


def read_verdict(verdict: Verdict, check: ProposalCheck) -> Verdict:
    """The round's one host read of its verdict: every row's accepted count and β per drafted position, with the
    proposal's check and a tree's depth and path in the same transfer (a failed check raises here, before anything is
    emitted). Fills the verdict's host fields (`accepted_counts`, `beta_values`, `depth`, `path_in_place`) and
    returns it."""
    rows, device = verdict.accepted.shape[0], verdict.accepted.device
    tree = verdict.tree_depth is not None
    failed = check.failed if check.failed is not None else verdict.accepted.new_zeros((), dtype=torch.bool)
    depth = verdict.tree_depth if tree else verdict.accepted.new_tensor(verdict.betas.shape[1])
    # one column each, all as float32 (small counts and flags are exact): accepted, failed, depth[, in place], betas
    columns = [verdict.accepted[:, None], failed.to(device).expand(rows, 1), depth.to(device).expand(rows, 1)]
    if tree:
        columns.append(verdict.tree_path_in_place[:, None])
    values = torch.cat([*(column.to(torch.float32) for column in columns), verdict.betas.float()], dim=1).tolist()
    check.raise_if(bool(values[0][1]))
    verdict.depth = int(values[0][2])
    if tree:
        verdict.path_in_place = [bool(row[3]) for row in values]
    verdict.accepted_counts = [int(row[0]) for row in values]
    verdict.beta_values = [row[len(columns) : len(columns) + verdict.depth] for row in values]
    return verdict


def first_stops(stopping_criteria, rows: list[tuple[torch.LongTensor, int, int]], scores_at=None) -> list[int | None]:
    """Where the stopping criteria stop each row's new tokens: for each `(sequences, start, count)` (`sequences`:
    `[1, start + count]`, its last `count` tokens new), the 1-based index of the first new token after which a
    criterion fires, or None. Every prefix is checked as plain `generate` checks after each token (EOS, stop strings,
    custom criteria may fire inside an accepted block), with one host read for all rows. `scores_at(e)`: the scores
    tuple plain `generate` would pass after a row's e-th new token (None: no scores)."""
    checks = [
        stopping_criteria(sequences[:, : start + e], scores_at(e) if scores_at is not None else None).any()
        for sequences, start, count in rows
        for e in range(1, count + 1)
    ]
    fired = iter(torch.stack(checks).tolist() if checks else [])  # [sum of counts]
    stops = []
    for _, _, count in rows:
        row_fired = [next(fired) for _ in range(count)]
        stops.append(row_fired.index(True) + 1 if any(row_fired) else None)
    return stops


def verify_round(
    do_sample: bool, proposal: DraftProposal, target_scores: torch.FloatTensor, options: SpeculativeOptions
) -> Verdict:
    """Algorithm 1 on a chain of drafts, on standardized scores `[batch, k + 1, vocab]` (trees: `TreeLayout.verify`)."""
    tokens, probs = proposal.tokens, proposal.probs
    num_drafted = tokens.shape[1]
    if do_sample:
        target_probs = target_scores.softmax(dim=-1)  # [batch, k + 1, vocab]
        accepted, next_tokens = verify_sampling(tokens, probs, target_probs, lenience=options.speculative_lenience)
        betas = draft_target_overlap(tokens, probs, target_probs)  # [batch, k]
    else:
        accepted, next_tokens = verify_greedy(tokens, target_scores, lenience=options.speculative_lenience)
        betas = (tokens == target_scores[:, :num_drafted].argmax(dim=-1)).float()  # [batch, k]
    return Verdict(accepted, next_tokens, None, betas)


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
        betas = (depths < accepted[:, None]).float()  # [batch, depth bound]: 1 for each accepted depth
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


def first_draft_acceptance(
    guess: DraftProposal, target_scores: torch.FloatTensor, token: int, do_sample: bool, lenience: float = 1.0
) -> float | None:
    """How likely verification would have accepted the first drafted token of `guess` (one sequence) at a position
    where the target's standardized scores are `target_scores` (`[vocab]`) and it emitted `token`; None when the
    guess drafted nothing. Greedy: 1.0 when a first-level draft is `token` (or, with `lenience` < 1, has
    p(x) >= lenience * max(p)), else 0.0. Sampling: min(1, p(x) / (lenience * q(x))) for a sampled draft (Algorithm 1's
    acceptance probability, Appendix A.5's with lenience), p's mass on the distinct first-level drafts for
    deterministic ones. Used by the `auto` policy's shadow drafts, which verify nothing."""
    if not guess.tokens.shape[1]:
        return None
    first = guess.tokens[0] if guess.parents is None else guess.tokens[0][guess.parents[0] < 0]  # [n]
    if guess.parents is None:
        first = first[:1]
    if not do_sample and lenience >= 1.0:
        return float(bool((first == token).any()))
    p = target_scores.float().softmax(dim=-1)  # [vocab]
    if not do_sample:
        return float(bool((first == token).any() | (p[first] >= lenience * p.max()).any()))
    if guess.probs is not None and guess.parents is None:
        q = guess.probs[0, 0].float()
        return float(torch.clamp(p[first[0]] / (lenience * q[first[0]]), max=1.0))
    return float(p[first.unique()].sum().clamp(max=1.0))
