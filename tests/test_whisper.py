"""Whisper, exact: a tiny Whisper from its config, a real `WhisperFeatureExtractor`, a tokenizer trained here, and
synthesized tones. Speculative greedy decoding must equal plain `generate` with every kind of drafter and with
Whisper's own generation features."""

import pytest
import torch
from transformers import pipeline

import hf_specdec
from whisper_setup import build_tokenizer, decoder_of, feature_extractor, features, tone, whisper

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("whisper_tokenizer")))


@pytest.fixture(scope="module")
def target(tokenizer):
    return hf_specdec.enable(whisper(tokenizer, seed=0))


@pytest.fixture(scope="module")
def clip():
    return features([tone(3.0, 440.0)])


def assert_exact(target, inputs, drafter_args, **kwargs):
    """Speculative == plain, both as Whisper returns tensors (its init tokens stripped) and as it returns outputs."""
    plain = target.generate(inputs, max_new_tokens=NEW_TOKENS, **kwargs)
    spec = target.generate(inputs, max_new_tokens=NEW_TOKENS, speculative_gamma=4, **drafter_args, **kwargs)
    assert torch.equal(spec, plain)
    plain_dict = target.generate(inputs, max_new_tokens=NEW_TOKENS, return_dict_in_generate=True, **kwargs)
    out = target.generate(inputs, max_new_tokens=NEW_TOKENS, speculative_gamma=4, return_dict_in_generate=True,
                          **drafter_args, **kwargs)
    assert torch.equal(out["sequences"], plain_dict["sequences"])
    assert len(set(plain[0].tolist())) >= 4  # not degenerate: a wrong drafter would show
    return out["speculative_stats"]


def test_enabling_keeps_plain_generate(tokenizer, clip):
    model = whisper(tokenizer, seed=0)
    plain = model.generate(clip, max_new_tokens=NEW_TOKENS)
    hf_specdec.enable(model)
    assert torch.equal(model.generate(clip, max_new_tokens=NEW_TOKENS), plain)
    assert torch.equal(model.generate(input_features=clip, max_new_tokens=NEW_TOKENS), plain)


def test_drafters(target, tokenizer, clip):
    stats = assert_exact(target, clip, dict(assistant_model=target))
    assert stats.acceptance_rate == 1.0
    # a smaller Whisper with its own encoder: mostly wrong, still exact
    assert_exact(target, clip, dict(assistant_model=whisper(tokenizer, seed=1, decoder_layers=1)))
    assert_exact(target, clip, dict(drafter="prompt_lookup"))
    plain = target.generate(clip, max_new_tokens=NEW_TOKENS)
    table = hf_specdec.NGramDrafter.from_corpus([plain[0].tolist()] * 2, n=2, vocab_size=len(tokenizer))
    stats = assert_exact(target, clip, dict(drafter=table))
    assert stats.accepted_tokens > 0


def test_decoder_only_assistant_reads_the_target_encoder_outputs(target, clip):
    # the distil-whisper layout: a WhisperForCausalLM drafter reads the target's encoder outputs
    stats = assert_exact(target, clip, dict(assistant_model=decoder_of(target)))
    assert stats.acceptance_rate == 1.0


@pytest.mark.parametrize("features_kwargs", [
    dict(language="fr", task="transcribe"),
    dict(language="en", task="translate"),
    dict(return_timestamps=True),
])
def test_whisper_generation_features(target, clip, features_kwargs):
    assert_exact(target, clip, dict(drafter="prompt_lookup"), **features_kwargs)
    assert_exact(target, clip, dict(assistant_model=target), **features_kwargs)


def test_prompt_ids_and_suppressed_tokens(target, tokenizer, clip):
    prompt_ids = torch.tensor(tokenizer.get_prompt_ids("the cat sat"))
    assert_exact(target, clip, dict(drafter="prompt_lookup"), prompt_ids=prompt_ids)
    suppressed = target.generate(clip, max_new_tokens=NEW_TOKENS)[0, :3].tolist()
    stats = assert_exact(target, clip, dict(assistant_model=target), suppress_tokens=suppressed)
    assert stats.acceptance_rate == 1.0


def test_batch_of_clips(target, tokenizer):
    batch = features([tone(2.0, 300.0), tone(4.0, 900.0, seed=1), tone(1.0, 150.0, seed=2)])
    assert_exact(target, batch, dict(drafter="prompt_lookup"))
    assert_exact(target, batch, dict(assistant_model=whisper(tokenizer, seed=1, decoder_layers=1)))


def test_long_form_audio(target):
    # beyond 30 s: Whisper decodes segment after segment, each one a call to the speculative loop
    audio = tone(45.0, 500.0)
    inputs = feature_extractor()(audio, sampling_rate=16_000, return_tensors="pt", truncation=False,
                                 padding="longest", return_attention_mask=True)
    arguments = dict(attention_mask=inputs.attention_mask, return_timestamps=True, condition_on_prev_tokens=False)
    plain = target.generate(inputs.input_features, **arguments)
    spec = target.generate(inputs.input_features, drafter="prompt_lookup", speculative_gamma=4, **arguments)
    assert torch.equal(spec, plain)


def test_speech_recognition_pipeline_takes_an_assistant(target, tokenizer):
    clips = [tone(2.0, 300.0), tone(3.0, 700.0, seed=1)]
    plain_pipe = pipeline("automatic-speech-recognition", model=target, tokenizer=tokenizer,
                          feature_extractor=feature_extractor())
    # transformers' speech pipeline defaults to beam search (num_beams=5): checked last, with speculative beam search
    generate_kwargs = {"max_new_tokens": NEW_TOKENS, "num_beams": 1}
    plain = plain_pipe(clips, generate_kwargs=generate_kwargs)
    assistant = whisper(tokenizer, seed=1, decoder_layers=1)
    pipe = pipeline("automatic-speech-recognition", model=target, tokenizer=tokenizer,
                    feature_extractor=feature_extractor(), assistant_model=assistant)
    assert pipe(clips, generate_kwargs={**generate_kwargs, "speculative_gamma": 4}) == plain
    assert plain_pipe(clips, generate_kwargs={**generate_kwargs, "drafter": "prompt_lookup"}) == plain
    assert pipe(clips, generate_kwargs={"max_new_tokens": NEW_TOKENS}) == plain_pipe(
        clips, generate_kwargs={"max_new_tokens": NEW_TOKENS})
    assert all(len(record["text"]) > 0 for record in plain)
