"""Batched throughput on the embedded early-exit pair: plain batched `generate` vs hf_specdec, side by side.

Left-padded prompts of different lengths, greedy, constant γ. For each batch size, reports generated tokens per
second for both (median over repeats, the two interleaved in one process), the ratio, α, and the verify cost
ratio v(B) = (a target forward over B x (γ+1) tokens) / (over B x 1 tokens): speculation pays while v stays near 1,
and stops paying once the verify forward costs about as many steps as it saves. Every speculative output is checked
against plain `generate`. (transformers' assisted generation refuses batches larger than one.)

    python benchmarks/bench_batch.py [--batch-sizes 1 4 8 16] [--gamma 4] [--max-new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from harness import cached_forward_ms, interleaved, write_results  # run from the repository root or benchmarks/
from pairs import PAD, padded_prompts

import hf_specdec
from hf_specdec.toy import build_early_exit_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target, drafter = build_early_exit_pair(hidden_size=args.hidden_size)
    target = hf_specdec.enable(target)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=PAD)
    target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, pad_token_id=PAD)  # warm-up
    results = []
    print(
        f"threads {torch.get_num_threads()}, gamma {args.gamma}, {args.max_new_tokens} new tokens, "
        f"hidden {args.hidden_size}"
    )
    print(f"{'batch':>5} {'plain tok/s':>12} {'ours tok/s':>11} {'ratio':>6} {'alpha':>6} {'v(B)':>5} {'same':>5}")
    for batch in args.batch_sizes:
        ids, mask = padded_prompts(batch, target.config.vocab_size, seed=batch)
        methods = {
            "plain": lambda: target.generate(ids, attention_mask=mask, **kwargs),
            "ours": lambda: target.generate(
                ids,
                attention_mask=mask,
                assistant_model=drafter,
                speculative_gamma=args.gamma,
                speculative_gamma_policy="constant",
                return_dict_in_generate=True,
                **kwargs,
            ),
        }
        outputs = {name: [] for name in methods}
        seconds = interleaved(methods, args.repeats, warmup=0, on_run=lambda run: outputs[run.name].append(run.output))
        same = all(torch.equal(out.sequences, plain) for out, plain in zip(outputs["ours"], outputs["plain"]))
        out = outputs["ours"][-1]
        tokens = batch * args.max_new_tokens
        plain_tps = tokens / statistics.median(seconds["plain"])
        spec_tps = tokens / statistics.median(seconds["ours"])
        verify_ratio = cached_forward_ms(target, batch, 48, args.gamma + 1) / cached_forward_ms(target, batch, 48, 1)
        row = dict(
            batch=batch,
            plain_tokens_per_s=plain_tps,
            speculative_tokens_per_s=spec_tps,
            ratio=spec_tps / plain_tps,
            alpha=out.speculative_stats.alpha,
            mean_accepted_length=out.speculative_stats.mean_accepted_length,
            verify_cost_ratio=verify_ratio,
            identical=same,
        )
        results.append(row)
        print(
            f"{batch:>5} {plain_tps:>12.1f} {spec_tps:>11.1f} {row['ratio']:>6.2f} {row['alpha']:>6.3f} "
            f"{verify_ratio:>5.2f} {str(same):>5}"
        )
    if args.output:
        write_results(args.output, dict(args={k: str(v) for k, v in vars(args).items()}, results=results))


if __name__ == "__main__":
    main()
