"""Tiny models of every type in transformers' generation mappings, built from their configs (no Hub)."""

from __future__ import annotations

import torch
import transformers
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
    (
        64,
        (
            "hidden_size",
            "d_model",
            "n_embd",
            "embed_dim",
            "n_embed",
            "dim",
            "d_embed",
            "hidden_dim",
            "model_dim",
            "word_embed_proj_dim",
            "embedding_size",
            "projection_dim",
            "output_dim",
            "input_dim",
            "text_hidden_size",
        ),
    ),
    (
        128,
        (
            "intermediate_size",
            "ffn_dim",
            "d_ff",
            "n_inner",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "dim_ff",
            "ffn_hidden_size",
            "hidden_ffn_dim",
            "inner_dim",
        ),
    ),
    (
        32,
        (
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "expert_intermediate_size",
            "moe_ffn_hidden_size",
            "ffn_dim_moe",
        ),
    ),
    (
        LAYERS,
        (
            "num_hidden_layers",
            "n_layer",
            "num_layers",
            "encoder_layers",
            "decoder_layers",
            "num_decoder_layers",
            "n_layers",
            "num_encoder_layers",
            "depth",
        ),
    ),
    (
        4,
        (
            "num_attention_heads",
            "n_head",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "num_heads",
            "n_heads",
            "num_experts",
            "n_routed_experts",
            "num_local_experts",
            "moe_num_experts",
            "index_n_heads",
            "linear_num_heads",
        ),
    ),
    (
        2,
        (
            "num_key_value_heads",
            "num_kv_heads",
            "multi_query_group_num",
            "num_experts_per_tok",
            "moe_topk",
            "top_k",
            "n_group",
            "topk_group",
            "n_shared_experts",
            "num_shared_experts",
            "num_experts_per_token",
            "num_expert_group",
        ),
    ),
    (
        16,
        (
            "head_dim",
            "d_kv",
            "dim_head",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
            "index_head_dim",
            "kv_lora_rank",
            "q_lora_rank",
            "attention_head_dim",
            "kv_channels",
            "linear_head_dim",
        ),
    ),
    # sparse attention that matters within a short generation
    (8, ("index_topk", "sliding_window", "attention_window", "local_attention", "window_size")),
]
LAYER_NAMES = next(names for value, names in SIZES if "num_hidden_layers" in names)
# inkling2 sizes its head by `unpadded_vocab_size` (transformers >= 5.24; earlier, it sliced the logits to it)
VOCAB_NAMES = ("vocab_size", "unpadded_vocab_size")
# what a default config leaves undefined, or sets for its full size, for a tiny one (by model type, nested configs
# included; applied after shrinking)
_GEMMA3N_TEXT = dict(
    vocab_size_per_layer_input=VOCAB,  # per-layer embeddings: a row per token (262144 by default)
    num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention"] * 2,
    intermediate_size=[128] * 4,
    activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
    num_kv_shared_layers=2,
)  # the last two layers read the first two's cache
_SEAMLESS = dict(  # a one-layer speech encoder and text-to-unit model
    speech_encoder_layers=1,
    speech_encoder_attention_heads=4,
    speech_encoder_intermediate_size=128,
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=4,
    t2u_encoder_layers=1,
    t2u_decoder_layers=1,
    t2u_encoder_ffn_dim=128,
    t2u_decoder_ffn_dim=128,
    t2u_encoder_attention_heads=4,
    t2u_decoder_attention_heads=4,
    t2u_vocab_size=VOCAB,
    unit_hifi_gan_vocab_size=VOCAB,
    upsample_initial_channel=32,
    unit_embed_dim=64,
)
OVERRIDES = {
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    # dory (transformers >= 5.24) loops its middle layers; its config lists each layer as an attention block and an
    # mlp block (halved on load): one input, one looped and one output layer
    "dory": dict(
        num_hidden_layers=6,
        n_input_layers=2,
        n_recurrent_layers=2,
        n_output_layers=2,
        layer_types=["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"],
    ),
    "deepseek_v2": dict(num_experts_per_tok=2),
    "jamba": dict(
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, use_mamba_kernels=False
    ),
    # zamba's attention reads the hidden states and the embeddings concatenated; two shared-attention layers
    "zamba": dict(
        num_hidden_layers=4,
        layers_block_type=["linear_attention", "hybrid"] * 2,
        attn_layer_period=2,
        attn_layer_offset=1,
        attention_hidden_size=128,
        attention_head_dim=32,
        use_mamba_kernels=False,
        mamba_dt_rank=8,
    ),
    "zamba2": dict(
        layers_block_type=["linear_attention", "hybrid"],
        hybrid_layer_ids=[1],
        mamba_headdim=16,
        attention_hidden_size=128,
        num_query_groups=4,
        use_mamba_kernels=False,
        adapter_rank=8,
    ),
    "gemma3n_text": _GEMMA3N_TEXT,
    # per-layer embeddings: a row per token (262144 by default, 134M parameters at the tiny size)
    "gemma4_text": dict(vocab_size_per_layer_input=VOCAB),
    # a Gemma 4 assistant reads its target's hidden states: the tiny Gemma 4 models' size
    "gemma4_assistant": dict(backbone_hidden_size=HIDDEN),
    "gemma4_unified_assistant": dict(backbone_hidden_size=HIDDEN),
    "speech_to_text": dict(conv_channels=64, max_source_positions=256),
    "seamless_m4t": _SEAMLESS,
    "seamless_m4t_v2": _SEAMLESS,
    # mamba2 mixers: heads x head size must equal expand x hidden size (2 x 64)
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, use_mamba_kernels=False),
    "granitemoehybrid": dict(
        layer_types=["linear_attention", "full_attention"], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16
    ),
    "mamba2": dict(num_heads=4, head_dim=32, n_groups=1, state_size=16, time_step_rank=8),
    "xlnet": dict(d_head=16),
    "codegen": dict(rotary_dim=16),
    "gptj": dict(rotary_dim=16),
    "rwkv": dict(attention_hidden_size=64),
    "xlstm": dict(embedding_dim=64, num_blocks=2, qk_dim_factor=1.0),  # its cache rounds the key size up to 64
    "ernie4_5_moe": dict(moe_k=2),
    "dots1": dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2),  # undefined by default
    # its cache has a slot per (cycle, layer): layers = per stack x H_cycles x (L_cycles + 1)
    "hrm_text": dict(num_layers_per_stack=1, H_cycles=1, L_cycles=1, L_bp_cycles=[1]),
    "reformer": dict(axial_pos_embds_dim=[16, 48], attention_head_size=16, feed_forward_size=128),
    # defaults that transformers 5.23's own default config leaves out (its default model does not build either)
    "dbrx": dict(attn_config=dict(kv_n_heads=1, rope_theta=10000.0, clip_qkv=8.0, attn_pdrop=0.0)),
    "cohere_compass_text": dict(
        rope_parameters={
            kind: dict(rope_type="default", rope_theta=10000.0) for kind in ("full_attention", "sliding_attention")
        }
    ),
    "moonshine_streaming": dict(num_key_value_heads=4),  # its attention views queries with this head count
    "speech-encoder-decoder": dict(decoder_start_token_id=2, pad_token_id=0),
    "qwen3_asr": dict(eos_token_id=3),  # required to be an integer (generation still runs without one)
    "vibevoice": dict(
        eos_token_id=3,
        pad_token_id=3,
        audio_bos_token_id=VOCAB - 3,
        audio_eos_token_id=VOCAB - 2,
        audio_token_id=VOCAB - 1,
    ),
    "dots3_note_text": dict(head_dim=32),  # its sliding-window layers' head: qk_nope_head_dim + qk_rope_head_dim
    # the audio pad token follows every codebook's tokens and the text vocabulary: 2049 x 32 + 128
    "kyutai_speech_to_text": dict(audio_pad_token_id=2049 * 32 + VOCAB),
    "mimi": dict(upsample_groups=64),  # Kyutai's audio codec: one group per channel of its hidden size
    "qwen4_exp_text": dict(
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=64, indexer_compress_ratio=4
    ),
    "hunyuan_v1_dense": dict(head_dim=16),
    "hunyuan_v1_moe": dict(head_dim=16),
    "ministral": dict(head_dim=16),
    "nemotron": dict(num_key_value_heads=2),
    # BLT's cache is built from the composite config, which transformers' own tests give the decoder's sizes; its
    # local decoder reads the global transformer's states, and the hash embeddings shrink as in those tests
    "blt": dict(
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        hidden_size=HIDDEN,
        encoder_hash_byte_group_size=[2, 3],
        encoder_hash_byte_group_vocab=64,
    ),
    "blt_local_encoder": dict(hidden_size_global=HIDDEN),
    "blt_local_decoder": dict(hidden_size_global=HIDDEN),
    # Dia stops through its own EOS logits processors, which need an EOS id: the audio special tokens (EOS, pad, BOS)
    # follow the codebook entries at the top of its vocabulary; its cross-attention reads the text encoder
    "dia_decoder": dict(
        eos_token_id=VOCAB - 4,
        pad_token_id=VOCAB - 3,
        bos_token_id=VOCAB - 2,
        cross_hidden_size=HIDDEN,
        cross_num_attention_heads=4,
        cross_head_dim=16,
        cross_num_key_value_heads=4,
    ),
    # the vision and audio adapters map their tower's width onto the text model's
    "dots3_note_vision_encoder": dict(adapter_in_dim=HIDDEN, adapter_out_dim=HIDDEN),
    "dots3_note_audio_encoder": dict(adapter_input_size=HIDDEN, adapter_out_dim=HIDDEN),
    # tied embeddings scaled with the head (tiny_model) make these repeat the last token for ever: untied, they
    # generate varied tokens, so a wrong draft would show
    "fun_asr_nano": dict(tie_word_embeddings=False),
    "voxtral_realtime": dict(tie_word_embeddings=False),
    # sub-configs without a model type of their own, keyed "<model type>.<sub-config name>"
    "fun_asr_nano.adaptor_config": dict(intermediate_size=HIDDEN // 4),  # a quarter of the text hidden size
    # a Gemma 4 assistant reads every layer's keys and values from its target (its config requires it), and has no
    # per-layer embeddings
    "gemma4_assistant.text_config": dict(num_kv_shared_layers=LAYERS, vocab_size_per_layer_input=0),
    "gemma4_unified_assistant.text_config": dict(num_kv_shared_layers=LAYERS),
    "nemotron3_diarization.head_config": dict(audio_hidden_size=HIDDEN),  # the diarization audio encoder's width
    "nemotron3_5_transcribe_word_timestamp": dict(blank_token_id=VOCAB - 1),  # the last class of its vocabulary
    # MusicGen's decoder: pad (= BOS = decoder start) is the id after its codebook entries, as in its checkpoints
    "musicgen_decoder": dict(pad_token_id=VOCAB, bos_token_id=VOCAB),
    "musicgen_melody_decoder": dict(pad_token_id=VOCAB, bos_token_id=VOCAB),
}
# arguments for a type's default config where transformers' own default does not validate: the Gemma 4 assistant's
# text model has no per-layer inputs, MoE block or double-wide MLP
DEFAULTS = {
    "gemma4_assistant": dict(
        text_config=dict(
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=0,
            enable_moe_block=False,
            use_double_wide_mlp=False,
        )
    ),
}
# generation-config values a type's checkpoints ship and its own `generate` reads
GENERATION = {
    # MusicGen's `generate` reads these without filling in defaults: its decoder starts from the pad id, one sequence
    # per prompt, no beams
    "musicgen": dict(decoder_start_token_id=VOCAB, num_return_sequences=1, num_beams=1),
    "musicgen_melody": dict(decoder_start_token_id=VOCAB, num_return_sequences=1, num_beams=1),
    # Pop2Piano conditions on a composer token, one per composer its config counts (as sweetcocoa/pop2piano's)
    "pop2piano": dict(composer_to_feature_token={f"composer{i}": 2051 + i for i in range(1, 22)}),
}


# model types whose causal-LM class is built from one sub-config of the type's composite config, as transformers'
# own tests build them (`MusicgenForCausalLM` takes a `MusicgenDecoderConfig`)
CAUSAL_SUB_CONFIG = {"musicgen": "decoder", "musicgen_melody": "decoder"}


def mapping_types() -> dict[str, str]:
    """model type -> which auto class builds it ("causal", "seq2seq" or "speech")."""
    kinds = {}
    for kind, names in (
        ("speech", MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES),
        ("seq2seq", MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
        ("causal", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
    ):
        for model_type in names:
            kinds.setdefault(model_type, kind)
    return dict(sorted(kinds.items()))


AUTO_CLASSES = {"causal": AutoModelForCausalLM, "seq2seq": AutoModelForSeq2SeqLM, "speech": AutoModelForSpeechSeq2Seq}


def _kept_layers(pattern: list, layers: int) -> list[int]:
    """Indices of the layers a tiny model keeps: the first `layers`, with the last ones swapped for the first layer of
    each kind the pattern names that they miss (a hybrid model cut to its first layers would lose its attention)."""
    kept = list(range(min(layers, len(pattern))))
    firsts = {}
    for index, kind in enumerate(map(str, pattern)):
        firsts.setdefault(kind, index)
    missing = [index for kind, index in firsts.items() if kind not in {str(pattern[i]) for i in kept}]
    return sorted(kept[: max(len(kept) - len(missing), 1)] + missing)[:layers] if missing else kept


def _is_pattern(name: str, value) -> bool:
    return isinstance(value, list) and (name.endswith("layer_types") or name in ("block_types", "layers_block_type"))


def _per_layer(out: dict, full: int, layers: int) -> None:
    """Cuts every per-layer setting (lists as long as the full model's layers, `per_layer_config`) to the kept
    layers."""
    patterns = [value for name, value in out.items() if _is_pattern(name, value) and len(value) == full]
    pattern = [tuple(map(str, kinds)) for kinds in zip(*patterns)]  # each layer's kinds (attention, feed-forward)
    kinds = len(set(pattern))
    if layers < kinds <= 4:  # one layer of each kind
        layers = kinds
        out[next(name for name in LAYER_NAMES if isinstance(out.get(name), int))] = layers
    kept = _kept_layers(pattern, layers) if pattern else list(range(layers))
    for name, value in list(out.items()):
        if isinstance(value, list) and len(value) == full and full != layers:
            out[name] = [value[i] for i in kept]
        elif _is_pattern(name, value):  # a repeating pattern shorter than the model (cycled over its layers)
            out[name] = [value[i] for i in _kept_layers(value, layers)]
    per_layer = out.get("per_layer_config")
    if isinstance(per_layer, dict):
        by_index = {int(key): (key, config) for key, config in per_layer.items()}
        out["per_layer_config"] = {
            str(new).zfill(len(by_index[old][0])): _shrink(by_index[old][1], top=False)
            for new, old in enumerate(kept)
            if old in by_index
        }
    for name in SIZES[1][1]:  # a feed-forward size per layer
        if isinstance(out.get(name), list):
            out[name] = [min(size, SIZES[1][0]) for size in out[name]]


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
    full = next((values[name] for name in LAYER_NAMES if isinstance(values.get(name), int)), None)
    if layers is not None:
        _per_layer(out, full, layers)
    if isinstance(out.get("kv_lora_rank"), int) and isinstance(out.get("qk_nope_head_dim"), int):
        # multi-head latent attention: every head reads the shared latent (no grouped heads); derived sizes follow
        if isinstance(out.get("num_key_value_heads"), int):
            out["num_key_value_heads"] = out.get("num_attention_heads", out["num_key_value_heads"])
        if isinstance(out.get("qk_head_dim"), int):
            out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    for name, sub in list(out.items()):
        if isinstance(sub, dict) and (
            "model_type" in sub or name.endswith("_config") or name in ("encoder", "decoder")
        ):
            keyed = OVERRIDES.get(f"{out.get('model_type')}.{name}", {})  # for a sub-config without a type
            out[name] = _shrink(sub, top=False) | keyed
    # special token ids inside the tiny vocabulary; no EOS so that generations run their full length
    for name in ("bos_token_id", "pad_token_id", "decoder_start_token_id"):
        if isinstance(out.get(name), int) and out[name] >= VOCAB:
            out[name] = {"bos_token_id": 1, "pad_token_id": 0, "decoder_start_token_id": 2}[name]
    if out.get("is_encoder_decoder") and out.get("decoder_start_token_id") is None:
        out["decoder_start_token_id"] = out.get("pad_token_id") or 0
    for name in ("eos_token_id",):
        if name in out:
            out[name] = None
    out.update(OVERRIDES.get(out.get("model_type"), {}))
    return out


def tiny_config(model_type: str, **overrides):
    cls = CONFIG_MAPPING[model_type]
    values = _shrink(cls(**DEFAULTS.get(model_type, {})).to_dict(), top=True)
    if model_type in CAUSAL_SUB_CONFIG:  # the causal-LM class takes one part of the composite config
        values = values[CAUSAL_SUB_CONFIG[model_type]]
        cls = CONFIG_MAPPING[values["model_type"]]
    values |= overrides
    if mapping_types()[model_type] == "causal" and "is_decoder" in values:
        values["is_decoder"] = True  # encoder families (BERT, RoBERTa) as causal LMs, as their docs ask
    values.pop("model_type", None)
    values.pop("transformers_version", None)
    values.pop("architectures", None)
    return cls(**values)


def tiny_model(model_type: str, seed: int = 0, **overrides):
    """A tiny `model_type` model; `overrides` replace top-level config values."""
    torch.manual_seed(seed)
    kind = mapping_types()[model_type]
    config = tiny_config(model_type, **overrides)
    if model_type in CAUSAL_SUB_CONFIG:  # the auto class maps the composite config only
        model = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(config).eval()
    else:
        model = AUTO_CLASSES[kind].from_config(config).eval()
    # random-init logits are nearly flat: a larger head makes greedy choices robust to rounding
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        with torch.no_grad():
            head.weight.mul_(8.0)
    if hasattr(model, "set_default_language"):  # X-MOD's language adapters
        model.set_default_language(model.config.languages[0])
    generation = model.generation_config
    generation.eos_token_id = None
    generation.forced_eos_token_id = None
    for name, value in GENERATION.get(model_type, {}).items():
        setattr(generation, name, value)
    return model
