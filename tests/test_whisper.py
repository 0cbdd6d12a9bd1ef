"""Whisper, exact: a tiny Whisper from its config, a real `WhisperFeatureExtractor`, a tokenizer trained here, and
synthesized tones. Speculative greedy decoding must equal plain `generate` with every kind of drafter and with
Whisper's own generation features."""

import copy
import re

import pytest
import torch
from conftest import noisy_copy
from test_sampling_distribution import P_THRESHOLD, goodness_of_fit, processors
from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration, pipeline
from transformers.modeling_outputs import BaseModelOutput
from whisper_setup import SAMPLING_RATE, build_tokenizer, decoder_of, feature_extractor, features, tone, whisper

import hf_specdec
from hf_specdec.pipelines import SpeechRecognitionPipeline

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
    out = target.generate(
        inputs, max_new_tokens=NEW_TOKENS, speculative_gamma=4, return_dict_in_generate=True, **drafter_args, **kwargs
    )
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


@pytest.mark.parametrize(
    "features_kwargs",
    [
        dict(language="fr", task="transcribe"),
        dict(language="en", task="translate"),
        dict(return_timestamps=True),
    ],
)
def test_whisper_generation_features(target, clip, features_kwargs):
    assert_exact(target, clip, dict(drafter="prompt_lookup"), **features_kwargs)
    assert_exact(target, clip, dict(assistant_model=target), **features_kwargs)


def test_word_timestamps_are_refused_naming_them(target, tokenizer, clip):
    """Whisper turns `output_attentions` on for word-level timestamps: the refusal names the timestamps (it told
    the user to set `output_attentions=False`, which they never set)."""
    target = copy.deepcopy(target)
    target.generation_config.alignment_heads = [[0, 0]]  # the cross-attention heads word timestamps read
    plain = target.generate(clip, max_new_tokens=NEW_TOKENS, return_token_timestamps=True)
    assert plain["token_timestamps"].shape[0] == 1  # served without a drafter
    with pytest.raises(ValueError, match=r"Word-level timestamps \(`return_token_timestamps=True`.* Drop the drafter"):
        target.generate(clip, max_new_tokens=NEW_TOKENS, return_token_timestamps=True, drafter="prompt_lookup")
    asr = pipeline(
        "automatic-speech-recognition", model=target, tokenizer=tokenizer, feature_extractor=feature_extractor()
    )
    audio = tone(3.0, 440.0)
    generate_kwargs = {"max_new_tokens": NEW_TOKENS, "num_beams": 1}
    assert asr(audio, return_timestamps="word", generate_kwargs=generate_kwargs)["chunks"]  # served without one
    with pytest.raises(ValueError, match=r"a pipeline's `return_timestamps=\"word\"`"):
        asr(audio, return_timestamps="word", generate_kwargs={**generate_kwargs, "drafter": "prompt_lookup"})


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
    inputs = feature_extractor()(
        audio,
        sampling_rate=16_000,
        return_tensors="pt",
        truncation=False,
        padding="longest",
        return_attention_mask=True,
    )
    arguments = dict(attention_mask=inputs.attention_mask, return_timestamps=True, condition_on_prev_tokens=False)
    plain = target.generate(inputs.input_features, **arguments)
    spec = target.generate(inputs.input_features, drafter="prompt_lookup", speculative_gamma=4, **arguments)
    assert torch.equal(spec, plain)


# sampling: Whisper samples only with a temperature; top-k 2 over 3 free tokens makes the support 8 sequences
WARPING = dict(temperature=1.0, top_k=2)
SAMPLING = dict(language="en", task="transcribe", do_sample=True, **WARPING)
FREE_TOKENS = 3
SAMPLES = 400  # drawn in one call, as the rows of a batch of identical clips (each row an independent sample)
# constant γ: the default policy stops drafting when tiny drafters are measured not to pay
SPECULATION = dict(speculative_gamma=2, speculative_gamma_policy="constant")


@torch.no_grad()
def exact_distribution(model, encoder_outputs, prefix, length, config):
    """P(x_1..x_length | clip, forced prefix) under `model` with the processors `generate` builds, by enumeration."""
    procs = processors(model, prefix, config)
    table = {(): 1.0}
    for _ in range(length):
        grown = {}
        for path, probability in table.items():
            ids = torch.cat([prefix, torch.tensor([path], dtype=torch.long).reshape(1, -1)], dim=-1)
            logits = model(encoder_outputs=encoder_outputs, decoder_input_ids=ids).logits[:, -1].float()
            probs = procs(ids, logits).softmax(-1)[0]  # [vocab]
            for token in torch.nonzero(probs).flatten().tolist():
                grown[path + (token,)] = probability * probs[token].item()
        table = grown
    return table


def sampled_paths(model, prefix, inputs, **kwargs):
    """SAMPLES sampled continuations of the forced prefix, one per row of a batch of identical inputs, and the
    speculative statistics (None without speculation)."""
    torch.manual_seed(1234)
    out = model.generate(**inputs, max_new_tokens=FREE_TOKENS, return_dict_in_generate=True, **SAMPLING, **kwargs)
    assert (out.sequences[:, : prefix.shape[1]] == prefix).all()  # the forced tokens are Whisper's own
    paths = [tuple(row) for row in out.sequences[:, prefix.shape[1] :].tolist()]
    assert len(paths) == SAMPLES
    return paths, getattr(out, "speculative_stats", None)


@pytest.fixture(scope="module")
def sampling_setup(tokenizer):
    """A Whisper over 1 s windows (50 encoder positions: cheap to sample), its clip's features from a real
    `WhisperFeatureExtractor`, the encoder outputs computed once, the forced prefix, and the exact distribution."""
    target = hf_specdec.enable(whisper(tokenizer, seed=0, eos=False, max_source_positions=50, init_std=0.1))
    extractor = WhisperFeatureExtractor(feature_size=80, sampling_rate=SAMPLING_RATE, chunk_length=1)
    clip = extractor(tone(1.0, 440.0), sampling_rate=SAMPLING_RATE, return_tensors="pt").input_features  # [1, 80, 100]
    with torch.no_grad():
        encoder_outputs = target.get_encoder()(clip)
    prefix = torch.tensor(
        [tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"])]
    )
    table = exact_distribution(target, encoder_outputs, prefix, FREE_TOKENS, WARPING)
    assert len(table) == 2**FREE_TOKENS and max(table.values()) < 0.5  # not degenerate
    return target, clip, encoder_outputs, prefix, table


def test_sampling_follows_the_target_distribution(sampling_setup, tokenizer):
    target, clip, encoder_outputs, prefix, table = sampling_setup
    batch = dict(input_features=clip.expand(SAMPLES, -1, -1))
    # the enumeration is right: plain sampling fits it
    assert goodness_of_fit(table, sampled_paths(target, prefix, batch)[0]) > P_THRESHOLD

    # partly right: a Whisper with its own encoder, the target's weights plus noise
    drafter = noisy_copy(target, 0.15)
    samples, stats = sampled_paths(target, prefix, batch, assistant_model=drafter, **SPECULATION)
    assert 0.1 < stats.acceptance_rate < 0.9
    assert goodness_of_fit(table, samples) > P_THRESHOLD
    # power: accepting every draft would sample the drafter's q; even drawn only where p > 0, the test rejects it
    with torch.no_grad():
        drafter_table = exact_distribution(drafter, drafter.get_encoder()(clip), prefix, FREE_TOKENS, WARPING)
    shared = [path for path in drafter_table if path in table]
    torch.manual_seed(0)
    draws = torch.multinomial(torch.tensor([drafter_table[path] for path in shared]), SAMPLES, replacement=True)
    assert goodness_of_fit(table, [shared[i] for i in draws.tolist()]) < P_THRESHOLD

    # mostly wrong: a smaller, unrelated Whisper (nearly every draft rejected, its token recovered from the residual)
    smaller = whisper(tokenizer, seed=1, decoder_layers=1, eos=False, max_source_positions=50, init_std=0.1)
    samples, stats = sampled_paths(target, prefix, batch, assistant_model=smaller, **SPECULATION)
    assert stats.acceptance_rate < 0.1 and goodness_of_fit(table, samples) > P_THRESHOLD

    # a decoder-only assistant on the target's encoder outputs (computed once and passed to generate)
    reader = noisy_copy(decoder_of(target), 0.15)
    expanded = dict(
        encoder_outputs=BaseModelOutput(last_hidden_state=encoder_outputs.last_hidden_state.expand(SAMPLES, -1, -1))
    )
    samples, stats = sampled_paths(target, prefix, expanded, assistant_model=reader, **SPECULATION)
    assert 0.1 < stats.acceptance_rate < 0.9
    assert goodness_of_fit(table, samples) > P_THRESHOLD


def test_speech_recognition_pipeline_takes_an_assistant(target, tokenizer):
    clips = [tone(2.0, 300.0), tone(3.0, 700.0, seed=1)]
    plain_pipe = pipeline(
        "automatic-speech-recognition", model=target, tokenizer=tokenizer, feature_extractor=feature_extractor()
    )
    # transformers' speech pipeline defaults to beam search (num_beams=5): checked last, with speculative beam search
    generate_kwargs = {"max_new_tokens": NEW_TOKENS, "num_beams": 1}
    plain = plain_pipe(clips, generate_kwargs=generate_kwargs)
    assistant = whisper(tokenizer, seed=1, decoder_layers=1)
    pipe = pipeline(
        "automatic-speech-recognition",
        model=target,
        tokenizer=tokenizer,
        feature_extractor=feature_extractor(),
        assistant_model=assistant,
    )
    assert pipe(clips, generate_kwargs={**generate_kwargs, "speculative_gamma": 4}) == plain
    assert plain_pipe(clips, generate_kwargs={**generate_kwargs, "drafter": "prompt_lookup"}) == plain
    assert pipe(clips, generate_kwargs={"max_new_tokens": NEW_TOKENS}) == plain_pipe(
        clips, generate_kwargs={"max_new_tokens": NEW_TOKENS}
    )
    assert all(len(record["text"]) > 0 for record in plain)


def test_speech_recognition_pipeline_loads_path_assistants_from_safetensors_only(target, tokenizer, tmp_path):
    clips = [tone(2.0, 300.0), tone(3.0, 700.0, seed=1)]
    extractor = feature_extractor()
    generate_kwargs = {"max_new_tokens": NEW_TOKENS, "num_beams": 1}
    plain_pipe = pipeline(
        "automatic-speech-recognition", model=target, tokenizer=tokenizer, feature_extractor=extractor
    )
    assert isinstance(plain_pipe, SpeechRecognitionPipeline)  # importing hf_specdec pointed the task at it
    plain = plain_pipe(clips, generate_kwargs=generate_kwargs)
    assistant = whisper(tokenizer, seed=1, decoder_layers=1)
    saved = tmp_path / "assistant"
    assistant.save_pretrained(saved)
    tokenizer.save_pretrained(saved)

    pipe = pipeline(
        "automatic-speech-recognition",
        model=target,
        tokenizer=tokenizer,
        feature_extractor=extractor,
        assistant_model=str(saved),
    )
    loaded = pipe.assistant_model
    assert isinstance(loaded, WhisperForConditionalGeneration) and loaded is not assistant
    assert all(torch.equal(value, assistant.state_dict()[name]) for name, value in loaded.state_dict().items())
    assert pipe(clips, generate_kwargs={**generate_kwargs, "speculative_gamma": 4}) == plain
    # in a call: loaded once per pipeline; over the construction's assistant; None decodes without one
    assert plain_pipe(clips, generate_kwargs={**generate_kwargs, "assistant_model": str(saved)}) == plain
    assert plain_pipe(clips, assistant_model=str(saved), generate_kwargs=generate_kwargs) == plain
    assert list(plain_pipe._loaded_assistants) == [str(saved)]
    assert pipe(clips, generate_kwargs={**generate_kwargs, "assistant_model": target}) == plain
    assert pipe(clips, generate_kwargs={**generate_kwargs, "assistant_model": None}) == plain

    # a directory with only a pickle checkpoint is refused before anything is read from it
    pickled = tmp_path / "pickled"
    assistant.save_pretrained(pickled)
    tokenizer.save_pretrained(pickled)
    (pickled / "model.safetensors").unlink()
    torch.save(assistant.state_dict(), pickled / "pytorch_model.bin")
    refusal = (
        rf"`assistant_model` '{re.escape(str(pickled))}' holds no safetensors weights \(only the pickle "
        r"checkpoint pytorch_model.bin\).*never unpickled.*save_pretrained"
    )
    with pytest.raises(ValueError, match=refusal):
        pipeline(
            "automatic-speech-recognition",
            model=target,
            tokenizer=tokenizer,
            feature_extractor=extractor,
            assistant_model=str(pickled),
        )
    with pytest.raises(ValueError, match=refusal):
        plain_pipe(clips, generate_kwargs={**generate_kwargs, "assistant_model": str(pickled)})
    # transformers' own loader reads it (so the refusal is this library's)
    assert isinstance(WhisperForConditionalGeneration.from_pretrained(pickled), WhisperForConditionalGeneration)
