"""The zoo benchmark: the embedded stdlib code model with every drafter, on held-out code (paper Tables 2-4).

Tasks (prompts from `hf_specdec/zoo_models/heldout_prompts.json`, held-out modules only): `completion`
(signature + docstring, write the body), `editing` (copy-heavy: a function, then its renamed signature; the
continuation repeats the body), `continuation` (free continuation of a file window). At T=0 (greedy) and T=1
(sampling, no top-k / top-p), batch 1, constant γ, one process, every method on a prompt before the next prompt, in
an order rotated each time (`harness.interleaved`; `--repeats` passes, times are their medians):

- Table 3: α for the unigram, bigram and trigram tables (`NGramDrafter` with n=1, 2, 3, built from the shipped
  trigram table), prompt lookup, and the distilled 1-layer drafter;
- Table 2: wall-clock speedup of hf_specdec over plain `generate` and over transformers' assisted generation with
  the same draft (the distilled model as `assistant_model`, and `prompt_lookup_num_tokens`);
- Table 4: Theorem 3.8's expected speedup from the measured α, γ and c (c: drafter seconds per drafted token over
  plain seconds per token, as timed in the loop) against the measured speedup; also priced at the measured verify
  cost v, and applied round by round to the γ actually drafted (prompt lookup drafts nothing without a match, and
  `prompt_lookup_optimal`, prompt lookup under `speculative_gamma_policy="optimal"`, varies γ).

Greedy outputs are compared with plain `generate` through `evaluate` (`exact_match`, must be 1.0). Speedups are
ratios of generated tokens per second: at T=0 the outputs are identical, so this is the wall-clock ratio; at T=1
each method samples its own text, which can end at an EOS sooner or later, so wall-clock time alone would compare
different amounts of work. Speed is measured, never asserted in tests.

    OMP_NUM_THREADS=1 python benchmarks/bench_zoo.py --threads 1 --output benchmarks/results/zoo_cpu_1thread.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import evaluate
import torch
from harness import assistant_with_gamma, interleaved, write_results  # run from the repository root or benchmarks/
from transformers import GenerationMixin

import hf_specdec
from hf_specdec import NGramDrafter, zoo
from hf_specdec.theory import expected_speedup
from hf_specdec.zoo.tasks import TASKS, load_prompts

EXACT_MATCH = Path(__file__).resolve().parent / "metrics" / "exact_match" / "exact_match.py"
DRAFTERS = ("unigram", "bigram", "trigram", "prompt_lookup", "distilled")


def lower_order(table: NGramDrafter, n: int, draft_mode: str) -> NGramDrafter:
    """The orders 1 ... n of a table (a unigram or bigram drafter from the shipped trigram table), drafting its
    argmax (`"greedy"`, for T=0) or sampling from its distribution (`"sample"`, for T=1: q enters the test)."""
    tables = {name: tensor for name, tensor in table.tables.items() if int(name.split(".")[0][6:]) <= n}
    return NGramDrafter(tables, n=n, vocab_size=table.vocab_size, top_k=table.top_k, draft_mode=draft_mode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per task")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="keep the last N prompt tokens")
    parser.add_argument("--gamma-model", type=int, default=4, help="γ of the distilled drafter")
    parser.add_argument("--gamma-table", type=int, default=6, help="γ of the n-gram tables and prompt lookup")
    parser.add_argument("--max-gamma", type=int, default=32, help="speculative_max_gamma of the optimal policy")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved passes; times are their medians")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target, distilled, tokenizer = zoo.load_default()
    target = hf_specdec.enable(target)
    trigram = zoo.load_ngram()

    def drafters_for(temperature):
        mode = "greedy" if temperature == 0 else "sample"
        constant = dict(speculative_gamma_policy="constant")  # each at its γ, as the tables report it
        return {
            "unigram": (dict(drafter=lower_order(trigram, 1, mode), **constant), args.gamma_table),
            "bigram": (dict(drafter=lower_order(trigram, 2, mode), **constant), args.gamma_table),
            "trigram": (dict(drafter=lower_order(trigram, 3, mode), **constant), args.gamma_table),
            "prompt_lookup": (dict(drafter="prompt_lookup", **constant), args.gamma_table),
            "prompt_lookup_optimal": (
                dict(drafter="prompt_lookup", speculative_gamma_policy="optimal", speculative_max_gamma=args.max_gamma),
                args.gamma_table,
            ),
            "distilled": (dict(assistant_model=distilled, **constant), args.gamma_model),
        }

    transformers_drafts = {
        "distilled": dict(assistant_model=assistant_with_gamma(distilled, args.gamma_model)),
        "prompt_lookup": dict(prompt_lookup_num_tokens=args.gamma_table),
        "prompt_lookup_10": dict(prompt_lookup_num_tokens=10),  # the value prompt lookup's authors recommend
    }
    # which transformers runs each of ours is compared with (the fastest of them)
    compared_with = {
        "distilled": ["distilled"],
        "prompt_lookup": ["prompt_lookup"],
        "prompt_lookup_optimal": ["prompt_lookup", "prompt_lookup_10"],
    }
    exact_match = evaluate.load(str(EXACT_MATCH))
    prompts = load_prompts()
    warm = tokenizer("def f(x):\n    return", return_tensors="pt").input_ids
    for kwargs, gamma in drafters_for(0).values():
        target.generate(warm, max_new_tokens=8, do_sample=False, speculative_gamma=gamma, **kwargs)

    results = {
        "threads": torch.get_num_threads(),
        "max_new_tokens": args.max_new_tokens,
        "prompts": args.prompts,
        "repeats": args.repeats,
        "gamma": {"distilled": args.gamma_model, "tables_and_prompt_lookup": args.gamma_table},
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "drafter_parameters": sum(p.numel() for p in distilled.parameters()),
        "runs": [],
    }
    for task in args.tasks:
        inputs = [
            tokenizer(item["prompt"], return_tensors="pt").input_ids[:, -args.max_prompt_tokens :]
            for item in prompts[task][: args.prompts]
        ]
        for temperature in args.temperatures:
            sampling = (
                dict(do_sample=False)
                if temperature == 0
                else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            )
            common = dict(max_new_tokens=args.max_new_tokens, **sampling)
            drafters = drafters_for(temperature)

            def seeded(run):  # every method samples prompt i with seed + i
                def call(item):
                    index, ids = item
                    torch.manual_seed(args.seed + index)
                    return run(ids, torch.ones_like(ids))

                return call

            def ours_with(kwargs, gamma):
                return lambda ids, mask: target.generate(
                    ids,
                    attention_mask=mask,
                    speculative_gamma=gamma,
                    return_dict_in_generate=True,
                    **kwargs,
                    **common,
                )

            def transformers_with(extra):
                return lambda ids, mask: GenerationMixin.generate(target, ids, attention_mask=mask, **extra, **common)

            methods = {
                "plain": seeded(lambda ids, mask: GenerationMixin.generate(target, ids, attention_mask=mask, **common)),
                **{
                    f"transformers/{name}": seeded(transformers_with(extra))
                    for name, extra in transformers_drafts.items()
                },
                **{f"ours/{name}": seeded(ours_with(kwargs, gamma)) for name, (kwargs, gamma) in drafters.items()},
            }
            stats = {name: [] for name in drafters}
            texts = {name: [] for name in methods}
            tokens = {name: 0 for name in methods}  # generated tokens: at T=1 every method samples its own text

            def record(run):
                if run.repeat:  # the same seeds draw the same tokens in every repeat: count the first
                    return
                kind, _, name = run.name.partition("/")
                sequences = run.output.sequences if kind == "ours" else run.output
                if kind == "ours":
                    stats[name].append(run.output.speculative_stats)
                prompt_length = inputs[run.index].shape[1]
                tokens[run.name] += sequences.shape[1] - prompt_length
                texts[run.name].append(" ".join(map(str, sequences[0, prompt_length:].tolist())))

            per_repeat = interleaved(methods, args.repeats, warmup=0, inputs=list(enumerate(inputs)), on_run=record)
            seconds = {name: statistics.median(times) for name, times in per_repeat.items()}
            plain_step = seconds["plain"] / tokens["plain"]  # the paper's T

            def rate(method):  # tokens per second: at T=1 the methods' samples (and so their lengths) differ
                return tokens[method] / seconds[method]

            for name, (_kwargs, gamma) in drafters.items():
                runs = stats[name]
                alpha = sum(s.beta_sum for s in runs) / max(1, sum(s.beta_count for s in runs))
                drafted = sum(s.drafted_tokens for s in runs)
                c = sum(s.draft_time_s for s in runs) / max(1, drafted) / plain_step
                speedup = rate(f"ours/{name}") / rate("plain")  # the wall-clock ratio when outputs are equal
                predicted = expected_speedup(alpha=min(alpha, 1 - 1e-9), gamma=gamma, c=c)
                # the theorem prices a verify round at one plain step; v is what it costs here (GEMM vs GEMV)
                v = sum(s.verify_time_s for s in runs) / sum(s.target_calls for s in runs) / plain_step
                with_v = hf_specdec.theory.expected_tokens_per_round(min(alpha, 1 - 1e-9), gamma) / (gamma * c + v)
                # the same theorem applied round by round to the γ actually drafted (a copy drafter with no match
                # drafts 0, the optimal policy varies γ): expected tokens over expected cost, summed over rounds
                drafted_per_round = [g for s in runs for g in s.drafted_history]
                round_tokens = sum(
                    hf_specdec.theory.expected_tokens_per_round(min(alpha, 1 - 1e-9), g) for g in drafted_per_round
                )
                per_round = round_tokens / sum(g * c + 1 for g in drafted_per_round)
                per_round_v = round_tokens / sum(g * c + v for g in drafted_per_round)
                row = {
                    "task": task,
                    "temperature": temperature,
                    "drafter": name,
                    "gamma": gamma,
                    "alpha": alpha,
                    "acceptance_rate": sum(s.accepted_tokens for s in runs) / max(1, drafted),
                    "tokens_per_target_call": sum(s.emitted_tokens for s in runs) / sum(s.target_calls for s in runs),
                    "c": c,
                    "plain_s": seconds["plain"],
                    "ours_s": seconds[f"ours/{name}"],
                    "plain_tokens": tokens["plain"],
                    "ours_tokens": tokens[f"ours/{name}"],
                    "speedup_over_plain": speedup,
                    "theorem_3_8": predicted,
                    "measured_over_theorem": speedup / predicted,
                    "verify_cost_v": v,
                    "theorem_3_8_with_measured_v": with_v,
                    "measured_over_theorem_with_v": speedup / with_v,
                    "mean_drafted_per_round": sum(drafted_per_round) / len(drafted_per_round),
                    "theorem_3_8_per_round": per_round,
                    "measured_over_theorem_per_round": speedup / per_round,
                    "theorem_3_8_per_round_with_v": per_round_v,
                    "measured_over_theorem_per_round_with_v": speedup / per_round_v,
                }
                if name in compared_with:
                    theirs = max(compared_with[name], key=lambda other: rate(f"transformers/{other}"))
                    row["transformers_setting"] = transformers_drafts[theirs].get("prompt_lookup_num_tokens", gamma)
                    row["transformers_s"] = seconds[f"transformers/{theirs}"]
                    row["transformers_tokens"] = tokens[f"transformers/{theirs}"]
                    row["transformers_speedup_over_plain"] = rate(f"transformers/{theirs}") / rate("plain")
                    row["speedup_over_transformers"] = rate(f"ours/{name}") / rate(f"transformers/{theirs}")
                if temperature == 0:
                    row["exact_match_vs_plain"] = exact_match.compute(
                        predictions=texts[f"ours/{name}"], references=texts["plain"]
                    )["exact_match"]
                    if name in compared_with:
                        row["transformers_exact_match_vs_plain"] = min(
                            exact_match.compute(predictions=texts[f"transformers/{other}"], references=texts["plain"])[
                                "exact_match"
                            ]
                            for other in compared_with[name]
                        )
                results["runs"].append(row)
                over = (
                    f" x{row['speedup_over_transformers']:.2f} vs transformers"
                    if "speedup_over_transformers" in row
                    else ""
                )
                em = f" EM {row['exact_match_vs_plain']:.2f}" if "exact_match_vs_plain" in row else ""
                print(
                    f"{task:12s} T={temperature:g} {name:21s} g={gamma} alpha {alpha:.3f} c {c:.3f} "
                    f"v {v:.2f} speedup x{speedup:.2f} (Thm 3.8 x{predicted:.2f}, with v x{with_v:.2f}; "
                    f"per round x{per_round:.2f}, with v x{per_round_v:.2f}){over}{em}",
                    flush=True,
                )
    if args.output:
        write_results(args.output, results)


if __name__ == "__main__":
    main()
