"""`register_pipelines`: hf_specdec's pipelines in transformers' pipeline registry, when asked for (`enable` asks)."""

from __future__ import annotations

from transformers import AutoModelForSeq2SeqLM

from .text2text import (
    _TRANSLATION_TASK,
    SummarizationPipeline,
    Text2TextGenerationPipeline,
    TranslationPipeline,
)
from .transformers_generating import (
    AnyToAnyPipeline,
    DocumentQuestionAnsweringPipeline,
    ImageTextToTextPipeline,
    SpeechRecognitionPipeline,
    TableQuestionAnsweringPipeline,
    TextGenerationPipeline,
    TextToAudioPipeline,
)

__all__ = ["REGISTERED_TASKS", "register_pipelines"]

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
# transformers' pipelines that call `generate`, by task -> hf_specdec's subclass of each
_TRANSFORMERS_GENERATING_PIPELINES = {
    "automatic-speech-recognition": SpeechRecognitionPipeline,
    "text-generation": TextGenerationPipeline,
    "text-to-audio": TextToAudioPipeline,
    "table-question-answering": TableQuestionAnsweringPipeline,
    "document-question-answering": DocumentQuestionAnsweringPipeline,
    "image-text-to-text": ImageTextToTextPipeline,
    "any-to-any": AnyToAnyPipeline,
}

REGISTERED_TASKS: list[str] = []
"""The tasks hf_specdec registered with transformers' `PIPELINE_REGISTRY` in this process (those the installed
transformers lacks). Empty until [`register_pipelines`] runs with transformers' registry, as the first
[`hf_specdec.enable`] does; importing hf_specdec registers nothing."""


def register_pipelines(registry=None, removed_tasks: dict[str, str] | None = None) -> list[str]:
    """Registers hf_specdec's pipelines with `registry` (transformers' by default), and returns the tasks it added.

    - The `text2text-generation`, `summarization` and `translation` pipelines, each only where `registry` lacks the
      task: a task the installed transformers has (as a task or an alias) keeps transformers' pipeline. For each task
      registered, the matching entry of `removed_tasks` (transformers 5's list of removed tasks, which `pipeline()`
      rejects) is dropped, and registering "translation" makes the registry accept the 4.x task names
      "translation_XX_to_YY".
    - The entries of transformers' own generating pipelines (`automatic-speech-recognition`, `text-generation`, ...)
      are pointed at hf_specdec's subclasses of them ([`SpeechRecognitionPipeline`], ...), where they hold
      transformers' own pipeline; an entry someone else registered is left as it is.

    Importing hf_specdec calls it never; the first [`hf_specdec.enable`] of a process calls it once with
    transformers' registry. Call it yourself to build a pipeline from a checkpoint name before enabling any model
    (then enable `pipe.model` to pass the speculative arguments). A second call changes nothing.

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
    >>> # transformers' own registry, to build a pipeline from a checkpoint name before enabling a model:
    >>> import hf_specdec
    >>> from transformers import pipeline
    >>> register_pipelines()  # doctest: +SKIP
    ['text2text-generation', 'summarization', 'translation']
    >>> summarizer = pipeline("summarization", model="sshleifer/distilbart-cnn-12-6")  # doctest: +SKIP
    >>> hf_specdec.enable(summarizer.model)  # doctest: +SKIP
    >>> summarizer(article, drafter="prompt_lookup", num_beams=1)  # doctest: +SKIP

    ```
    """
    import transformers.pipelines

    transformers_registry = transformers.pipelines.PIPELINE_REGISTRY
    if registry is None:
        registry = transformers_registry
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
    _load_path_assistants_safely(registry)
    if registry is transformers_registry:
        REGISTERED_TASKS.extend(registered)
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


def _load_path_assistants_safely(registry) -> list[str]:
    """Points the registry's entries for transformers' generating pipelines at hf_specdec's subclasses of them
    (`_TRANSFORMERS_GENERATING_PIPELINES`) where they hold transformers' own pipeline (a class, or the dotted path
    transformers registers); returns the tasks it pointed. An entry someone else registered is left as it is."""
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
