"""Speculative beam search (the paper's Appendix A.4): the same output as plain beam search with the target alone.

With beam width w (`num_beams`), each **round**:

1. the drafter model M_q runs its own beam search of width u ≥ w (`speculative_draft_beams`, default 2w) for γ
   steps (`speculative_gamma`; left unset, `DEFAULT_BEAM_GAMMA` = 2), starting from the target's w running beams
   with their scores. Every beam it keeps at every depth is a **node** of the **draft tree** (roots: the target's
   running beams). Continuations with EOS are not kept, as the target never keeps a finished beam running;
2. the target M_p scores every node in one forward: the tree is laid out as a batch of its root-to-leaf **paths**
   (right-padded to γ tokens; causal attention keeps the padding out of the real positions), each row reading its
   root's cache. A node's logits are those of any path through it;
3. the target's own beam search is **replayed** step by step on those logits, with transformers' own per-step
   helpers (`_get_top_k_continuations`, `_get_running_beams_for_next_iteration`, `_update_finished_beams`,
   `_check_early_stop_heuristic`), the logits processors and the stopping criteria, exactly as `_beam_search`
   calls them. A step needs the target's logits after each running beam; it is **accepted** while every running
   beam the previous step kept is a node of the tree (top_w(M_p) ⊆ top_u(M_q) in the paper's words). The first
   step whose running beams are not all nodes cannot be taken from this forward: the round ends there, and the
   target's cache keeps each running beam's prefix (rows of the paths, cropped).

Every step is computed from the target's own logits for the target's own running beams, so `sequences`,
`sequences_scores`, `beam_indices`, `scores` and `logits` are those of plain beam search, up to the float rounding
of a forward over several tokens at once. Every round takes at least one beam step (its first step reads the
roots' logits); a round accepts up to γ more. Beam sampling (`do_sample=True`) replays transformers' own
multinomial draw per step on the target's logits, so it samples exactly what plain beam sampling samples (the
drafter draws nothing, so with the same seed the draws are the same).

Costs: a forward over rows x (γ + 1) positions per round (rows: the tree's leaves, about u plus the branches that
died), against w positions per plain step, plus the drafter's γ steps over u beams. It pays where a target forward
over that many positions costs about one forward over w (memory-bound decoding) and the drafter's beams keep the
target's; the paper calls it "a performance penalty". `output.speculative_stats` books, per round, the beam steps
taken and the forward's size.
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, EncoderDecoderCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.utils import ModelOutput

from .caches import CACHE_KWARG, is_static
from .capability import check_multi_token_forward
from .configuration import SpeculativeOptions
from .drafters.base import Drafter
from .drafters.model import ModelDrafter
from .outputs import SpeculativeBeamDecoderOnlyOutput, SpeculativeBeamEncoderDecoderOutput
from .rounds import draft_context, target_logits
from .stats import SpeculativeStats

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["DEFAULT_BEAM_GAMMA", "DEFAULT_DRAFT_BEAMS_PER_BEAM", "speculative_beam_search"]

DEFAULT_BEAM_GAMMA = 2
"""γ when `speculative_gamma` is left at its default: every running beam must be among the drafter's for a step to
be accepted, which happens far less often than one token matching, so steps past the second are rarely accepted and
drafting them costs more than it returns (on a memory-bound Llama pair, γ = 2 is faster than γ = 3)."""

DEFAULT_DRAFT_BEAMS_PER_BEAM = 2
"""u = 2 w when `speculative_draft_beams` is not set: twice the target's beams keep more of the target's beams among
the drafter's, so each target forward takes more beam steps (on a memory-bound Llama pair at w = 2, about 1.7 against
1.3 with u = w), which is what pays where a forward over more positions costs little more."""


def speculative_beam_search(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,  # [batch * num_beams, prompt_len]: `generate` has expanded it already
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    *,
    drafter: Drafter,
    options: SpeculativeOptions,
    streamer=None,
    inputs_tensor: torch.Tensor | None = None,  # [batch, ...]: not expanded
    stats: SpeculativeStats | None = None,
    attach_stats: bool = True,
    **model_kwargs,  # expanded to batch * num_beams rows (encoder outputs, attention mask, position ids)
):
    """Beam search with a drafter; see the module docstring. Returns what `_beam_search` returns."""
    _check_beam_supported(model, generation_config, model_kwargs, drafter, options, streamer)

    check_multi_token_forward(model, input_ids, model_kwargs, generation_config)
    if stats is None:
        stats = SpeculativeStats(lenience=options.speculative_lenience)
    num_beams = generation_config.num_beams
    draft_beams = options.speculative_draft_beams or DEFAULT_DRAFT_BEAMS_PER_BEAM * num_beams
    if draft_beams < num_beams:
        raise ValueError(
            f"`speculative_draft_beams` (u) must be at least `num_beams` (w), got speculative_draft_beams="
            f"{draft_beams} and num_beams={num_beams}: the drafter's beams must be able to hold the target's. Use "
            f"`speculative_draft_beams={num_beams}` or more, or leave it unset (2 x num_beams)."
        )
    search = _BeamSearch(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)
    cache = model_kwargs[CACHE_KWARG]
    cache.activate_past_recording()
    batch = search.batch_size
    # the drafter is reset on one row per prompt (the source, for an encoder-decoder drafter, is encoded once)
    first_rows = torch.arange(batch, device=input_ids.device) * num_beams
    draft_model = _DraftBeams(
        drafter.for_call(
            draft_context(
                model,
                input_ids[first_rows],
                logits_processor,
                generation_config,
                select_rows(model_kwargs, first_rows, input_ids.shape[0]),
                inputs_tensor,
            )
        ),
        num_beams,
        generation_config,
        batch,
    )

    # the first step is plain beam search's: the prefill over the expanded prompt
    start = time.perf_counter()
    outputs = model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)
    model_kwargs = model._update_model_kwargs_for_generation(
        outputs, model_kwargs, is_encoder_decoder=model.config.is_encoder_decoder
    )
    logits = outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32, device=input_ids.device)  # [batch*w, V]
    del outputs
    search.step(logits)
    cache.reorder_cache(search.parents_of_running())
    stats.verify_time_s += time.perf_counter() - start
    stats.record_round(0, 0, 0, [])
    stats.emitted_tokens += 1
    stats.beam_steps_history.append(1)
    stats.target_forward_tokens.append(input_ids.numel())

    gamma = options.with_default_gamma(DEFAULT_BEAM_GAMMA, "hf_specdec.beam.DEFAULT_BEAM_GAMMA").speculative_gamma
    while not search.finished:
        # a node at depth d is a running beam of length cur_len + d; no step can start from max_length - 1 or later
        depth = max(0, min(gamma, generation_config.max_length - 1 - search.cur_len))
        start = time.perf_counter()
        padding = None if model.config.is_encoder_decoder else model_kwargs.get("attention_mask")
        tree = draft_model.search(search.flat_running(), search.running_beam_scores, padding, depth, draft_beams)
        drafted = time.perf_counter()
        stats.draft_time_s += drafted - start
        row_logits = _score_paths(model, search.flat_running(), tree, model_kwargs)  # [rows, depth + 1, V]
        steps, cache_rows, origins = search.replay(tree, row_logits)
        # each running beam's cache: its parent's path, up to the parent (all but the beam's newest token)
        cache.reorder_cache(cache_rows)
        _crop(cache, search.cur_len - 1)
        model_kwargs = model._update_model_kwargs_for_generation(
            {},
            select_rows(model_kwargs, origins, origins.shape[0]),
            is_encoder_decoder=model.config.is_encoder_decoder,
            num_new_tokens=steps,
        )
        draft_model.keep(origins)
        stats.verify_time_s += time.perf_counter() - drafted
        stats.record_round(depth, tree.num_nodes, steps - 1, [], depth=depth)
        stats.emitted_tokens += steps
        stats.beam_steps_history.append(steps)
        stats.target_forward_tokens.append(tree.num_rows * (depth + 1))

    return search.output(model_kwargs, stats if attach_stats else None)


def _check_beam_supported(model, generation_config, model_kwargs, drafter, options, streamer) -> None:
    """What speculative beam search cannot serve exactly fails here, before any forward."""
    groups = getattr(generation_config, "num_beam_groups", None)
    if groups is not None and groups > 1:
        raise ValueError(
            f"Group beam search (`num_beam_groups={groups}`) cannot be combined with a drafter: its groups score each "
            "other's tokens (diversity penalty) within a step. Drop `num_beam_groups` or the drafter."
        )
    for name in ("constraints", "force_words_ids"):
        if getattr(generation_config, name, None) is not None:
            raise ValueError(
                f"Constrained beam search (`{name}`) cannot be combined with a drafter. Drop `{name}` or the drafter."
            )
    if generation_config.low_memory:
        raise ValueError("`low_memory=True` is not supported by beam search (transformers removed it); drop it.")
    if streamer is not None:
        raise ValueError("A `streamer` cannot be used with beam search; set `num_beams=1` or drop `streamer`.")
    if not generation_config.use_cache:
        raise ValueError(
            "`use_cache=False` cannot be combined with a drafter: speculative beam search reads the target's "
            "key/value cache. Use `use_cache=True` (the default)."
        )
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "`output_attentions` and `output_hidden_states` are not supported by speculative beam search "
            f"(got output_attentions={generation_config.output_attentions}, "
            f"output_hidden_states={generation_config.output_hidden_states}). Set them to False."
        )
    if generation_config.guidance_scale not in (None, 1, 1.0):
        raise ValueError(
            f"`guidance_scale={generation_config.guidance_scale}` cannot be combined with a drafter. Drop it or the "
            "drafter."
        )
    if options.speculative_lenience != 1.0:
        raise ValueError(
            f"`speculative_lenience={options.speculative_lenience}` cannot be combined with `num_beams` > 1: "
            "speculative beam search is exact only. Use `speculative_lenience=1.0`."
        )
    if options.speculative_tree_budget is not None:
        raise ValueError(
            f"`speculative_tree_budget={options.speculative_tree_budget}` cannot be combined with `num_beams` > 1: "
            "speculative beam search verifies the drafter's beams (`speculative_draft_beams`). Drop "
            "`speculative_tree_budget`."
        )
    if options.speculative_gamma_policy not in ("auto", "constant"):
        raise ValueError(
            f"`speculative_gamma_policy={options.speculative_gamma_policy!r}` is not supported with `num_beams` > 1: "
            "speculative beam search drafts `speculative_gamma` beam steps every round. Use "
            "`speculative_gamma_policy='constant'`."
        )
    if not isinstance(drafter, ModelDrafter) or drafter.reads_target_hidden_states:
        raise ValueError(
            f"Speculative beam search (`num_beams` > 1) needs a draft model that can run beam search of its own "
            f"(`assistant_model=...` or a `hf_specdec.ModelDrafter`), got {type(drafter).__name__}. Use an "
            "assistant model, or `num_beams=1` with this drafter."
        )
    if drafter.cache_implementation == "static":
        raise ValueError(
            "Speculative beam search (`num_beams` > 1) runs the draft model's own beams on dynamic caches, so it "
            "cannot use `ModelDrafter(cache_implementation='static')`. Leave the drafter's cache dynamic "
            "(`cache_implementation=None`), or use `num_beams=1`."
        )
    cache = model_kwargs.get(CACHE_KWARG)
    if (
        cache is None
        or not isinstance(cache, (DynamicCache, EncoderDecoderCache))
        or not cache.is_croppable
        or is_static(cache)
    ):  # an encoder-decoder's static cache is an `EncoderDecoderCache` of static ones
        decoder_cache = getattr(cache, "self_attention_cache", cache)
        raise ValueError(
            f"Speculative beam search needs the target's cache to be a croppable dynamic cache, got "
            f"{type(decoder_cache).__name__} (cache_implementation={generation_config.cache_implementation!r}): its "
            "rows are expanded to the drafter's paths and cut back each round. Use the default dynamic cache "
            "(`cache_implementation=None`)."
        )


def select_rows(model_kwargs: dict, rows: torch.LongTensor, batch: int) -> dict:
    """The prepared model kwargs of `batch` rows, with rows `rows` (`[n]`, repeats allowed) of every tensor (and
    of every tensor in a `ModelOutput`, such as `encoder_outputs`) whose first dimension is the batch; the cache is
    shared, not copied."""

    def pick(value):
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
            return value.index_select(0, rows.to(value.device))
        return value

    selected = {}
    for key, value in model_kwargs.items():
        if isinstance(value, ModelOutput):
            value = type(value)(**{k: pick(v) for k, v in value.items()})
        elif key != CACHE_KWARG:
            value = pick(value)
        selected[key] = value
    return selected


def _crop(cache, length: int) -> None:
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


class _DraftTree:
    """The drafter's beams of one round, as the target scores them: one row per root-to-leaf path.

    `row_roots[r]`: the flat index (prompt x w + beam) of the target beam row r starts from; `row_tokens[r]`: its
    path's tokens, right-padded to the depth; `nodes`: (root, path tokens) -> (row, depth) for every node."""

    def __init__(self, row_roots: list[int], paths: list[list[int]], depth: int, pad: list[int], device):
        self.nodes: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}
        for row, (root, path) in enumerate(zip(row_roots, paths)):
            for d in range(len(path) + 1):
                self.nodes.setdefault((root, tuple(path[:d])), (row, d))
        self.num_rows = len(row_roots)
        self.num_nodes = len(self.nodes) - len(set(row_roots))  # drafted nodes, roots excluded
        self.depth = depth
        self.row_roots = torch.tensor(row_roots, dtype=torch.long, device=device)  # [rows]
        padded = [
            path + [path[-1] if path else pad[root]] * (depth - len(path)) for root, path in zip(row_roots, paths)
        ]
        self.row_tokens = torch.tensor(padded, dtype=torch.long, device=device).reshape(len(paths), depth)


class _DraftBeams:
    """The draft model's side: a cache with one row per target running beam (the beams' tokens up to the round's
    start), and beam search of width u over γ steps from the target's running beams."""

    def __init__(self, drafter: ModelDrafter, num_beams: int, generation_config: GenerationConfig, num_prompts: int):
        self.drafter = drafter
        self.model = drafter.model
        self.num_beams = num_beams
        eos = generation_config._eos_token_tensor
        self.eos = None if eos is None else eos.reshape(-1)
        # processor state sized to the target's beam rows (repetition penalty's prompt padding, one entry per beam
        # row): kept per prompt, and picked for the drafter's rows (w, then u per prompt) at each call
        self.padding_per_prompt: dict[int, torch.Tensor] = {}
        for index, processor in enumerate(drafter.logits_processor):
            ignore = getattr(processor, "prompt_ignore_length", None)
            if isinstance(ignore, torch.Tensor) and ignore.shape[0] in (num_prompts, num_prompts * num_beams):
                self.padding_per_prompt[index] = ignore.reshape(num_prompts, -1)[:, 0]

    def _processors(self, batch_of_row: torch.LongTensor) -> LogitsProcessorList:
        """The drafter's processors for rows of the prompts `batch_of_row` (`[rows]`)."""
        if not self.padding_per_prompt:
            return self.drafter.logits_processor
        processors = LogitsProcessorList()
        for index, processor in enumerate(self.drafter.logits_processor):
            if index in self.padding_per_prompt:
                processor = copy.copy(processor)  # the target's own keeps its state
                ignore = self.padding_per_prompt[index]
                processor.prompt_ignore_length = ignore[batch_of_row.to(ignore.device)]
            processors.append(processor)
        return processors

    def _forward(
        self, ids: torch.LongTensor, cache, batch_of_row: torch.LongTensor, attention_mask: torch.LongTensor | None
    ) -> torch.FloatTensor:
        """Feeds the uncached tail of `ids` (`[rows, len]`) and returns float32 log q of the last position."""
        drafter = self.drafter
        cached = cache.get_seq_length()
        inputs = {drafter.cache_argument: cache, "use_cache": True}
        tail = drafter._drafter_ids(ids[:, cached:]).to(drafter.device)
        if drafter.encoder_inputs is not None:
            for key, value in drafter.encoder_inputs.items():
                if isinstance(value, ModelOutput):
                    value = type(value)(**{k: v.index_select(0, batch_of_row.to(v.device)) for k, v in value.items()})
                elif isinstance(value, torch.Tensor):
                    value = value.index_select(0, batch_of_row.to(value.device))
                inputs[key] = value
            inputs["decoder_input_ids" if self.model.config.is_encoder_decoder else "input_ids"] = tail
        else:
            inputs["input_ids"] = tail
            if attention_mask is not None:
                mask = torch.cat(
                    [attention_mask, attention_mask.new_ones(ids.shape[0], ids.shape[1] - attention_mask.shape[1])],
                    dim=-1,
                )
                inputs["attention_mask"] = mask.to(drafter.device)
                positions = mask.long().cumsum(-1) - 1
            else:
                positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
            if drafter.accepts_position_ids:
                inputs["position_ids"] = positions.clamp(0, drafter.max_position)[:, cached:].to(drafter.device)
        if drafter.accepts_logits_to_keep:
            inputs["logits_to_keep"] = 1
        logits = self.model(**inputs).logits[:, -1]
        logits = drafter._target_logits(logits)  # ids are on the target's device
        return self._processors(batch_of_row)(ids, logits.log_softmax(dim=-1))  # [rows, V]

    @torch.no_grad()
    def search(
        self, running: torch.LongTensor, root_scores: torch.FloatTensor, attention_mask, depth: int, width: int
    ) -> _DraftTree:
        """`running`: the target's running beams `[batch * w, cur_len]`; `root_scores`: their scores `[batch, w]`.
        Returns the tree of the drafter's beams of width `width` over `depth` steps; at every depth its first w beams
        are the best w children of the first w beams before (what the target keeps were p = q)."""
        batch, w = root_scores.shape
        device = running.device
        base = self.drafter.cache
        ids = running
        batch_of_row = torch.arange(batch, device=device).repeat_interleave(w)  # [batch * w]
        levels = []  # per depth: (parent index into the previous level [batch, u], token [batch, u])
        if depth:
            log_q = self._forward(ids, base, batch_of_row, attention_mask)  # [batch * w, V]; base: cur_len now
            scores = root_scores
            cache = None
            for d in range(1, depth + 1):
                vocab = log_q.shape[-1]
                if self.eos is not None:  # a finished beam does not run on (ids past the vocabulary never occur)
                    eos = self.eos.to(device)
                    log_q[:, eos[eos < vocab]] = -float("inf")
                previous = scores.shape[1]
                total = (scores[:, :, None] + log_q.reshape(batch, previous, vocab)).reshape(batch, -1)
                # the first w beams are the ones the target itself would keep were p = q (the best w children of
                # the first w beams before), so that a drafter that agrees has every step accepted; the other
                # u - w are the best of all the rest
                primary_scores, primary = total[:, : w * vocab].topk(w, dim=-1)  # [batch, w]
                rest = total.scatter(1, primary, -float("inf"))
                extra_scores, extra = rest.topk(min(width, total.shape[1]) - w, dim=-1)  # [batch, u - w]
                scores = torch.cat([primary_scores, extra_scores], dim=-1)  # [batch, u]
                top = torch.cat([primary, extra], dim=-1)
                parent, token = top // vocab, top % vocab
                levels.append((parent, token))
                if d == depth:
                    break
                flat_parent = (parent + torch.arange(batch, device=device)[:, None] * previous).reshape(-1)
                ids = torch.cat([ids[flat_parent], token.reshape(-1, 1)], dim=-1)  # [batch * u, cur_len + d]
                batch_of_row = batch_of_row[flat_parent]
                if attention_mask is not None:
                    attention_mask = attention_mask[flat_parent]
                if cache is None:
                    cache = copy.deepcopy(base)
                cache.reorder_cache(flat_parent.to(self.drafter.device))
                log_q = self._forward(ids, cache, batch_of_row, attention_mask)
        return self._tree(running, batch, w, levels, depth)

    def _tree(self, running, batch: int, w: int, levels, depth: int) -> _DraftTree:
        """Root-to-leaf paths of the drafter's beams (host side: a few dozen nodes)."""
        level_lists = [(parent.tolist(), token.tolist()) for parent, token in levels]
        row_roots, paths = [], []
        for b in range(batch):
            # nodes per level as (parent slot, token); level 0: the w roots
            sizes = [w] + [len(parents[b]) for parents, _ in level_lists]
            has_child = [[False] * size for size in sizes]
            for d, (parents, _) in enumerate(level_lists):
                for p in parents[b]:
                    has_child[d][p] = True
            for d in range(len(sizes)):
                for slot in range(sizes[d]):
                    if has_child[d][slot]:
                        continue
                    path, level, index = [], d, slot
                    while level > 0:
                        parents, tokens = level_lists[level - 1]
                        path.append(tokens[b][index])
                        index, level = parents[b][index], level - 1
                    row_roots.append(b * w + index)
                    paths.append(path[::-1])
        pad = running[:, -1].tolist()
        return _DraftTree(row_roots, paths, depth, pad, running.device)

    def keep(self, origins: torch.LongTensor) -> None:
        """After a round: the cache row of each new running beam is its root's (`origins`: `[batch * w]`)."""
        self.drafter.cache.reorder_cache(origins.to(self.drafter.device))


@torch.no_grad()
def _score_paths(model, running: torch.LongTensor, tree: _DraftTree, model_kwargs: dict) -> torch.FloatTensor:
    """One target forward over every path of `tree`, each row after its root's cache (all of the root's tokens but
    the newest); returns float32 logits `[rows, depth + 1, V]`: position d follows the path's first d tokens."""
    cache = model_kwargs[CACHE_KWARG]
    cache.reorder_cache(tree.row_roots)
    row_kwargs = select_rows(model_kwargs, tree.row_roots, running.shape[0])
    if tree.depth:
        row_kwargs = model._update_model_kwargs_for_generation(
            {}, row_kwargs, is_encoder_decoder=model.config.is_encoder_decoder, num_new_tokens=tree.depth
        )
    candidates = torch.cat([running[tree.row_roots], tree.row_tokens], dim=-1)  # [rows, cur_len + depth]
    # transformers' beam search runs its steps without `decode_step`'s kernel switch: so do these
    return target_logits(model, candidates, tree.depth, row_kwargs, first_round=False, decode_kernels=False)


class _BeamSearch:
    """transformers' `_beam_search` state and step (5.x), fed logits one step at a time. Every tensor and every
    helper call is the one `_beam_search` makes, in the same order."""

    def __init__(self, model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs):
        self.model = model
        self.logits_processor = logits_processor
        self.stopping_criteria = stopping_criteria
        config = generation_config
        self.config = config
        self.num_beams = num_beams = config.num_beams
        self.batch_size = batch = input_ids.shape[0] // num_beams
        self.cur_len = self.decoder_prompt_len = input_ids.shape[1]
        device = input_ids.device
        pad_token_id, eos_token_id = config._pad_token_tensor, config._eos_token_tensor
        n_eos_tokens = eos_token_id.shape[0] if eos_token_id is not None else 0
        self.beams_to_keep = max(2, 1 + n_eos_tokens) * num_beams
        self.top_num_beam_mask = torch.cat(
            (torch.ones(num_beams, dtype=torch.bool), torch.zeros(self.beams_to_keep - num_beams, dtype=torch.bool))
        ).to(device)
        return_dict = config.return_dict_in_generate
        self.all_scores = () if (return_dict and config.output_scores) else None
        self.raw_logits = () if (return_dict and config.output_logits) else None
        output_fill_value = pad_token_id or eos_token_id[0] if eos_token_id is not None else -1
        self.running_sequences = torch.full(
            (batch, num_beams, config.max_length), fill_value=output_fill_value, dtype=torch.int64, device=device
        )
        self.running_sequences[:, :, : self.cur_len] = model._unflatten_beam_dim(input_ids, batch, num_beams)
        self.sequences = self.running_sequences.detach().clone()
        self.running_beam_scores = torch.zeros((batch, num_beams), dtype=torch.float, device=device)
        self.running_beam_scores[:, 1:] = -1e9
        self.beam_scores = torch.full((batch, num_beams), fill_value=-1e9, dtype=torch.float, device=device)
        self.is_sent_finished = torch.zeros((batch, num_beams), dtype=torch.bool, device=device)
        self.is_early_stop_heuristic_unsatisfied = torch.ones((batch, 1), dtype=torch.bool, device=device)
        self.next_token_hits_stopping_criteria = torch.zeros((batch, num_beams), dtype=torch.bool, device=device)
        self.running_beam_indices = torch.full(
            (batch, num_beams, config.max_length - self.cur_len), fill_value=-1, dtype=torch.int32, device=device
        )
        self.beam_indices = self.running_beam_indices.detach().clone()
        self.finished = False

    def flat_running(self) -> torch.LongTensor:
        return self.model._flatten_beam_dim(self.running_sequences[:, :, : self.cur_len])  # [batch * w, cur_len]

    def parents_of_running(self) -> torch.LongTensor:
        """`[batch * w]`: the flat index of the beam each running beam continued at the last step."""
        column = self.cur_len - 1 - self.decoder_prompt_len
        return self.model._flatten_beam_dim(self.running_beam_indices[..., column]).long()

    def step(self, logits: torch.FloatTensor) -> None:
        """One beam step from the target's logits after each running beam, `[batch * w, V]` (float32)."""
        model, config = self.model, self.config
        batch, num_beams, cur_len = self.batch_size, self.num_beams, self.cur_len
        flat_running_sequences = self.flat_running()
        log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
        log_probs = self.logits_processor(flat_running_sequences, log_probs)
        if self.raw_logits is not None:
            self.raw_logits += (logits.clone(),)
        if self.all_scores is not None:
            self.all_scores += (log_probs.clone(),)
        log_probs = model._unflatten_beam_dim(log_probs, batch, num_beams)
        log_probs = log_probs + self.running_beam_scores[:, :, None]
        log_probs = torch.reshape(log_probs, (batch, -1))
        topk_log_probs, topk_running_sequences, topk_running_beam_indices = model._get_top_k_continuations(
            accumulated_log_probs=log_probs,
            running_sequences=self.running_sequences,
            running_beam_indices=self.running_beam_indices,
            cur_len=cur_len,
            decoder_prompt_len=self.decoder_prompt_len,
            do_sample=config.do_sample,
            beams_to_keep=self.beams_to_keep,
            num_beams=num_beams,
            batch_size=batch,
        )
        hits = self.stopping_criteria(
            model._flatten_beam_dim(topk_running_sequences[:, :, : cur_len + 1]), self.all_scores
        )
        self.next_token_hits_stopping_criteria = model._unflatten_beam_dim(hits, batch, self.beams_to_keep)
        self.running_sequences, self.running_beam_scores, self.running_beam_indices = (
            model._get_running_beams_for_next_iteration(
                topk_log_probs=topk_log_probs,
                topk_running_sequences=topk_running_sequences,
                topk_running_beam_indices=topk_running_beam_indices,
                next_token_hits_stopping_criteria=self.next_token_hits_stopping_criteria,
                num_beams=num_beams,
            )
        )
        self.sequences, self.beam_scores, self.beam_indices, self.is_sent_finished = model._update_finished_beams(
            sequences=self.sequences,
            topk_running_sequences=topk_running_sequences,
            beam_scores=self.beam_scores,
            topk_log_probs=topk_log_probs,
            beam_indices=self.beam_indices,
            topk_running_beam_indices=topk_running_beam_indices,
            is_early_stop_heuristic_unsatisfied=self.is_early_stop_heuristic_unsatisfied,
            is_sent_finished=self.is_sent_finished,
            next_token_hits_stopping_criteria=self.next_token_hits_stopping_criteria,
            top_num_beam_mask=self.top_num_beam_mask,
            num_beams=num_beams,
            cur_len=cur_len,
            decoder_prompt_len=self.decoder_prompt_len,
            length_penalty=config.length_penalty,
            early_stopping=config.early_stopping,
        )
        self.cur_len = cur_len = cur_len + 1
        self.is_early_stop_heuristic_unsatisfied = model._check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=self.is_early_stop_heuristic_unsatisfied,
            running_beam_scores=self.running_beam_scores,
            beam_scores=self.beam_scores,
            is_sent_finished=self.is_sent_finished,
            cur_len=cur_len,
            max_length=config.max_length,
            decoder_prompt_len=self.decoder_prompt_len,
            early_stopping=config.early_stopping,
            length_penalty=config.length_penalty,
        )
        self.finished = not model._beam_search_has_unfinished_sequences(
            self.is_early_stop_heuristic_unsatisfied,
            self.is_sent_finished,
            self.next_token_hits_stopping_criteria,
            config.early_stopping,
        )

    def replay(self, tree: _DraftTree, row_logits: torch.FloatTensor):
        """Beam steps on the logits of the tree's nodes while every running beam is a node. Returns (steps taken,
        `[batch * w]` the row of each new running beam's parent node, `[batch * w]` each new beam's root)."""
        start = self.cur_len
        flat = self.batch_size * self.num_beams
        origins = list(range(flat))  # the root of each running beam
        nodes = [tree.nodes[(root, ())] for root in origins]  # (row, depth) of each running beam
        steps = 0
        while True:
            rows = torch.tensor([row for row, _ in nodes], device=row_logits.device)
            depths = torch.tensor([d for _, d in nodes], device=row_logits.device)
            self.step(row_logits[rows, depths])
            steps += 1
            parents = self.parents_of_running().tolist()
            parent_rows = [nodes[p][0] for p in parents]
            origins = [origins[p] for p in parents]
            if self.finished or steps > tree.depth:
                break
            paths = self.flat_running()[:, start:].tolist()
            found = [tree.nodes.get((root, tuple(path))) for root, path in zip(origins, paths)]
            if any(node is None for node in found):
                break  # a running beam the drafter did not keep: its logits are the next round's
            nodes = found
        device = row_logits.device
        return steps, torch.tensor(parent_rows, device=device), torch.tensor(origins, device=device)

    def output(self, model_kwargs: dict, stats: SpeculativeStats | None):
        """`_beam_search`'s return value, with `speculative_stats`."""
        model, config = self.model, self.config
        n = config.num_return_sequences
        sequences = model._flatten_beam_dim(self.sequences[:, :n, :])
        beam_scores = model._flatten_beam_dim(self.beam_scores[:, :n])
        beam_indices = model._flatten_beam_dim(self.beam_indices[:, :n, :])
        max_generated_length = ((beam_indices + 1).bool()).sum(dim=1).max()
        sequences = sequences[:, : self.decoder_prompt_len + max_generated_length]
        beam_indices = beam_indices[:, :max_generated_length]
        if not config.return_dict_in_generate:
            return sequences
        output_class = (
            SpeculativeBeamEncoderDecoderOutput if model.config.is_encoder_decoder else SpeculativeBeamDecoderOnlyOutput
        )
        return output_class(
            sequences=sequences,
            sequences_scores=beam_scores if config.output_scores else None,
            scores=self.all_scores,
            logits=self.raw_logits,
            beam_indices=beam_indices,
            **{CACHE_KWARG: model_kwargs.get(CACHE_KWARG)},
            speculative_stats=stats,
        )
