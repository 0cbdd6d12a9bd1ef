"""The costs of a recurrent model's rounds. Its verify forwards run its chunked kernel as one chunk of their own length
(`chunk_size`, where the model takes it: `hf_specdec.recurrent.takes_chunk_size`), not padded to the kernel's default
chunk of 64, and stay exactly plain `generate`'s; a model whose chunking with `chunk_size` would differ keeps its
default. The γ policy learns which of its plain steps carried kept tokens again after a rollback, and that a plain
step's cost cannot be told from verify forwards there."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import ScriptedDrafter
from transformers.cache_utils import Cache

import hf_specdec
from hf_specdec.policies import _POLICIES, GammaPolicy
from hf_specdec.recurrent import CHUNK_LIMIT, chunk_kwargs, takes_chunk_size

sys.path.insert(0, str(Path(__file__).parent / "sweep"))
from tiny import VOCAB
from tiny import tiny_model as sweep_model

NEW_TOKENS = 20
# the gated-delta-rule families, whose forward passes its keyword arguments down to the chunked kernel
GATED_DELTA = ["qwen3_5_text", "qwen3_next", "olmo_hybrid"]


def prompt(length=9, seed=0):
    return torch.randint(4, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def recurrent_mixers(model):
    """The modules that run a recurrent kernel and read `chunk_size` from their keyword arguments."""
    return [module for module in model.modules() if type(module).__name__.endswith("GatedDeltaNet")]


class ChunkRecorder:
    """Records, for every cached forward of a recurrent mixer, (new tokens, the `chunk_size` it was given or None)."""

    def __init__(self, model):
        self.calls = []
        self.handles = [
            mixer.register_forward_pre_hook(self._record, with_kwargs=True) for mixer in recurrent_mixers(model)[:1]
        ]

    def _record(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        cache = kwargs.get("cache", kwargs.get("cache_params"))
        if isinstance(cache, Cache):
            self.calls.append((hidden.shape[1], kwargs.get("chunk_size")))

    def close(self):
        for handle in self.handles:
            handle.remove()


def speculative(model, ids, reference, period):
    return model.generate(
        ids,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        speculative_gamma=4,
        speculative_gamma_policy="constant",
        return_dict_in_generate=True,
        drafter=ScriptedDrafter(reference, period=period, vocab=VOCAB),
    )


@pytest.mark.parametrize("model_type", GATED_DELTA)
@pytest.mark.parametrize("period", [None, 1, 3], ids=["always_right", "never_right", "partly_right"])
def test_verify_forwards_run_as_one_chunk_and_equal_plain_generate(model_type, period):
    """Every multi-token forward after the prefill (verifies, with a kept tail refed after a rollback) passes
    `chunk_size` = its tokens; the prefill keeps the default; the output is plain greedy `generate`'s."""
    model = hf_specdec.enable(sweep_model(model_type))
    ids = prompt()
    reference = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    speculative(model, ids, reference, period)  # the capability probe runs in the first call: not recorded
    recorder = ChunkRecorder(model)
    try:
        out = speculative(model, ids, reference, period)
    finally:
        recorder.close()
    assert torch.equal(out.sequences, reference)
    assert takes_chunk_size(model)
    multi = [(tokens, chunk) for tokens, chunk in recorder.calls if tokens > 1]
    prefill, verifies = multi[0], multi[1:]
    assert prefill[1] is None  # the prompt's forward chunks as plain generate's prefill does
    assert verifies and all(chunk == tokens for tokens, chunk in verifies), verifies
    assert all(chunk is None for tokens, chunk in recorder.calls if tokens == 1)


def test_a_stateful_draft_model_refeeds_its_tail_as_one_chunk():
    """A draft model that is always right (the target's own weights): each round it feeds its last draft and the
    target's extra token in one forward, as one chunk."""
    model = hf_specdec.enable(sweep_model("qwen3_5_text"))
    drafter = sweep_model("qwen3_5_text")
    ids = prompt(seed=2)
    reference = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    recorder = ChunkRecorder(drafter)  # (the drafter is not probed: every forward of it is its drafting)
    try:
        out = model.generate(
            ids,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            assistant_model=drafter,
            speculative_gamma=4,
            speculative_gamma_policy="constant",
            return_dict_in_generate=True,
        )
    finally:
        recorder.close()
    assert torch.equal(out.sequences, reference)
    assert out.speculative_stats.accepted_tokens == out.speculative_stats.drafted_tokens > 0
    refed = [(tokens, chunk) for tokens, chunk in recorder.calls[1:] if tokens > 1]
    assert refed and all(chunk == tokens for tokens, chunk in refed), recorder.calls


def test_chunk_kwargs_only_for_a_model_that_takes_the_argument_and_short_forwards():
    model = sweep_model("qwen3_5_text")
    assert chunk_kwargs(model, 5) == {}  # not checked yet: nothing passed
    assert takes_chunk_size(model)
    assert chunk_kwargs(model, 5) == {"chunk_size": 5}
    assert chunk_kwargs(model, 1) == {} and chunk_kwargs(model, CHUNK_LIMIT + 1) == {}
    assert chunk_kwargs(model, CHUNK_LIMIT) == {"chunk_size": CHUNK_LIMIT}


def test_a_forward_that_rejects_the_argument_never_gets_it():
    model = sweep_model("qwen3_5_text")

    def reject(module, args, kwargs):
        if "chunk_size" in kwargs:
            raise TypeError("forward() got an unexpected keyword argument 'chunk_size'")

    handle = recurrent_mixers(model)[0].register_forward_pre_hook(reject, with_kwargs=True)
    try:
        assert not takes_chunk_size(model)
        assert chunk_kwargs(model, 5) == {}
        model = hf_specdec.enable(model)
        ids = prompt(seed=3)
        reference = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        out = speculative(model, ids, reference, period=3)  # would raise had a verify been given `chunk_size`
        assert torch.equal(out.sequences, reference)
    finally:
        handle.remove()


def test_a_model_whose_chunked_verify_differs_keeps_its_default_chunking():
    """A kernel that computes something else when given `chunk_size` with a cache (which `takes_chunk_size`, run
    without one, cannot see): the capability probe finds the difference, and the model is verified with its default
    chunking (exactly), not refused."""
    model = sweep_model("qwen3_5_text")

    def off_by_chunk(module, args, kwargs):
        if "chunk_size" in kwargs and isinstance(kwargs.get("cache"), Cache):
            if args:
                return (args[0] + 1.0, *args[1:]), kwargs
            return args, kwargs | {"hidden_states": kwargs["hidden_states"] + 1.0}
        return None

    handle = recurrent_mixers(model)[0].register_forward_pre_hook(off_by_chunk, with_kwargs=True)
    try:
        assert takes_chunk_size(model)
        model = hf_specdec.enable(model)
        ids = prompt(seed=4)
        reference = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        out = speculative(model, ids, reference, period=3)  # the probe tries `chunk_size`, then goes without
        assert torch.equal(out.sequences, reference)
        assert not takes_chunk_size(model) and chunk_kwargs(model, 5) == {}
        recorder = ChunkRecorder(model)
        try:
            out = speculative(model, ids, reference, period=3)
        finally:
            recorder.close()
        assert torch.equal(out.sequences, reference)
        assert any(tokens > 1 for tokens, _ in recorder.calls)
        assert all(chunk is None for _, chunk in recorder.calls)
    finally:
        handle.remove()


class Alternating(GammaPolicy):
    """4 drafts, then a plain step, and so on; records what the loop tells it before each observation."""

    seen: list = []

    def __init__(self, gamma, max_gamma):
        super().__init__(gamma, max_gamma)
        self.rounds = 0

    def next_gamma(self):
        self.rounds += 1
        return 4 if self.rounds % 2 else 0

    def observe(self, *, drafted, accepted, draft_time_s, verify_time_s, first_round):
        Alternating.seen.append((drafted, accepted, self.carried_tokens, self.one_token_kernels, first_round))


@pytest.fixture
def alternating(monkeypatch):
    monkeypatch.setitem(_POLICIES._classes, "alternating_test", Alternating)  # the registry as found afterwards
    Alternating.seen = []
    return "alternating_test"


@pytest.mark.parametrize("model_type, recurrent", [("qwen3_5_text", True), ("llama", False)])
def test_the_policy_learns_which_plain_steps_carried_kept_tokens(alternating, model_type, recurrent):
    """After a round that rejected drafts, a recurrent cache went back to its checkpoint: the next step's forward
    carries the kept tokens again (the policy is told how many). A key/value cache is cropped: nothing is carried."""
    model = hf_specdec.enable(sweep_model(model_type))
    ids = prompt(seed=5)
    reference = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    out = model.generate(
        ids,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        drafter=ScriptedDrafter(reference, period=1, vocab=VOCAB),  # never right: every drafting round rejects
        speculative_gamma=4,
        speculative_gamma_policy=alternating,
    )
    assert torch.equal(out, reference)
    seen = Alternating.seen
    assert all(kernels is recurrent for *_, kernels, _ in seen)
    plain_after_rejection = [carried for drafted, _, carried, _, first in seen if not drafted and not first]
    assert plain_after_rejection
    assert all(carried == (1 if recurrent else 0) for carried in plain_after_rejection), seen


@pytest.mark.parametrize("period", [None, 1, 3], ids=["always_right", "never_right", "partly_right"])
def test_the_default_policy_on_a_recurrent_target_stays_exact(period):
    """The default policy on a hybrid: plain steps first until two are measured (a recurrent model's one-token
    forward runs other kernels than its verify forwards), then drafting, a probe of a drafter whose first round
    accepted nothing, and plain steps that carried kept tokens again; the output is plain greedy `generate`'s. (A
    never-right drafter once raised here: a wrong guess while no plain step was measured yet.)"""
    model = hf_specdec.enable(sweep_model("qwen3_5_text"))
    ids = prompt(seed=3)
    reference = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    out = model.generate(
        ids,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        drafter=ScriptedDrafter(reference, period=period, vocab=VOCAB),
        speculative_gamma=4,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, reference)
    history = out.speculative_stats.gamma_history
    assert history[:3] == [0, 0, 0] and max(history) > 0, history
