"""γ policies side by side: a sweep of constant γ = 1..12 against `optimal` (told nothing) and `heuristic`, on
three early-exit pairs built from the embedded toy target: a good drafter (deeper layers scaled by 0.02), a
mediocre one (0.05, the default pair), and a useless one (an unrelated random 1-layer model). Greedy, batch 1, one
process, every output checked against plain `generate`; every setting runs on a prompt before the next prompt, in an
order rotated each time (`harness.interleaved`), and times are medians over repeats of one pass over the prompts.

    python benchmarks/bench_gamma_policy.py [--max-new-tokens 128] [--prompts 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from harness import interleaved, spread, write_results  # run from the repository root or benchmarks/
from pairs import random_prompts

import hf_specdec
from hf_specdec.toy import build_early_exit_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--max-gamma", type=int, default=12)
    parser.add_argument(
        "--pairs", nargs="+", default=["good", "mediocre", "useless"], choices=["good", "mediocre", "useless"]
    )
    parser.add_argument(
        "--gammas", type=int, nargs="+", default=None, help="constant γ values to sweep (default 1 ... --max-gamma)"
    )
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()

    pairs = {}
    for name, scale in (("good", 0.02), ("mediocre", 0.05)):
        target, drafter = build_early_exit_pair(hidden_size=args.hidden_size, deep_layer_scale=scale)
        pairs[name] = (hf_specdec.enable(target), drafter)
    useless = build_early_exit_pair(hidden_size=args.hidden_size, seed=1)[1]
    pairs["useless"] = (pairs["mediocre"][0], useless)

    prompts = random_prompts(args.prompts, 32, pairs["good"][0].config.vocab_size, low=0)
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    results = {"max_new_tokens": args.max_new_tokens, "hidden_size": args.hidden_size, "pairs": {}}
    for pair_name in args.pairs:
        target, drafter = pairs[pair_name]
        target.generate(prompts[0], max_new_tokens=4)  # warm-up
        configs = {"plain": {}}
        configs.update(
            {
                f"constant_{g}": dict(assistant_model=drafter, speculative_gamma=g)
                for g in (args.gammas or range(1, args.max_gamma + 1))
            }
        )
        configs["optimal"] = dict(assistant_model=drafter, speculative_gamma_policy="optimal", speculative_max_gamma=16)
        configs["heuristic"] = dict(assistant_model=drafter, speculative_gamma_policy="heuristic")
        references = [target.generate(ids, **common) for ids in prompts]
        identical = True

        def check(run):
            nonlocal identical
            identical &= torch.equal(run.output, references[run.index])

        methods = {
            name: (lambda ids, kwargs=kwargs: target.generate(ids, **kwargs, **common))
            for name, kwargs in configs.items()
        }
        per_repeat = interleaved(methods, args.repeats, warmup=0, inputs=prompts, on_run=check)
        seconds = {name: statistics.median(times) for name, times in per_repeat.items()}
        stats = target.generate(prompts[0], return_dict_in_generate=True, **configs["optimal"], **common)
        best = min((name for name in configs if name.startswith("constant_")), key=seconds.get)
        results["pairs"][pair_name] = {
            "speedup_over_plain": {name: seconds["plain"] / s for name, s in seconds.items()},
            "best_constant": best,
            "optimal_over_best_constant": seconds[best] / seconds["optimal"],
            "heuristic_over_best_constant": seconds[best] / seconds["heuristic"],
            "optimal_over_plain": seconds["plain"] / seconds["optimal"],
            "optimal_gamma_history": stats.speculative_stats.gamma_history,
            "alpha": stats.speculative_stats.alpha,
            "identical_to_plain": identical,
            "spread": {name: spread(times) for name, times in per_repeat.items()},
        }
        summary = results["pairs"][pair_name]
        print(
            pair_name,
            "best",
            best,
            round(summary["speedup_over_plain"][best], 3),
            "optimal",
            round(summary["optimal_over_plain"], 3),
            "optimal/best",
            round(summary["optimal_over_best_constant"], 3),
            "heuristic/best",
            round(summary["heuristic_over_best_constant"], 3),
            "identical",
            identical,
            flush=True,
        )
    print(json.dumps(results, indent=2))
    if args.output:
        write_results(args.output, results)


if __name__ == "__main__":
    main()
