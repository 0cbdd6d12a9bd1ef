"""Prompt lookup side by side: plain `generate`, transformers' `prompt_lookup_num_tokens`, and hf_specdec's
`drafter="prompt_lookup"`, in one process, same prompts, greedy, batch 1.

Copy-heavy case: the target is the embedded toy target with its attention output projections zeroed, which makes
its next token a function of the current token only (same compute per forward). For a prompt S + C + S, where C
is its greedy continuation of S, its greedy continuation is C again: it repeats the context, like a model asked to
return a code block. Renamed case: the same, but in the prompt's copy of C one token (C's most frequent, "an
identifier") is renamed to another everywhere, so the prompt and the answer differ wherever it occurs, like a model
asked to return a code block with one identifier renamed (here the prompt holds the renamed block and the answer the
original, which is the same comparison). No-match case: the unmodified toy target on random prompts, where copying
rarely helps; the goal there is to be no slower than plain `generate`.

Methods: transformers' prompt lookup with `prompt_lookup_num_tokens=--gamma` (10 is the value its authors
recommend) and at each `--transformers-sweep` value (so the ratio over transformers' best fixed setting is reported
too); hf_specdec with the same constant γ, with `speculative_gamma_policy="optimal"` (section 3.5: γ chosen online
from measured acceptance and costs, starting at `--gamma`, up to `--max-gamma`), the configuration we recommend for
copy drafters, the same with token trees (`speculative_tree_budget=--tree-budget`: the copy is the main branch,
continuations of other earlier matches are branches), and the same with `follow_copies=False` (every proposal looked
up afresh: the ablation of copy following and learned substitutions), and `optimal` starting at `--max-gamma`
(compared with transformers at that number, which is where both start). `mixed_workload` adds the three cases up, each method with one setting for
all prompts, and reports ours against transformers' best single `prompt_lookup_num_tokens` over that mix.

    python benchmarks/bench_prompt_lookup.py [--gamma 10] [--max-new-tokens 128] [--prompts 3] [--repeats 3]

Every method runs on a prompt before the next prompt, in an order rotated each time (`harness.interleaved`);
`seconds` are the medians over repeats of one pass over a case's prompts, with their `spread`.

The toy target is compute-bound on a CPU (a forward over 11 tokens costs about twice a one-token one), so verifying
long copies and trees is dear there. `--memory-bound` runs the same three cases on the memory-bound pair of
`bench_memory_bound.py` instead: TinyLlama-1.1B's shape in bfloat16, built from its config, its head sharpened to
logit std `--head-logit-std` (10 by default) and run in float32 (bfloat16 logits tie exactly at one token in ten,
and a tie's argmax depends on how the forward rounded, so speculation and plain decoding would part ways at once).
It measures the target's cost curve first and, unless `--tree-budget` is given, takes the largest measured tree
whose forward costs at most `--tree-cost` one-token forwards (from the curve, not a GPU default):

    python benchmarks/bench_prompt_lookup.py --memory-bound --threads 2 --max-new-tokens 64 --prompts 2 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import transformers
from harness import cost_curves, interleaved, spread, write_results  # run from the repository root or benchmarks/
from pairs import FULL_PAIR, float32_head
from transformers import GenerationMixin

import hf_specdec
from hf_specdec.toy import build_early_exit_pair, copying_target


def run_case(target, prompts, args, label, sweep=()):
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    drafter_kwargs = {"max_ngram_size": args.max_ngram_size, "min_ngram_size": args.min_ngram_size}
    ours = dict(
        drafter="prompt_lookup",
        speculative_gamma=args.gamma,
        speculative_gamma_policy="constant",
        drafter_kwargs=drafter_kwargs,
        **common,
    )
    optimal = dict(ours, speculative_gamma_policy="optimal", speculative_max_gamma=args.max_gamma)
    optimal_fresh = dict(optimal, drafter_kwargs={**drafter_kwargs, "follow_copies": False})
    optimal_from_max = dict(optimal, speculative_gamma=args.max_gamma)  # its first round drafts up to max_gamma
    # token trees: the copy as the main branch, other earlier matches as branches (a budget above max_gamma keeps
    # the longest copy whole)
    optimal_tree = dict(optimal_from_max, speculative_tree_budget=args.tree_budget)

    def transformers_lookup(num_tokens):
        return lambda ids: GenerationMixin.generate(
            target, ids, prompt_lookup_num_tokens=num_tokens, max_matching_ngram_size=args.max_ngram_size, **common
        )

    methods = {
        "plain": lambda ids: GenerationMixin.generate(target, ids, **common),
        "transformers_prompt_lookup": transformers_lookup(args.gamma),
        **{f"transformers_prompt_lookup_{n}": transformers_lookup(n) for n in sweep if n != args.gamma},
        "hf_specdec_prompt_lookup": lambda ids: target.generate(ids, **ours),
        "hf_specdec_prompt_lookup_optimal": lambda ids: target.generate(ids, **optimal),
        # ablation: the same, with every proposal looked up afresh (no copy following, no learned substitutions)
        "hf_specdec_prompt_lookup_optimal_no_follow": lambda ids: target.generate(ids, **optimal_fresh),
        "hf_specdec_prompt_lookup_optimal_from_max": lambda ids: target.generate(ids, **optimal_from_max),
        "hf_specdec_prompt_lookup_optimal_tree": lambda ids: target.generate(ids, **optimal_tree),
    }
    methods["plain"](prompts[0][:, :8])  # warm-up, and one-time costs (a model's capability probes) out of the timings
    for kwargs in (ours, optimal_tree):
        target.generate(prompts[0][:, :8], **{**kwargs, "max_new_tokens": 4})
    GenerationMixin.generate(
        target,
        prompts[0][:, :8],
        prompt_lookup_num_tokens=args.gamma,
        max_matching_ngram_size=args.max_ngram_size,
        max_new_tokens=4,
        do_sample=False,
    )
    references = [methods["plain"](ids) for ids in prompts]
    identical = {name: True for name in methods}

    def check(run):
        identical[run.name] &= torch.equal(run.output, references[run.index])

    per_repeat = interleaved(methods, args.repeats, warmup=0, inputs=prompts, on_run=check)
    seconds = {name: statistics.median(times) for name, times in per_repeat.items()}  # one pass over the prompts
    configs = {
        "hf_specdec_prompt_lookup": ours,
        "hf_specdec_prompt_lookup_optimal": optimal,
        "hf_specdec_prompt_lookup_optimal_no_follow": optimal_fresh,
        "hf_specdec_prompt_lookup_optimal_from_max": optimal_from_max,
        "hf_specdec_prompt_lookup_optimal_tree": optimal_tree,
    }
    stats_of = {
        name: [target.generate(ids, return_dict_in_generate=True, **kwargs).speculative_stats for ids in prompts]
        for name, kwargs in configs.items()
    }
    stats, optimal_stats = stats_of["hf_specdec_prompt_lookup"], stats_of["hf_specdec_prompt_lookup_optimal"]
    transformers_best = min(s for name, s in seconds.items() if name.startswith("transformers"))
    return {
        "case": label,
        "seconds": seconds,
        "spread": {name: spread(times) for name, times in per_repeat.items()},
        "identical_to_plain": identical,
        "speedup_over_plain": {name: seconds["plain"] / s for name, s in seconds.items()},
        "hf_specdec_over_transformers": seconds["transformers_prompt_lookup"] / seconds["hf_specdec_prompt_lookup"],
        "hf_specdec_optimal_over_transformers": (
            seconds["transformers_prompt_lookup"] / seconds["hf_specdec_prompt_lookup_optimal"]
        ),
        "hf_specdec_optimal_over_transformers_best_fixed": transformers_best
        / seconds["hf_specdec_prompt_lookup_optimal"],
        # the same starting number of tokens on both sides: transformers at max_gamma, ours starting there
        "hf_specdec_optimal_from_max_over_transformers_at_max": (
            seconds.get(f"transformers_prompt_lookup_{args.max_gamma}", float("nan"))
            / seconds["hf_specdec_prompt_lookup_optimal_from_max"]
        ),
        "hf_specdec_optimal_from_max_over_transformers_best_fixed": transformers_best
        / seconds["hf_specdec_prompt_lookup_optimal_from_max"],
        "hf_specdec_optimal_tree_over_transformers_best_fixed": transformers_best
        / seconds["hf_specdec_prompt_lookup_optimal_tree"],
        "target_calls_per_prompt": {name: [s.target_calls for s in runs] for name, runs in stats_of.items()},
        "optimal_mean_gamma": (
            sum(sum(s.gamma_history) for s in optimal_stats) / sum(len(s.gamma_history) for s in optimal_stats)
        ),
        "optimal_mean_tokens_per_target_call": (
            sum(s.emitted_tokens for s in optimal_stats) / sum(s.target_calls for s in optimal_stats)
        ),
        "acceptance_rate": sum(s.accepted_tokens for s in stats) / max(1, sum(s.drafted_tokens for s in stats)),
        "mean_tokens_per_target_call": sum(s.emitted_tokens for s in stats) / sum(s.target_calls for s in stats),
        "rounds_without_proposal": sum(s.drafted_history.count(0) for s in stats) / sum(s.target_calls for s in stats),
    }


def mixed_workload(cases):
    """All cases as one workload served with one setting per method: a user of transformers picks one
    `prompt_lookup_num_tokens` for every prompt, so its best single value over the mix is the fair tuned baseline."""
    seconds = {name: sum(case["seconds"][name] for case in cases) for name in cases[0]["seconds"]}
    transformers = {name: s for name, s in seconds.items() if name.startswith("transformers")}
    best = min(transformers, key=transformers.get)
    return {
        "seconds": seconds,
        "speedup_over_plain": {name: seconds["plain"] / s for name, s in seconds.items()},
        "transformers_best_single_setting": best,
        "hf_specdec_optimal_over_transformers": (
            seconds["transformers_prompt_lookup"] / seconds["hf_specdec_prompt_lookup_optimal"]
        ),
        "hf_specdec_optimal_over_transformers_best_single_setting": (
            transformers[best] / seconds["hf_specdec_prompt_lookup_optimal"]
        ),
        "hf_specdec_optimal_from_max_over_transformers_best_single_setting": (
            transformers[best] / seconds["hf_specdec_prompt_lookup_optimal_from_max"]
        ),
        "hf_specdec_optimal_tree_over_transformers_best_single_setting": (
            transformers[best] / seconds["hf_specdec_prompt_lookup_optimal_tree"]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gamma", type=int, default=10)
    parser.add_argument("--max-gamma", type=int, default=64, help="speculative_max_gamma of the optimal policy")
    parser.add_argument(
        "--transformers-sweep",
        default="5,10,20,40,64",
        help="prompt_lookup_num_tokens values also timed for transformers",
    )
    parser.add_argument(
        "--tree-budget",
        type=int,
        default=None,
        help="speculative_tree_budget of the token-tree row (optimal policy from --max-gamma); "
        "default 72 on the toy target, from the cost curve with --memory-bound",
    )
    parser.add_argument(
        "--memory-bound",
        action="store_true",
        help="the memory-bound 1.1B bf16 target of bench_memory_bound.py instead of the toy one",
    )
    parser.add_argument("--head-logit-std", type=float, default=10.0, help="with --memory-bound: the head's sharpness")
    parser.add_argument(
        "--tree-cost",
        type=float,
        default=1.5,
        help="with --memory-bound: the tree budget's forward may cost this many one-token forwards",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--max-ngram-size", type=int, default=3)
    parser.add_argument("--min-ngram-size", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    costs = None
    if args.memory_bound:
        target, drafter = build_early_exit_pair(**FULL_PAIR, head_logit_std=args.head_logit_std, dtype=torch.bfloat16)
        float32_head(target)
        sizes = (1, 2, 6, 11, 16, 21, 33, 49, 65)
        costs = cost_curves(
            target,
            drafter,
            context=2 * args.max_new_tokens,
            causal_sizes=sizes,
            tree_sizes=sizes[1:],
            drafter_frontiers=(1,),
            repeats=5,
        )
        del drafter
        if args.tree_budget is None:  # the largest measured tree (nodes plus its root) within the cost bound
            args.tree_budget = max([k - 1 for k, v in costs["v_tree_mask"].items() if v <= args.tree_cost] or [1])
        print(
            f"target step {costs['target_step_ms']:.0f} ms; v (tree mask): "
            + " ".join(f"{k}:{v:.2f}" for k, v in costs["v_tree_mask"].items())
            + f"; tree budget {args.tree_budget}",
            flush=True,
        )
    else:
        target, _ = build_early_exit_pair(hidden_size=args.hidden_size)
        if args.tree_budget is None:
            args.tree_budget = 72
    target = hf_specdec.enable(target)
    copier = hf_specdec.enable(copying_target(target))
    vocab = target.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    seeds = [torch.randint(0, vocab, (1, 24), generator=generator) for _ in range(args.prompts)]
    copy_prompts, renamed_prompts = [], []
    for seed in seeds:
        continuation = copier.generate(seed, max_new_tokens=args.max_new_tokens)[:, seed.shape[1] :]
        copy_prompts.append(torch.cat([seed, continuation, seed], dim=-1))
        identifier = continuation.flatten().mode().values
        renamed = continuation.masked_fill(continuation == identifier, int((identifier + 1) % vocab))
        renamed_prompts.append(torch.cat([seed, renamed, seed], dim=-1))
    random_prompts = [torch.randint(0, vocab, (1, 64), generator=generator) for _ in range(args.prompts)]

    sweep = [int(n) for n in args.transformers_sweep.split(",") if n]
    results = {
        "gamma": args.gamma,
        "max_new_tokens": args.max_new_tokens,
        "target": (
            f"memory-bound: TinyLlama-1.1B's shape, bfloat16 (head in float32), head logit std {args.head_logit_std}"
            if args.memory_bound
            else f"toy, hidden {args.hidden_size}, float32"
        ),
        "hidden_size": FULL_PAIR["hidden_size"] if args.memory_bound else args.hidden_size,
        "costs": costs,
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__},
        "threads": torch.get_num_threads(),
        "max_gamma": args.max_gamma,
        "tree_budget": args.tree_budget,
        "cases": [
            run_case(copier, copy_prompts, args, "copy-heavy", sweep=sweep),
            run_case(copier, renamed_prompts, args, "copy-heavy-renamed", sweep=sweep),
            run_case(target, random_prompts, args, "no-match", sweep=sweep),
        ],
    }
    results["mixed_workload"] = mixed_workload(results["cases"])
    print(json.dumps(results, indent=2))
    if args.output:
        write_results(args.output, results)


if __name__ == "__main__":
    main()
