"""Continuous batching (`generate_batch`) on an enabled model: hf_specdec does not speculate there yet, so drafting
arguments are refused by name instead of being dropped by transformers' `generate_batch` (which takes `**kwargs` and
reads only `max_new_tokens`), and plain continuous batching is unchanged."""

import pytest
from conftest import tiny_model
from transformers import GenerationConfig

import hf_specdec

PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]


def config(**overrides):
    return GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0, **overrides)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(drafter="prompt_lookup"),
        dict(drafter="prompt_lookup", drafter_kwargs={"max_ngram_size": 2}),
        dict(speculative_gamma=4),
        dict(speculative_tree_budget=8),
        dict(prompt_lookup_num_tokens=3),
        dict(assistant_early_exit=1),
        dict(use_mtp=True),
    ],
    ids=lambda kwargs: next(iter(kwargs)),
)
def test_drafting_arguments_are_refused_by_name(kwargs):
    model = hf_specdec.enable(tiny_model("llama"))
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=f"`{name}={value!r}`.*continuous batching.*generate\\(input_ids"):
        model.generate_batch(PROMPTS, config(), **kwargs)


def test_an_assistant_model_is_refused():
    model = hf_specdec.enable(tiny_model("llama"))
    with pytest.raises(ValueError, match="`assistant_model=<LlamaForCausalLM>`: .*continuous batching"):
        model.generate_batch(PROMPTS, config(), assistant_model=tiny_model("llama", seed=1))


@pytest.mark.parametrize("setting", [dict(prompt_lookup_num_tokens=3), dict(assistant_early_exit=1)])
def test_drafting_settings_in_the_generation_config_are_refused(setting):
    model = hf_specdec.enable(tiny_model("llama"))
    with pytest.raises(ValueError, match=f"`{next(iter(setting))}=.*continuous batching"):
        model.generate_batch(PROMPTS, generation_config=config(**setting))


def test_plain_continuous_batching_is_unchanged():
    plain = tiny_model("llama").generate_batch(PROMPTS, config(), warmup=False)
    enabled = hf_specdec.enable(tiny_model("llama")).generate_batch(PROMPTS, config(), warmup=False, max_new_tokens=5)
    assert {k: v.generated_tokens for k, v in enabled.items()} == {k: v.generated_tokens for k, v in plain.items()}
    assert all(len(output.generated_tokens) == 5 for output in plain.values())
