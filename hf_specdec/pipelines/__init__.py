"""hf_specdec's pipelines: `text2text-generation`, `summarization` and `translation` for transformers versions that
lack them, and transformers' own generating pipelines with the speculative arguments.

transformers 5 removed the first three pipelines. [`register_pipelines`] registers hf_specdec's versions with
transformers' pipeline registry, each only where the installed transformers does not already have the task (its own
pipeline always wins), so that `transformers.pipeline("summarization", ...)` works again. They follow transformers
4.x's call conventions (inputs, outputs and arguments) and pass every other keyword argument to `generate`, the
speculative ones included. It also points the registry entries of transformers' own generating pipelines
(`automatic-speech-recognition`, `text-generation`, `text-to-audio`, table and document question answering,
`image-text-to-text`, `any-to-any`) at subclasses ([`SpeechRecognitionPipeline`], ...) that change only how the
speculative arguments are handled.

Importing hf_specdec registers nothing. The first [`hf_specdec.enable`] of a process calls `register_pipelines()`,
so a pipeline built from an enabled model takes the speculative arguments:

```python
>>> import hf_specdec
>>> from transformers import AutoModelForSeq2SeqLM, pipeline
>>> t5 = hf_specdec.enable(AutoModelForSeq2SeqLM.from_pretrained("google-t5/t5-base"))  # doctest: +SKIP
>>> pipe = pipeline("text2text-generation", model=t5, tokenizer="google-t5/t5-base")  # doctest: +SKIP
>>> pipe("translate English to German: How old are you?",  # doctest: +SKIP
...      assistant_model="google-t5/t5-small", speculative_gamma=5)
[{'generated_text': ...}]

```

To build a pipeline from a checkpoint name before enabling any model, call
`hf_specdec.pipelines.register_pipelines()` first, then `hf_specdec.enable(pipe.model)`.

The speculative arguments (`assistant_model`, `drafter`, `drafter_kwargs`, `speculative_*`) need a model enabled with
[`hf_specdec.enable`]; the pipelines never enable one themselves, as that would modify the caller's model. An
`assistant_model` given as a path or Hub id is loaded from safetensors only, never unpickled.
"""

from .registration import REGISTERED_TASKS, register_pipelines
from .text2text import ReturnType, SummarizationPipeline, Text2TextGenerationPipeline, TranslationPipeline
from .transformers_generating import (
    AnyToAnyPipeline,
    DocumentQuestionAnsweringPipeline,
    ImageTextToTextPipeline,
    SpeechRecognitionPipeline,
    TableQuestionAnsweringPipeline,
    TextGenerationPipeline,
    TextToAudioPipeline,
)

__all__ = [
    "REGISTERED_TASKS",
    "AnyToAnyPipeline",
    "DocumentQuestionAnsweringPipeline",
    "ImageTextToTextPipeline",
    "ReturnType",
    "SpeechRecognitionPipeline",
    "SummarizationPipeline",
    "TableQuestionAnsweringPipeline",
    "Text2TextGenerationPipeline",
    "TextGenerationPipeline",
    "TextToAudioPipeline",
    "TranslationPipeline",
    "register_pipelines",
]
