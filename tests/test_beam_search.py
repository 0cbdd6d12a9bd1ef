"""Speculative beam search (Appendix A.4, `hf_specdec/beam.py`): the same output as plain beam search.

Every test compares against `generate(..., num_beams=w)` without a drafter, in float32: `sequences` equal,
`sequences_scores`, `scores` and `beam_indices` equal to float tolerance, on two decoder-only and two
encoder-decoder architectures, with drafters that are always right (the target itself), partly right (a noisy copy)
and never right (another random model)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import noisy_copy, prompt, source, tiny_model, tiny_seq2seq
from test_pipelines import TEXTS, tokenizer  # noqa: F401 - `tokenizer` is a fixture
from test_pipelines import tiny_seq2seq as pipeline_seq2seq
from transformers import pipeline

import hf_specdec
from hf_specdec.beam import DEFAULT_BEAM_GAMMA
from hf_specdec.caches import cache_of

DECODER_ONLY = ["gpt2", "llama"]
ENCODER_DECODER = ["bart", "t5"]
DRAFTERS = ["always", "partly", "never"]


def _target(arch: str):
    return hf_specdec.enable(tiny_model(arch) if arch in DECODER_ONLY else tiny_seq2seq(arch))


def _drafter(target, arch: str, kind: str):
    if kind == "always":
        return target
    if kind == "partly":
        return noisy_copy(target, 0.05)
    # never right: the target's head negated, so that its favourite tokens are the target's least likely ones
    # (a parameter of its own: negating weights tied to the input embeddings as well would cancel out)
    wrong = copy.deepcopy(target)
    head = wrong.get_output_embeddings()
    head.weight = torch.nn.Parameter(-head.weight.detach().clone())
    return wrong


def _inputs(arch: str) -> torch.LongTensor:
    """Two prompts (a batch): token ids, or the encoder's source."""
    if arch in DECODER_ONLY:
        return torch.cat([prompt(8, seed=0), prompt(8, seed=1)])
    return torch.cat([source(10, seed=0), source(10, seed=1)])


def assert_same_beams(plain, spec):
    assert torch.equal(spec.sequences, plain.sequences)
    torch.testing.assert_close(spec.sequences_scores, plain.sequences_scores, rtol=1e-4, atol=1e-4)
    assert torch.equal(spec.beam_indices, plain.beam_indices)
    assert len(spec.scores) == len(plain.scores)
    for ours, theirs in zip(spec.scores, plain.scores):
        finite = torch.isfinite(theirs)
        assert torch.equal(finite, torch.isfinite(ours))
        torch.testing.assert_close(ours[finite], theirs[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("arch", DECODER_ONLY + ENCODER_DECODER)
def test_identical_to_plain_beam_search(arch, kind):
    target = _target(arch)
    ids = _inputs(arch)
    kwargs = dict(
        num_beams=3, num_return_sequences=2, max_new_tokens=14, return_dict_in_generate=True, output_scores=True
    )
    plain = target.generate(ids, **kwargs)
    spec = target.generate(
        ids, assistant_model=_drafter(target, arch, kind), speculative_gamma=3, speculative_draft_beams=6, **kwargs
    )
    assert_same_beams(plain, spec)
    stats = spec.speculative_stats
    steps = plain.sequences.shape[1] - ids.shape[1] if arch in DECODER_ONLY else plain.sequences.shape[1] - 1
    assert sum(stats.beam_steps_history) == steps == stats.emitted_tokens
    assert stats.target_calls == len(stats.beam_steps_history) == len(stats.target_forward_tokens)
    if kind == "always":  # every round takes 1 + γ steps (but the prefill's and a last one cut by max length)
        assert stats.beam_steps_history[1:-1] == [4] * (len(stats.beam_steps_history) - 2)
    if kind == "never":
        assert stats.accepted_tokens == 0


@pytest.mark.parametrize("arch", ["llama", "t5"])
@pytest.mark.parametrize(
    "early_stopping, length_penalty", [(True, 1.0), (False, 0.8), ("never", 2.0), ("never", -0.5), (False, 0.0)]
)
def test_eos_inside_drafted_blocks_and_beam_options(arch, early_stopping, length_penalty):
    target = _target(arch)
    ids = _inputs(arch)
    base = dict(num_beams=4, max_new_tokens=16)
    # an EOS the target emits a few steps in, so that beams finish inside drafted blocks
    free = target.generate(ids, **base)
    start = ids.shape[1] if arch in DECODER_ONLY else 1
    eos = int(free[0, start + 4])
    kwargs = dict(
        base,
        eos_token_id=eos,
        pad_token_id=eos if arch in DECODER_ONLY else 0,
        early_stopping=early_stopping,
        length_penalty=length_penalty,
        num_return_sequences=4,
        return_dict_in_generate=True,
        output_scores=True,
    )
    plain = target.generate(ids, **kwargs)
    if length_penalty <= 1.0:  # a strong length penalty may prefer the beams that ran to max length
        assert (plain.sequences == eos).any()
    for drafter in (target, noisy_copy(target, 0.05)):
        spec = target.generate(ids, assistant_model=drafter, speculative_gamma=4, speculative_draft_beams=8, **kwargs)
        assert_same_beams(plain, spec)


@pytest.mark.parametrize("arch", ["gpt2", "bart"])
def test_max_length_and_no_repeat_ngram_size(arch):
    target = _target(arch)
    ids = _inputs(arch)
    for kwargs in (
        dict(max_length=ids.shape[1] + 7 if arch in DECODER_ONLY else 8),  # γ = 5 capped near the end
        dict(max_new_tokens=15, no_repeat_ngram_size=2, repetition_penalty=1.3),
    ):
        kwargs.update(num_beams=2, return_dict_in_generate=True, output_scores=True)
        plain = target.generate(ids, **kwargs)
        for drafter in (target, _drafter(target, arch, "partly")):
            spec = target.generate(ids, assistant_model=drafter, speculative_gamma=5, **kwargs)
            assert_same_beams(plain, spec)


def test_left_padded_batch_and_tensor_output():
    target = _target("llama")
    ids = torch.cat([prompt(8, seed=0), prompt(8, seed=1)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt is 5 tokens, left-padded
    kwargs = dict(attention_mask=mask, num_beams=3, max_new_tokens=12, pad_token_id=0)
    plain = target.generate(ids, **kwargs)
    for drafter in (target, noisy_copy(target, 0.05)):
        assert torch.equal(target.generate(ids, assistant_model=drafter, speculative_gamma=3, **kwargs), plain)


def test_output_logits_and_cache():
    target = _target("llama")
    ids = prompt(8)
    kwargs = dict(num_beams=2, max_new_tokens=10, return_dict_in_generate=True, output_logits=True)
    plain = target.generate(ids, **kwargs)
    spec = target.generate(ids, assistant_model=target, **kwargs)
    assert type(spec).__name__ == "SpeculativeBeamDecoderOnlyOutput"
    assert spec.sequences_scores is None and plain.sequences_scores is None
    assert len(spec.logits) == len(plain.logits)
    for ours, theirs in zip(spec.logits, plain.logits):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    # the cache holds each final running beam's tokens but the newest, as plain beam search leaves it
    assert cache_of(spec).get_seq_length() == cache_of(plain).get_seq_length()


@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_beam_sampling_draws_what_plain_beam_sampling_draws(arch):
    """The replay calls transformers' multinomial once per step on the target's own logits, and the drafter draws
    nothing: with the same seed, the same samples. Temperature and top-k go through the target's processors."""
    target = _target(arch)
    ids = _inputs(arch)
    kwargs = dict(num_beams=3, do_sample=True, temperature=1.5, top_k=20, max_new_tokens=12)
    for seed in range(3):
        torch.manual_seed(seed)
        plain = target.generate(ids, **kwargs)
        torch.manual_seed(seed)
        spec = target.generate(ids, assistant_model=target, speculative_gamma=3, **kwargs)
        assert torch.equal(spec, plain)
    torch.manual_seed(0)
    other_seed = target.generate(ids, **kwargs)
    torch.manual_seed(1)
    assert not torch.equal(target.generate(ids, **kwargs), other_seed)  # the comparison above can fail


def test_translation_pipeline_with_beams(tokenizer):
    target = hf_specdec.enable(pipeline_seq2seq("t5", len(tokenizer)))
    assistant = noisy_copy(target, 0.01)
    translator = pipeline("translation_en_to_de", model=target, tokenizer=tokenizer)
    plain = translator(TEXTS, num_beams=4, max_new_tokens=12)
    assert translator(TEXTS, assistant_model=assistant, num_beams=4, max_new_tokens=12) == plain
    assert translator(
        TEXTS,
        assistant_model=assistant,
        num_beams=4,
        max_new_tokens=12,
        num_return_sequences=2,
        speculative_draft_beams=8,
    ) == translator(TEXTS, num_beams=4, max_new_tokens=12, num_return_sequences=2)
    # the pipeline reaches speculative beam search (which checks u against w)
    with pytest.raises(ValueError, match=r"`speculative_draft_beams` \(u\) must be at least `num_beams`"):
        translator(TEXTS, assistant_model=assistant, num_beams=4, speculative_draft_beams=2)


def test_stats_count_accepted_beam_steps():
    target = _target("llama")
    out = target.generate(
        prompt(8),
        assistant_model=target,
        num_beams=2,
        speculative_gamma=4,
        max_new_tokens=11,
        return_dict_in_generate=True,
    )
    stats = out.speculative_stats
    # the prefill's plain step, then rounds of 1 + 4 steps: 1 + 5 + 5
    assert stats.beam_steps_history == [1, 5, 5]
    assert stats.accepted_tokens == 8 and stats.mean_accepted_length == 11 / 3
    # rounds after the prefill score the drafter's paths: at least u rows of γ + 1 positions
    assert all(tokens >= 2 * 5 for tokens in stats.target_forward_tokens[1:])
    assert stats.gamma_history == [0, 4, 4]
    # `speculative_gamma` left at its default: beam search drafts DEFAULT_BEAM_GAMMA steps
    out = target.generate(
        prompt(8), assistant_model=target, num_beams=2, max_new_tokens=11, return_dict_in_generate=True
    )
    assert out.speculative_stats.gamma_history[1] == DEFAULT_BEAM_GAMMA != 5
    explicit = target.generate(
        prompt(8),
        assistant_model=target,
        num_beams=2,
        max_new_tokens=11,
        speculative_gamma=5,
        return_dict_in_generate=True,
    )
    assert explicit.speculative_stats.gamma_history[1] == 5
    # and so does a `SpeculativeGenerationConfig` that leaves it unset
    config = hf_specdec.SpeculativeGenerationConfig(num_beams=2, max_new_tokens=11, return_dict_in_generate=True)
    out = target.generate(prompt(8), assistant_model=target, generation_config=config)
    assert out.speculative_stats.gamma_history[1] == DEFAULT_BEAM_GAMMA
    capped = target.generate(
        prompt(8),
        assistant_model=target,
        num_beams=2,
        max_new_tokens=11,
        speculative_max_gamma=1,
        return_dict_in_generate=True,
    )
    assert capped.speculative_stats.gamma_history[1] == 1  # an explicit speculative_max_gamma caps the default


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_beam_groups=2, diversity_penalty=1.0), r"Group beam search \(`num_beam_groups=2`\) cannot be"),
        (dict(force_words_ids=[[5]]), r"Constrained beam search \(`force_words_ids`\) cannot be combined"),
        (
            dict(speculative_draft_beams=2),
            r"`speculative_draft_beams` \(u\) must be at least `num_beams` \(w\), got "
            r"speculative_draft_beams=2 and num_beams=4",
        ),
        (dict(speculative_tree_budget=8), r"`speculative_tree_budget=8` cannot be combined with `num_beams` > 1"),
        (dict(speculative_lenience=0.5), r"`speculative_lenience=0.5` cannot be combined with `num_beams` > 1"),
        (dict(speculative_gamma_policy="optimal"), r"`speculative_gamma_policy='optimal'` is not supported with"),
    ],
)
def test_what_cannot_be_served_exactly_is_refused(kwargs, match):
    target = _target("llama")
    with pytest.raises(ValueError, match=match):
        target.generate(prompt(8), assistant_model=target, num_beams=4, max_new_tokens=5, **kwargs)


def test_drafters_without_a_model_are_refused():
    target = _target("llama")
    with pytest.raises(
        ValueError,
        match=r"needs a draft model that can run beam search of its own .*got "
        r"PromptLookupDrafter",
    ):
        target.generate(prompt(8), drafter="prompt_lookup", num_beams=2, max_new_tokens=5)


def test_draft_beams_is_validated():
    with pytest.raises(ValueError, match=r"`speculative_draft_beams` must be a positive int, got 0"):
        hf_specdec.SpeculativeGenerationConfig(speculative_draft_beams=0).validate()
    # without beams nothing would use it (it was accepted and ignored); with them it is used
    target = _target("llama")
    ids = prompt(8)
    for beams in ({}, {"num_beams": 1}):
        with pytest.raises(ValueError, match=r"`speculative_draft_beams=4` .* decodes with num_beams=1, so nothing"):
            target.generate(ids, max_new_tokens=4, assistant_model=target, speculative_draft_beams=4, **beams)
    plain = target.generate(ids, max_new_tokens=4, num_beams=2)
    assert torch.equal(
        target.generate(ids, max_new_tokens=4, num_beams=2, assistant_model=target, speculative_draft_beams=4), plain
    )


def test_whisper_with_a_decoder_only_assistant(tmp_path):
    """A `WhisperForCausalLM` assistant reads the target's encoder outputs (distil-whisper's layout), per beam."""
    from whisper_setup import build_tokenizer, decoder_of, features, tone, whisper

    target = hf_specdec.enable(whisper(build_tokenizer(str(tmp_path)), seed=0))
    clips = features([tone(2.0, 440.0), tone(3.0, 700.0, seed=1)])
    kwargs = dict(num_beams=3, max_new_tokens=12, return_dict_in_generate=True, output_scores=True)
    plain = target.generate(clips, **kwargs)
    spec = target.generate(clips, assistant_model=decoder_of(target), speculative_gamma=3, **kwargs)
    assert torch.equal(spec["sequences"], plain["sequences"])
    assert spec["speculative_stats"].accepted_tokens > 0


@pytest.mark.parametrize("arch, overrides", [("mistral", dict(sliding_window=6)), ("gpt2", dict(eos_token_id=500))])
def test_sliding_window_cache_and_an_eos_outside_the_vocabulary(arch, overrides):
    target = hf_specdec.enable(tiny_model(arch, **overrides))
    target.generation_config.eos_token_id = overrides.get("eos_token_id")
    ids = _inputs(arch)
    for max_new_tokens in (1, 16):
        plain = target.generate(ids, num_beams=3, max_new_tokens=max_new_tokens)
        spec = target.generate(
            ids,
            assistant_model=noisy_copy(target, 0.05),
            num_beams=3,
            speculative_gamma=3,
            speculative_draft_beams=6,
            max_new_tokens=max_new_tokens,
        )
        assert torch.equal(spec, plain)


@pytest.mark.parametrize("kind", DRAFTERS)
def test_repetition_penalty_on_a_left_padded_batch(kind):
    """transformers gives repetition penalty one prompt padding length per beam row; the drafter's own beams (w,
    then u per prompt) get their prompt's. It raised `Incompatible prompt_ignore_length batch size`."""
    target = _target("llama")
    ids = torch.cat([prompt(8, seed=0), prompt(8, seed=1)])
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(
        attention_mask=mask,
        num_beams=2,
        max_new_tokens=12,
        pad_token_id=0,
        repetition_penalty=1.5,
        return_dict_in_generate=True,
        output_scores=True,
    )
    plain = target.generate(ids, **kwargs)
    spec = target.generate(ids, assistant_model=_drafter(target, "llama", kind), speculative_gamma=3, **kwargs)
    assert_same_beams(plain, spec)


@pytest.mark.parametrize("kind", DRAFTERS)
def test_a_prefix_function_is_asked_about_each_beam_s_own_prompt(kind):
    """`prefix_allowed_tokens_fn` on a batch of two: the drafter's own beams (w, then u per prompt) ask the function
    about their own prompt, numbered as plain beam search numbers them (they got 0 to 2 for two prompts, and a
    function indexing per-prompt constraints raised)."""
    target = _target("llama")
    ids = _inputs("llama")
    seen = set()

    def allowed(batch_id, sent):
        seen.add(batch_id)
        return [list(range(3, 11)), list(range(20, 26))][batch_id]

    kwargs = dict(
        num_beams=3,
        max_new_tokens=8,
        prefix_allowed_tokens_fn=allowed,
        return_dict_in_generate=True,
        output_scores=True,
    )
    plain = target.generate(ids, **kwargs)
    seen.clear()
    spec = target.generate(ids, assistant_model=_drafter(target, "llama", kind), speculative_gamma=3, **kwargs)
    assert_same_beams(plain, spec)
    assert seen == {0, 1}
    # each prompt's tokens come from its own constraints
    assert set(spec.sequences[0, 8:].tolist()) <= set(range(3, 11))
    assert set(spec.sequences[1, 8:].tolist()) <= set(range(20, 26))


@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_a_static_cache_is_refused_clearly(arch):
    """An encoder-decoder's static cache (static caches inside an `EncoderDecoderCache`) reached the loop and failed
    there with `TypeError: crop is only defined for dynamic cache`; it is refused up front, as a decoder-only one."""
    target = _target(arch)
    with pytest.raises(
        ValueError,
        match=r"Speculative beam search needs the target's cache to be a croppable dynamic "
        r"cache, got StaticCache \(cache_implementation='static'\)",
    ):
        target.generate(
            _inputs(arch)[:1], assistant_model=target, num_beams=3, max_new_tokens=6, cache_implementation="static"
        )
