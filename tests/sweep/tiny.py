"""Tiny models of every type in transformers' generation mappings, built from their configs (no Hub)."""

from __future__ import annotations

import copy

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
)

VOCAB = 128
HIDDEN = 64
LAYERS = 2
# config attribute names (across model families) and their tiny values
SIZES = [
    (64, ("hidden_size", "d_model", "n_embd", "embed_dim", "n_embed", "dim", "d_embed", "hidden_dim", "model_dim",
         "word_embed_proj_dim", "embedding_size", "projection_dim", "output_dim", "input_dim", "text_hidden_size")),
    (128, ("intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim", "dim_ff",
          "ffn_hidden_size", "hidden_ffn_dim", "inner_dim")),
    (32, ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
         "moe_ffn_hidden_size", "ffn_dim_moe")),
    (LAYERS, ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers", "num_decoder_layers",
             "n_layers", "num_encoder_layers", "depth")),
    (4, ("num_attention_heads", "n_head", "encoder_attention_heads", "decoder_attention_heads", "num_heads", "n_heads",
        "num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "index_n_heads")),
    (2, ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "num_experts_per_tok", "moe_topk",
        "top_k", "n_group", "topk_group", "n_shared_experts", "num_shared_experts")),
    (16, ("head_dim", "d_kv", "dim_head", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "index_head_dim",
         "kv_lora_rank", "q_lora_rank", "attention_head_dim", "kv_channels")),
    # sparse attention that matters within a short generation
    (8, ("index_topk", "sliding_window", "attention_window", "local_attention", "window_size")),
]
LAYER_NAMES = next(names for value, names in SIZES if "num_hidden_layers" in names)
VOCAB_NAMES = ("vocab_size",)
# what a default config leaves undefined for a tiny one
OVERRIDES = {
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
}


def mapping_types() -> dict[str, str]:
    """model type -> which auto class builds it ("causal", "seq2seq" or "speech")."""
    kinds = {}
    for kind, names in (("speech", MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES),
                        ("seq2seq", MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
                        ("causal", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)):
        for model_type in names:
            kinds.setdefault(model_type, kind)
    return dict(sorted(kinds.items()))


AUTO_CLASSES = {"causal": AutoModelForCausalLM, "seq2seq": AutoModelForSeq2SeqLM, "speech": AutoModelForSpeechSeq2Seq}


def _shrink(values: dict, top: bool) -> dict:
    out = dict(values)
    for value, names in SIZES:
        for name in names:
            if name in out and isinstance(out[name], int) and not isinstance(out[name], bool) and out[name] > value:
                out[name] = value
    for name in VOCAB_NAMES:
        if isinstance(out.get(name), int):
            out[name] = VOCAB
    layers = next((out[name] for name in LAYER_NAMES if isinstance(out.get(name), int)), None)
    for name, value in list(out.items()):
        if layers and name.endswith("layer_types") or name in ("block_types", "layers_block_type"):
            if isinstance(value, list) and layers is not None:
                out[name] = value[:layers]  # the first layers' pattern
    for name, sub in list(out.items()):
        if isinstance(sub, dict) and ("model_type" in sub or name.endswith("_config") or name in ("encoder", "decoder")):
            out[name] = _shrink(sub, top=False)
    # special token ids inside the tiny vocabulary; no EOS so that generations run their full length
    for name in ("bos_token_id", "pad_token_id", "decoder_start_token_id"):
        if isinstance(out.get(name), int) and out[name] >= VOCAB:
            out[name] = {"bos_token_id": 1, "pad_token_id": 0, "decoder_start_token_id": 2}[name]
    if out.get("is_encoder_decoder") and out.get("decoder_start_token_id") is None:
        out["decoder_start_token_id"] = out.get("pad_token_id") or 0
    for name in ("eos_token_id",):
        if name in out:
            out[name] = None
    return out


def tiny_config(model_type: str):
    cls = CONFIG_MAPPING[model_type]
    values = _shrink(cls().to_dict(), top=True)
    if mapping_types()[model_type] == "causal" and "is_decoder" in values:
        values["is_decoder"] = True  # encoder families (BERT, RoBERTa) as causal LMs, as their docs ask
    values.update(OVERRIDES.get(model_type, {}))
    values.pop("model_type", None)
    values.pop("transformers_version", None)
    values.pop("architectures", None)
    return cls(**values)


def tiny_model(model_type: str, seed: int = 0):
    torch.manual_seed(seed)
    kind = mapping_types()[model_type]
    model = AUTO_CLASSES[kind].from_config(tiny_config(model_type)).eval()
    # random-init logits are nearly flat: a larger head makes greedy choices robust to rounding
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        with torch.no_grad():
            head.weight.mul_(8.0)
    generation = model.generation_config
    generation.eos_token_id = None
    generation.forced_eos_token_id = None
    return model
