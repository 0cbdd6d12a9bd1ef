"""Sampling is exact: chi-square goodness of fit against the target's exactly enumerated distribution."""

import pytest
import torch
from conftest import ScriptedDrafter, prompt, tiny_model
from scipy.stats import chisquare
from transformers import LogitsProcessorList

import hf_specdec

SAMPLES = 2000
P_THRESHOLD = 1e-3


def processors(model, ids, config):
    """Exactly the processors `generate` builds for this config (model defaults such as top_k=50 included)."""
    generation_config, _ = model._prepare_generation_config(None, do_sample=True, **config)
    return model._get_logits_processor(
        generation_config=generation_config,
        input_ids_seq_length=ids.shape[1],
        encoder_input_ids=ids,
        prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(),
        device=ids.device,
        model_kwargs={},
    )


@torch.no_grad()
def exact_two_token_distribution(model, ids, config):
    """P(x1, x2 | prompt) under the target with the given sampling processors, by enumeration."""
    procs = processors(model, ids, config)

    def next_probs(seq):
        logits = model(seq).logits[:, -1].float()
        return procs(seq, logits).softmax(-1)[0]

    first = next_probs(ids)
    table = {}
    for x1 in torch.nonzero(first).flatten().tolist():
        seq = torch.cat([ids, torch.tensor([[x1]])], dim=-1)
        second = next_probs(seq)
        for x2 in torch.nonzero(second).flatten().tolist():
            table[(x1, x2)] = first[x1].item() * second[x2].item()
    return table


def exact_distribution(model, ids, config, length: int = 3):
    """P(x1..x_length | prompt) under the target with the sampling processors, by enumeration."""
    procs = processors(model, ids, config)
    table = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, probability in table.items():
            seq = torch.cat([ids, torch.tensor([list(prefix)], dtype=torch.long)], dim=-1)
            with torch.no_grad():
                probs = procs(seq, model(seq).logits[:, -1].float()).softmax(-1)[0]
            for token in torch.nonzero(probs).flatten().tolist():
                grown[prefix + (token,)] = probability * probs[token].item()
        table = grown
    return table


def goodness_of_fit(table, samples):
    outcomes = sorted(table, key=table.get, reverse=True)
    observed, expected = [], []
    rest_observed, rest_expected = 0, 0.0
    counts = {}
    for sample in samples:
        counts[sample] = counts.get(sample, 0) + 1
    assert set(counts) <= set(table), f"sampled outcomes the target gives probability 0: {set(counts) - set(table)}"
    for outcome in outcomes:
        e = table[outcome] * len(samples)
        if e >= 5:
            observed.append(counts.get(outcome, 0))
            expected.append(e)
        else:
            rest_observed += counts.get(outcome, 0)
            rest_expected += e
    if rest_expected > 0:
        observed.append(rest_observed)
        expected.append(rest_expected)
    scale = sum(observed) / sum(expected)
    return chisquare(observed, [e * scale for e in expected]).pvalue


CONFIGS = {
    "temperature_top_k": dict(temperature=0.9, top_k=4),
    "top_p_repetition_penalty": dict(temperature=1.2, top_p=0.6, repetition_penalty=1.3),
    # the warpers that cut by the distribution's own shape: each position is cut from its own prefix's logits
    "min_p_typical_eta": dict(temperature=0.7, top_k=0, min_p=0.2, typical_p=0.9, eta_cutoff=0.01),
}


@pytest.fixture(scope="module")
def models():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    # the logits of random-init models are close to flat; sharpen the target so the support is small
    drafter = tiny_model("llama", seed=1)
    return target, drafter


def sample_pairs(model, ids, config, n, **kwargs):
    torch.manual_seed(1234)
    pairs = []
    for _ in range(n):
        out = model.generate(ids, do_sample=True, max_new_tokens=2, **config, **kwargs)
        pairs.append(tuple(out[0, ids.shape[1] :].tolist()))
    return pairs


@pytest.mark.parametrize(
    "config_name,verification",
    [(name, "auto") for name in sorted(CONFIGS)] + [("temperature_top_k", "token")],
)
def test_model_drafter_samples_follow_target(models, config_name, verification):
    """A draft model's sampled drafts: block verification (the default, `"auto"`) and Algorithm 1 (`"token"`)."""
    target, drafter = models
    config = CONFIGS[config_name]
    ids = prompt(6, seed=11)
    table = exact_two_token_distribution(target, ids, config)
    assert len(table) >= 4
    samples = sample_pairs(
        target,
        ids,
        config,
        SAMPLES,
        assistant_model=drafter,
        speculative_gamma=2,
        speculative_verification=verification,
    )
    assert goodness_of_fit(table, samples) > P_THRESHOLD
    # power: the same test rejects samples from the drafter alone
    drafter_samples = sample_pairs(hf_specdec.enable(drafter), ids, config, SAMPLES)
    drafter_outcomes_in_support = [s for s in drafter_samples if s in table]
    assert (
        len(drafter_outcomes_in_support) < len(drafter_samples) or goodness_of_fit(table, drafter_samples) < P_THRESHOLD
    )


def test_deterministic_drafter_samples_follow_target(models):
    target, _ = models
    config = CONFIGS["temperature_top_k"]
    ids = prompt(6, seed=11)
    table = exact_two_token_distribution(target, ids, config)
    likely = max(table, key=table.get)
    # proposes the most likely pair (point-mass q): accepted with probability p(x), else recovered
    reference = torch.cat([ids, torch.tensor([list(likely)])], dim=-1)
    samples = sample_pairs(target, ids, config, SAMPLES, drafter=ScriptedDrafter(reference), speculative_gamma=2)
    assert goodness_of_fit(table, samples) > P_THRESHOLD
    wrong = [likely] * SAMPLES
    assert goodness_of_fit(table, wrong) < P_THRESHOLD


def test_always_right_drafter_accepts_everything_when_sampling(models):
    target, _ = models
    ids = prompt(6, seed=2)
    out = target.generate(
        ids,
        do_sample=True,
        temperature=0.8,
        top_k=10,
        top_p=0.9,
        repetition_penalty=1.3,
        assistant_model=target,
        max_new_tokens=20,
        return_dict_in_generate=True,
    )
    # q == p at every position (same processors, same prefix), so r < p/q = 1 always holds
    assert out.speculative_stats.acceptance_rate == 1.0
    assert abs(out.speculative_stats.alpha - 1.0) < 1e-5
