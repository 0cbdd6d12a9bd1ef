"""The `text2text-generation`, `summarization` and `translation` pipelines, as transformers 4.x had them.

transformers 5 removed them; [`register_pipelines`] (which the first [`hf_specdec.enable`] calls) registers these
where the installed transformers lacks the task.
"""

from __future__ import annotations

import enum
import re

from transformers import AutoModelForSeq2SeqLM, GenerationConfig, PreTrainedModel
from transformers.pipelines.base import Pipeline
from transformers.tokenization_utils_base import TruncationStrategy
from transformers.utils import ModelOutput

from .speculative_arguments import _check_speculation_enabled, _PathAssistants

__all__ = ["ReturnType", "SummarizationPipeline", "Text2TextGenerationPipeline", "TranslationPipeline"]

_TRANSLATION_TASK = re.compile(r"translation_([^_]+)_to_([^_]+)")


class ReturnType(enum.Enum):
    """What a record holds: the generated token ids (`TENSORS`) and/or the decoded text (`TEXT`)."""

    TENSORS = 0
    TEXT = 1


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
    >>> import hf_specdec
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
    >>> import hf_specdec
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
    >>> import hf_specdec
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
