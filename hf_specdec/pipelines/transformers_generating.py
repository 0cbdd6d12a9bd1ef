"""Subclasses of transformers' own generating pipelines that change only how they handle the speculative
arguments."""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer, PreTrainedModel
from transformers import pipelines as transformers_pipelines
from transformers.pipelines.automatic_speech_recognition import AutomaticSpeechRecognitionPipeline
from transformers.pipelines.base import load_assistant_model

from .speculative_arguments import (
    _ASSISTANT_ARGUMENTS,
    _SPECULATIVE_ARGUMENTS,
    _check_speculation_enabled,
    _PathAssistants,
)

__all__ = [
    "AnyToAnyPipeline",
    "DocumentQuestionAnsweringPipeline",
    "ImageTextToTextPipeline",
    "SpeechRecognitionPipeline",
    "TableQuestionAnsweringPipeline",
    "TextGenerationPipeline",
    "TextToAudioPipeline",
]


class _PipelineWithPathAssistants(_PathAssistants):
    """For transformers' own generating pipelines: the speculative arguments (`assistant_model`,
    `assistant_tokenizer`, `drafter`, `drafter_kwargs`, `speculative_*`), at construction or in a call, top-level or
    in `generate_kwargs`, all reach `generate`; an `assistant_model` path or Hub id is loaded from safetensors only
    (see [`SpeechRecognitionPipeline`]); a call's assistant is used over the construction's."""

    # whether the pipeline hands `generate` its arguments nested in the forward parameters' "generate_kwargs"
    _nested_generate_kwargs = False

    def __init__(self, model: PreTrainedModel, *args, assistant_model=None, assistant_tokenizer=None, **kwargs):
        # set before transformers' __init__, which calls `_sanitize_parameters` with the remaining arguments
        self._speculative_kwargs = {name: kwargs.pop(name) for name in list(kwargs) if _is_speculative(name)}
        _check_generating(self, model, {"assistant_model": assistant_model, **self._speculative_kwargs})
        # `model` by name: some of transformers' pipelines take another first argument (table QA's `args_parser`)
        if not isinstance(assistant_model, str):
            super().__init__(
                *args, model=model, assistant_model=assistant_model, assistant_tokenizer=assistant_tokenizer, **kwargs
            )
            return
        super().__init__(*args, model=model, **kwargs)
        # loaded after transformers placed the model, onto its device and dtype (as `load_assistant_model` does)
        loaded = self._load_assistant(assistant_model)
        if assistant_tokenizer is None:
            assistant_tokenizer = AutoTokenizer.from_pretrained(assistant_model)
        # each call's `_sanitize_parameters` hands it to `generate`
        self.assistant_model, self.assistant_tokenizer = load_assistant_model(self.model, loaded, assistant_tokenizer)

    def _sanitize_parameters(self, **kwargs):
        nested = kwargs.get("generate_kwargs") or {}
        # as transformers merges them: a top-level generate argument over the one in `generate_kwargs`; taken out
        # here, as some pipelines drop unknown arguments or hand them to their processor
        call = {name: value for name, value in {**nested, **kwargs}.items() if _is_speculative(name)}
        kwargs = {name: value for name, value in kwargs.items() if not _is_speculative(name)}
        rest = {name: value for name, value in nested.items() if not _is_speculative(name)}
        if self._nested_generate_kwargs:
            # a copy: some pipelines write into it (transformers' text-to-audio fails on None there)
            kwargs["generate_kwargs"] = rest
        elif "generate_kwargs" in kwargs:
            # a pipeline that takes generate's arguments top-level (text generation) would hand `generate_kwargs`
            # itself to `generate` as a model argument: its contents go top-level, under the top-level ones
            del kwargs["generate_kwargs"]
            kwargs = {**rest, **kwargs}
        _check_generating(self, self.model, call)
        preprocess_params, forward_params, postprocess_params = super()._sanitize_parameters(**kwargs)
        if not _calls_generate(self, self.model):
            return preprocess_params, forward_params, postprocess_params
        if self._nested_generate_kwargs:
            forward_params["generate_kwargs"] = generate_kwargs = dict(forward_params.get("generate_kwargs") or {})
        else:
            generate_kwargs = forward_params
        generate_kwargs.update(getattr(self, "_speculative_kwargs", {}))
        generate_kwargs.update({name: value for name, value in call.items() if name not in _ASSISTANT_ARGUMENTS})
        # this call's assistant over the construction's (which transformers keeps, or for some pipelines drops)
        if "assistant_model" in call:
            assistant = self._load_assistant(call["assistant_model"])
            # the construction's tokenizer goes with its assistant only
            assistant_tokenizer = call.get("assistant_tokenizer")
        else:
            assistant = getattr(self, "assistant_model", None)
            assistant_tokenizer = call.get("assistant_tokenizer", getattr(self, "assistant_tokenizer", None))
        if "assistant_model" in call or assistant is not None:
            # set even when None: the call's parameters are merged over the construction's
            generate_kwargs["assistant_model"] = assistant
            generate_kwargs["assistant_tokenizer"] = assistant_tokenizer
            if assistant_tokenizer is not None:
                generate_kwargs.setdefault("tokenizer", self.tokenizer or getattr(self.processor, "tokenizer", None))
        return preprocess_params, forward_params, postprocess_params


def _is_speculative(name: str) -> bool:
    return name in _SPECULATIVE_ARGUMENTS or name in _ASSISTANT_ARGUMENTS or name.startswith("speculative_")


def _calls_generate(pipe, model) -> bool:
    # transformers' own condition for loading an assistant
    return type(pipe)._pipeline_calls_generate and model.can_generate()


def _check_generating(pipe, model, arguments: dict[str, Any]) -> None:
    """Refuses speculative arguments the pipeline's model cannot use (transformers would drop them silently)."""
    given = sorted(name for name, value in arguments.items() if value is not None)
    if not given:
        return
    if not _calls_generate(pipe, model):
        raise ValueError(
            f"{', '.join(f'`{name}`' for name in given)} given to {type(pipe).__name__}, whose model "
            f"({type(model).__name__}) does not generate: it would be ignored. Remove it, or use a model with a "
            "generation head for this task."
        )
    # transformers' own assisted generation serves `assistant_model` on a model that is not enabled
    _check_speculation_enabled(model, {name: arguments[name] for name in given if name not in _ASSISTANT_ARGUMENTS})


class SpeechRecognitionPipeline(_PipelineWithPathAssistants, AutomaticSpeechRecognitionPipeline):
    r"""
    transformers' `automatic-speech-recognition` pipeline, changed only in how it handles the speculative arguments
    (`assistant_model`, `assistant_tokenizer`, `drafter`, `drafter_kwargs`, `speculative_*`). [`register_pipelines`]
    (which the first [`hf_specdec.enable`] calls) points transformers' registry entry for the task at this class
    (unless the entry was replaced by someone else), so `pipeline("automatic-speech-recognition", ...)` builds it;
    everything else is transformers' pipeline. The
    same changes apply to transformers' other generating pipelines (`text-generation`, `text-to-audio`,
    `table-question-answering`, `document-question-answering`, `image-text-to-text`, `any-to-any`):

    - An `assistant_model` given as a path or Hub id, at construction or in a call, is loaded from safetensors only,
      once per pipeline, so a directory holding only a pickle checkpoint is refused before anything is read from it.
    - The speculative arguments, given at construction or in a call (top-level or in `generate_kwargs`), reach
      `generate`, a call's over the construction's. An assistant given in a call is used for that call (transformers
      would keep the construction's); `assistant_model=None` in a call decodes without one. A path assistant given
      at construction gets its tokenizer from the same path, as in transformers, unless `assistant_tokenizer` is
      passed.
    - They are refused with a `ValueError` where they could not be used (transformers would drop them silently): on
      a model that does not generate, and, except `assistant_model` / `assistant_tokenizer` (which transformers'
      own assisted generation serves), on a model not enabled with [`hf_specdec.enable`].

    Example:

    ```python
    >>> import hf_specdec
    >>> from transformers import WhisperForConditionalGeneration, pipeline
    >>> checkpoint = "openai/whisper-large-v2"
    >>> whisper = hf_specdec.enable(WhisperForConditionalGeneration.from_pretrained(checkpoint))  # doctest: +SKIP
    >>> asr = pipeline("automatic-speech-recognition", model=whisper, tokenizer=checkpoint,  # doctest: +SKIP
    ...                feature_extractor=checkpoint, assistant_model="distil-whisper/distil-large-v2")
    >>> asr("clip.wav", generate_kwargs={"num_beams": 1, "speculative_gamma": 4})  # doctest: +SKIP
    {'text': ...}

    ```
    """


class TextGenerationPipeline(_PipelineWithPathAssistants, transformers_pipelines.TextGenerationPipeline):
    r"""
    transformers' `text-generation` pipeline, changed as [`SpeechRecognitionPipeline`] is (assistants given by path
    loaded from safetensors only, a call's assistant over the construction's, speculative arguments refused where
    they could not be used). [`register_pipelines`] (which the first [`hf_specdec.enable`] calls) points the task's
    registry entry at this class (unless someone else replaced transformers' own).

    Example:

    ```python
    >>> import hf_specdec
    >>> from transformers import AutoModelForCausalLM, pipeline
    >>> checkpoint = "HuggingFaceTB/SmolLM2-1.7B-Instruct"
    >>> model = hf_specdec.enable(AutoModelForCausalLM.from_pretrained(checkpoint))  # doctest: +SKIP
    >>> pipe = pipeline("text-generation", model=model, tokenizer=checkpoint)  # doctest: +SKIP
    >>> pipe("The capital of France is",  # doctest: +SKIP
    ...      assistant_model="HuggingFaceTB/SmolLM2-135M-Instruct", max_new_tokens=20)
    [{'generated_text': ...}]

    ```
    """


class TextToAudioPipeline(_PipelineWithPathAssistants, transformers_pipelines.TextToAudioPipeline):
    r"""
    transformers' `text-to-audio` pipeline, changed as [`SpeechRecognitionPipeline`] is. Also: transformers' own
    fails (`TypeError`) on a call without `generate_kwargs` once an assistant was given at construction, and writes
    the assistant into the caller's `generate_kwargs`; this one does neither.

    Speculative decoding runs where the model decodes through transformers' `generate`. Models whose own `generate`
    runs a loop of its own (Musicgen's, over its codebooks) refuse a drafter with a `ValueError` naming the class.

    Example:

    ```python
    >>> import hf_specdec
    >>> from transformers import AutoModelForTextToWaveform, pipeline
    >>> checkpoint = "facebook/musicgen-small"
    >>> model = hf_specdec.enable(AutoModelForTextToWaveform.from_pretrained(checkpoint))  # doctest: +SKIP
    >>> pipe = pipeline("text-to-audio", model=model, tokenizer=checkpoint)  # doctest: +SKIP
    >>> pipe("lo-fi beat", generate_kwargs={"max_new_tokens": 64})  # doctest: +SKIP
    {'audio': ..., 'sampling_rate': ...}
    >>> pipe("lo-fi beat", generate_kwargs={"drafter": "prompt_lookup", "max_new_tokens": 64})  # doctest: +SKIP
    Traceback (most recent call last):
    ValueError: MusicgenForConditionalGeneration cannot run speculative decoding: its own `generate` decodes with ...

    ```
    """

    _nested_generate_kwargs = True


class TableQuestionAnsweringPipeline(
    _PipelineWithPathAssistants, transformers_pipelines.TableQuestionAnsweringPipeline
):
    r"""
    transformers' `table-question-answering` pipeline, changed as [`SpeechRecognitionPipeline`] is. Also: the
    speculative arguments of a call reach `generate` (transformers' own drops every keyword argument it does not
    know, silently).

    Example:

    ```python
    >>> import hf_specdec
    >>> from transformers import AutoModelForSeq2SeqLM, pipeline
    >>> checkpoint = "microsoft/tapex-large-finetuned-wtq"
    >>> tapex = hf_specdec.enable(AutoModelForSeq2SeqLM.from_pretrained(checkpoint))  # doctest: +SKIP
    >>> pipe = pipeline("table-question-answering", model=tapex, tokenizer=checkpoint)  # doctest: +SKIP
    >>> table = {"city": ["Paris", "Rome"], "country": ["France", "Italy"]}
    >>> pipe(table=table, query="Where is Rome?", drafter="prompt_lookup")  # doctest: +SKIP
    {'answer': ...}

    ```
    """


class DocumentQuestionAnsweringPipeline(
    _PipelineWithPathAssistants, transformers_pipelines.DocumentQuestionAnsweringPipeline
):
    r"""
    transformers' `document-question-answering` pipeline, changed as [`TableQuestionAnsweringPipeline`] is. The
    speculative arguments need a generating model (Donut); with an extractive one (LayoutLM) they are refused.

    Example:

    ```python
    >>> import hf_specdec
    >>> from transformers import VisionEncoderDecoderModel, pipeline
    >>> checkpoint = "naver-clova-ix/donut-base-finetuned-docvqa"
    >>> donut = hf_specdec.enable(VisionEncoderDecoderModel.from_pretrained(checkpoint))  # doctest: +SKIP
    >>> pipe = pipeline("document-question-answering", model=donut,  # doctest: +SKIP
    ...                 image_processor=checkpoint, tokenizer=checkpoint)
    >>> pipe("invoice.png", "What is the total?", drafter="prompt_lookup")  # doctest: +SKIP
    [{'answer': ...}]

    ```
    """

    def _forward(self, model_inputs, **generate_kwargs):
        if any(generate_kwargs.get(name) is not None for name in _SPECULATIVE_ARGUMENTS):
            # transformers asks an encoder-decoder (Donut) for attentions that nothing reads, and speculative decoding
            # does not return them: not asked for here
            model_inputs = {name: value for name, value in model_inputs.items() if name != "output_attentions"}
        return super()._forward(model_inputs, **generate_kwargs)


class ImageTextToTextPipeline(_PipelineWithPathAssistants, transformers_pipelines.ImageTextToTextPipeline):
    r"""
    transformers' `image-text-to-text` pipeline, changed as [`SpeechRecognitionPipeline`] is. Also: an
    `assistant_model` given at construction is used (transformers' own loads it and then never passes it to
    `generate`), and top-level speculative arguments of a call reach `generate` instead of the processor.

    Example:

    ```python
    >>> import hf_specdec
    >>> from transformers import AutoModelForImageTextToText, pipeline
    >>> checkpoint = "HuggingFaceTB/SmolVLM-256M-Instruct"
    >>> vlm = hf_specdec.enable(AutoModelForImageTextToText.from_pretrained(checkpoint))  # doctest: +SKIP
    >>> pipe = pipeline("image-text-to-text", model=vlm, processor=checkpoint)  # doctest: +SKIP
    >>> pipe("photo.png", text="<image> Describe the picture.",  # doctest: +SKIP
    ...      drafter="prompt_lookup", max_new_tokens=40)
    [{'generated_text': ...}]

    ```
    """

    _nested_generate_kwargs = True


class AnyToAnyPipeline(_PipelineWithPathAssistants, transformers_pipelines.AnyToAnyPipeline):
    r"""
    transformers' `any-to-any` pipeline, changed as [`ImageTextToTextPipeline`] is.

    Example:

    ```python
    >>> import hf_specdec
    >>> from transformers import AutoModelForMultimodalLM, pipeline
    >>> model = hf_specdec.enable(AutoModelForMultimodalLM.from_pretrained("google/gemma-3n-E4B-it"))  # doctest: +SKIP
    >>> pipe = pipeline("any-to-any", model=model, processor="google/gemma-3n-E4B-it")  # doctest: +SKIP
    >>> pipe(text="Name three colours.", drafter="prompt_lookup", max_new_tokens=20)  # doctest: +SKIP
    [{'generated_text': ...}]

    ```
    """

    _nested_generate_kwargs = True
