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

import time
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, EncoderDecoderCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from .beam_drafts import DraftBeams, DraftTree, select_rows
from .beam_replay import TargetBeamSearch
from .caches import CACHE_KWARG, is_static
from .capability import check_multi_token_forward
from .configuration import SpeculativeOptions
from .drafters.base import Drafter
from .drafters.model import ModelDrafter
from .forward import target_logits
from .policies import GammaPolicy
from .proposals import draft_context
from .recurrent import rolls_back_from_checkpoints
from .rounds import Draft, Lane, Round, Scores
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
    search = TargetBeamSearch(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)
    cache = model_kwargs[CACHE_KWARG]
    cache.activate_past_recording()
    batch = search.batch_size
    # the drafter is reset on one row per prompt (the source, for an encoder-decoder drafter, is encoded once)
    first_rows = torch.arange(batch, device=input_ids.device) * num_beams
    draft_model = DraftBeams(
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
    lane = BeamLane(model, search, draft_model, model_kwargs, generation_config, options, stats, draft_beams)
    round_ = Round(model, GammaPolicy(gamma, gamma), stats)  # beam search drafts `gamma` steps every round
    while not search.finished:
        round_.run(lane)
    model_kwargs = lane.model_kwargs

    return search.output(model_kwargs, stats if attach_stats else None)


class BeamLane(Lane):
    """Beam search's side of a round: the drafter's beams are the draft, the target scores every path in one
    forward, and the target's own beam search is replayed on those logits (see the module docstring)."""

    def __init__(self, model, search, draft_model, model_kwargs, generation_config, options, stats, draft_beams):
        super().__init__(generation_config, options)
        self.model, self.search, self.draft_model, self.stats = model, search, draft_model, stats
        self.model_kwargs, self.max_length, self.draft_beams = model_kwargs, generation_config.max_length, draft_beams
        self.cache = model_kwargs[CACHE_KWARG]

    def room(self, gamma: int) -> int:
        # a node at depth d is a running beam of length cur_len + d; no step can start from max_length - 1 or later
        return max(0, min(gamma, self.max_length - 1 - self.search.cur_len))

    def draft(self, gamma: int, chosen_gamma: int) -> Draft:
        search = self.search
        padding = None if self.model.config.is_encoder_decoder else self.model_kwargs.get("attention_mask")
        tree = self.draft_model.search(
            search.flat_running(), search.running_beam_scores, padding, gamma, self.draft_beams
        )
        return Draft(tree, None, None, gamma)

    def score(self, draft: Draft) -> Scores:
        logits = _score_paths(self.model, self.search.flat_running(), draft.proposal, self.model_kwargs)
        return Scores(logits, logits)  # [rows, depth + 1, V]: the processors run inside the replay, per step

    def verify(self, draft: Draft, scores: Scores):
        """The target's beam search replayed on the paths' logits: (steps taken, cache rows, origins)."""
        return self.search.replay(draft.proposal, scores.logits)

    def emit(self, draft: Draft, verdict, scores: Scores) -> None:
        steps = verdict[0]
        tree = draft.proposal
        self.stats.record_round(tree.depth, tree.num_nodes, steps - 1, [], depth=tree.depth)
        self.stats.emitted_tokens += steps
        self.stats.beam_steps_history.append(steps)
        self.stats.target_forward_tokens.append(tree.num_rows * (tree.depth + 1))
        self.finished = self.search.finished

    def keep(self, draft: Draft, verdict, scores: Scores) -> None:
        steps, cache_rows, origins = verdict
        # each running beam's cache: its parent's path, up to the parent (all but the beam's newest token)
        self.cache.reorder_cache(cache_rows)
        _crop(self.cache, self.search.cur_len - 1)
        self.model_kwargs = self.model._update_model_kwargs_for_generation(
            {},
            select_rows(self.model_kwargs, origins, origins.shape[0]),
            is_encoder_decoder=self.model.config.is_encoder_decoder,
            num_new_tokens=steps,
        )
        self.draft_model.keep(origins)

    def observe(self, policy, draft: Draft, verdict, draft_s: float, verify_s: float) -> None:
        """A constant γ: nothing to learn."""


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
    if options.speculative_verification == "block":
        raise ValueError(
            "`speculative_verification='block'` cannot be combined with `num_beams` > 1: speculative beam search "
            "verifies the drafter's beams by the target's own beam scores. Leave it at \"auto\" (the default)."
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
    if getattr(drafter, "assistant_tokenizer", None) is not None:
        raise ValueError(
            f"Speculative beam search (`num_beams` > 1) cannot draft with `assistant_tokenizer` (got "
            f"{type(drafter).__name__}): a draft model of another tokenizer drafts text, spelled in the target's tokens "
            "one sequence at a time, not beams of the target's token ids. Use `num_beams=1` with it, or a draft model "
            "that shares the target's tokenizer (drop `assistant_tokenizer`)."
        )
    if not isinstance(drafter, ModelDrafter) or drafter.reads_target_hidden_states:
        raise ValueError(
            f"Speculative beam search (`num_beams` > 1) needs a draft model that can run beam search of its own "
            f"(`assistant_model=...` or a `hf_specdec.ModelDrafter`), got {type(drafter).__name__}. Use a draft "
            "model that runs on its own (a Gemma 4 assistant drafts from the target's states at one position), or "
            "`num_beams=1` with this drafter."
        )
    if drafter.cache_implementation == "static":
        raise ValueError(
            "Speculative beam search (`num_beams` > 1) runs the draft model's own beams on dynamic caches, so it "
            "cannot use `ModelDrafter(cache_implementation='static')`. Leave the drafter's cache dynamic "
            "(`cache_implementation=None`), or use `num_beams=1`."
        )
    cache = model_kwargs.get(CACHE_KWARG)
    if rolls_back_from_checkpoints(model, cache):
        raise ValueError(
            f"Speculative beam search (`num_beams` > 1) is not supported on {type(model).__name__}: its cache "
            "keeps state along the sequence (linear-attention / SSM layers, or compressors of past keys), one per "
            "row, which cannot be expanded to the drafter's paths and cut back each round. Use `num_beams=1` with the drafter (exact on this model), or "
            "plain beam search without one."
        )
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


def _crop(cache, length: int) -> None:
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


@torch.no_grad()
def _score_paths(model, running: torch.LongTensor, tree: DraftTree, model_kwargs: dict) -> torch.FloatTensor:
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
