"""On a CUDA device (skipped without one): drafting inside continuous batching, and the drafters that read the
target's hidden states (an EAGLE-3 head, MTP layers) in `generate` and in continuous batching. Every request's output
equals plain decoding's on the same device (greedy, float32), with drafts both kept and rejected.

The CPU suite checks the same mechanisms at length; this file is part of the CUDA pass (`python -m pytest -q
tests/test_cuda.py tests/test_cuda_continuous_batching.py` on a machine with a GPU)."""

import copy

import pytest
import torch
from conftest import noisy_copy, tiny_model
from test_continuous_batching import (
    NEW_TOKENS,
    PROMPTS,
    ScriptedRequests,
    config,
    drafted_and_accepted,
    small_cache,
    tokens,
)
from test_continuous_batching_features import trained_mtp
from test_eagle import trained_head

import hf_specdec
from hf_specdec.drafters.mtp import MtpDrafter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
CONSTANT = dict(speculative_gamma=3, speculative_gamma_policy="constant")


def assert_drafts(outputs, kind: str) -> None:
    drafted, accepted = drafted_and_accepted(outputs)
    assert drafted > 0, kind
    if kind == "always_right":
        assert accepted == drafted, kind
    elif kind == "never_right":
        assert accepted == 0, kind
    else:
        assert 0 < accepted < drafted, kind


def test_continuous_batching_drafts_exactly_on_cuda():
    """Pages of 4, a small token budget and fewer slots than requests, as on the CPU: scripted drafters always,
    never and partly right, prompt lookup and a draft model (a draft cache per request, on the GPU)."""
    model = hf_specdec.enable(tiny_model("llama")).to(CUDA)
    plain = tokens(model.generate_batch(PROMPTS, config(), continuous_batching_config=small_cache()))
    references = [prompt + out for prompt, out in zip(PROMPTS, plain)]
    cases = {
        "always_right": dict(drafter=ScriptedRequests(references)),
        "never_right": dict(drafter=ScriptedRequests(references, period=1)),
        "partly_right": dict(drafter=ScriptedRequests(references, period=3)),
        "prompt_lookup": dict(drafter="prompt_lookup"),
        "draft_model": dict(assistant_model=noisy_copy(model, 0.05)),
    }
    for kind, drafting in cases.items():
        outputs = model.generate_batch(
            PROMPTS, config(), continuous_batching_config=small_cache(), **drafting, **CONSTANT
        )
        assert tokens(outputs) == plain, kind
        if kind != "prompt_lookup":  # prompt lookup finds too little in these prompts to be always partly right
            assert_drafts(outputs.values(), "partly_right" if kind == "draft_model" else kind)


def eagle_on_cuda():
    target, head = trained_head("llama")
    target, head_model = copy.deepcopy((target, head.model))  # the cached CPU pair stays on the CPU
    return hf_specdec.enable(target).to(CUDA), hf_specdec.EagleDrafter(head_model.to(CUDA))


def mtp_on_cuda():
    target, layers, prompts = trained_mtp()
    target.to(CUDA)
    return target, MtpDrafter(layers.to(CUDA)), prompts


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_feature_drafters_are_exact_on_cuda(kind):
    """Trained briefly on the target's own text (partly right): the hidden states each round hands the drafter are
    the GPU's, in `generate` and sliced per request from continuous batching's packed forward."""
    if kind == "eagle":
        (target, drafter), prompts = eagle_on_cuda(), PROMPTS
    else:
        target, drafter, prompts = mtp_on_cuda()
    for prompt in prompts[:3]:
        ids = torch.tensor([prompt], device=CUDA)
        plain = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        out = target.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, drafter=drafter, return_dict_in_generate=True, **CONSTANT
        )
        assert torch.equal(out.sequences, plain), prompt
    cache = small_cache(max_batch_tokens=256, max_requests_per_batch=8)
    plain = tokens(target.generate_batch(prompts, config(), continuous_batching_config=cache))
    outputs = target.generate_batch(prompts, config(), continuous_batching_config=cache, drafter=drafter, **CONSTANT)
    assert tokens(outputs) == plain
    assert_drafts(outputs.values(), "partly_right")
