"""Builds the second-tokenizer drafter for `bench_cross_tokenizer.py` (artifacts under /work/runs/cross_tokenizer/).

1. a tokenizer of another kind than the zoo's (the zoo: byte-level BPE, 8192 tokens; this one: a BPE of 4096
   tokens with a regex pre-tokenizer (words with their leading space, runs of spaces, punctuation runs) and the
   SentencePiece "▁" for spaces (Metaspace), no byte-level alphabet, unknown characters as `<unk>`), trained on the
   zoo's train split with `tokenizers`;
2. a 1-layer Llama (hidden 256, the zoo drafter's shape) trained from scratch on the same split tokenized with it
   (next-token loss, AdamW, cosine schedule), for a few minutes of CPU.

    flock /work/bench.lock python benchmarks/train_cross_tokenizer_drafter.py --steps 600 --threads 2 --max-minutes 9
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from hf_specdec.zoo import ZOO_DIR
from hf_specdec.zoo import corpus as zoo_corpus

OUT = Path("/work/runs/cross_tokenizer")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFC()
    # words with their leading space, runs of spaces (indentation) and punctuation runs are pieces; spaces are "▁"
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r" ?[A-Za-z_]+| ?[0-9]+| +|\n+| ?[^A-Za-z0-9_\s]+|\s"), behavior="isolated"),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False),
        ]
    )
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        limit_alphabet=200,
        special_tokens=["<s>", "</s>", "<unk>", "<pad>"],
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-minutes", type=float, default=14.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from transformers import AutoConfig, AutoModelForCausalLM

    manifest = zoo_corpus.load_manifest(ZOO_DIR / "manifest.json")
    texts = zoo_corpus.read_split(manifest, "train")
    start = time.perf_counter()
    tokenizer = train_tokenizer(texts, args.vocab_size)
    tokenizer.save_pretrained(OUT / "tokenizer")
    log(f"tokenizer: {len(tokenizer)} tokens in {time.perf_counter() - start:.1f} s")
    ids = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    ids = torch.tensor(ids)
    blocks = ids[: ids.numel() // args.seq_len * args.seq_len].view(-1, args.seq_len)
    log(f"{ids.numel()} training tokens, {len(blocks)} windows")

    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 50)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps))))
        ),
    )
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    steps_done = 0
    for step in range(args.steps):
        batch = blocks[torch.randint(len(blocks), (args.batch_size,), generator=generator)]
        logits = model(batch).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        steps_done = step + 1
        minutes = (time.perf_counter() - start) / 60
        if step % 50 == 0 or step == args.steps - 1:
            log(f"step {step}/{args.steps} loss {loss.item():.3f} {minutes:.1f} min")
        if minutes > args.max_minutes:
            log(f"stopping at {args.max_minutes} minutes")
            break
    model.eval()
    model.save_pretrained(OUT / "drafter")
    tokenizer.save_pretrained(OUT / "drafter")
    record = {
        "steps": steps_done,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "final_loss": loss.item(),
        "minutes": (time.perf_counter() - start) / 60,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
    }
    (OUT / "drafter" / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    log(f"saved {OUT / 'drafter'}: {record}")


if __name__ == "__main__":
    main()
