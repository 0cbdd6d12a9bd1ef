"""One step of speculative continuous batching: drafting before transformers' scheduler runs, the verify forward
over every request's last token and drafts, and the update that emits the accepted tokens and rolls the request's
write position back (see `hf_specdec.continuous_batching` for the whole design).

The processor and scheduler are transformers' own objects, upgraded in place to the classes below, so their
construction (cache sizing, scheduler choice, offloading) stays transformers'.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time

import torch
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor
from transformers.generation.continuous_batching.model_runner import ModelRunner
from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.generation.continuous_batching.utils import stream_context

from .configuration import SpeculativeOptions
from .continuous_features import FeatureHandoff
from .drafters.base import DraftContext, Drafter, DraftProposal
from .modeling import logits_width
from .policies.batch import BatchDraftAllocator
from .stats import SpeculativeStats
from .verdicts import verify_round

__all__ = ["SpeculativeBatchProcessor", "draft_trimming"]


@functools.cache
def draft_trimming(scheduler_cls: type) -> type:
    """transformers' scheduler class `scheduler_cls`, where a decoding request whose drafts do not fit the step's
    token budget keeps the drafts that fit (at least its last token) instead of being split like a prompt."""

    class DraftTrimmingScheduler(scheduler_cls):
        def _schedule_request(self, state, request_tokens, token_budget, request_ids_to_remove_from_waiting) -> None:
            if state.status == RequestStatus.DECODING and len(request_tokens) > token_budget:
                state.tokens_to_process = request_tokens[:token_budget]
                return
            super()._schedule_request(state, request_tokens, token_budget, request_ids_to_remove_from_waiting)

    DraftTrimmingScheduler.__name__ = DraftTrimmingScheduler.__qualname__ = f"DraftTrimming{scheduler_cls.__name__}"
    return DraftTrimmingScheduler


class VerifyingModelRunner(ModelRunner):
    """transformers' model runner, keeping the processed scores of every verified position instead of sampling (a
    step without drafts samples as transformers does)."""

    verifying: bool = False  # whether this step verifies drafts
    arg_rows: torch.LongTensor | None = None  # [positions]: each verified position's request, among those with a token
    scores: torch.Tensor | None = None  # [positions, vocab]: processed fp32 scores

    def _forward_process_and_sample(self, model, batch_data, carry_over_ids, prev_output_ids, output_ids) -> None:
        if not self.verifying:
            return super()._forward_process_and_sample(model, batch_data, carry_over_ids, prev_output_ids, output_ids)
        logits = model(**batch_data).logits  # [1, positions or seq_len, vocab]
        indices = batch_data["logits_indices"]
        if "logits_to_keep" not in batch_data:
            logits = logits[:, indices, :]
        scores = logits[0].float()  # [positions, vocab], fp32 as plain continuous batching
        if self.logit_processor.do_processing:
            arguments = batch_data["logits_processor_args"][:, self.arg_rows]
            scores = self.logit_processor(batch_data["input_ids"][0, indices], scores, arguments)
        self.scores = scores


@dataclasses.dataclass
class _Scheduled:
    """One request of the step that gets a new token: where its verified positions start in the scores, and its
    drafts as scheduled (trimmed to the budget; None: it verifies none)."""

    future_state: object
    start: int
    proposal: DraftProposal | None

    @property
    def num_drafted(self) -> int:
        return 0 if self.proposal is None else self.proposal.tokens.shape[1]


class SpeculativeBatchProcessor(FeatureHandoff, ContinuousBatchProcessor):
    """transformers' batch processor with a drafting step before scheduling and a verifying update after it."""

    def setup_drafting(
        self, target, drafter: Drafter, options: SpeculativeOptions, generation_config, prototype: Drafter
    ) -> None:
        """`prototype`: what each request's drafter copy is made from (`feature_prototype`)."""
        self.target, self.drafter, self.options = target, drafter, options
        self.gamma = options.speculative_gamma
        self.vocab_size = logits_width(target)
        self.drafter_processors = target._get_logits_processor(generation_config)
        self.drafting_config = generation_config
        # a drafter with a model of its own (a draft model) reads each request's sequence on the target's device
        self.draft_device = self.model_device if isinstance(getattr(drafter, "model", None), torch.nn.Module) else None
        runner = self.model_runner
        runner.__class__ = VerifyingModelRunner
        self.copies: dict[str, Drafter] = {}  # each request's own drafter
        self.stats: dict[str, SpeculativeStats] = {}
        self.proposals: dict[str, DraftProposal] = {}  # this step's drafts to verify, by request
        self.drafted: dict[str, list[int]] = {}  # every draft of this step, verified or not, by request
        self.scheduled: list[_Scheduled] = []
        self.allocator = BatchDraftAllocator() if options.speculative_gamma_policy == "auto" else None
        # drafts that cost next to nothing (copied from text) are always made: only their verification is priced
        self.rests = self.allocator is not None and not drafter.free_drafts
        self.step_start = 0.0
        self._setup_features(prototype)

    def reset(self) -> None:
        super().reset()
        self.close_capture()  # the next generation loop runs in a thread of its own
        self.copies, self.stats, self.proposals, self.drafted, self.scheduled = {}, {}, {}, {}, []
        self.sequences = {}
        if self.allocator is not None:
            self.allocator.forget_requests()  # the step cost fit stays: same model, same machine

    # ----- drafting and scheduling -----------------------------------------------------------------------------

    def prepare_next_batch(self) -> bool:
        self._open_capture()
        self._draft()
        if not super().prepare_next_batch():
            return False
        self._plan_verification()
        return True

    def _draft(self) -> None:
        """Every decoding request's drafts (up to γ and its room), of which the `auto` policy keeps a count per
        request priced on the whole step; the others stay shadow drafts, compared with what the request emits."""
        active = self.scheduler.active_requests
        self._drop_departed(active)
        self.proposals, self.drafted, decoding = {}, {}, 0
        for request_id, state in active.items():
            if state.status != RequestStatus.DECODING or not state.generated_tokens:
                continue
            decoding += 1
            last = state.tokens_to_process[:1]
            room = state._new_tokens_limit - state.generated_len() - 1  # the target's own token comes last
            num_tokens = min(self.gamma, room)
            state.tokens_to_process = last
            if num_tokens <= 0 or (self.rests and not self.allocator.should_draft(request_id, num_tokens)):
                continue
            started = time.perf_counter()
            sequence = self._sequence(state)
            first = request_id not in self.copies
            copy_ = self._drafting_copy(state, sequence)
            if copy_ is None:
                continue
            proposal = copy_.propose(sequence, num_tokens)
            drafts = proposal.tokens[0, :num_tokens].tolist()
            if self.allocator is not None:  # a first draft holds a draft model's prefill of the prompt: provisional
                self.allocator.observe_draft(time.perf_counter() - started, provisional=first)
            if any(not 0 <= token < self.vocab_size for token in drafts):
                raise ValueError(
                    f"{type(self.drafter).__name__}.propose returned token ids outside [0, {self.vocab_size}) for "
                    f"request {request_id!r}: {drafts}. A drafter must propose ids of the target's vocabulary."
                )
            self.proposals[request_id], self.drafted[request_id] = proposal, drafts
        drafted = {r: len(d) for r, d in self.drafted.items()}
        counts = self.allocator.allocate(drafted, others=decoding - len(drafted)) if self.allocator else {}
        for request_id, drafts in self.drafted.items():
            count = counts.get(request_id, len(drafts))
            if count:
                self.proposals[request_id] = _first(self.proposals[request_id], count)
            else:  # shadow drafts only
                del self.proposals[request_id]
            state = active[request_id]
            state.tokens_to_process = state.tokens_to_process + drafts[:count]
        # the step's seconds (fitted by the `auto` policy) start after drafting: drafting is priced per request
        self.step_start = time.perf_counter()

    def _drop_departed(self, active) -> None:
        """Drafter copies of requests no longer active (finished, cancelled, or offloaded: those get a new copy when
        they come back), and the statistics and acceptance counts of requests gone for good (cancelled)."""
        for request_id in [r for r in self.copies if r not in active]:
            del self.copies[request_id]
        for request_id in [r for r in self.sequences if r not in active]:
            del self.sequences[request_id]
        waiting = self.scheduler.waiting_requests
        for request_id in [r for r in self.stats if r not in active and r not in waiting]:
            del self.stats[request_id]
        if self.allocator is not None:
            for request_id in self.allocator.requests() - active.keys() - waiting.keys():
                self.allocator.forget(request_id)

    def _copy_for(self, state, sequence: torch.LongTensor) -> Drafter:
        """The request's own copy of the drafter (a draft model's copy keeps the request's draft cache), made at its
        first draft with a generation config whose `max_length` is the request's own."""
        request_id = state.request_id
        if request_id not in self.copies:
            generation_config = copy.copy(self.drafting_config)
            generation_config.max_length = len(state.initial_tokens) + state._new_tokens_limit
            self.copies[request_id] = self.prototype.for_call(self._context(sequence, generation_config))
        return self.copies[request_id]

    def _context(self, sequence: torch.LongTensor, generation_config) -> DraftContext:
        return DraftContext(
            target=self.target,
            input_ids=sequence,
            logits_processor=self.drafter_processors,
            generation_config=generation_config,
            vocab_size=self.vocab_size,
        )

    def _plan_verification(self) -> None:
        """Where each request's verified positions lie in the packed batch: its last token and its scheduled drafts."""
        io = self.inputs_and_outputs
        positions, arg_rows, self.scheduled = [], [], []
        end = 0
        for future_state in io.requests_in_batch:
            end += future_state.query_length
            if not future_state.has_new_token:
                continue
            proposal = self.proposals.get(future_state.state.request_id)
            num_drafted = future_state.query_length - 1 if proposal is not None else 0  # the scheduler may trim
            proposal = _first(proposal, num_drafted) if num_drafted else None
            self.scheduled.append(_Scheduled(future_state, len(positions), proposal))
            arg_rows += [len(self.scheduled) - 1] * (num_drafted + 1)
            positions += range(end - 1 - num_drafted, end)
        # a step where no request verifies drafts runs exactly as transformers' own (its sampling, one host read)
        self.model_runner.verifying = len(positions) > len(self.scheduled)
        if self.model_runner.verifying:
            self.verify_positions = torch.tensor(positions, dtype=torch.int32, device=self.model_device)
            self.model_runner.arg_rows = torch.tensor(arg_rows, dtype=torch.long, device=self.model_device)

    @torch.no_grad()
    def _generation_step(self, model) -> None:
        if not self.model_runner.verifying:
            return super()._generation_step(model)
        batch_data = self.inputs_and_outputs.get_model_kwargs(use_padding=False)
        batch_data["logits_indices"] = self.verify_positions
        self.model_runner.compute_batch(model, batch_data)
        self.inputs_and_outputs.retrieve_device_outputs()

    # ----- verification and update -----------------------------------------------------------------------------

    def _verify(self) -> list[tuple[int, int, list[float], list[float] | None]]:
        """Each scheduled request's (accepted drafts, next token, β per verified draft, and with `return_logprobs`
        the log-probability of each token it emits), in one host read."""
        if not self.scheduled:  # a step of prompt chunks only
            return []
        count, logprobs = len(self.scheduled), self.model_runner.return_logprobs
        if not self.model_runner.verifying:  # transformers sampled each request's token (and its log-probability)
            output_ids = self.inputs_and_outputs.output_ids
            if not logprobs:
                return [(0, token, [], None) for token in output_ids[0, :count].tolist()]
            # transformers stores each float32 log-probability's bits in its int32 output row
            values = torch.stack([output_ids[0, :count].double(), output_ids[1, :count].view(torch.float32).double()])
            tokens, read = values.tolist()
            return [(0, int(token), [], [value]) for token, value in zip(tokens, read)]
        scores = self.model_runner.scores
        groups: dict[int, list[int]] = {}
        for i, item in enumerate(self.scheduled):
            groups.setdefault(item.num_drafted, []).append(i)
        columns, order, width = [], [], 3 + 2 * max(groups)
        for num_drafted, members in groups.items():
            starts = torch.tensor([self.scheduled[i].start for i in members], device=scores.device)
            rows = starts[:, None] + torch.arange(num_drafted + 1, device=scores.device)  # [n, k + 1]
            proposal = _stack([self.scheduled[i].proposal for i in members], self.vocab_size, scores.device)
            group_scores = scores[rows]  # [n, k + 1, vocab]
            verdict = verify_round(self.do_sample, proposal, group_scores, self.options)
            parts = [verdict.accepted[:, None], verdict.next_tokens[:, None], verdict.betas]
            if logprobs:
                parts.append(_emitted_logprobs(group_scores, proposal.tokens, verdict))
            column = torch.cat([part.double() for part in parts], 1)
            columns.append(torch.nn.functional.pad(column, (0, width - column.shape[1])))
            order += members
        values = torch.cat(columns).tolist()  # the step's one host read
        results = [None] * count
        for i, row in zip(order, values):
            k = self.scheduled[i].num_drafted
            results[i] = (int(row[0]), int(row[1]), row[2 : 2 + k], row[2 + k : 3 + 2 * k] if logprobs else None)
        return results

    @torch.no_grad()
    def update_batch(self) -> None:
        results = self._verify()
        self._hand_out_features(
            {item.future_state.state.request_id: (item.num_drafted, r[0]) for item, r in zip(self.scheduled, results)}
        )
        outputs = []
        # a step of decoding requests only (no prompt chunk): the steps whose cost the `auto` policy fits
        decoding_only = len(self.scheduled) == len(self.inputs_and_outputs.requests_in_batch)
        for item, (accepted, next_token, betas, logprobs) in zip(self.scheduled, results):
            state = item.future_state.state
            if state.status in (RequestStatus.FINISHED, RequestStatus.PENDING):
                raise RuntimeError(f"Tried to update {state.status.name} request {state.request_id} in sync mode.")
            if state.generated_len() == 0:
                state.status = RequestStatus.DECODING
                decoding_only = False
            drafts = self.drafted.get(state.request_id, [])[: item.num_drafted]  # as verified, on the host
            # the verify wrote 1 + k positions; keep the last token's and the accepted drafts'
            state.position_offset -= len(drafts) - accepted
            emitted, finished = 0, False
            for token in drafts[:accepted] + [next_token]:
                emitted += 1
                if state.update_and_check_completion(token, None if logprobs is None else logprobs[emitted - 1]):
                    finished = True
                    break
            # blocks completed by this step's kept positions are hashed for prefix sharing: every position it wrote
            # when it verified no drafts (a prompt's last chunk, a plain step), else the accepted ones
            if drafts:
                kept_blocks = self._accepted_complete_blocks(state, 1 + accepted)
            else:
                kept_blocks = item.future_state.complete_blocks
            self.cache.mark_complete_blocks(state, kept_blocks)
            stats = self.stats.setdefault(
                state.request_id, SpeculativeStats(lenience=self.options.speculative_lenience)
            )
            stats.record_round(len(drafts), len(drafts), accepted, betas[: min(accepted + 1, len(drafts))])
            stats.emitted_tokens += emitted
            if self.allocator is not None:
                self.allocator.observe_request(
                    state.request_id, self.drafted.get(state.request_id, []), state.generated_tokens[-emitted:]
                )
            # also after the last step (a drafter may learn from the output)
            self._tell_copy(state, accepted)
            if finished:
                self.copies.pop(state.request_id, None)
                if self.allocator is not None:
                    self.allocator.forget(state.request_id)
                self.scheduler.finish_request(state.request_id)
                self.scheduler.block_new_requests = False
            if state.streaming or finished:
                output = state.to_generation_output()
                output.speculative_stats = self.stats.pop(state.request_id) if finished else copy.deepcopy(stats)
                outputs.append(output)
        for future_state in self.inputs_and_outputs.requests_in_batch:  # prompts split across steps
            if not future_state.has_new_token and future_state.state.status == RequestStatus.PREFILLING:
                self.cache.mark_complete_blocks(future_state.state, future_state.complete_blocks)
        if outputs:
            self.output_router.deliver_batch(outputs)
        if self.allocator is not None and self.scheduled:
            seconds = time.perf_counter() - self.step_start
            self.allocator.observe_share(seconds / len(self.scheduled))
            if decoding_only:
                query_tokens = sum(f.query_length for f in self.inputs_and_outputs.requests_in_batch)
                self.allocator.observe_step(query_tokens, seconds, self.model_runner.verifying)
        verified = {item.future_state.state.request_id for item in self.scheduled}
        active = self.scheduler.active_requests
        for request_id in self.drafted.keys() - verified:  # drafted, then not scheduled or offloaded: none kept
            if request_id in active:
                self._tell_copy(active[request_id], 0)
        self._fork_requests()

    def _tell_copy(self, state, accepted: int) -> None:
        """The request's drafter copy hears that `accepted` of its drafts were kept (a draft model crops its cache to
        the request's tokens); a feature drafter was told with its states already (`_hand_out_features`)."""
        copy_ = self.copies.get(state.request_id)
        if copy_ is not None and self._tells_copies(copy_):
            copy_.on_verified(self._sequence(state), torch.tensor([accepted]))

    def _fork_requests(self) -> None:
        """`num_return_sequences > 1`: the requests whose prompt stopped one token short are forked now, as
        transformers' own update does (children share the prompt's complete blocks and copy the partial one, so no
        draft a child writes lands in a block another request reads); each child then drafts with a copy of its own."""
        if not self.scheduler._requests_to_fork:
            return
        self.cache.pool.try_to_free_sectors()
        fork_src_and_dst = {name: ([], []) for name in self.cache.cache_allocators}
        while self.scheduler._requests_to_fork:
            state = self.scheduler._requests_to_fork.pop()
            num_children, state.num_children = state.num_children, 0
            new_request_ids = [f"{state.request_id}__child#{i}" for i in range(num_children)]
            forked_ids = self.cache.prepare_fork_request(state, new_request_ids, fork_src_and_dst)
            for new_request_id in forked_ids:
                self.scheduler.active_requests[new_request_id] = state.fork(new_request_id)
            for new_request_id in new_request_ids[len(forked_ids) :]:  # no room: prefilled from scratch later
                child = state.create_equivalent_initial_request()
                child.request_id = new_request_id
                self.scheduler.add_waiting_request(child)
        with stream_context(self.inputs_and_outputs.compute_stream):
            self.cache.perform_cache_copy(fork_src_and_dst)

    def _accepted_complete_blocks(self, state, written: int) -> dict[str, int]:
        """The blocks completed by the `written` accepted positions of this step (the scheduler counted the drafts'
        too): only these are marked for prefix sharing, so no block holding a rejected draft is ever hashed."""
        if not self.cache.use_prefix_sharing:
            return {}
        before = state.position_offset - written
        complete = {}
        for name, allocator in self.cache.cache_allocators.items():
            count = (before % allocator.tokens_per_page + written) // allocator.tokens_per_page
            if count:
                complete[name] = count
        return complete


def _emitted_logprobs(scores: torch.Tensor, drafts: torch.LongTensor, verdict) -> torch.Tensor:
    """`[n, k + 1]`: at each verified position, the log-probability under the processed scores (`[n, k + 1, vocab]`)
    of the token emitted there (an accepted draft, then the next token; later positions emit nothing), computed as
    transformers' continuous batching computes it for the one token it samples."""
    positions = torch.arange(drafts.shape[1] + 1, device=scores.device)
    padded = torch.nn.functional.pad(drafts, (0, 1))
    emitted = torch.where(positions < verdict.accepted[:, None], padded, verdict.next_tokens[:, None])
    return torch.softmax(scores, dim=-1).gather(-1, emitted[..., None]).squeeze(-1).log()


def _first(proposal: DraftProposal, num_drafted: int) -> DraftProposal:
    """`proposal` cut to its first `num_drafted` drafts (the policy and the scheduler may trim them)."""
    probs = proposal.probs[:, :num_drafted] if proposal.probs is not None else None
    return DraftProposal(tokens=proposal.tokens[:, :num_drafted], probs=probs)


def _stack(proposals: list[DraftProposal | None], vocab_size: int, device) -> DraftProposal:
    """Proposals of the same length as one batch (None: no drafts); deterministic drafts get their one-hot q when
    others carry q."""
    if proposals[0] is None:
        return DraftProposal.empty(len(proposals), device)
    tokens = torch.cat([p.tokens for p in proposals]).to(device)  # drafted on the host
    if all(p.probs is None for p in proposals):
        return DraftProposal(tokens=tokens)
    probs = [
        p.probs.to(device) if p.probs is not None else torch.nn.functional.one_hot(p.tokens, vocab_size).to(device)
        for p in proposals
    ]
    return DraftProposal(tokens=tokens, probs=torch.cat([q[..., :vocab_size].float() for q in probs]))
