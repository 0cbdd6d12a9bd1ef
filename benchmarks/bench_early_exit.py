"""Side-by-side benchmark on the embedded early-exit pair: plain `generate`, transformers' assisted generation,
and hf_specdec, in one process, same prompts, greedy, batch 1, constant γ.

Reports α (measured by hf_specdec), c two ways (a cached drafter forward / a cached target forward, timed in
isolation; and a drafter step / a plain decoding step, as timed during decoding), the Theorem 3.8 prediction for
each, the verify cost ratio v (a target forward over γ+1 tokens / over 1 token, which the theorem assumes to be
1), and each speedup over plain `generate`: `seconds` are medians over repeats of one pass over the prompts, every
method run on a prompt before the next prompt, in an order rotated each time (`harness.interleaved`), with their
`spread`. Speed is measured here, never asserted in tests.

    python benchmarks/bench_early_exit.py [--gamma 5] [--max-new-tokens 128] [--prompts 3] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from harness import (  # run from the repository root or benchmarks/
    assistant_with_gamma,
    cached_forward_ms,
    interleaved,
    spread,
    write_results,
)
from pairs import random_prompts
from transformers import GenerationMixin

import hf_specdec
from hf_specdec.toy import build_early_exit_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    target, drafter = build_early_exit_pair(hidden_size=args.hidden_size, dtype=getattr(torch, args.dtype))
    target, drafter = target.to(args.device), drafter.to(args.device)
    target = hf_specdec.enable(target)
    # transformers reads the draft length from the assistant's own generation config: set it on a copy
    assistant = assistant_with_gamma(drafter, args.gamma)

    prompts = [
        ids.to(args.device) for ids in random_prompts(args.prompts, args.prompt_length, target.config.vocab_size, low=0)
    ]
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    methods = {
        "plain": lambda ids: GenerationMixin.generate(target, ids, **common),
        "transformers_assisted": lambda ids: GenerationMixin.generate(target, ids, assistant_model=assistant, **common),
        "hf_specdec": lambda ids: target.generate(
            ids, assistant_model=drafter, speculative_gamma=args.gamma, speculative_gamma_policy="constant", **common
        ),
    }
    methods["plain"](prompts[0][:, :8])  # warm-up
    references = [methods["plain"](ids) for ids in prompts]
    identical = {name: True for name in methods}

    def check(run):
        identical[run.name] &= torch.equal(run.output, references[run.index])

    per_repeat = interleaved(methods, args.repeats, warmup=0, inputs=prompts, device=args.device, on_run=check)
    seconds = {name: statistics.median(times) for name, times in per_repeat.items()}

    stats = [
        target.generate(
            ids,
            assistant_model=drafter,
            speculative_gamma=args.gamma,
            return_dict_in_generate=True,
            speculative_gamma_policy="constant",
            **common,
        ).speculative_stats
        for ids in prompts
    ]
    alpha = sum(s.beta_sum for s in stats) / sum(s.beta_count for s in stats)
    # in-loop costs, relative to one plain decoding step (the paper's T): what a drafter step and a verify round
    # actually cost during decoding, as timed by hf_specdec itself
    plain_step_s = seconds["plain"] / (args.prompts * args.max_new_tokens)
    c_loop = sum(s.draft_time_s for s in stats) / sum(s.drafted_tokens for s in stats) / plain_step_s
    v_loop = sum(s.verify_time_s for s in stats) / sum(s.target_calls for s in stats) / plain_step_s
    mean_tokens = sum(s.emitted_tokens for s in stats) / sum(s.target_calls for s in stats)
    context = args.prompt_length + args.max_new_tokens // 2
    target_ms = cached_forward_ms(target, 1, context, 1, repeats=15)
    verify_ms = cached_forward_ms(target, 1, context, args.gamma + 1, repeats=15)
    drafter_ms = cached_forward_ms(drafter, 1, context, 1, repeats=15)
    c = drafter_ms / target_ms
    v = verify_ms / target_ms
    predicted = hf_specdec.expected_speedup(alpha=alpha, gamma=args.gamma, c=c)
    hardware_adjusted = hf_specdec.theory.expected_tokens_per_round(alpha, args.gamma) / (args.gamma * c + v)
    predicted_loop = hf_specdec.expected_speedup(alpha=alpha, gamma=args.gamma, c=c_loop)
    predicted_loop_v = hf_specdec.theory.expected_tokens_per_round(alpha, args.gamma) / (args.gamma * c_loop + v_loop)

    results = {
        "gamma": args.gamma,
        "max_new_tokens": args.max_new_tokens,
        "prompts": args.prompts,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "device": args.device,
        "dtype": args.dtype,
        "hidden_size": args.hidden_size,
        "alpha": alpha,
        "mean_tokens_per_target_call": mean_tokens,
        "target_forward_ms": target_ms,
        "verify_forward_ms": verify_ms,
        "drafter_forward_ms": drafter_ms,
        "c": c,
        "verify_cost_ratio_v": v,
        "theorem_3_8_speedup": predicted,
        "theorem_3_8_with_measured_v": hardware_adjusted,
        "c_in_loop": c_loop,
        "verify_cost_ratio_in_loop": v_loop,
        "theorem_3_8_speedup_in_loop_c": predicted_loop,
        "theorem_3_8_in_loop_c_and_v": predicted_loop_v,
        "seconds": seconds,
        "spread": {name: spread(times) for name, times in per_repeat.items()},
        "identical_to_plain": identical,
        "speedup_over_plain": {name: seconds["plain"] / s for name, s in seconds.items()},
        "hf_specdec_over_transformers_assisted": seconds["transformers_assisted"] / seconds["hf_specdec"],
    }
    results["fraction_of_theorem_3_8"] = results["speedup_over_plain"]["hf_specdec"] / predicted
    results["fraction_of_theorem_3_8_in_loop_c"] = results["speedup_over_plain"]["hf_specdec"] / predicted_loop
    print(json.dumps(results, indent=2))
    if args.output:
        write_results(args.output, results)


if __name__ == "__main__":
    main()
