"""hf_specdec.pipelines: the text2text-generation, summarization and translation pipelines, and speculative arguments
passed through transformers' pipelines (speculative output == plain output).

`pipeline(task, ...)` builds hf_specdec's pipelines once they are registered: by the process's first `hf_specdec.enable`
or by `register_pipelines()`. Each test enables its models or calls `register_pipelines()` as a user would; conftest's
session fixture has already installed both before the first test, so those calls change nothing here."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from conftest import noisy_copy, tiny_model
from transformers import AutoConfig, AutoModelForSeq2SeqLM, PreTrainedTokenizerFast, T5Model, pipeline
from transformers.pipelines.base import PipelineRegistry

import hf_specdec
import hf_specdec.pipelines
from hf_specdec.pipelines import (
    SpeechRecognitionPipeline,
    SummarizationPipeline,
    Text2TextGenerationPipeline,
    TextGenerationPipeline,
    TranslationPipeline,
    register_pipelines,
)
from hf_specdec.pipelines.registration import _load_path_assistants_safely

PAD, EOS, UNK = 0, 1, 2  # the tokenizer's special tokens, in this order; the decoder starts from PAD (as T5)
NEW_TOKENS = 20
GREEDY = dict(max_new_tokens=NEW_TOKENS, do_sample=False)

SEQ2SEQ = {
    # T5 always ties its head to its embeddings: gated-GELU and 4x its other weights make its greedy output vary
    "t5": dict(d_model=32, d_ff=64, d_kv=8, num_layers=1, num_heads=4, feed_forward_proj="gated-gelu"),
    "bart": dict(
        d_model=32,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        tie_word_embeddings=False,
    ),
    "marian": dict(
        d_model=32,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        tie_word_embeddings=False,
        max_position_embeddings=128,
    ),
}
# how much Gaussian noise (relative to each weight's std) makes the drafter partly right
DRAFT_NOISE = {"t5": 0.01, "bart": 0.1, "marian": 0.1}
# each pipeline with the architecture it is tested on, and its output key
TASKS = [
    ("text2text-generation", "t5", "generated"),
    ("summarization", "bart", "summary"),
    ("translation_en_to_de", "marian", "translation"),
]
TEXTS = [
    "translate English to German: the cat sat on the mat",
    "summarize: the quick brown fox jumps over the lazy dog while the cat watches",
]
CORPUS = TEXTS + [
    "speculative decoding drafts tokens with a small model and verifies them with a large one",
    "die Katze sitzt auf der Matte und der Hund schaut zu",
]


@pytest.fixture(scope="module")
def tokenizer():
    """A BPE tokenizer trained here, with pad / eos / unk at the ids the tiny models' configs use."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "</s>", "<unk>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(CORPUS * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (PAD, EOS, UNK)
    return tokenizer


def tiny_seq2seq(arch: str, vocab_size: int, seed: int = 0):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        arch,
        **SEQ2SEQ[arch],
        vocab_size=vocab_size,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=PAD,
        forced_eos_token_id=None,
    )
    model = AutoModelForSeq2SeqLM.from_config(config).eval()
    # random-init decoders repeat one token forever; larger weights make the greedy output depend on the source and
    # vary, so that a wrong draft would show
    with torch.no_grad():
        if arch == "t5":
            for name, param in model.named_parameters():
                if param.dim() == 2 and name != "shared.weight":
                    param.mul_(4.0)
        else:
            for param in model.parameters():
                if param.dim() == 2:
                    param.normal_(0.0, param.shape[-1] ** -0.5)
            model.get_output_embeddings().weight.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def seq2seq_pairs(tokenizer):
    """arch -> (enabled target, partly-right drafter, plain greedy outputs of TEXTS)."""
    pairs = {}
    for arch in SEQ2SEQ:
        target = hf_specdec.enable(tiny_seq2seq(arch, len(tokenizer)))
        plain = [target.generate(**tokenizer(text, return_tensors="pt"), **GREEDY)[0] for text in TEXTS]
        for ids in plain:  # the decoder start token, then NEW_TOKENS tokens that are not all alike
            assert ids.shape[0] == NEW_TOKENS + 1 and len(set(ids.tolist())) > 5, (arch, ids)
        pairs[arch] = target, noisy_copy(target, DRAFT_NOISE[arch]), plain
    return pairs


@pytest.mark.parametrize("arch", sorted(SEQ2SEQ))
def test_drafters_are_partly_right(seq2seq_pairs, tokenizer, arch):
    target, drafter, plain = seq2seq_pairs[arch]
    inputs = tokenizer(TEXTS[0], return_tensors="pt")
    out = target.generate(
        **inputs, assistant_model=drafter, speculative_gamma=4, return_dict_in_generate=True, **GREEDY
    )
    assert torch.equal(out.sequences[0], plain[0])
    assert 0.0 < out.speculative_stats.acceptance_rate < 1.0


@pytest.mark.parametrize("task, arch, key", TASKS, ids=[task for task, _, _ in TASKS])
def test_speculative_pipeline_output_is_plain_output(seq2seq_pairs, tokenizer, task, arch, key):
    target, drafter, plain = seq2seq_pairs[arch]
    pipe = pipeline(task, model=target, tokenizer=tokenizer)
    expected = [{f"{key}_text": tokenizer.decode(ids, skip_special_tokens=True)} for ids in plain]
    assert len(set(record[f"{key}_text"] for record in expected)) == 2

    assert pipe(TEXTS[0], **GREEDY) == expected[:1]  # one input: a list of one record
    assert pipe(TEXTS, **GREEDY) == expected  # a list of inputs: one record each
    assert pipe(TEXTS[0], assistant_model=drafter, speculative_gamma=5, **GREEDY) == expected[:1]
    assert pipe(TEXTS, assistant_model=drafter, speculative_gamma=3, **GREEDY) == expected
    assert pipe(TEXTS, drafter="prompt_lookup", **GREEDY) == expected
    assert pipe(TEXTS[1], drafter="prompt_lookup", drafter_kwargs={"min_ngram_size": 1}, **GREEDY) == expected[1:]
    # return_tensors alone returns the ids only, as in transformers 4.x; with return_text both
    assert torch.equal(
        pipe(TEXTS[0], return_tensors=True, drafter="prompt_lookup", **GREEDY)[0][f"{key}_token_ids"], plain[0]
    )
    assert pipe(TEXTS[0], return_tensors=True, return_text=True, **GREEDY)[0].keys() == {
        f"{key}_text",
        f"{key}_token_ids",
    }


def test_assistant_model_at_construction_and_as_a_path(seq2seq_pairs, tokenizer, tmp_path):
    target, drafter, plain = seq2seq_pairs["t5"]
    expected = [{"generated_text": tokenizer.decode(ids, skip_special_tokens=True)} for ids in plain]
    drafter.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    pipe = pipeline(
        "text2text-generation",
        model=target,
        tokenizer=tokenizer,
        assistant_model=drafter,
        speculative_gamma=4,
        **GREEDY,
    )
    assert pipe.assistant_model is drafter
    assert pipe(TEXTS) == expected
    assert pipe(TEXTS[0], assistant_model=None) == expected[:1]  # a call can turn the assistant off
    # (the construction's γ waits for the calls that draft); a call's own γ without any drafter is refused
    with pytest.raises(ValueError, match="`speculative_tree_budget=4` was given without a drafter"):
        pipe(TEXTS[0], assistant_model=None, speculative_tree_budget=4)
    # stop strings end speculative and plain generation at the same place
    full_text = expected[1]["generated_text"]
    stop = next(char for char in full_text[len(full_text) // 2 :] if char.isascii() and char.isalpha())
    stopped = pipe(TEXTS[1], stop_sequence=stop)
    assert stopped == pipe(TEXTS[1], stop_sequence=stop, assistant_model=None)
    assert len(stopped[0]["generated_text"]) < len(full_text)

    from_path = pipeline("text2text-generation", model=target, tokenizer=tokenizer, assistant_model=str(tmp_path))
    assert from_path.assistant_model is not drafter
    assert from_path(TEXTS, **GREEDY) == expected

    per_call = pipeline("text2text-generation", model=target, tokenizer=tokenizer)
    assert per_call(TEXTS, assistant_model=str(tmp_path), **GREEDY) == expected

    # safetensors only: a directory with only a pickle checkpoint is refused, naming it and the fix
    pickled = tmp_path / "pickled"
    drafter.save_pretrained(pickled)
    (pickled / "model.safetensors").unlink()
    torch.save(drafter.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(
        ValueError,
        match=rf"'{re.escape(str(pickled))}' holds no safetensors weights \(only the "
        r"pickle checkpoint pytorch_model.bin\).*save_pretrained",
    ):
        per_call(TEXTS[0], assistant_model=str(pickled), **GREEDY)

    # the registered tasks load checkpoints (and their tokenizer) like any transformers pipeline
    loaded = pipeline("summarization", model=str(tmp_path))
    assert isinstance(loaded, SummarizationPipeline) and loaded.model.config.is_encoder_decoder
    assert loaded(TEXTS[0], max_new_tokens=3)[0].keys() == {"summary_text"}


def test_translation_task_names_and_task_specific_params(tokenizer):
    model = hf_specdec.enable(tiny_seq2seq("t5", len(tokenizer)))
    model.config.task_specific_params = {
        "translation_en_to_de": {"prefix": "translate English to German: ", "max_new_tokens": 7}
    }
    saved = copy.deepcopy(model.config.task_specific_params)
    direct = model.generate(**tokenizer(TEXTS[0], return_tensors="pt"), max_new_tokens=7)[0]

    translator = pipeline("translation_en_to_de", model=model, tokenizer=tokenizer)
    assert isinstance(translator, TranslationPipeline)
    expected = [{"translation_text": tokenizer.decode(direct, skip_special_tokens=True)}]
    assert translator("the cat sat on the mat") == expected
    assert translator("the cat sat on the mat", drafter="prompt_lookup") == expected
    assert model.config.task_specific_params == saved  # read, never written
    # the parameters of another task do not apply
    other_task = pipeline("translation", model=model, tokenizer=tokenizer)
    assert other_task("the cat sat on the mat", max_new_tokens=7) != expected
    with pytest.raises(KeyError, match="translation_XX_to_YY"):
        pipeline("translation_en_de", model=model, tokenizer=tokenizer)


def test_text_generation_pipeline_passes_speculative_arguments(tokenizer):
    target = hf_specdec.enable(tiny_model("llama", seed=0, vocab_size=len(tokenizer)))
    drafter = noisy_copy(target, 0.3)
    prompt = "the quick brown fox jumps over"
    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer)
    expected = pipe(prompt, **GREEDY)
    assert len(tokenizer(expected[0]["generated_text"])["input_ids"]) > NEW_TOKENS

    assert pipe(prompt, assistant_model=drafter, speculative_gamma=4, **GREEDY) == expected
    assert pipe(prompt, drafter="prompt_lookup", **GREEDY) == expected
    assisted = pipeline(
        "text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter, speculative_gamma=2
    )
    assert assisted([prompt, prompt], **GREEDY) == [expected, expected]
    # the construction's γ waits in a call that turns the assistant off; a call's γ without any drafter is refused
    assert assisted(prompt, assistant_model=None, **GREEDY) == expected
    with pytest.raises(ValueError, match="`speculative_gamma=4` was given without a drafter"):
        pipe(prompt, speculative_gamma=4, **GREEDY)
    # in `generate_kwargs`, per call and at construction (transformers' text generation would hand `generate_kwargs`
    # itself to `generate`, which refuses it as an unused model argument); the caller's dict is left as it was
    generate_kwargs = {"drafter": "prompt_lookup", "speculative_gamma": 3, **GREEDY}
    assert pipe(prompt, generate_kwargs=generate_kwargs) == expected
    assert generate_kwargs == {"drafter": "prompt_lookup", "speculative_gamma": 3, **GREEDY}
    nested = pipeline(
        "text-generation", model=target, tokenizer=tokenizer, generate_kwargs={"drafter": "prompt_lookup"}
    )
    assert nested(prompt, **GREEDY) == expected


def test_text_generation_pipeline_loads_path_assistants_from_safetensors_only(tokenizer, tmp_path):
    target = hf_specdec.enable(tiny_model("llama", seed=0, vocab_size=len(tokenizer)))
    drafter = noisy_copy(target, 0.3)
    drafter.save_pretrained(tmp_path / "draft")
    tokenizer.save_pretrained(tmp_path / "draft")
    prompt = "the quick brown fox jumps over"
    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer)
    assert isinstance(pipe, TextGenerationPipeline)  # importing hf_specdec pointed the task at it
    expected = pipe(prompt, **GREEDY)

    from_path = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=str(tmp_path / "draft"))
    loaded = from_path.assistant_model
    assert loaded is not drafter and all(
        torch.equal(value, drafter.state_dict()[name]) for name, value in loaded.state_dict().items()
    )
    assert from_path(prompt, speculative_gamma=4, **GREEDY) == expected
    assert pipe(prompt, assistant_model=str(tmp_path / "draft"), **GREEDY) == expected  # a path in a call
    assert list(pipe._loaded_assistants) == [str(tmp_path / "draft")]  # loaded once per pipeline
    assert from_path(prompt, assistant_model=None, **GREEDY) == expected  # a call's choice wins, None included

    pickled = tmp_path / "pickled"
    drafter.save_pretrained(pickled)
    (pickled / "model.safetensors").unlink()
    torch.save(drafter.state_dict(), pickled / "pytorch_model.bin")
    refusal = (
        rf"'{re.escape(str(pickled))}' holds no safetensors weights \(only the pickle checkpoint pytorch_model.bin\)"
    )
    with pytest.raises(ValueError, match=refusal):
        pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=str(pickled))
    with pytest.raises(ValueError, match=refusal):
        pipe(prompt, assistant_model=str(pickled), **GREEDY)


def test_wrong_model_kind_is_a_clear_error(tokenizer):
    register_pipelines()  # no model is enabled here: the tasks are registered as a user would register them
    decoder_only = tiny_model("llama", vocab_size=len(tokenizer))
    with pytest.raises(
        ValueError,
        match=r"`text2text-generation` pipeline needs an encoder-decoder model .*"
        r"LlamaForCausalLM.*pipeline\(\"text-generation\"",
    ):
        pipeline("text2text-generation", model=decoder_only, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"`summarization` pipeline needs an encoder-decoder"):
        SummarizationPipeline(model=decoder_only, tokenizer=tokenizer)
    headless = T5Model(tiny_seq2seq("t5", len(tokenizer)).config)
    with pytest.raises(
        ValueError,
        match=r"`translation` pipeline needs a model with a language-modeling head, got "
        r"T5Model.*AutoModelForSeq2SeqLM",
    ):
        pipeline("translation", model=headless, tokenizer=tokenizer)


def test_speculative_arguments_need_an_enabled_model(seq2seq_pairs, tokenizer):
    _, drafter, _ = seq2seq_pairs["t5"]
    plain_model = tiny_seq2seq("t5", len(tokenizer))
    pipe = pipeline("text2text-generation", model=plain_model, tokenizer=tokenizer)
    with pytest.raises(
        ValueError,
        match=r"`drafter` need\(s\) speculative decoding.*T5ForConditionalGeneration.*"
        r"hf_specdec.enable\(model\)",
    ):
        pipe(TEXTS[0], drafter="prompt_lookup")
    with pytest.raises(ValueError, match=r"`assistant_model`, `speculative_gamma` need\(s\)"):
        pipeline("summarization", model=plain_model, tokenizer=tokenizer, assistant_model=drafter, speculative_gamma=3)
    assert not isinstance(plain_model, hf_specdec.SpeculativeGenerationMixin)  # the pipeline did not enable it
    assert pipe(TEXTS[0], max_new_tokens=3, assistant_model=None)  # None is no speculation
    # an assistant's tokenizer without the assistant (drafting across tokenizers: tests/test_cross_tokenizer.py)
    with pytest.raises(
        ValueError,
        match=r"`assistant_tokenizer` \(\w+\) is the tokenizer of an `assistant_model`.*"
        r"Pass `assistant_model=",
    ):
        pipeline(
            "summarization", model=hf_specdec.enable(plain_model), tokenizer=tokenizer, assistant_tokenizer=tokenizer
        )


def test_registration_keeps_tasks_transformers_has():
    existing = {"impl": object, "pt": ()}
    registry = PipelineRegistry({"summarization": existing}, {"text2text-generation": "summarization"})
    removed = {"summarization": "gone", "translation": "gone", "text2text-generation": "gone"}

    assert register_pipelines(registry, removed) == ["translation"]
    assert registry.supported_tasks["summarization"] is existing
    assert registry.task_aliases == {"text2text-generation": "summarization"}
    assert registry.supported_tasks["translation"]["impl"] is TranslationPipeline
    assert removed == {"summarization": "gone", "text2text-generation": "gone"}
    # 4.x's parametrized names resolve to "translation" with the language pair, which selects the default checkpoint
    task, entry, options = registry.check_task("translation_en_to_fr")
    assert (task, entry["impl"], options) == ("translation", TranslationPipeline, ("en", "fr"))
    assert entry["default"][options]["model"][0] == "google-t5/t5-base"
    assert register_pipelines(registry, removed) == []  # a second call changes nothing

    # the speech recognition entry is pointed at hf_specdec's subclass only where it holds transformers' own class
    speech = "transformers.pipelines.automatic_speech_recognition.AutomaticSpeechRecognitionPipeline"
    from transformers.pipelines.text_generation import TextGenerationPipeline as TransformersTextGeneration

    registry = PipelineRegistry(
        {"automatic-speech-recognition": {"impl": speech}, "text-generation": {"impl": TransformersTextGeneration}}, {}
    )
    assert _load_path_assistants_safely(registry) == ["automatic-speech-recognition", "text-generation"]
    assert registry.check_task("automatic-speech-recognition")[1]["impl"] is SpeechRecognitionPipeline
    assert registry.check_task("text-generation")[1]["impl"] is TextGenerationPipeline
    custom = PipelineRegistry({"automatic-speech-recognition": {"impl": object}, "text-generation": {"impl": int}}, {})
    assert _load_path_assistants_safely(custom) == [] and _load_path_assistants_safely(PipelineRegistry({}, {})) == []
    assert custom.supported_tasks["automatic-speech-recognition"]["impl"] is object
    assert custom.supported_tasks["text-generation"]["impl"] is int

    # a registry's generating entries are pointed by `register_pipelines` itself
    registry = PipelineRegistry({"text-generation": {"impl": TransformersTextGeneration}}, {})
    assert register_pipelines(registry, {}) == ["text2text-generation", "summarization", "translation"]
    assert registry.check_task("text-generation")[1]["impl"] is TextGenerationPipeline

    # transformers 5.x lacks all three, so the process's first `enable` registered them (in this suite, conftest's
    # session fixture installs what that `enable` installs; tests/test_enable.py checks it in a fresh process)
    from transformers.pipelines import PIPELINE_REGISTRY

    for task, pipeline_class in [
        ("text2text-generation", Text2TextGenerationPipeline),
        ("summarization", SummarizationPipeline),
        ("translation", TranslationPipeline),
    ]:
        if task in hf_specdec.pipelines.REGISTERED_TASKS:
            assert PIPELINE_REGISTRY.check_task(task)[1]["impl"] is pipeline_class
