"""What hf_specdec changes in transformers, and when: importing hf_specdec (or any of its modules) changes nothing;
the first `hf_specdec.enable` of a process installs hf_specdec's pipelines and the hint in transformers'
unused-arguments error, once; `hf_specdec.pipelines.register_pipelines()` installs the pipelines alone.

Each check runs in a fresh Python process: in this one, conftest has installed all of it before the first test."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

REMOVED_IN_TRANSFORMERS_5 = ["text2text-generation", "summarization", "translation"]
# prints a JSON report of what each step changed; argv[1] is the first call after the imports: "enable" or "register"
SCRIPT = r"""
import importlib, json, pkgutil, sys
import torch
import transformers.pipelines
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin

registry = transformers.pipelines.PIPELINE_REGISTRY


def state():
    return {
        "GenerationMixin": dict(vars(GenerationMixin)),
        "registry tasks": {task: dict(entry) for task, entry in registry.supported_tasks.items()},
        "registry aliases": dict(registry.task_aliases),
        "registry attributes": {
            name: value for name, value in vars(registry).items() if name not in ("supported_tasks", "task_aliases")
        },
        "REMOVED_TASKS": dict(getattr(transformers.pipelines, "REMOVED_TASKS", {})),
    }


def changed(before, after):
    return sorted(name for name in before if before[name] != after[name])


def tiny():
    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    return AutoModelForCausalLM.from_config(config).eval()


def unused_arguments_error(model):
    try:
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, drafter="prompt_lookup")
    except ValueError as error:
        return str(error)


before = state()
missing = [
    task for task in ("text2text-generation", "summarization", "translation") if task not in registry.supported_tasks
]
import hf_specdec

for module in pkgutil.walk_packages(hf_specdec.__path__, "hf_specdec."):
    importlib.import_module(module.name)
imported = state()
report = {"imported": changed(before, imported), "missing": missing, "error before": unused_arguments_error(tiny())}
if sys.argv[1] == "enable":
    hf_specdec.enable(tiny())
else:
    report["returned"] = hf_specdec.pipelines.register_pipelines()
installed = state()
report["installed"] = changed(imported, installed)
report["error after"] = unused_arguments_error(tiny())
report["registered tasks"] = list(hf_specdec.pipelines.REGISTERED_TASKS)
report["impl"] = {
    task: registry.check_task(task)[1]["impl"].__qualname__
    for task in ("text-generation", "automatic-speech-recognition", *missing, "translation_en_to_de")
}
hf_specdec.enable(tiny())
enabled = state()
report["then enabled"] = changed(installed, enabled)
hf_specdec.enable(tiny())
report["again"] = changed(enabled, state()) + hf_specdec.pipelines.register_pipelines()
print(json.dumps(report))
"""


def run_fresh(first_call: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, first_call], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def after_enable():
    return run_fresh("enable")


@pytest.fixture(scope="module")
def after_register():
    return run_fresh("register")


def test_importing_hf_specdec_changes_nothing_in_transformers(after_enable):
    assert after_enable["imported"] == []
    # transformers' own message, not yet naming `enable`
    assert "not used by the model: ['drafter']" in after_enable["error before"]
    assert "hf_specdec" not in after_enable["error before"]


def test_enable_installs_pipelines_and_the_hint_once(after_enable):
    # transformers 5 removed these three pipelines: hf_specdec registers its own
    assert after_enable["missing"] == REMOVED_IN_TRANSFORMERS_5
    assert after_enable["installed"] == [
        "GenerationMixin",  # the hint in `_validate_model_kwargs`
        "REMOVED_TASKS",  # the registered tasks are no longer refused as removed
        "registry attributes",  # `check_task` parses 4.x's "translation_XX_to_YY"
        "registry tasks",
    ]
    assert after_enable["registered tasks"] == REMOVED_IN_TRANSFORMERS_5
    assert "call `model = hf_specdec.enable(model)` first" in after_enable["error after"]
    assert after_enable["impl"] == {
        "text-generation": "TextGenerationPipeline",
        "automatic-speech-recognition": "SpeechRecognitionPipeline",
        "text2text-generation": "Text2TextGenerationPipeline",
        "summarization": "SummarizationPipeline",
        "translation": "TranslationPipeline",
        "translation_en_to_de": "TranslationPipeline",
    }
    # once per process: later `enable`s and `register_pipelines()` change nothing
    assert after_enable["then enabled"] == [] and after_enable["again"] == []


def test_register_pipelines_installs_the_pipelines_alone(after_register):
    assert after_register["imported"] == []
    assert after_register["returned"] == after_register["registered tasks"] == REMOVED_IN_TRANSFORMERS_5
    assert after_register["installed"] == ["REMOVED_TASKS", "registry attributes", "registry tasks"]
    assert "hf_specdec" not in after_register["error after"]  # the hint comes with `enable`
    assert after_register["impl"]["text-generation"] == "TextGenerationPipeline"
    assert after_register["impl"]["translation_en_to_de"] == "TranslationPipeline"
    assert after_register["then enabled"] == ["GenerationMixin"]  # then `enable` adds the hint, and nothing else
    assert after_register["again"] == []
