"""`train_mtp_layers` and the MTP checkpoint layout: layers trained for a model that ships none (a Llama) draft
exactly, learn (agreement with the target rises), never change the target, save beside the model in DeepSeek-V3's
layout, load back through `drafter="mtp"` / `use_mtp=True` with the same weights and drafts, and are read by
transformers' own loader for a type it serves with MTP; bad input is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from test_mtp import deepseek_config
from transformers import AutoModelForCausalLM, GenerationMixin
from transformers.modeling_layers import MtpModel

import hf_specdec
from hf_specdec.distill import train_mtp_layers
from hf_specdec.drafters.mtp import MtpDrafter
from hf_specdec.drafters.mtp_checkpoint import build_mtp_layers, save_mtp_layers
from hf_specdec.mtp_training import mtp_agreement
from hf_specdec.toy import build_early_exit_pair

VOCAB = 256
GREEDY = dict(do_sample=False, speculative_gamma_policy="constant", return_dict_in_generate=True)


@pytest.fixture(scope="module")
def llama():
    """A small Llama (no MTP layers in its config) whose later layers add little, and 96 of its own greedy texts."""
    target, _ = build_early_exit_pair(num_layers=4, hidden_size=128, vocab_size=VOCAB, seed=0)
    target = hf_specdec.enable(target)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, VOCAB, (96, 8), generator=generator)
    texts = GenerationMixin.generate(target, prompts, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    return target, texts.tolist()


def state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_trained_layers_draft_exactly_and_leave_the_target_alone(llama):
    target, texts = llama
    before = state(target)
    target.train()  # a model in training mode is read in eval mode (no dropout in what is learned), and given back
    try:
        layers = train_mtp_layers(target, texts=texts, num_mtp_layers=2, num_steps=20, show_progress=False)
        assert target.training
    finally:
        target.eval()
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    assert all(p.grad is None for p in target.parameters())
    assert "num_mtp_layers" not in target.config.to_dict()  # built from a copy of the config
    assert layers.embed_tokens is target.get_input_embeddings()
    assert layers.shared_head is target.get_output_embeddings()
    ids = torch.tensor([texts[0][:8], texts[1][:8], texts[2][:8]])
    accepted = drafted = 0
    for gamma in (1, 2, 4):  # within, at and past the trained depth (the layers reused in turn)
        for row in ids:
            plain = target.generate(row[None], max_new_tokens=32, do_sample=False)
            out = target.generate(
                row[None], drafter=MtpDrafter(layers), max_new_tokens=32, speculative_gamma=gamma, **GREEDY
            )
            assert torch.equal(out.sequences, plain)
            accepted += out.speculative_stats.accepted_tokens
            drafted += out.speculative_stats.drafted_tokens
    assert 0 < accepted < drafted  # partly right


def test_init_from_target_starts_as_the_early_exit_and_training_learns(llama):
    target, texts = llama
    held_out = [ids[:40] for ids in texts[-8:]]
    # from the target's first layer: its first layer, final norm and head predict one position further on
    start = build_mtp_layers(target, 1)
    from hf_specdec.mtp_training import _initialize

    _initialize(start, target, True, seed=0)
    from_target = mtp_agreement(start, target, held_out)[0]
    _initialize(start, target, False, seed=0)
    from_scratch = mtp_agreement(start, target, held_out)[0]
    assert from_target > 0.5 and from_scratch < 0.1
    trained = train_mtp_layers(
        target, texts=texts[:-8], num_steps=120, init_from_target=False, show_progress=False, seed=0
    )
    summary = trained.training_summary
    assert summary["steps"] == 120
    assert mtp_agreement(trained, target, held_out)[0] > from_scratch + 0.25
    assert summary["agreement_after"][0] > summary["agreement_before"][0] + 0.25


def test_saved_layers_load_back_through_drafter_mtp_and_use_mtp(llama, tmp_path):
    target, texts = llama
    layers = train_mtp_layers(target, texts=texts, num_mtp_layers=2, num_steps=10, show_progress=False, seed=3)
    save_mtp_layers(target, layers, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_mtp_layers"] == 2
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    mtp_file, own_file = "model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors"
    assert index["model.layers.4.eh_proj.weight"] == mtp_file  # DeepSeek-V3's layout: layer L + k
    assert index["model.layers.5.shared_head.norm.weight"] == mtp_file
    assert index["model.layers.3.mlp.down_proj.weight"] == own_file
    assert not (tmp_path / "model.safetensors").exists()
    loaded = hf_specdec.enable(AutoModelForCausalLM.from_pretrained(tmp_path).eval())
    drafter = MtpDrafter.from_target(loaded)
    for (name, theirs), ours in zip(drafter.mtp_model.state_dict().items(), layers.state_dict().values()):
        assert torch.equal(theirs, ours), name
    assert drafter.mtp_model.shared_head is loaded.get_output_embeddings()
    ids = torch.tensor([texts[2][:8]])
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    in_memory = target.generate(ids, drafter=MtpDrafter(layers), max_new_tokens=24, speculative_gamma=3, **GREEDY)
    for request in (dict(drafter="mtp"), dict(use_mtp=True)):
        out = loaded.generate(ids, max_new_tokens=24, speculative_gamma=3, **request, **GREEDY)
        assert torch.equal(out.sequences, plain)
        assert out.speculative_stats.position_accepted == in_memory.speculative_stats.position_accepted
    # saved again into the same folder (after more training): the new weights are the ones read back
    again = train_mtp_layers(target, texts=texts, num_mtp_layers=2, num_steps=10, show_progress=False, seed=4)
    save_mtp_layers(target, again, tmp_path)
    reloaded = MtpDrafter.from_target(AutoModelForCausalLM.from_pretrained(tmp_path).eval()).mtp_model
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), again.state_dict().values()))
    assert not torch.equal(again.layers[0].eh_proj.weight, layers.layers[0].eh_proj.weight)
    # a weight missing from the MTP file is named
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / mtp_file))
    del tensors["model.layers.5.hnorm.weight"]
    save_file(tensors, str(tmp_path / mtp_file), metadata={"format": "pt"})
    broken = hf_specdec.enable(AutoModelForCausalLM.from_pretrained(tmp_path).eval())
    with pytest.raises(ValueError, match=r"Could not load the MTP layers .*missing \['layers\.1\.hnorm\.weight'\]"):
        broken.generate(ids, drafter="mtp", max_new_tokens=3)


def test_deepseek_layout_is_read_by_transformers_own_loader(tmp_path):
    """For a type transformers serves with MTP (DeepSeek-V3, 61 decoder layers: its pattern `model.layers.61.*`),
    the saved layers load through `MtpModel.from_pretrained` (its renames and expert conversions) unchanged, and
    transformers' own `generate(use_mtp=True)` decodes with them."""
    small = dict(hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_attention_heads=2)
    small.update(num_key_value_heads=2, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(
        deepseek_config(1, num_hidden_layers=61, first_k_dense_replace=61, **small)
    ).eval()
    generator = torch.Generator().manual_seed(0)
    texts = torch.randint(0, target.config.vocab_size, (12, 24), generator=generator).tolist()
    layers = train_mtp_layers(target, texts=texts, num_steps=3, show_progress=False)
    assert type(layers.layers[0].mtp_block.mlp).__name__ == "DeepseekV3MoE"  # not the dense layers' shape
    save_mtp_layers(target, layers, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    plain_loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    theirs = MtpModel.from_pretrained(plain_loaded)
    for (name, loaded), ours in zip(theirs.state_dict().items(), layers.state_dict().values()):
        assert torch.equal(loaded, ours), name
    ids = torch.tensor([texts[0][:6]])
    plain = plain_loaded.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(plain_loaded.generate(ids, max_new_tokens=8, do_sample=False, use_mtp=True), plain)


def test_bad_input_is_refused_by_name(llama):
    target, texts = llama
    with pytest.raises(ValueError, match=r"needs training data: pass `prompts=`"):
        train_mtp_layers(target, num_steps=1)
    with pytest.raises(ValueError, match=r"needs a budget: pass `max_minutes=`"):
        train_mtp_layers(target, texts=texts)
    with pytest.raises(ValueError, match=r"needs `tokenizer=`"):
        train_mtp_layers(target, texts=["some text"], num_steps=1)
    with pytest.raises(ValueError, match=r"`num_mtp_layers` must be a positive integer, got 0"):
        train_mtp_layers(target, texts=texts, num_steps=1, num_mtp_layers=0)
    with pytest.raises(ValueError, match=r"`num_steps` must be a positive int, got 0"):
        train_mtp_layers(target, texts=texts, num_steps=0)
    other, _ = build_early_exit_pair(num_layers=2, hidden_size=64, vocab_size=VOCAB, seed=5)
    with pytest.raises(ValueError, match=r"`mtp_model` was not built for this target"):
        save_mtp_layers(other, build_mtp_layers(target, 1), "unused")
    with pytest.raises(ValueError, match=r"`mtp_model` was not built for this LlamaForCausalLM"):
        hf_specdec.enable(other).generate(
            torch.tensor([[1, 2, 3]]), drafter=MtpDrafter(build_mtp_layers(target, 1)), max_new_tokens=3
        )


def test_a_mixture_of_experts_block_starts_as_the_first_dense_layer():
    """DeepSeek-V3's MTP block is MoE after dense layers: from the target, its shared expert takes the first layer's
    MLP and its routed experts add nothing, so it drafts as the early exit would from the start."""
    torch.manual_seed(0)
    config = deepseek_config(1, num_hidden_layers=3, first_k_dense_replace=3, moe_intermediate_size=64)
    target = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(8.0)
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    generator = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, config.vocab_size, (8, 6), generator=generator)
    texts = GenerationMixin.generate(target, prompts, max_new_tokens=24, do_sample=False).tolist()
    from hf_specdec.mtp_training import _initialize

    layers = build_mtp_layers(target)
    _initialize(layers, target, True, seed=0)
    block = layers.layers[0].mtp_block
    assert torch.equal(block.mlp.shared_experts.up_proj.weight, target.model.layers[0].mlp.up_proj.weight)
    assert not block.mlp.experts.down_proj.any()
    from_target = mtp_agreement(layers, target, texts)[0]
    _initialize(layers, target, False, seed=0)
    assert from_target > 0.5 > mtp_agreement(layers, target, texts)[0] + 0.3


def test_cli_trains_mtp_layers_and_the_saved_model_drafts_with_them(tmp_path, local_tokenizer, capsys):
    from conftest import saved_target

    from hf_specdec.cli import main

    saved_target(tmp_path, local_tokenizer)
    (tmp_path / "prompts.txt").write_text("the cat sat\na quick brown fox\n\ndef add(a, b):\n")
    (tmp_path / "text.txt").write_text("the dog sat on the log and the cat watches the fox " * 8)
    argv = ["train-mtp", "--target", str(tmp_path / "target"), "--output", str(tmp_path / "out"), "--threads", "1"]
    data = ["--prompts", str(tmp_path / "prompts.txt"), "--texts", str(tmp_path / "text.txt")]
    assert main([*argv, *data, "--steps", "3", "--max-answer-tokens", "12"]) == 0
    assert "1 MTP layer(s) written with the model to" in capsys.readouterr().out
    model = hf_specdec.enable(AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval())
    ids = torch.tensor([local_tokenizer("the cat sat on")["input_ids"]])
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    out = model.generate(ids, drafter="mtp", max_new_tokens=12, speculative_gamma=2, **GREEDY)
    assert torch.equal(out.sequences, plain) and out.speculative_stats.drafted_tokens > 0
    assert (tmp_path / "out" / "tokenizer_config.json").exists()
    assert main([*argv, "--steps", "1"]) == 2
    assert "train-mtp needs data" in capsys.readouterr().err
    assert main([*argv, *data]) == 2
    assert "train-mtp needs a budget" in capsys.readouterr().err


def test_a_hybrid_s_mtp_block_starts_as_its_first_layer_where_it_can_and_drafts_exactly():
    """Qwen3.5: gated-delta-rule layers, then attention layers; its MTP block is an attention layer, which takes the
    target's first attention layer's attention and its first layer's MLP and norms (as much of the first layer as the
    block can compute). On a target whose deeper layers are damped, that start agrees with the target far more often
    than the first attention layer alone. Trained layers then draft on the hybrid exactly, its recurrent state rolled
    back after each rejection."""
    from conftest import VOCAB as SMALL_VOCAB
    from conftest import prompt
    from test_mtp_checkpoints import qwen_config

    from hf_specdec.mtp_training import _first_layer_as_block, _initialize

    config = qwen_config("qwen3_5_text")
    config.layer_types = ["linear_attention", "linear_attention", "full_attention", "full_attention"]
    torch.manual_seed(0)
    target = hf_specdec.enable(AutoModelForCausalLM.from_config(config).eval())
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(8.0)
        for layer in target.model.layers[1:]:
            for module in layer.modules():
                for name in ("out_proj", "o_proj", "down_proj"):
                    if isinstance(getattr(module, name, None), torch.nn.Linear):
                        getattr(module, name).weight.mul_(0.05)
    layers = build_mtp_layers(target, 1)
    _initialize(layers, target, True, seed=0)
    block = layers.layers[0].mtp_block.state_dict()
    first, first_attention = target.model.layers[0].state_dict(), target.model.layers[2].state_dict()
    assert set(first_attention) <= set(block)
    for name, tensor in first_attention.items():
        source = first if name in first and first[name].shape == tensor.shape else first_attention
        assert torch.equal(block[name], source[name]), name
    assert any(name.startswith("mlp.") for name in first) and any(name.startswith("self_attn.") for name in block)
    generator = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, SMALL_VOCAB, (8, 6), generator=generator)
    texts = GenerationMixin.generate(target, prompts, max_new_tokens=24, do_sample=False).tolist()
    merged = mtp_agreement(layers, target, texts)[0]
    _first_layer_as_block(layers.layers[0].mtp_block, first_attention)  # the first attention layer alone
    assert merged > mtp_agreement(layers, target, texts)[0] + 0.1
    generator = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, SMALL_VOCAB, (8, 6), generator=generator)
    texts = GenerationMixin.generate(target, prompts, max_new_tokens=24, do_sample=False).tolist()
    trained = train_mtp_layers(target, texts=texts, num_steps=2, batch_size=4, show_progress=False)
    ids = prompt(6, seed=2)
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    out = target.generate(ids, drafter=MtpDrafter(trained), speculative_gamma=2, max_new_tokens=20, **GREEDY)
    assert torch.equal(out.sequences, plain) and out.speculative_stats.drafted_tokens > 10


@pytest.mark.parametrize("family", ["llama", "qwen3_5_text"])
def test_every_mtp_norm_starts_where_it_only_normalizes(family):
    """Norms start at the weight where they give back their input over its RMS: 1 for a Llama's, 0 for Qwen3.5's
    (which scale by `1 + weight`; a weight of 1 would double what they pass on), from scratch and from the target."""
    from test_mtp_checkpoints import qwen_config

    from hf_specdec.mtp_training import _initialize

    if family == "llama":
        target, _ = build_early_exit_pair(num_layers=2, hidden_size=64, vocab_size=VOCAB, seed=0)
    else:
        torch.manual_seed(0)
        target = AutoModelForCausalLM.from_config(qwen_config("qwen3_5_text")).eval()
    layers = build_mtp_layers(target, 1)
    norms = {name: module for name, module in layers.layers.named_modules() if name.endswith(("enorm", "hnorm"))}
    assert len(norms) == 2
    x = torch.randn(3, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for init_from_target in (False, True):
        _initialize(layers, target, init_from_target, seed=0)
        for name, norm in norms.items():
            eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
            with torch.no_grad():
                expected = x * x.pow(2).mean(-1, keepdim=True).add(eps).rsqrt()
                torch.testing.assert_close(norm(x), expected, rtol=1e-4, atol=1e-4, msg=name)
