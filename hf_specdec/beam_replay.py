"""The target's own beam search, replayed one step at a time on logits a round already computed
(`TargetBeamSearch`; see `beam.py`): every tensor and every helper call is the one transformers' `_beam_search` makes,
in the same order."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .caches import CACHE_KWARG
from .outputs import SpeculativeBeamDecoderOnlyOutput, SpeculativeBeamEncoderDecoderOutput

if TYPE_CHECKING:
    from .beam_drafts import DraftTree
    from .stats import SpeculativeStats

__all__ = ["TargetBeamSearch"]


class TargetBeamSearch:
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

    def replay(self, tree: DraftTree, row_logits: torch.FloatTensor):
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
