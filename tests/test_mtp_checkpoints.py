"""MTP layers of GLM-4 MoE and Mellum checkpoints, written by the test in their published layouts: GLM-4 MoE's under
`model.layers.46.` (transformers finds them by that layer number: the target has 46 decoder layers), Mellum's under
`mtp.` (`fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `norm`, and the block under `mtp.layers.0.`; a
sliding-window MTP layer). Each loads with transformers' loader, drafts per round what `generate(use_mtp=True)`
drafts, and decodes exactly, alone and in a batch. Tiny targets built from configs, fp32."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import VOCAB, prompt
from safetensors.torch import load_file, save_file
from test_mtp import Recorder, recorded_generate, transformers_drafts, use_mtp_drafts
from transformers import AutoConfig, AutoModelForCausalLM

import hf_specdec
from hf_specdec.drafters.mtp import MtpDrafter

GREEDY = dict(do_sample=False, speculative_gamma_policy="constant")


def family_config(family: str):
    """The target's config with one decoder layer more than the checkpoint keeps: that layer is written as the MTP
    layer's block (the layout `save_pretrained` writes, experts one by one, as the published checkpoints hold them)."""
    common = dict(vocab_size=VOCAB, num_mtp_layers=1, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    common.update(tie_word_embeddings=False, num_experts_per_tok=2, head_dim=8, num_key_value_heads=2)
    if family == "glm4_moe":  # GLM-4.5-Air's 46 dense-then-MoE layers; its MTP block is an MoE layer
        size = dict(hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_attention_heads=2)
        experts = dict(n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=46)
        return AutoConfig.for_model(family, num_hidden_layers=47, **size, **experts, **common), 46
    # Mellum: sliding-window and full-attention layers, sparse MLPs; its MTP layer is a sliding-window one
    size = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4)
    kinds = dict(sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    return AutoConfig.for_model(
        family, num_hidden_layers=3, num_local_experts=4, mlp_layer_types=["sparse"] * 3, **kinds, **size, **common
    ), 2


def published_checkpoint(directory, family: str, context: float = 0.5, roughness: float = 0.05) -> dict:
    """Writes `family`'s checkpoint with its MTP layer in the published layout; returns the tensors written. The
    target's next token depends mostly on its current one (attention scaled by `context`, MLP outputs zeroed, a sharp
    head) and the MTP layer passes the embedding of the token it reads through to the target's final norm and head
    (plus `roughness` of its hidden-state input and attention), so its drafts are partly right."""
    config, layers = family_config(family)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    for key in list(tensors):
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.*)", key)
        if match is None:
            continue
        if "down_proj" in match.group(2):
            tensors[key] = torch.zeros_like(tensors[key])
        elif match.group(2) == "self_attn.o_proj.weight":
            tensors[key] = tensors[key] * (roughness if int(match.group(1)) == layers else context)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 8.0
    hidden = config.hidden_size
    generator = torch.Generator().manual_seed(1)
    projection = torch.cat([torch.eye(hidden), torch.randn(hidden, hidden, generator=generator) * roughness], dim=1)
    if family == "glm4_moe":
        prefix = f"model.layers.{layers}."
        tensors[prefix + "enorm.weight"] = torch.ones(hidden)
        tensors[prefix + "hnorm.weight"] = torch.ones(hidden)
        tensors[prefix + "eh_proj.weight"] = projection
        tensors[prefix + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    else:
        block = f"model.layers.{layers}."
        for key in [key for key in tensors if key.startswith(block)]:
            tensors["mtp.layers.0." + key[len(block) :]] = tensors.pop(key)
        tensors["mtp.fc.weight"] = projection
        tensors["mtp.pre_fc_norm_embedding.weight"] = torch.ones(hidden)
        tensors["mtp.pre_fc_norm_hidden.weight"] = torch.ones(hidden)
        tensors["mtp.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    written = json.loads((directory / "config.json").read_text())
    written["num_hidden_layers"] = layers
    for key in ("layer_types", "mlp_layer_types"):
        if key in written:
            written[key] = written[key][:layers]
    (directory / "config.json").write_text(json.dumps(written))
    return tensors


# checkpoint key -> MtpModel parameter, per family
LOADED_AS = {
    "glm4_moe": {
        "model.layers.46.eh_proj.weight": "layers.0.eh_proj.weight",
        "model.layers.46.shared_head.norm.weight": "layers.0.post_norm.weight",
        "model.layers.46.self_attn.q_proj.weight": "layers.0.mtp_block.self_attn.q_proj.weight",
        "model.layers.46.mlp.gate.weight": "layers.0.mtp_block.mlp.gate.weight",
        "model.layers.46.mlp.shared_experts.gate_proj.weight": "layers.0.mtp_block.mlp.shared_experts.gate_proj.weight",
    },
    "mellum": {
        "mtp.fc.weight": "layers.0.eh_proj.weight",
        "mtp.norm.weight": "layers.0.post_norm.weight",
        "mtp.layers.0.self_attn.q_proj.weight": "layers.0.mtp_block.self_attn.q_proj.weight",
        "mtp.layers.0.self_attn.k_norm.weight": "layers.0.mtp_block.self_attn.k_norm.weight",
        "mtp.layers.0.mlp.gate.weight": "layers.0.mtp_block.mlp.gate.weight",
    },
}


@pytest.mark.parametrize("family", ["glm4_moe", "mellum"])
def test_published_layout_loads_and_drafts_as_transformers_use_mtp(family, tmp_path, monkeypatch):
    tensors = published_checkpoint(tmp_path, family)
    target = hf_specdec.enable(AutoModelForCausalLM.from_pretrained(tmp_path).eval())
    drafter = MtpDrafter.from_target(target)
    loaded = dict(drafter.mtp_model.named_parameters())
    for key, name in LOADED_AS[family].items():
        assert torch.equal(loaded[name], tensors[key]), (key, name)
    assert drafter.mtp_model.embed_tokens.weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    assert drafter.mtp_model.shared_head.weight.data_ptr() == target.get_output_embeddings().weight.data_ptr()

    ids = prompt(6, seed=2)
    run = dict(max_new_tokens=24, do_sample=False)  # past Mellum's sliding window of 6
    plain = target.generate(ids, **run)
    theirs, theirs_log = use_mtp_drafts(monkeypatch, AutoModelForCausalLM.from_pretrained(tmp_path).eval(), ids, **run)
    out, ours = recorded_generate(
        target, Recorder(drafter.mtp_model), ids, speculative_gamma=1, **dict(GREEDY, max_new_tokens=24)
    )
    assert torch.equal(theirs, plain) and torch.equal(out.sequences, plain)
    ours_log = [(sequence.shape[1], drafts) for sequence, drafts in ours.log]
    assert ours_log == theirs_log[: len(ours_log)] and len(ours_log) >= 12
    assert 0 < out.speculative_stats.accepted_tokens < out.speculative_stats.drafted_tokens
    # longer chains (the layer reused), by name, and transformers' own request on the enabled model
    for request in (dict(drafter="mtp", speculative_gamma=3), dict(use_mtp=True)):
        assert torch.equal(target.generate(ids, **request, **GREEDY, max_new_tokens=24), plain)
    # a tree: GLM-4 MoE's MTP layer grows one; Mellum's sliding-window target cache cannot hold one, refused by name
    trees = dict(drafter="mtp", speculative_gamma=3, speculative_tree_budget=8, **GREEDY, max_new_tokens=24)
    if family == "glm4_moe":
        assert torch.equal(target.generate(ids, **trees), plain)
    else:
        with pytest.raises(ValueError, match=r"Token trees need a cache .* MellumForCausalLM .* sliding-window"):
            target.generate(ids, **trees)


@pytest.mark.parametrize("family", ["glm4_moe", "mellum"])
def test_published_layout_decodes_a_left_padded_batch_exactly(family, tmp_path):
    """Both verify both rows in one forward: GLM-4 MoE, and Mellum, whose sliding-window layers are realigned as
    full ones are."""
    published_checkpoint(tmp_path, family)
    target = hf_specdec.enable(AutoModelForCausalLM.from_pretrained(tmp_path).eval())
    ids = torch.cat([prompt(8, seed=3), prompt(8, seed=4)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    run = dict(attention_mask=mask, drafter="mtp", speculative_gamma=2, max_new_tokens=20, **GREEDY)
    target.generate(ids, **run)  # the first call probes the model (forwards of one row)
    sizes = []
    handle = target.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    out = target.generate(ids, return_dict_in_generate=True, **run)
    handle.remove()
    assert torch.equal(out.sequences, plain) and out.speculative_stats.accepted_tokens > 0
    # one forward for both rows (a row that reaches max_length first leaves)
    assert sizes[0] == 2 and sizes == sorted(sizes, reverse=True)


def qwen_config(family: str):
    """A tiny Qwen3.5 (dense) or Qwen3-Next (MoE) hybrid: three gated-delta-rule layers, then full attention, as the
    published ones end. The config declares its MTP layer as they do, `mtp_num_hidden_layers` (no
    `num_mtp_layers`)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
    common.update(num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
    common.update(linear_key_head_dim=16, linear_value_head_dim=16, mtp_num_hidden_layers=1, tie_word_embeddings=False)
    common.update(eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if family == "qwen3_next":
        common.update(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
        )
    return AutoConfig.for_model(family, **common)


def qwen_checkpoint(directory, family: str, context: float = 0.3, roughness: float = 0.05) -> dict:
    """The published layout of Qwen3.5 / Qwen3-Next MTP weights: `mtp.fc` (the projection), `mtp.pre_fc_norm_embedding`,
    `mtp.pre_fc_norm_hidden`, `mtp.norm`, and the full-attention block under `mtp.layers.0.` (its experts one by one),
    beside the model's own keys. The target mostly maps its current token to the next (mixers scaled by `context`,
    MLP outputs zeroed); the MTP layer passes the embedding it reads through (norm weights 0: these norms scale by
    1 + w), so its drafts are partly right."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(qwen_config(family)).save_pretrained(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    block = "model.layers.3."  # the full-attention layer: the MTP block's keys, as the model names them
    for key in [key for key in tensors if key.startswith(block)]:
        tensors["mtp.layers.0." + key[len(block) :]] = tensors[key].clone()
    for key in list(tensors):
        if "down_proj" in key:
            tensors[key] = torch.zeros_like(tensors[key])
        elif key.endswith(("self_attn.o_proj.weight", "linear_attn.out_proj.weight")):
            tensors[key] = tensors[key] * (roughness if key.startswith("mtp.") else context)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 8.0
    hidden = 64
    generator = torch.Generator().manual_seed(1)
    projection = torch.cat([torch.eye(hidden), torch.randn(hidden, hidden, generator=generator) * roughness], dim=1)
    tensors["mtp.fc.weight"] = projection
    tensors["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden)
    tensors["mtp.pre_fc_norm_hidden.weight"] = torch.zeros(hidden)
    tensors["mtp.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return tensors


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_qwen_published_layout_loads_and_drafts_as_its_mtp_model(family, tmp_path):
    """transformers reads no `mtp_num_hidden_layers` (and refuses these stateful models with a drafter): hf_specdec
    loads the layer with transformers' loader through a config copy that declares it, the weights land where the
    published keys say, each round's draft is what `MtpModel` makes from scratch, and the output is plain's (each
    rejected round rolls the gated-delta state back)."""
    tensors = qwen_checkpoint(tmp_path, family)
    target = hf_specdec.enable(AutoModelForCausalLM.from_pretrained(tmp_path).eval())
    assert getattr(target.config, "num_mtp_layers", None) is None and target.config.mtp_num_hidden_layers == 1
    drafter = MtpDrafter.from_target(target)
    loaded = dict(drafter.mtp_model.named_parameters())
    published = {
        "mtp.fc.weight": "layers.0.eh_proj.weight",
        "mtp.pre_fc_norm_embedding.weight": "layers.0.enorm.weight",
        "mtp.pre_fc_norm_hidden.weight": "layers.0.hnorm.weight",
        "mtp.norm.weight": "layers.0.post_norm.weight",
        "mtp.layers.0.self_attn.q_proj.weight": "layers.0.mtp_block.self_attn.q_proj.weight",
    }
    for key, name in published.items():
        assert torch.equal(loaded[name], tensors[key]), (key, name)
    if family == "qwen3_next":  # experts stored one by one, loaded fused
        gate_up = loaded["layers.0.mtp_block.mlp.experts.gate_up_proj"]
        assert torch.equal(gate_up[1, : gate_up.shape[1] // 2], tensors["mtp.layers.0.mlp.experts.1.gate_proj.weight"])
    assert drafter.mtp_model.config.layer_types == ["full_attention"]
    assert getattr(target.config, "num_mtp_layers", None) is None  # the target's config is not changed

    ids = prompt(6, seed=2)
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    out, ours = recorded_generate(
        target, Recorder(drafter.mtp_model), ids, speculative_gamma=1, **dict(GREEDY, max_new_tokens=24)
    )
    assert torch.equal(out.sequences, plain)
    assert len(ours.log) >= 10
    for sequence, drafts in ours.log:
        assert drafts == transformers_drafts(target, drafter.mtp_model, sequence)[:1], sequence.shape[1]
    assert 0 < out.speculative_stats.accepted_tokens < out.speculative_stats.drafted_tokens
    for request in (dict(drafter="mtp", speculative_gamma=3), dict(use_mtp=True)):
        assert torch.equal(target.generate(ids, **request, **GREEDY, max_new_tokens=24), plain)
