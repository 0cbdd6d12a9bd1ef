"""Draft models inside continuous batching: each request drafts with its own copy of the draft model (its own
`DynamicCache`, rolled back after each verification, dropped when the request leaves), and every request's output
equals plain continuous batching's (greedy) or follows the target's distribution (sampling)."""

import copy
import sys
from pathlib import Path

import pytest
import torch
from conftest import noisy_copy, tiny_model
from test_continuous_batching import (
    PROMPTS,
    SAMPLING,
    config,
    counting_offloads,
    drafted_and_accepted,
    serve,
    small_cache,
    tokens,
)
from test_sampling_distribution import exact_distribution, goodness_of_fit
from transformers import ContinuousBatchingConfig

import hf_specdec

sys.path.insert(0, str(Path(__file__).parent / "sweep"))
from tiny import VOCAB as SWEEP_VOCAB
from tiny import tiny_model as sweep_model


def argmin_copy(model):
    """A drafter that is never right: the target with its output head negated (it drafts the target's least likely
    token)."""
    wrong = copy.deepcopy(model)
    head = wrong.get_output_embeddings()
    head.weight = torch.nn.Parameter(-head.weight.detach().clone())  # untied from the input embeddings
    return wrong


@pytest.fixture(scope="module")
def target():
    return hf_specdec.enable(tiny_model("llama"))


@pytest.fixture(scope="module")
def plain(target):
    return tokens(target.generate_batch(PROMPTS, config(), continuous_batching_config=small_cache()))


@pytest.mark.parametrize("kind", ["always_right", "partly_right", "never_right"])
def test_a_draft_model_decodes_every_request_exactly(target, plain, kind):
    """Pages of 4 (drafts cross blocks), a token budget that trims drafts, fewer slots than requests; each request's
    draft cache is its own and is dropped when the request finishes."""
    drafter = {"always_right": copy.deepcopy, "partly_right": lambda m: noisy_copy(m, 0.05), "never_right": argmin_copy}
    processors = []
    outputs = serve(
        target,
        [(prompt, {}) for prompt in PROMPTS],
        small_cache(),
        processors.append,
        assistant_model=drafter[kind](target),
        speculative_gamma=3,
        speculative_gamma_policy="constant",
    )
    assert [output.generated_tokens for output in outputs] == plain
    drafted, accepted = drafted_and_accepted(outputs)
    assert drafted > 0
    if kind == "always_right":
        assert accepted == drafted
    elif kind == "never_right":
        assert accepted == 0
    else:
        assert 0 < accepted < drafted
    assert processors[0].copies == {}  # no request's draft cache outlives it


@pytest.mark.parametrize("family", ["qwen3_5_text", "mamba2", "gemma2"])
def test_stateful_and_sliding_window_draft_models(family):
    """A hybrid (gated delta rule), a pure state-space and a sliding-window draft model: each request's copy rolls its
    own recurrent state (or window) back to the kept tokens."""
    model = hf_specdec.enable(tiny_model("llama", vocab_size=SWEEP_VOCAB))
    reference = tokens(model.generate_batch(PROMPTS, config(), continuous_batching_config=small_cache()))
    outputs = model.generate_batch(
        PROMPTS,
        config(),
        continuous_batching_config=small_cache(),
        assistant_model=sweep_model(family),
        speculative_gamma=3,
        speculative_gamma_policy="constant",
    )
    assert tokens(outputs) == reference
    assert drafted_and_accepted(outputs.values())[0] > 0


def test_offloaded_requests_draft_again_from_a_new_copy(target, plain):
    """Too few blocks for every request: offloaded requests lose their draft cache with their own and come back
    with a new copy of the draft model; every output ends as plain's."""
    offloads, copies = [], []
    count = counting_offloads(offloads)

    def watch(processor):
        count(processor)
        copies.append(processor.copies)

    outputs = serve(
        target,
        [(prompt, {}) for prompt in PROMPTS],
        small_cache(num_blocks=14, max_requests_per_batch=5, max_batch_tokens=24),
        watch,
        assistant_model=noisy_copy(target, 0.05),
        speculative_gamma=4,
        speculative_gamma_policy="constant",
    )
    assert offloads
    assert [output.generated_tokens for output in outputs] == plain
    assert copies[0] == {}


@pytest.mark.parametrize("lenience", [1.0, 0.05], ids=["exact", "lossy_power_check"])
def test_sampled_drafts_follow_the_target_distribution(target, lenience):
    """A draft model that samples its drafts (q from its own logits, far from the target's: the target's weights
    with noise as large as themselves; about a third of its drafts are kept) under temperature and top-k: each
    request's three tokens follow the exactly enumerated target distribution; a lossy verification (lenience 0.05)
    with the same drafter must fail."""
    prompt = PROMPTS[1]
    table = exact_distribution(target, torch.tensor([prompt]), dict(temperature=0.9, top_k=4), length=3)
    torch.manual_seed(0)
    outputs = target.generate_batch(
        [prompt] * 1500,
        config(**SAMPLING),
        continuous_batching_config=ContinuousBatchingConfig(
            num_blocks=256, max_batch_tokens=256, max_requests_per_batch=64
        ),
        assistant_model=noisy_copy(target, 1.0),
        speculative_gamma=2,
        speculative_gamma_policy="constant",
        speculative_lenience=lenience,
    )
    samples = [tuple(output.generated_tokens) for output in outputs.values()]
    drafted, accepted = drafted_and_accepted(outputs.values())
    assert len(samples) == 1500 and drafted >= 1500 and 0 < accepted < drafted
    p_value = goodness_of_fit(table, samples)
    if lenience == 1.0:
        assert p_value > 1e-3
    else:
        assert p_value < 1e-6


def test_a_static_draft_cache_is_refused(target):
    drafter = hf_specdec.ModelDrafter(tiny_model("llama", seed=1), cache_implementation="static")
    with pytest.raises(ValueError, match=r"cache_implementation='static'.*Leave the drafter's cache dynamic"):
        target.generate_batch(PROMPTS, config(), continuous_batching_config=small_cache(), drafter=drafter)
