"""The drafter's side of speculative beam search (`beam.py`): its own beam search of width u from the target's running
beams (`DraftBeams`), and the tree of those beams as the target scores it, one row per root-to-leaf path
(`DraftTree`)."""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.utils import ModelOutput

from .caches import CACHE_KWARG
from .drafters.model import ModelDrafter

__all__ = ["DraftBeams", "DraftTree", "select_rows"]


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


class DraftTree:
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


class DraftBeams:
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
        tail = drafter.drafter_ids(ids[:, cached:]).to(drafter.device)
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
        logits = drafter.target_logits(logits)  # ids are on the target's device
        return self._processors(batch_of_row)(ids, logits.log_softmax(dim=-1))  # [rows, V]

    @torch.no_grad()
    def search(
        self, running: torch.LongTensor, root_scores: torch.FloatTensor, attention_mask, depth: int, width: int
    ) -> DraftTree:
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

    def _tree(self, running, batch: int, w: int, levels, depth: int) -> DraftTree:
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
        return DraftTree(row_roots, paths, depth, pad, running.device)

    def keep(self, origins: torch.LongTensor) -> None:
        """After a round: the cache row of each new running beam is its root's (`origins`: `[batch * w]`)."""
        self.drafter.cache.reorder_cache(origins.to(self.drafter.device))
