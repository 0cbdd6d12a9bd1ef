"""`distill_drafter`: both objectives reduce their loss on a tiny real target; inputs and errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import tiny_config, tiny_model
from transformers import AutoModelForCausalLM

from hf_specdec.distill import distill_drafter, drafter_agreement


def one_layer_config():
    config = tiny_config("llama")
    config.num_hidden_layers = 1
    config.layer_types = None
    return config


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def corpus():
    # text from the target itself, like the data a drafter meets at decoding time
    ids = torch.randint(0, 96, (8, 4), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = tiny_model("llama", seed=0)
    return model.generate(ids, do_sample=True, max_new_tokens=28, attention_mask=torch.ones_like(ids))  # [8, 32]


@pytest.mark.parametrize("objective", ["kl", "tv"])
def test_distillation_reduces_its_objective(target, corpus, objective):
    torch.manual_seed(1)
    drafter = AutoModelForCausalLM.from_config(one_layer_config()).eval()
    before = drafter_agreement(target, drafter, corpus)
    distilled = distill_drafter(
        target,
        corpus,
        drafter,
        objective=objective,
        num_steps=40,
        batch_size=8,
        learning_rate=1e-2,
        show_progress=False,
    )
    after = drafter_agreement(target, distilled, corpus)
    assert after[objective] < 0.7 * before[objective]
    assert after["top1"] > before["top1"]
    assert distilled is drafter and not distilled.training


def test_config_builds_an_early_exit_drafter_and_saves(target, corpus, tmp_path):
    drafter = distill_drafter(
        target, corpus, one_layer_config(), num_steps=3, show_progress=False, output_dir=tmp_path / "drafter"
    )
    # initialised from the target: embeddings and first layer copied before training started
    assert drafter.config.num_hidden_layers == 1
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "drafter")
    torch.testing.assert_close(reloaded.lm_head.weight, drafter.lm_head.weight)
    log = json.loads((tmp_path / "drafter" / "distill_log.json").read_text())
    assert log["objective"] == "kl" and log["steps"] == 3 and log["log"][-1]["step"] == 3


def test_saving_never_writes_through_a_planted_link(target, corpus, tmp_path):
    """The drafter's files and the training log replace links standing in the output folder, never write through."""
    output, outside = tmp_path / "drafter", tmp_path / "outside"
    output.mkdir()
    outside.mkdir()
    for name in ("config.json", "distill_log.json", "model.safetensors"):
        (outside / name).write_text("keep me")
        (output / name).symlink_to(outside / name)
    distill_drafter(target, corpus, one_layer_config(), num_steps=1, show_progress=False, output_dir=output)
    for name in ("config.json", "distill_log.json", "model.safetensors"):
        assert (outside / name).read_text() == "keep me"
        assert not (output / name).is_symlink() and (output / name).stat().st_size > 0
    assert AutoModelForCausalLM.from_pretrained(output).config.num_hidden_layers == 1


def test_texts_are_tokenized_with_the_tokenizer():
    from hf_specdec.zoo import load_tokenizer

    tokenizer = load_tokenizer()
    config = tiny_config("llama", vocab_size=len(tokenizer))
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config).eval()
    texts = ["def add(a, b):\n    return a + b\n" * 8, "class A:\n    pass\n" * 8]
    drafter_config = copy.deepcopy(config)
    drafter_config.num_hidden_layers, drafter_config.layer_types = 1, None
    drafter = distill_drafter(
        target, texts, drafter_config, tokenizer=tokenizer, seq_len=16, num_steps=2, show_progress=False
    )
    assert drafter.get_output_embeddings().weight.shape[0] == len(tokenizer)


def test_errors(target, corpus):
    with pytest.raises(ValueError, match="`objective` must be one of"):
        distill_drafter(target, corpus, one_layer_config(), objective="l2")
    with pytest.raises(ValueError, match="corpus is empty"):
        distill_drafter(target, [], one_layer_config())
    with pytest.raises(ValueError, match="pass `tokenizer=`"):
        distill_drafter(target, ["def f(): pass"], one_layer_config())
    wrong = one_layer_config()
    wrong.vocab_size = 64
    with pytest.raises(ValueError, match="vocabulary of 64 tokens but the target has 96"):
        distill_drafter(target, corpus, wrong, num_steps=1)
    with pytest.raises(TypeError, match="`drafter` must be a `PreTrainedModel` or a `PretrainedConfig`"):
        distill_drafter(target, corpus, "llama")
    with pytest.raises(ValueError, match="`num_steps` must be a positive int"):
        distill_drafter(target, corpus, one_layer_config(), num_steps=0)
