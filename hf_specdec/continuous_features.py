"""Feature drafters (EAGLE-3 heads, MTP layers, DFlash blocks: `Drafter.reads_target_hidden_states`) inside
continuous batching: each request's copy hears the target's hidden states of its own kept positions, sliced from the
packed forward of every step.

A step's forward runs every request's query (a prompt chunk, or the last token and its drafts) packed in one row, in
the order of `requests_in_batch`; the capture (`HiddenStateCapture`, in the generation loop's thread) records the
few layers the drafter reads. After the verdict, each request's rows that stay in its sequence are handed to its
copy through `on_verified(..., target_hidden_states=...)`, exactly as `generate`'s rounds hand them: a prompt chunk's
rows all, a verified query's first `1 + accepted` (its last token's and the accepted drafts'). A copy is made when a
request's prefill starts at position 0 (again if it restarts after being offloaded), so it has heard every position
before it drafts. A request whose prompt prefix was read from the cache (prefix sharing) or that was forked from
another has no states for those positions: it decodes without drafts, exactly.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from .capture import HiddenStateCapture
from .drafters.base import DraftContext, Drafter
from .modeling import logits_width

logger = logging.get_logger(__name__)

__all__ = ["FeatureHandoff", "feature_prototype"]


def feature_prototype(target, drafter: Drafter, generation_config) -> Drafter:
    """The drafter the requests' copies are made from: `drafter` itself, or for a feature drafter a probe copy made
    now (in the caller's thread, so that a bad drafter fails here, clearly), which tells the layers every copy reads
    and loads a head named by a Hub id once."""
    if not drafter.reads_target_hidden_states:
        return drafter
    context = DraftContext(
        target=target,
        input_ids=torch.zeros(1, 1, dtype=torch.long, device=target.device),
        logits_processor=target._get_logits_processor(generation_config),
        generation_config=generation_config,
        vocab_size=logits_width(target),
    )
    prototype = drafter.for_call(context)
    if getattr(prototype, "target_hidden_layers", None) is None:
        raise ValueError(
            f"`drafter={type(drafter).__name__}` sets `reads_target_hidden_states` but its `reset` set no "
            "`target_hidden_layers` (the entries of the target's `output_hidden_states` it reads). Set them in `reset`."
        )
    HiddenStateCapture(target, prototype.target_hidden_layers, owner=type(drafter).__name__).close()  # checks them
    return prototype


class FeatureHandoff:
    """The part of `SpeculativeBatchProcessor` that feeds feature drafters (mixed in; no state of its own but the
    capture and the layers it records)."""

    def _setup_features(self, prototype: Drafter) -> None:
        """`prototype` (`feature_prototype`): what each request's copy is made from."""
        self.sequences: dict[str, _Tokens] = {}  # each request's tokens, where `_sequence` reads them
        self.capture: HiddenStateCapture | None = None
        self.prototype = prototype
        self.feature_layers = list(prototype.target_hidden_layers) if prototype.reads_target_hidden_states else None

    def _open_capture(self) -> None:
        """In the generation loop's thread (a capture records the forwards of the thread that built it)."""
        if self.feature_layers is not None and self.capture is None:
            self.capture = HiddenStateCapture(self.target, self.feature_layers, owner=type(self.drafter).__name__)

    def close_capture(self) -> None:
        if self.capture is not None:
            self.capture.close()
            self.capture = None

    def _drafting_copy(self, state, sequence: torch.LongTensor) -> Drafter | None:
        """The copy that drafts for the request this step: made at its first draft, but a feature drafter's only
        when its prefill starts (`_hand_out_features`); None when the request cannot draft (it missed some states)."""
        if self.feature_layers is None:
            return self._copy_for(state, sequence)
        return self.copies.get(state.request_id)

    def _hand_out_features(self, verdicts: dict[str, tuple[int, int]]) -> None:
        """Each request's kept rows of this step's hidden states to its copy; `verdicts`: request id -> (drafts
        verified, drafts accepted) of the requests that got a new token."""
        if self.capture is None:
            return
        states = self.capture.take()  # [1, query tokens of the step (padding after them), features]
        if states is None:
            return
        offset = 0
        for future_state in self.inputs_and_outputs.requests_in_batch:
            state, query = future_state.state, future_state.query_length
            request_id = state.request_id
            drafted, accepted = verdicts.get(request_id, (0, 0))
            rows = states[:, offset : offset + query - drafted + accepted]
            offset += query
            if state.position_offset - query == 0:  # the prefill (re)starts: a new copy hears it from the first
                self.copies.pop(request_id, None)
                copy_ = self._copy_for(state, self._sequence(state))
            else:
                copy_ = self.copies.get(request_id)
            if copy_ is None:  # it never drafts
                logger.warning_once(
                    f"{type(self.drafter).__name__} has no hidden states for the start of some request (its prompt "
                    "prefix was read from the cache, or it was forked from another request), which then decodes "
                    "without drafts. Pass `ContinuousBatchingConfig(allow_block_sharing=False)` to run every prompt "
                    "through the model."
                )
                continue
            copy_.on_verified(self._sequence(state), torch.tensor([accepted]), target_hidden_states=rows)
        for request_id in self.drafted.keys() - verdicts.keys():  # drafted, then not scheduled: nothing kept
            copy_, state = self.copies.get(request_id), self.scheduler.active_requests.get(request_id)
            if copy_ is not None and state is not None:
                copy_.on_verified(self._sequence(state), torch.tensor([0]), target_hidden_states=states[:, :0])

    def _sequence(self, state) -> torch.LongTensor:
        """The request's tokens so far, `[1, n]`, where its drafter reads them: a view of a host buffer the request
        keeps (each token is written into it once, not the whole sequence converted every step), moved to
        `draft_device` when the drafter reads there."""
        prompt, generated = state.initial_tokens, state.generated_tokens
        length = len(prompt) + len(generated)
        tokens = self.sequences.get(state.request_id)
        if tokens is None or tokens.prompt is not prompt or not tokens.filled <= length <= tokens.buffer.shape[1]:
            # room for the request's remaining tokens, but at most as many as it holds (at least 256): a request
            # without `max_new_tokens` may go on to 2**31 - 1 tokens (until its EOS), so its buffer doubles as it grows
            room = min(max(state._new_tokens_limit - len(generated), 0), max(length, 256))
            tokens = self.sequences[state.request_id] = _Tokens(prompt, length + room + 1)
        if length > tokens.filled:
            tokens.array[tokens.filled : length] = generated[tokens.filled - len(prompt) :]
            tokens.filled = length
        view = tokens.buffer[:, :length]
        return view if self.draft_device is None else view.to(self.draft_device)

    def _tells_copies(self, copy_: Drafter) -> bool:
        """Whether the emission step itself tells `copy_` of its verdict (a feature drafter is told here, with its
        states; a drafter whose `on_verified` is the base no-op is not told)."""
        return self.feature_layers is None and type(copy_).on_verified is not Drafter.on_verified


class _Tokens:
    """One request's tokens on the host: `buffer` `[1, capacity]` (its first `filled` written), `array` its numpy
    view; `prompt` is the request's prompt list it was made for (offloading may give the request a new one)."""

    __slots__ = ("array", "buffer", "filled", "prompt")

    def __init__(self, prompt: list[int], capacity: int):
        self.prompt, self.filled = prompt, len(prompt)
        self.buffer = torch.empty(1, max(capacity, len(prompt)), dtype=torch.long)
        self.array = self.buffer.numpy()[0]
        self.array[: len(prompt)] = prompt
