"""The `text2text-generation`, `summarization` and `translation` pipelines, for transformers versions that lack them.

transformers 5 removed these three pipelines. Importing this module registers hf_specdec's versions with transformers'
pipeline registry, each only where the installed transformers does not already have the task (its own pipeline
always wins), so that `transformers.pipeline("summarization", ...)` works again. They follow transformers 4.x's call
conventions (inputs, outputs and arguments) and pass every other keyword argument to `generate`, the speculative ones
included:

```python
>>> import hf_specdec, hf_specdec.pipelines
>>> from transformers import AutoModelForSeq2SeqLM, pipeline
>>> t5 = hf_specdec.enable(AutoModelForSeq2SeqLM.from_pretrained("google-t5/t5-base"))  # doctest: +SKIP
>>> pipe = pipeline("text2text-generation", model=t5, tokenizer="google-t5/t5-base")  # doctest: +SKIP
>>> pipe("translate English to German: How old are you?",  # doctest: +SKIP
...      assistant_model="google-t5/t5-small", speculative_gamma=5)
[{'generated_text': ...}]

```

The speculative arguments (`assistant_model`, `drafter`, `drafter_kwargs`, `speculative_*`) need a model enabled with
[`hf_specdec.enable`]; the pipelines never enable one themselves, as that would modify the caller's model.

An `assistant_model` given as a path or Hub id is loaded from safetensors only, never unpickled: by these pipelines,
and by transformers' own generating pipelines (`automatic-speech-recognition`, `text-generation`, `text-to-audio`,
table and document question answering, `image-text-to-text`, `any-to-any`), whose registry entries this module
points at subclasses ([`SpeechRecognitionPipeline`], ...) that change only how the speculative arguments are handled.
"""

from __future__ import annotations

import enum
import os
import re
from typing import Any

from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer, GenerationConfig, PreTrainedModel
from transformers import pipelines as transformers_pipelines
from transformers.pipelines.automatic_speech_recognition import AutomaticSpeechRecognitionPipeline
from transformers.pipelines.base import Pipeline, load_assistant_model, load_model
from transformers.tokenization_utils_base import TruncationStrategy
from transformers.utils import ModelOutput

from .mixin import SpeculativeGenerationMixin

__all__ = [
    "REGISTERED_TASKS",
    "ReturnType",
    "SpeechRecognitionPipeline",
    "SummarizationPipeline",
    "TextGenerationPipeline",
    "Text2TextGenerationPipeline",
    "TextToAudioPipeline",
    "TableQuestionAnsweringPipeline",
    "DocumentQuestionAnsweringPipeline",
    "ImageTextToTextPipeline",
    "AnyToAnyPipeline",
    "TranslationPipeline",
    "register_pipelines",
]

# `generate` arguments that run speculative decoding, besides every `speculative_*` one
_SPECULATIVE_ARGUMENTS = ("assistant_model", "drafter", "drafter_kwargs")
# the arguments transformers' own pipelines take for its assisted generation
_ASSISTANT_ARGUMENTS = ("assistant_model", "assistant_tokenizer")
_TRANSLATION_TASK = re.compile(r"translation_([^_]+)_to_([^_]+)")


class ReturnType(enum.Enum):
    """What a record holds: the generated token ids (`TENSORS`) and/or the decoded text (`TEXT`)."""

    TENSORS = 0
    TEXT = 1


class _PathAssistants:
    """Loads an `assistant_model` given as a path or Hub id once per pipeline, from safetensors only."""

    # tried before the classes the checkpoint's config names (none: only those, as transformers' pipelines do)
    _assistant_classes: tuple[type, ...] = ()

    def _load_assistant(self, assistant_model):
        if not isinstance(assistant_model, str):
            return assistant_model
        loaded = vars(self).setdefault("_loaded_assistants", {})  # path -> model
        if assistant_model not in loaded:  # once per pipeline, not once per call
            _check_safetensors_checkpoint(assistant_model)
            config = AutoConfig.from_pretrained(assistant_model)
            # safetensors only: a path never reaches the unpickler, whatever transformers' loading defaults are
            model = load_model(
                assistant_model, config=config, model_classes=self._assistant_classes, use_safetensors=True
            )
            loaded[assistant_model] = model.to(device=self.model.device, dtype=self.model.dtype)
        return loaded[assistant_model]


def _check_safetensors_checkpoint(path: str) -> None:
    """Refuses a local directory without safetensors weights before anything is loaded from it."""
    if not os.path.isdir(path):
        return  # a Hub id: `use_safetensors=True` refuses a repository without safetensors weights
    files = sorted(os.listdir(path))
    if any(name.endswith(".safetensors") for name in files):
        return
    found = [name for name in files if name.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl"))]
    raise ValueError(
        f"`assistant_model` {path!r} holds no safetensors weights"
        f"{' (only the pickle checkpoint ' + ', '.join(found) + ')' if found else ''}. Assistants given by path are "
        "loaded from safetensors only and never unpickled: load that checkpoint where you trust it and re-save it "
        "with `model.save_pretrained(path)` (which writes model.safetensors), or pass the loaded model as "
        "`assistant_model=model`."
    )


class Text2TextGenerationPipeline(_PathAssistants, Pipeline):
    r"""
    Text-to-text generation with an encoder-decoder model (T5, BART, Marian, ...), as transformers 4.x's pipeline of
    the same name: `pipeline("text2text-generation", model=..., tokenizer=...)`.

    Unlike transformers 4.x, the only default generation parameter is `max_new_tokens=256` (4.x also set
    `num_beams=4`): speculative decoding verifies greedy or sampled decoding, and a beam-search default would make
    `pipe(text)` and `pipe(text, assistant_model=draft)` decode differently. Parameters in the model's generation
    config, and in its config's `task_specific_params` for the pipeline's task, still apply.

    Args:
        model ([`~transformers.PreTrainedModel`]):
            An encoder-decoder model with a language-modeling head (`AutoModelForSeq2SeqLM`). To pass speculative
            arguments, enable it first with [`hf_specdec.enable`].
        tokenizer ([`~transformers.PreTrainedTokenizerBase`]):
            The model's tokenizer.
        assistant_model ([`~transformers.PreTrainedModel`] or `str`, *optional*):
            A drafter for every call: a model sharing the target's tokenizer, or a path or Hub id to load one from
            (as transformers' pipelines load assistants, onto the model's device and dtype).
        assistant_tokenizer ([`~transformers.PreTrainedTokenizerBase`], *optional*):
            The tokenizer of `assistant_model` when it is not the model's: the pipeline then drafts across
            tokenizers ([`CrossTokenizerDrafter`]), passing its own tokenizer as `tokenizer`. Also accepted per call.
        kwargs:
            Any [`~transformers.Pipeline`] argument, and generation parameters applied to every call.

    Example:

    ```python
    >>> import hf_specdec, hf_specdec.pipelines
    >>> from transformers import AutoModelForSeq2SeqLM, pipeline
    >>> model = hf_specdec.enable(AutoModelForSeq2SeqLM.from_pretrained("google-t5/t5-base"))  # doctest: +SKIP
    >>> pipe = pipeline("text2text-generation", model=model, tokenizer="google-t5/t5-base")  # doctest: +SKIP
    >>> text = "question: What is 42? context: 42 is the answer to life, the universe and everything"
    >>> plain = pipe(text, max_new_tokens=20)  # doctest: +SKIP
    >>> plain == pipe(text, max_new_tokens=20,  # doctest: +SKIP
    ...               assistant_model="google-t5/t5-small", speculative_gamma=5)
    True

    ```
    """

    _pipeline_calls_generate = True
    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True
    _default_generation_config = GenerationConfig(max_new_tokens=256)
    _assistant_classes = (AutoModelForSeq2SeqLM,)

    # the task this class serves when built without one, and the prefix of its output keys
    default_task = "text2text-generation"
    return_name = "generated"

    def __init__(self, model: PreTrainedModel, *args, assistant_model=None, assistant_tokenizer=None, **kwargs):
        task = kwargs.setdefault("task", self.default_task)
        _check_model_kind(model, task)
        _check_speculation_enabled(model, {"assistant_model": assistant_model, **kwargs})
        if assistant_tokenizer is not None and assistant_model is None:
            raise ValueError(
                f"`assistant_tokenizer` ({type(assistant_tokenizer).__name__}) is the tokenizer of an "
                "`assistant_model`, and none was given. Pass `assistant_model=` with it, or drop `assistant_tokenizer`."
            )
        super().__init__(model, *args, **kwargs)
        # loaded here, not by transformers' `load_assistant_model`, which fails on configs without `bos_token_id` (T5)
        self.assistant_model = self._load_assistant(assistant_model)
        self.assistant_tokenizer = assistant_tokenizer

        # like 4.x, the model config's settings for this task apply beneath the generation parameters passed here; a
        # `generation_config` (here or in a call) replaces them
        task_params = dict((getattr(self.model.config, "task_specific_params", None) or {}).get(self.task, {}))
        if "prefix" in task_params:
            self.prefix = task_params.pop("prefix")
        if "generation_config" not in self._generate_kwargs:
            generation_keys = {key for key in vars(GenerationConfig()) if not key.startswith("_")}
            task_generation = {key: value for key, value in task_params.items() if key in generation_keys}
            self._generate_kwargs = {**task_generation, **self._generate_kwargs}

    def _sanitize_parameters(
        self,
        return_tensors=None,
        return_text=None,
        return_type=None,
        clean_up_tokenization_spaces=None,
        truncation=None,
        stop_sequence=None,
        **generate_kwargs,
    ):
        preprocess_params = {}
        if truncation is not None:
            preprocess_params["truncation"] = truncation

        postprocess_params = {}
        if return_type is None and (return_tensors is not None or return_text is not None):
            # 4.x: `return_tensors=True` alone returns only the token ids
            text = return_text if return_text is not None else not return_tensors
            tensors = return_tensors if return_tensors is not None else not text
            return_type = {kind for kind, wanted in ((ReturnType.TEXT, text), (ReturnType.TENSORS, tensors)) if wanted}
        if return_type is not None:
            postprocess_params["return_type"] = return_type if isinstance(return_type, set) else {return_type}
        if clean_up_tokenization_spaces is not None:
            postprocess_params["clean_up_tokenization_spaces"] = clean_up_tokenization_spaces

        forward_params = generate_kwargs
        if stop_sequence is not None:  # as the 5.x text-generation pipeline: any stop string, not just one token
            forward_params["stop_strings"] = [stop_sequence] if isinstance(stop_sequence, str) else stop_sequence
            forward_params["tokenizer"] = self.tokenizer
        if "assistant_model" in forward_params:  # this call's, over the one given at construction
            forward_params["assistant_model"] = self._load_assistant(forward_params["assistant_model"])
        if forward_params.get("assistant_tokenizer") is not None:  # drafting with another tokenizer needs both
            forward_params.setdefault("tokenizer", self.tokenizer)
        _check_speculation_enabled(self.model, forward_params)
        return preprocess_params, forward_params, postprocess_params

    def __call__(self, inputs: str | list[str], **kwargs):
        r"""
        Generates text from each input text.

        Args:
            inputs (`str` or `list[str]`):
                The input text(s) for the encoder; the model config's `prefix` (or its task-specific one) is prepended.
            return_text (`bool`, *optional*, defaults to `True`):
                Whether to include the decoded texts in the outputs.
            return_tensors (`bool`, *optional*, defaults to `False`):
                Whether to include the generated token ids in the outputs. Alone, it replaces the texts (as in 4.x).
            clean_up_tokenization_spaces (`bool`, *optional*, defaults to `False`):
                Whether to clean up the potential extra spaces in the text output.
            truncation (`TruncationStrategy`, *optional*, defaults to `TruncationStrategy.DO_NOT_TRUNCATE`):
                The truncation strategy of the tokenizer.
            stop_sequence (`str` or `list[str]`, *optional*):
                Generation stops after any of these strings.
            generate_kwargs:
                Passed to the model's `generate`, e.g. `max_new_tokens`, and the speculative arguments
                `assistant_model` (a model, or a path or Hub id, loaded once per pipeline), `assistant_tokenizer`
                (its tokenizer, when it differs from the pipeline's), `drafter`, `drafter_kwargs` and
                `speculative_*`.

        Return:
            For one input, a list with a `dict` per returned sequence; for a list of inputs, a list of such lists, or
            of `dict`s when each input returns one sequence. Each `dict` has `generated_text` (`str`, with
            `return_text`) and/or `generated_token_ids` (`torch.Tensor`, with `return_tensors`); the summarization and
            translation pipelines name them `summary_*` and `translation_*`.
        """
        result = super().__call__(inputs, **kwargs)
        if (
            isinstance(inputs, list)
            and all(isinstance(item, str) for item in inputs)
            and all(len(records) == 1 for records in result)
        ):
            return [records[0] for records in result]
        return result

    def _parse_and_tokenize(self, inputs, truncation):
        prefix = self.prefix if self.prefix is not None else ""
        if isinstance(inputs, list):
            if self.tokenizer.pad_token_id is None:
                raise ValueError(
                    f"A batch of {len(inputs)} texts in one input needs a tokenizer with a pad token, and "
                    f"{type(self.tokenizer).__name__} has none. Set `tokenizer.pad_token`, or pass the texts as a "
                    "list of separate inputs."
                )
            texts, padding = [prefix + text for text in inputs], True
        elif isinstance(inputs, str):
            texts, padding = prefix + inputs, False
        else:
            raise ValueError(f"Each input must be a `str` or a `list[str]`, got {type(inputs).__name__}: {inputs!r}.")
        encoded = self.tokenizer(texts, padding=padding, truncation=truncation, return_tensors="pt")
        encoded.pop("token_type_ids", None)  # tokenizers produce it; `generate` rejects it
        return encoded

    def preprocess(self, inputs, truncation=TruncationStrategy.DO_NOT_TRUNCATE):
        return self._parse_and_tokenize(inputs, truncation=truncation)

    def _forward(self, model_inputs, **generate_kwargs):
        in_batch = model_inputs["input_ids"].shape[0]
        if "assistant_model" not in generate_kwargs and self.assistant_model is not None:
            generate_kwargs["assistant_model"] = self.assistant_model
            if self.assistant_tokenizer is not None and "assistant_tokenizer" not in generate_kwargs:
                # the construction's assistant and its tokenizer go together (as in transformers' pipelines)
                generate_kwargs["assistant_tokenizer"] = self.assistant_tokenizer
                generate_kwargs.setdefault("tokenizer", self.tokenizer)
        generate_kwargs = self._prepare_generate_kwargs(generate_kwargs)
        output = self.model.generate(**model_inputs, **generate_kwargs)
        if isinstance(output, ModelOutput):  # return_dict_in_generate=True
            output = output.sequences
        out_batch = output.shape[0]  # in_batch * num_return_sequences
        return {"output_ids": output.reshape(in_batch, out_batch // in_batch, *output.shape[1:])}

    def postprocess(self, model_outputs, return_type=frozenset({ReturnType.TEXT}), clean_up_tokenization_spaces=False):
        records = []
        for output_ids in model_outputs["output_ids"][0]:
            record = {}
            if ReturnType.TEXT in return_type:
                record[f"{self.return_name}_text"] = self.tokenizer.decode(
                    output_ids, skip_special_tokens=True, clean_up_tokenization_spaces=clean_up_tokenization_spaces
                )
            if ReturnType.TENSORS in return_type:
                record[f"{self.return_name}_token_ids"] = output_ids
            records.append(record)
        return records


class SummarizationPipeline(Text2TextGenerationPipeline):
    r"""
    Summarizes documents with an encoder-decoder model, as transformers 4.x's pipeline of the same name:
    `pipeline("summarization", model=..., tokenizer=...)`. Outputs hold `summary_text` (and `summary_token_ids`). See
    [`Text2TextGenerationPipeline`] for the arguments.

    Example:

    ```python
    >>> import hf_specdec, hf_specdec.pipelines
    >>> from transformers import AutoModelForSeq2SeqLM, pipeline
    >>> bart = hf_specdec.enable(AutoModelForSeq2SeqLM.from_pretrained("facebook/bart-large-cnn"))  # doctest: +SKIP
    >>> summarizer = pipeline("summarization", model=bart, tokenizer="facebook/bart-large-cnn")  # doctest: +SKIP
    >>> article = open("article.txt").read()  # doctest: +SKIP
    >>> # summaries copy from the article, so prompt lookup drafts well; the checkpoint asks for beam search
    >>> summarizer(article, drafter="prompt_lookup", num_beams=1)  # doctest: +SKIP
    [{'summary_text': ...}]

    ```
    """

    default_task = "summarization"
    return_name = "summary"


class TranslationPipeline(Text2TextGenerationPipeline):
    r"""
    Translates text with an encoder-decoder model, as transformers 4.x's pipeline of the same name:
    `pipeline("translation", model=..., tokenizer=...)` or `pipeline("translation_en_to_de", ...)`, whose languages
    select the model config's task-specific parameters (e.g. T5's "translate English to German: " prefix) and are
    passed to multilingual tokenizers. Outputs hold `translation_text` (and `translation_token_ids`). See
    [`Text2TextGenerationPipeline`] for the arguments; calls also take `src_lang` and `tgt_lang` (`str`, *optional*),
    which multilingual tokenizers (mBART, NLLB, M2M100) need.

    Example:

    ```python
    >>> import hf_specdec, hf_specdec.pipelines
    >>> from transformers import AutoModelForSeq2SeqLM, pipeline
    >>> t5 = hf_specdec.enable(AutoModelForSeq2SeqLM.from_pretrained("google-t5/t5-base"))  # doctest: +SKIP
    >>> translator = pipeline("translation_en_to_de", model=t5, tokenizer="google-t5/t5-base")  # doctest: +SKIP
    >>> # T5's settings for this task add the "translate English to German: " prefix, and beam search
    >>> translator("How old are you?", assistant_model="google-t5/t5-small", num_beams=1)  # doctest: +SKIP
    [{'translation_text': ...}]

    ```
    """

    default_task = "translation"
    return_name = "translation"

    def _sanitize_parameters(self, src_lang=None, tgt_lang=None, **kwargs):
        preprocess_params, forward_params, postprocess_params = super()._sanitize_parameters(**kwargs)
        if src_lang is None and tgt_lang is None:
            match = _TRANSLATION_TASK.fullmatch(self.task)
            if match is not None:
                src_lang, tgt_lang = match.groups()
        if src_lang is not None:
            preprocess_params["src_lang"] = src_lang
        if tgt_lang is not None:
            preprocess_params["tgt_lang"] = tgt_lang
        return preprocess_params, forward_params, postprocess_params

    def preprocess(self, inputs, truncation=TruncationStrategy.DO_NOT_TRUNCATE, src_lang=None, tgt_lang=None):
        if getattr(self.tokenizer, "_build_translation_inputs", None):  # multilingual tokenizers
            return self.tokenizer._build_translation_inputs(
                inputs, return_tensors="pt", truncation=truncation, src_lang=src_lang, tgt_lang=tgt_lang
            )
        return self._parse_and_tokenize(inputs, truncation=truncation)


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
        if kwargs.get("generate_kwargs") is not None or self._nested_generate_kwargs:
            # a copy: some pipelines write into it (transformers' text-to-audio fails on None there)
            kwargs["generate_kwargs"] = {name: value for name, value in nested.items() if not _is_speculative(name)}
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
    (`assistant_model`, `assistant_tokenizer`, `drafter`, `drafter_kwargs`, `speculative_*`). Importing `hf_specdec`
    points transformers' registry entry for the task at this class (unless the entry was replaced by someone else),
    so `pipeline("automatic-speech-recognition", ...)` builds it; everything else is transformers' pipeline. The
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
    they could not be used). Importing `hf_specdec` points the task's registry entry at this class (unless someone
    else replaced transformers' own).

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


def _check_model_kind(model, task: str) -> None:
    config = getattr(model, "config", None)
    if config is None:  # a checkpoint name reaches here only when the class is built directly
        raise TypeError(
            f"The `{task}` pipeline class needs a loaded model, got {model!r}. Use `pipeline({task!r}, model=...)`, "
            "which loads checkpoints."
        )
    can_generate = model.can_generate()
    if not config.is_encoder_decoder:
        fix = (
            f'Use `pipeline("text-generation", model=...)` for {type(model).__name__}'
            if can_generate
            else "Load an encoder-decoder checkpoint with `AutoModelForSeq2SeqLM.from_pretrained(...)`"
        )
        raise ValueError(
            f"The `{task}` pipeline needs an encoder-decoder model (T5, BART, Marian, ...), got "
            f"{type(model).__name__}, which is not one (its config has is_encoder_decoder=False). {fix}."
        )
    if not can_generate:
        raise ValueError(
            f"The `{task}` pipeline needs a model with a language-modeling head, got {type(model).__name__}, which "
            "cannot `generate`. Load the checkpoint with `AutoModelForSeq2SeqLM.from_pretrained(...)`."
        )


def _check_speculation_enabled(model, kwargs: dict[str, Any]) -> None:
    requested = sorted(
        name
        for name, value in kwargs.items()
        if (name in _SPECULATIVE_ARGUMENTS and value is not None) or name.startswith("speculative_")
    )
    if requested and not isinstance(model, SpeculativeGenerationMixin):
        raise ValueError(
            f"{', '.join(f'`{name}`' for name in requested)} need(s) speculative decoding, which the pipeline's model "
            f"({type(model).__name__}) does not have. Call `hf_specdec.enable(model)` on it before building the "
            "pipeline (or `hf_specdec.enable(pipe.model)`); the pipeline does not change your model for you."
        )


# transformers 4.x's default checkpoints, for `pipeline(task)` without a model
_DEFAULTS = {
    "text2text-generation": {"model": ("google-t5/t5-base", "a9723ea")},
    "summarization": {"model": ("sshleifer/distilbart-cnn-12-6", "a4f8f3e")},
    "translation": {
        (source, target): {"model": ("google-t5/t5-base", "a9723ea")}
        for source, target in (("en", "fr"), ("en", "de"), ("en", "ro"))
    },
}
_PIPELINES = {
    "text2text-generation": Text2TextGenerationPipeline,
    "summarization": SummarizationPipeline,
    "translation": TranslationPipeline,
}


def register_pipelines(registry=None, removed_tasks: dict[str, str] | None = None) -> list[str]:
    """Registers each of this module's pipelines whose task `registry` lacks, and returns the tasks it registered.

    Importing `hf_specdec.pipelines` calls it once with transformers' own registry; a task the installed
    transformers has (as a task or an alias) keeps transformers' pipeline. For each registered task the matching
    entry of `removed_tasks` (transformers 5's list of removed tasks, which `pipeline()` rejects) is dropped, and
    registering "translation" makes the registry accept the 4.x task names "translation_XX_to_YY".

    Args:
        registry (`transformers.pipelines.base.PipelineRegistry`, *optional*):
            Defaults to transformers' `PIPELINE_REGISTRY`.
        removed_tasks (`dict[str, str]`, *optional*):
            Defaults to transformers' `REMOVED_TASKS` (empty where transformers has none).

    Example:

    ```python
    >>> from transformers.pipelines.base import PipelineRegistry
    >>> from hf_specdec.pipelines import register_pipelines
    >>> register_pipelines(PipelineRegistry({"summarization": {"impl": object, "pt": ()}}, {}), {})
    ['text2text-generation', 'translation']

    ```
    """
    import transformers.pipelines

    if registry is None:
        registry = transformers.pipelines.PIPELINE_REGISTRY
    if removed_tasks is None:
        removed_tasks = getattr(transformers.pipelines, "REMOVED_TASKS", {})
    registered = []
    for task, pipeline_class in _PIPELINES.items():
        if task in registry.supported_tasks or task in registry.task_aliases:
            continue
        registry.register_pipeline(task, pipeline_class=pipeline_class, pt_model=AutoModelForSeq2SeqLM, type="text")
        # set after registering: `register_pipeline` would nest the language-pair keys under "model"
        registry.supported_tasks[task]["default"] = _DEFAULTS[task]
        removed_tasks.pop(task, None)
        registered.append(task)
    if "translation" in registered:
        _accept_translation_pairs(registry)
    return registered


def _accept_translation_pairs(registry) -> None:
    # transformers 5's registry dropped 4.x's parsing of "translation_XX_to_YY" into "translation" + (XX, YY); it has
    # no hook for parametrized task names, so this wraps its `check_task` on the instance, once
    check_task = registry.check_task
    if getattr(check_task, "_accepts_translation_pairs", False):
        return

    def check_translation_task(task: str):
        try:
            return check_task(task)
        except KeyError:
            if not task.startswith("translation_"):
                raise
            match = _TRANSLATION_TASK.fullmatch(task)
            if match is None:
                raise KeyError(
                    f"Invalid translation task {task!r}: use 'translation_XX_to_YY' with two language codes, e.g. "
                    "'translation_en_to_de', or 'translation' with `src_lang` and `tgt_lang`."
                ) from None
            normalized_task, targeted_task, _ = check_task("translation")
            return normalized_task, targeted_task, match.groups()

    check_translation_task._accepts_translation_pairs = True
    registry.check_task = check_translation_task


# transformers' pipelines that call `generate`, by task -> this module's subclass of each
_TRANSFORMERS_GENERATING_PIPELINES = {
    "automatic-speech-recognition": SpeechRecognitionPipeline,
    "text-generation": TextGenerationPipeline,
    "text-to-audio": TextToAudioPipeline,
    "table-question-answering": TableQuestionAnsweringPipeline,
    "document-question-answering": DocumentQuestionAnsweringPipeline,
    "image-text-to-text": ImageTextToTextPipeline,
    "any-to-any": AnyToAnyPipeline,
}


def _load_path_assistants_safely(registry=None) -> list[str]:
    """Points the registry's entries for transformers' generating pipelines at this module's subclasses of them
    (`_TRANSFORMERS_GENERATING_PIPELINES`) where they hold transformers' own pipeline (a class, or the dotted path
    transformers registers); returns the tasks it pointed. An entry someone else registered is
    left as it is. Importing `hf_specdec.pipelines` calls it once with transformers' registry (`PIPELINE_REGISTRY`
    when `registry` is None)."""
    import transformers.pipelines

    if registry is None:
        registry = transformers.pipelines.PIPELINE_REGISTRY
    pointed = []
    for task, ours in _TRANSFORMERS_GENERATING_PIPELINES.items():
        transformers_own = next(base for base in ours.__mro__ if base.__module__.startswith("transformers."))
        entry = registry.supported_tasks.get(task)
        if entry is None or entry.get("impl") not in (
            transformers_own,
            f"{transformers_own.__module__}.{transformers_own.__name__}",
        ):
            continue
        entry["impl"] = ours
        pointed.append(task)
    return pointed


REGISTERED_TASKS: list[str] = register_pipelines()
"""The tasks that importing this module registered with transformers (those the installed version lacks)."""
_load_path_assistants_safely()
