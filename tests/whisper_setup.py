"""A tiny Whisper built from its config, with a real `WhisperFeatureExtractor` and a BPE tokenizer trained here."""

from __future__ import annotations

import copy
import math
import os

import numpy as np
import torch
from transformers import (
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForCausalLM,
    WhisperForConditionalGeneration,
    WhisperTokenizer,
)

SAMPLING_RATE = 16_000
LANGUAGES = ("en", "fr")
SPECIALS = [
    "<|endoftext|>",
    "<|startoftranscript|>",
    *(f"<|{lang}|>" for lang in LANGUAGES),
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nospeech|>",
    "<|notimestamps|>",
]
TIMESTAMPS = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "a quick brown fox jumps over the lazy dog while the cat watches",
    "speech recognition turns sound into text one token at a time",
    "le chat est sur le tapis et le chien dort",
] * 20


def build_tokenizer(directory: str) -> WhisperTokenizer:
    """Byte-level BPE trained on a small corpus, saved as Whisper's vocab.json / merges.txt, then Whisper's specials
    and timestamp tokens added after it (as in the real vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer)
    bpe.model.save(directory)
    tokenizer = WhisperTokenizer(
        os.path.join(directory, "vocab.json"),
        os.path.join(directory, "merges.txt"),
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    tokenizer.add_tokens(TIMESTAMPS)
    return tokenizer


def tone(seconds: float, frequency: float, seed: int = 0) -> np.ndarray:
    """A tone with a little noise, at 16 kHz."""
    t = np.arange(int(seconds * SAMPLING_RATE)) / SAMPLING_RATE
    noise = np.random.default_rng(seed).normal(0, 0.05, t.shape)
    return (0.5 * np.sin(2 * math.pi * frequency * t) + noise).astype(np.float32)


def whisper_config(tokenizer, decoder_layers: int = 2, **overrides) -> WhisperConfig:
    ids = tokenizer.convert_tokens_to_ids
    eot = ids("<|endoftext|>")
    values = dict(
        vocab_size=len(tokenizer),
        d_model=64,
        encoder_layers=2,
        decoder_layers=decoder_layers,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_mel_bins=80,
        max_source_positions=1500,
        max_target_positions=448,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=ids("<|startoftranscript|>"),
        suppress_tokens=[],
        begin_suppress_tokens=[eot],
        init_std=0.2,
    )
    values.update(overrides)
    return WhisperConfig(**values)


def set_generation_config(model, tokenizer, eos: bool = True) -> None:
    ids = tokenizer.convert_tokens_to_ids
    eot = ids("<|endoftext|>")
    config = model.generation_config
    config.decoder_start_token_id = ids("<|startoftranscript|>")
    config.no_timestamps_token_id = ids("<|notimestamps|>")
    config.prev_sot_token_id = ids("<|startofprev|>")
    config.lang_to_id = {f"<|{lang}|>": ids(f"<|{lang}|>") for lang in LANGUAGES}
    config.task_to_id = {"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")}
    config.is_multilingual = True
    config.max_initial_timestamp_index = 50
    config.forced_decoder_ids = None
    config.suppress_tokens = [ids("<|startoflm|>"), ids("<|nospeech|>")]
    config.begin_suppress_tokens = [eot]
    config.pad_token_id = eot
    config.eos_token_id = eot if eos else None
    config.bos_token_id = eot
    config.max_length = 448


def whisper(tokenizer, seed: int = 0, decoder_layers: int = 2, eos: bool = True, **overrides):
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(whisper_config(tokenizer, decoder_layers, **overrides)).eval()
    set_generation_config(model, tokenizer, eos)
    return model


def decoder_of(target) -> WhisperForCausalLM:
    """The target's own decoder as a `WhisperForCausalLM` that reads the target's encoder outputs (the
    distil-whisper assistant layout)."""
    config = copy.deepcopy(target.config)
    config.is_encoder_decoder = False
    decoder = WhisperForCausalLM(config).eval()
    decoder.model.decoder.load_state_dict(target.model.decoder.state_dict())
    decoder.proj_out.load_state_dict(target.proj_out.state_dict())
    decoder.generation_config = copy.deepcopy(target.generation_config)
    return decoder


def feature_extractor() -> WhisperFeatureExtractor:
    return WhisperFeatureExtractor(feature_size=80, sampling_rate=SAMPLING_RATE)


def features(clips, **kwargs) -> torch.FloatTensor:
    return feature_extractor()(clips, sampling_rate=SAMPLING_RATE, return_tensors="pt", **kwargs).input_features
