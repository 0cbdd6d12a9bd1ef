"""hf_specdec.pipelines: transformers' generating pipelines that hf_specdec's registration replaces with subclasses
(image-text-to-text, any-to-any, table and document question answering, text-to-audio). The speculative arguments
reach `generate` from the construction and from a call (a call's over the construction's), also where transformers
drops them; the output equals the plain output; assistants given by path load from safetensors only; and
speculative arguments are refused where the model does not generate or is not enabled.

The subclasses are registered by the process's first `hf_specdec.enable` or by `register_pipelines()`, never by
importing hf_specdec (tests/test_enable.py). Each test enables its models or calls `register_pipelines()` as a user
would; conftest's session fixture has already installed both before the first test, so those calls change nothing
here."""

from __future__ import annotations

import copy
import re

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import noisy_copy, tiny_model
from PIL import Image
from test_pipelines import DRAFT_NOISE, GREEDY, NEW_TOKENS, PAD, tiny_seq2seq, tokenizer  # noqa: F401 (a fixture)
from transformers import (
    BartConfig,
    BatchFeature,
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    DonutImageProcessorPil,
    DonutSwinConfig,
    EncodecConfig,
    LayoutLMConfig,
    LayoutLMForQuestionAnswering,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    Mistral4Config,
    Mistral4ForCausalLM,
    MusicgenConfig,
    MusicgenDecoderConfig,
    MusicgenForConditionalGeneration,
    PreTrainedTokenizerFast,
    ProcessorMixin,
    T5Config,
    TapasConfig,
    TapasForQuestionAnswering,
    VisionEncoderDecoderConfig,
    VisionEncoderDecoderModel,
    VitsConfig,
    VitsModel,
    pipeline,
)

import hf_specdec
from hf_specdec.pipelines import (
    AnyToAnyPipeline,
    DocumentQuestionAnsweringPipeline,
    ImageTextToTextPipeline,
    TableQuestionAnsweringPipeline,
    TextToAudioPipeline,
    register_pipelines,
)

IMAGE_PROMPT = "<image> the cat sat on the"
TABLE = {"animal": ["cat", "dog", "fox"], "place": ["mat", "log", "den"]}
QUERY = "where does the dog sit"
DONUT_TOKENS = ["<s_docvqa>", "<s_question>", "</s_question>", "<s_answer>", "</s_answer>"]
# constant γ: the default policy may stop drafting when tiny drafters are measured not to pay
GAMMA_2 = dict(speculative_gamma=2, speculative_gamma_policy="constant")


class CountingLookup(hf_specdec.PromptLookupDrafter):
    """Prompt lookup that records the size of each proposal: evidence that a pipeline's `drafter` reached `generate`
    (equal outputs alone would not show an argument that the pipeline dropped)."""

    def __init__(self, **options):
        super().__init__(**options)
        self.proposals = []  # shared with the per-call copies (`Drafter.for_call` copies shallowly)

    def propose(self, input_ids, num_tokens, attention_mask=None):
        self.proposals.append(num_tokens)
        return super().propose(input_ids, num_tokens, attention_mask)


def forward_calls(model) -> list:
    """A list that grows by one on each forward of `model`: evidence that an assistant reached `generate`."""
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    return calls


def pickled_checkpoint(model, directory) -> str:
    """Saves `model` as a pickle checkpoint only (pytorch_model.bin, no safetensors) and returns the path
    (transformers 5's `save_pretrained` writes safetensors only)."""
    model.save_pretrained(directory)
    (directory / "model.safetensors").unlink()
    torch.save(model.state_dict(), directory / "pytorch_model.bin")
    return str(directory)


def pickle_refusal(path: str) -> str:
    return (
        rf"`assistant_model` '{re.escape(path)}' holds no safetensors weights \(only the pickle checkpoint "
        r"pytorch_model.bin\).*save_pretrained"
    )


ENABLE_HINT = r"`drafter` need\(s\) speculative decoding.*Call `hf_specdec.enable\(model\)`"


def with_tokens(tokenizer, tokens):
    """A copy of the module's tokenizer with these special tokens added (the fixture stays as it is)."""
    extended = copy.deepcopy(tokenizer)
    extended.add_tokens(tokens, special_tokens=True)
    return extended


def random_image(size: int, seed: int = 0) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (size, size, 3), generator=generator, dtype=torch.uint8).numpy())


@pytest.mark.parametrize(
    "task, pipeline_class",
    [
        ("image-text-to-text", ImageTextToTextPipeline),
        ("any-to-any", AnyToAnyPipeline),
        ("table-question-answering", TableQuestionAnsweringPipeline),
        ("document-question-answering", DocumentQuestionAnsweringPipeline),
        ("text-to-audio", TextToAudioPipeline),
        ("text-to-speech", TextToAudioPipeline),  # transformers' alias of text-to-audio
    ],
)
def test_registration_points_the_tasks_at_its_subclasses(task, pipeline_class):
    import transformers.pipelines

    register_pipelines()  # as the first `enable` does
    assert transformers.pipelines.PIPELINE_REGISTRY.check_task(task)[1]["impl"] is pipeline_class
    assert issubclass(pipeline_class, getattr(transformers.pipelines, pipeline_class.__name__))  # transformers' own


# image-text-to-text and any-to-any: a tiny Llava (CLIP vision tower, 2x2 patches of a 30x30 image, Llama text model)


def tiny_llava(tokenizer, seed: int = 0):
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=30, patch_size=15
    )
    text = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids("<image>")
    )
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # as conftest's `tiny_model`: sharp argmaxes, so that float noise decides no tie
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def llava(tokenizer):
    """An enabled tiny Llava, a partly-right drafter, its processor, an image and the plain pipeline output."""
    image_tokenizer = with_tokens(tokenizer, ["<image>"])
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30}),
        tokenizer=image_tokenizer,
        patch_size=15,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    target = hf_specdec.enable(tiny_llava(image_tokenizer))
    image = random_image(30)
    inputs = processor(images=image, text=IMAGE_PROMPT, return_tensors="pt")
    plain = target.generate(**inputs, **GREEDY)[0, inputs["input_ids"].shape[1] :]
    assert len(set(plain.tolist())) > 5, plain  # not degenerate: a wrong draft would show
    return target, noisy_copy(target, 0.3), processor, image


def test_image_text_to_text_passes_speculative_arguments(llava):
    target, drafter, processor, image = llava
    pipe = pipeline("image-text-to-text", model=target, processor=processor)
    assert isinstance(pipe, ImageTextToTextPipeline)
    expected = pipe(image, text=IMAGE_PROMPT, max_new_tokens=NEW_TOKENS)
    assert expected[0]["generated_text"].startswith(IMAGE_PROMPT)

    # top-level: transformers' own hands unknown arguments to the processor
    lookup = CountingLookup()
    assert pipe(image, text=IMAGE_PROMPT, max_new_tokens=NEW_TOKENS, drafter=lookup, **GAMMA_2) == expected
    assert max(lookup.proposals) == 2  # the drafter and `speculative_gamma` both reached `generate`
    calls = forward_calls(drafter)
    assert pipe(image, text=IMAGE_PROMPT, max_new_tokens=NEW_TOKENS, assistant_model=drafter) == expected
    assert calls
    calls.clear()
    assert (
        pipe(image, text=IMAGE_PROMPT, generate_kwargs={"assistant_model": drafter, "max_new_tokens": NEW_TOKENS})
        == expected
    )
    assert calls

    # at construction: transformers' own loads it and never passes it to `generate`
    assisted = pipeline(
        "image-text-to-text", model=target, processor=processor, assistant_model=drafter, speculative_gamma=3
    )
    calls.clear()
    assert assisted(image, text=IMAGE_PROMPT, max_new_tokens=NEW_TOKENS) == expected
    assert calls
    other = noisy_copy(target, 0.3, seed=2)
    other_calls = forward_calls(other)
    calls.clear()
    assert assisted(image, text=IMAGE_PROMPT, max_new_tokens=NEW_TOKENS, assistant_model=other) == expected
    assert other_calls and not calls  # a call's assistant over the construction's
    calls.clear()
    assert assisted(image, text=IMAGE_PROMPT, max_new_tokens=NEW_TOKENS, assistant_model=None) == expected
    assert not calls  # None included
    lookup = CountingLookup()
    constructed = pipeline("image-text-to-text", model=target, processor=processor, drafter=lookup, **GAMMA_2)
    assert constructed(image, text=IMAGE_PROMPT, max_new_tokens=NEW_TOKENS) == expected
    assert max(lookup.proposals) == 2


def test_image_text_to_text_path_assistants_and_models_not_enabled(llava, tmp_path):
    target, drafter, processor, image = llava
    drafter.save_pretrained(tmp_path / "draft")
    processor.tokenizer.save_pretrained(tmp_path / "draft")
    path = str(tmp_path / "draft")
    pipe = pipeline("image-text-to-text", model=target, processor=processor)
    expected = pipe(image, text=IMAGE_PROMPT, max_new_tokens=NEW_TOKENS)

    from_path = pipeline("image-text-to-text", model=target, processor=processor, assistant_model=path)
    loaded = from_path.assistant_model
    assert isinstance(loaded, LlavaForConditionalGeneration) and loaded is not drafter
    assert all(torch.equal(value, drafter.state_dict()[name]) for name, value in loaded.state_dict().items())
    calls = forward_calls(loaded)
    assert from_path(image, text=IMAGE_PROMPT, max_new_tokens=NEW_TOKENS) == expected
    assert calls
    assert pipe(image, text=IMAGE_PROMPT, max_new_tokens=NEW_TOKENS, assistant_model=path) == expected
    first = pipe._loaded_assistants[path]
    assert (
        pipe(image, text=IMAGE_PROMPT, generate_kwargs={"assistant_model": path, "max_new_tokens": NEW_TOKENS})
        == expected
    )
    assert pipe._loaded_assistants == {path: first}  # loaded once per pipeline

    pickled = pickled_checkpoint(drafter, tmp_path / "pickled")
    with pytest.raises(ValueError, match=pickle_refusal(pickled)):
        pipeline("image-text-to-text", model=target, processor=processor, assistant_model=pickled)
    with pytest.raises(ValueError, match=pickle_refusal(pickled)):
        pipe(image, text=IMAGE_PROMPT, assistant_model=pickled)

    # a model not enabled: hf_specdec's arguments are refused, transformers' assisted generation still serves
    # `assistant_model`
    plain_model = tiny_llava(processor.tokenizer)
    plain_pipe = pipeline("image-text-to-text", model=plain_model, processor=processor)
    with pytest.raises(ValueError, match=ENABLE_HINT):
        plain_pipe(image, text=IMAGE_PROMPT, drafter="prompt_lookup")
    with pytest.raises(ValueError, match=r"`drafter` need\(s\) speculative decoding"):
        pipeline("image-text-to-text", model=plain_model, processor=processor, drafter="prompt_lookup")
    calls = forward_calls(drafter)
    assert plain_pipe(image, text=IMAGE_PROMPT, max_new_tokens=NEW_TOKENS, assistant_model=drafter) == expected
    assert calls
    assert not isinstance(plain_model, hf_specdec.SpeculativeGenerationMixin)


def test_any_to_any_refuses_speculation_on_a_model_not_enabled(llava):
    _, _, processor, _ = llava
    # refused before transformers' own construction (which needs torchvision)
    with pytest.raises(
        ValueError,
        match=r"`drafter`, `speculative_gamma` need\(s\) speculative decoding.*"
        r"LlavaForConditionalGeneration.*hf_specdec.enable",
    ):
        pipeline(
            "any-to-any",
            model=tiny_llava(processor.tokenizer),
            processor=processor,
            drafter="prompt_lookup",
            speculative_gamma=2,
        )


class TextProcessor(ProcessorMixin):
    """A processor holding only a tokenizer: transformers' any-to-any pipeline needs a processor, and torchvision
    (not installed here) for any model that takes images."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)

    def __call__(self, text=None, images=None, videos=None, audio=None, **kwargs):
        kwargs = {name: value for name, value in kwargs.items() if name in ("padding", "truncation", "return_tensors")}
        return BatchFeature(dict(self.tokenizer(text, **kwargs)))


def tiny_mistral4(vocab_size: int, seed: int = 0):
    """Mistral 4 (a text-only model in transformers' multimodal-LM mapping, so any-to-any serves it)."""
    torch.manual_seed(seed)
    config = Mistral4Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=8,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        v_head_dim=8,
        qk_nope_head_dim=8,
        head_dim=16,
        qk_head_dim=16,
        pad_token_id=PAD,
        eos_token_id=None,
        bos_token_id=None,
    )
    return Mistral4ForCausalLM(config).eval()


def test_any_to_any_passes_speculative_arguments(tokenizer):
    target = hf_specdec.enable(tiny_mistral4(len(tokenizer)))
    drafter = noisy_copy(target, 0.1)
    processor = TextProcessor(tokenizer)
    pipe = pipeline("any-to-any", model=target, processor=processor)
    assert isinstance(pipe, AnyToAnyPipeline)
    prompt = "the cat sat on the"
    expected = pipe(text=prompt, max_new_tokens=NEW_TOKENS)
    assert len(expected[0]["generated_text"]) > len(prompt)
    lookup = CountingLookup()
    # top-level: transformers' own hands unknown call arguments to the processor
    assert pipe(text=prompt, max_new_tokens=NEW_TOKENS, drafter=lookup, **GAMMA_2) == expected
    assert max(lookup.proposals) == 2
    calls = forward_calls(drafter)
    assert pipe(text=prompt, generate_kwargs={"assistant_model": drafter, "max_new_tokens": NEW_TOKENS}) == expected
    assert calls
    # transformers' own loads a construction's assistant and never passes it to `generate`
    assisted = pipeline("any-to-any", model=target, processor=processor, assistant_model=drafter)
    calls.clear()
    assert assisted(text=prompt, max_new_tokens=NEW_TOKENS) == expected
    assert calls
    calls.clear()
    assert assisted(text=prompt, max_new_tokens=NEW_TOKENS, assistant_model=None) == expected
    assert not calls


# table question answering: a BART reading TAPEX's linearized tables (generates), and TAPAS (extractive)


class LinearizedTableTokenizer(PreTrainedTokenizerFast):
    """Encodes `(table, query)` as TAPEX's tokenizer did ("query col : a | b row 1 : x | y"; transformers 5 has none),
    for a BART that answers questions about tables."""

    model_input_names = ["input_ids", "attention_mask"]

    def __call__(self, table=None, query=None, **kwargs):
        if not isinstance(table, pd.DataFrame):
            return super().__call__(table, query, **kwargs)
        rows = " ".join(
            f"row {index} : " + " | ".join(map(str, row))
            for index, row in enumerate(table.itertuples(index=False), start=1)
        )
        return super().__call__(f"{query} col : {' | '.join(table.columns)} {rows}", **kwargs)


@pytest.fixture(scope="module")
def table_tokenizer(tokenizer):
    return LinearizedTableTokenizer(
        tokenizer_object=copy.deepcopy(tokenizer.backend_tokenizer),
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def test_table_question_answering_passes_speculative_arguments(table_tokenizer):
    target = hf_specdec.enable(tiny_seq2seq("bart", len(table_tokenizer)))
    drafter = noisy_copy(target, DRAFT_NOISE["bart"])
    # transformers' table pipeline takes generation parameters only at construction
    pipe = pipeline("table-question-answering", model=target, tokenizer=table_tokenizer, **GREEDY)
    assert isinstance(pipe, TableQuestionAnsweringPipeline)
    expected = pipe(table=TABLE, query=QUERY)
    assert len(set(expected["answer"])) > 5  # not degenerate

    # transformers' own drops every call argument it does not know
    lookup = CountingLookup()
    assert pipe(table=TABLE, query=QUERY, drafter=lookup, **GAMMA_2) == expected
    assert max(lookup.proposals) == 2
    calls = forward_calls(drafter)
    assert pipe(table=TABLE, query=QUERY, assistant_model=drafter) == expected
    assert calls
    calls.clear()
    assert pipe(table=TABLE, query=QUERY, generate_kwargs={"assistant_model": drafter}) == expected
    assert calls
    assisted = pipeline(
        "table-question-answering",
        model=target,
        tokenizer=table_tokenizer,
        assistant_model=drafter,
        speculative_gamma=3,
        **GREEDY,
    )
    calls.clear()
    assert assisted(table=TABLE, query=QUERY) == expected
    assert calls
    calls.clear()
    assert assisted(table=TABLE, query=QUERY, assistant_model=None) == expected
    assert not calls

    with pytest.raises(ValueError, match=ENABLE_HINT):
        pipeline(
            "table-question-answering", model=tiny_seq2seq("bart", len(table_tokenizer)), tokenizer=table_tokenizer
        )(table=TABLE, query=QUERY, drafter="prompt_lookup")
    # TAPAS selects cells: nothing to draft for
    tapas = pipeline("table-question-answering", model=tiny_tapas(len(table_tokenizer)), tokenizer=table_tokenizer)
    with pytest.raises(
        ValueError,
        match=r"`assistant_model` given to TableQuestionAnsweringPipeline, whose model "
        r"\(TapasForQuestionAnswering\) does not generate",
    ):
        tapas(table=TABLE, query=QUERY, assistant_model=drafter)


def test_table_question_answering_path_assistants(table_tokenizer, tmp_path):
    target = hf_specdec.enable(tiny_seq2seq("bart", len(table_tokenizer)))
    drafter = noisy_copy(target, DRAFT_NOISE["bart"])
    drafter.save_pretrained(tmp_path / "draft")
    pipe = pipeline("table-question-answering", model=target, tokenizer=table_tokenizer, **GREEDY)
    expected = pipe(table=TABLE, query=QUERY)
    path = str(tmp_path / "draft")
    assert pipe(table=TABLE, query=QUERY, assistant_model=path) == expected
    first = pipe._loaded_assistants[path]
    assert pipe(table=TABLE, query=QUERY, assistant_model=path) == expected
    assert pipe._loaded_assistants == {path: first}
    pickled = pickled_checkpoint(drafter, tmp_path / "pickled")
    with pytest.raises(ValueError, match=pickle_refusal(pickled)):
        pipe(table=TABLE, query=QUERY, assistant_model=pickled)


def tiny_tapas(vocab_size: int):
    torch.manual_seed(0)
    return TapasForQuestionAnswering(
        TapasConfig(
            vocab_size=vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
    ).eval()


# document question answering: a Donut-like model (DonutSwin encoder, BART decoder) that generates, and LayoutLM


def tiny_donut(tokenizer, seed: int = 0):
    torch.manual_seed(seed)
    encoder = DonutSwinConfig(
        image_size=[32, 32], patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4
    )
    decoder = BartConfig(
        vocab_size=len(tokenizer),
        d_model=32,
        decoder_layers=1,
        decoder_attention_heads=4,
        decoder_ffn_dim=64,
        is_decoder=True,
        add_cross_attention=True,
        pad_token_id=PAD,
        eos_token_id=None,
        bos_token_id=None,
        forced_eos_token_id=None,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    config = VisionEncoderDecoderConfig(encoder=encoder, decoder=decoder, decoder_start_token_id=PAD, pad_token_id=PAD)
    model = VisionEncoderDecoderModel(config=config).eval()
    with torch.no_grad():  # outputs that depend on the image and vary (as `tiny_seq2seq` does for BART)
        for param in model.decoder.parameters():
            if param.dim() == 2:
                param.normal_(0.0, param.shape[-1] ** -0.5)
        model.decoder.get_output_embeddings().weight.mul_(8.0)
    # the pipeline's answer is the text up to "</s_answer>": forced as the last token, it ends every answer
    model.generation_config.eos_token_id = None
    model.generation_config.forced_eos_token_id = tokenizer.convert_tokens_to_ids("</s_answer>")
    return model


@pytest.fixture(scope="module")
def donut(tokenizer):
    """An enabled Donut-like model, a partly-right drafter, its tokenizer and image processor, and a document."""
    donut_tokenizer = with_tokens(tokenizer, DONUT_TOKENS)
    image_processor = DonutImageProcessorPil(
        size={"height": 32, "width": 32}, do_align_long_axis=False, do_thumbnail=False, do_pad=False
    )
    target = hf_specdec.enable(tiny_donut(donut_tokenizer))
    return target, noisy_copy(target, 0.1), donut_tokenizer, image_processor, random_image(32)


def test_document_question_answering_passes_speculative_arguments(donut):
    target, drafter, donut_tokenizer, image_processor, document = donut
    question = "what is the total"
    pipe = pipeline(
        "document-question-answering",
        model=target,
        tokenizer=donut_tokenizer,
        image_processor=image_processor,
        **GREEDY,
    )
    assert isinstance(pipe, DocumentQuestionAnsweringPipeline)
    expected = pipe(document, question)
    assert len(set(expected[0]["answer"])) > 5  # not degenerate

    lookup = CountingLookup()
    assert pipe(document, question, drafter=lookup, **GAMMA_2) == expected
    assert max(lookup.proposals) == 2
    calls = forward_calls(drafter)
    assert pipe(document, question, assistant_model=drafter) == expected
    assert calls
    calls.clear()
    assert pipe(document, question, generate_kwargs={"assistant_model": drafter}) == expected
    assert calls
    assisted = pipeline(
        "document-question-answering",
        model=target,
        tokenizer=donut_tokenizer,
        image_processor=image_processor,
        assistant_model=drafter,
        **GREEDY,
    )
    calls.clear()
    assert assisted(document, question) == expected
    assert calls


def test_document_question_answering_refusals(donut, tmp_path):
    target, drafter, donut_tokenizer, image_processor, document = donut
    pipe = pipeline(
        "document-question-answering",
        model=target,
        tokenizer=donut_tokenizer,
        image_processor=image_processor,
        **GREEDY,
    )
    assert isinstance(pipe, DocumentQuestionAnsweringPipeline)
    assert pipe(document, "what is the total")[0]["answer"]  # transformers' own decoding, unchanged
    pickled = pickled_checkpoint(drafter, tmp_path / "pickled")
    with pytest.raises(ValueError, match=pickle_refusal(pickled)):
        pipe(document, "what is the total", assistant_model=pickled)
    with pytest.raises(ValueError, match=pickle_refusal(pickled)):
        pipeline(
            "document-question-answering",
            model=target,
            tokenizer=donut_tokenizer,
            image_processor=image_processor,
            assistant_model=pickled,
        )
    plain_pipe = pipeline(
        "document-question-answering",
        model=tiny_donut(donut_tokenizer),
        tokenizer=donut_tokenizer,
        image_processor=image_processor,
    )
    with pytest.raises(ValueError, match=ENABLE_HINT):
        plain_pipe(document, "what is the total", drafter="prompt_lookup")


# text-to-audio: a decoder-only language model over audio codes, Musicgen, and VITS (does not generate)


def test_text_to_audio_passes_speculative_arguments(tokenizer):
    """A decoder-only model over audio codes (CSM's and Dia's layout; for Musicgen see below): a tiny Llama, whose
    generated ids the pipeline returns as the audio, as no processor decodes them."""
    target = hf_specdec.enable(tiny_model("llama", vocab_size=len(tokenizer)))
    drafter = noisy_copy(target, 0.3)
    text = "the quick brown fox jumps over"
    pipe = pipeline("text-to-audio", model=target, tokenizer=tokenizer)
    assert isinstance(pipe, TextToAudioPipeline)
    expected = pipe(text, generate_kwargs=GREEDY)["audio"]
    assert len(set(expected[-NEW_TOKENS:].tolist())) > 5  # not degenerate

    lookup = CountingLookup()
    generate_kwargs = {**GREEDY, "drafter": lookup, **GAMMA_2}
    assert np.array_equal(pipe(text, generate_kwargs=generate_kwargs)["audio"], expected)
    assert max(lookup.proposals) == 2
    assert generate_kwargs == {**GREEDY, "drafter": lookup, **GAMMA_2}  # the caller's dict, unchanged
    calls = forward_calls(drafter)
    assert np.array_equal(pipe(text, assistant_model=drafter, generate_kwargs=GREEDY)["audio"], expected)
    assert calls

    # at construction: transformers' own fails (TypeError) on a call without `generate_kwargs`, and writes the
    # assistant into the caller's `generate_kwargs`
    assisted = pipeline("text-to-audio", model=target, tokenizer=tokenizer, assistant_model=drafter, **GREEDY)
    calls.clear()
    assert np.array_equal(assisted(text)["audio"], expected)
    assert calls
    calls.clear()
    generate_kwargs = {"do_sample": False}
    assert np.array_equal(assisted(text, generate_kwargs=generate_kwargs)["audio"], expected)
    assert calls
    assert generate_kwargs == {"do_sample": False}
    calls.clear()
    assert np.array_equal(assisted(text, generate_kwargs={"assistant_model": None})["audio"], expected)
    assert not calls  # a call's choice over the construction's, None included


def tiny_musicgen(tokenizer, seed: int = 0):
    torch.manual_seed(seed)
    text = T5Config(vocab_size=len(tokenizer), d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2)
    audio = EncodecConfig(
        hidden_size=16,
        num_filters=4,
        codebook_size=32,
        codebook_dim=16,
        num_residual_layers=1,
        upsampling_ratios=[2, 2],
        num_lstm_layers=1,
        sampling_rate=64,
        target_bandwidths=[1.0],
        audio_channels=1,
    )
    # the codebooks' pad / start token is the one past the codebook
    decoder = MusicgenDecoderConfig(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        ffn_dim=32,
        num_codebooks=2,
        max_position_embeddings=64,
        pad_token_id=32,
        bos_token_id=32,
        decoder_start_token_id=32,
    )
    config = MusicgenConfig(text_encoder=text.to_dict(), audio_encoder=audio.to_dict(), decoder=decoder.to_dict())
    return MusicgenForConditionalGeneration(config).eval()


def tiny_vits(vocab_size: int):
    torch.manual_seed(0)
    config = VitsConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        ffn_dim=32,
        flow_size=8,
        spectrogram_bins=16,
        upsample_initial_channel=16,
        upsample_rates=[2, 2],
        upsample_kernel_sizes=[4, 4],
        resblock_kernel_sizes=[3],
        resblock_dilation_sizes=[[1, 3]],
        prior_encoder_num_flows=1,
        prior_encoder_num_wavenet_layers=1,
        posterior_encoder_num_wavenet_layers=1,
        duration_predictor_num_flows=1,
        duration_predictor_filter_channels=16,
        depth_separable_num_layers=1,
    )
    return VitsModel(config).eval()


AUDIO_GREEDY = {"max_new_tokens": 8, "do_sample": False}


def test_text_to_audio_refusals(tokenizer, tmp_path):
    target = hf_specdec.enable(tiny_musicgen(tokenizer))
    pipe = pipeline("text-to-audio", model=target, tokenizer=tokenizer)
    assert isinstance(pipe, TextToAudioPipeline)
    assert pipe("the cat sat", generate_kwargs=AUDIO_GREEDY)["audio"].size > 0

    pickled = pickled_checkpoint(tiny_musicgen(tokenizer, seed=1), tmp_path / "pickled")
    with pytest.raises(ValueError, match=pickle_refusal(pickled)):
        pipeline("text-to-audio", model=target, tokenizer=tokenizer, assistant_model=pickled)
    generate_kwargs = {**AUDIO_GREEDY, "assistant_model": pickled}
    with pytest.raises(ValueError, match=pickle_refusal(pickled)):
        pipe("the cat sat", generate_kwargs=generate_kwargs)
    assert generate_kwargs == {**AUDIO_GREEDY, "assistant_model": pickled}  # the caller's dict, unchanged

    plain_model = tiny_musicgen(tokenizer)
    with pytest.raises(ValueError, match=ENABLE_HINT):
        pipeline("text-to-audio", model=plain_model, tokenizer=tokenizer)(
            "the cat sat", generate_kwargs={"drafter": "prompt_lookup"}
        )
    with pytest.raises(ValueError, match=r"`drafter` need\(s\) speculative decoding.*MusicgenForConditionalGeneration"):
        pipeline("text-to-audio", model=plain_model, tokenizer=tokenizer, drafter="prompt_lookup")


def test_musicgen_refuses_speculative_decoding_clearly(tokenizer):
    """Musicgen's own `generate` decodes with a loop of its own (codebooks with a delay pattern): a drafter is
    refused naming the class, instead of transformers' "`model_kwargs` are not used: ['custom_generate']"."""
    target = hf_specdec.enable(tiny_musicgen(tokenizer))
    pipe = pipeline("text-to-audio", model=target, tokenizer=tokenizer)
    assert pipe("the cat sat", generate_kwargs=AUDIO_GREEDY)["audio"].size > 0
    generate_kwargs = {**AUDIO_GREEDY, "drafter": "prompt_lookup"}
    with pytest.raises(
        ValueError,
        match=r"^MusicgenForConditionalGeneration cannot run speculative decoding: its own "
        r"`generate` decodes with a loop of its own .*Drop `assistant_model`/`drafter`",
    ):
        pipe("the cat sat", generate_kwargs=generate_kwargs)
    assert generate_kwargs == {**AUDIO_GREEDY, "drafter": "prompt_lookup"}


def test_models_that_do_not_generate_refuse_speculative_arguments(tokenizer):
    register_pipelines()  # no model is enabled here: the tasks are pointed as a user would point them
    vits = tiny_vits(len(tokenizer))
    with pytest.raises(
        ValueError,
        match=r"`drafter` given to TextToAudioPipeline, whose model \(VitsModel\) does not "
        r"generate",
    ):
        pipeline("text-to-audio", model=vits, tokenizer=tokenizer, drafter="prompt_lookup")
    speech = pipeline("text-to-audio", model=vits, tokenizer=tokenizer)
    assert speech("the cat sat")["audio"].size > 0
    with pytest.raises(
        ValueError,
        match=r"`assistant_model` given to TextToAudioPipeline, whose model \(VitsModel\) "
        r"does not generate",
    ):
        speech("the cat sat", assistant_model=vits)

    with pytest.raises(
        ValueError,
        match=r"`assistant_model`, `speculative_gamma` given to "
        r"TableQuestionAnsweringPipeline, whose model \(TapasForQuestionAnswering\) "
        r"does not generate",
    ):
        pipeline(
            "table-question-answering",
            model=tiny_tapas(len(tokenizer)),
            tokenizer=tokenizer,
            assistant_model=vits,
            speculative_gamma=2,
        )

    torch.manual_seed(0)
    layoutlm = LayoutLMForQuestionAnswering(
        LayoutLMConfig(
            vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
    ).eval()
    with pytest.raises(
        ValueError,
        match=r"`drafter` given to DocumentQuestionAnsweringPipeline, whose model "
        r"\(LayoutLMForQuestionAnswering\) does not generate",
    ):
        pipeline("document-question-answering", model=layoutlm, tokenizer=tokenizer, drafter="prompt_lookup")
    extractive = pipeline("document-question-answering", model=layoutlm, tokenizer=tokenizer)
    # words and boxes given: no OCR; `max_seq_len`: the tokenizer sets no `model_max_length`
    document = dict(word_boxes=[("the", [0, 0, 10, 10]), ("cat", [12, 0, 30, 10])], max_seq_len=64)
    assert extractive(random_image(32), "what sat", **document)
    with pytest.raises(
        ValueError,
        match=r"`speculative_gamma` given to DocumentQuestionAnsweringPipeline.*does not "
        r"generate",
    ):
        extractive(random_image(32), "what sat", generate_kwargs={"speculative_gamma": 2}, **document)
