"""Drafting with another tokenizer: the zoo's code model with a drafter on a second tokenizer, against the
same-tokenizer drafter and against transformers' Universal Assisted Generation on the same pair.

The pair (built by `train_cross_tokenizer_drafter.py`, under /work/runs/cross_tokenizer/):

- target: the zoo's 6-layer Llama (byte-level BPE, 8192 tokens);
- cross drafter: a 1-layer Llama (hidden 256, as the zoo's drafter) trained from scratch on the zoo's train split
  tokenized with a Metaspace BPE of 4096 tokens (SentencePiece-style "▁" spaces), a few minutes of CPU;
- same-tokenizer drafter: the zoo's distilled 1-layer drafter (the target's tokenizer).

Methods, each at batch 1 on the zoo's held-out prompts, greedy (T=0) and sampling (T=1, no top-k / top-p), constant
γ, interleaved per prompt in an order rotated each time (`harness.interleaved`) and repeated (`--repeats`, each
prompt's median time): plain `generate`; ours with each drafter (`assistant_model=...`, and for the cross one
`tokenizer=..., assistant_tokenizer=...`); transformers' assisted generation with the same drafters (for the cross
one, its `AssistedCandidateGeneratorDifferentTokenizers` when greedy and `UniversalSpeculativeDecodingGenerator` when
sampling), with a constant draft length of γ. Reported: α (mean β), acceptance rate, tokens per target call (target
forwards counted by a hook, the same way for every method), speedup over plain and over transformers on the same
pair, and Theorem 3.8's expected speedup from α, γ and c. Greedy outputs are compared with plain `generate` token
for token. Speedups are ratios of generated tokens per second (at T=1 each method samples its own text). Sampling
exactness on the real pair: the first new token's marginal at T=1 (`--exactness-samples` draws per method) against
the target's exact next-token distribution, chi-square.

    flock /work/bench.lock python benchmarks/bench_cross_tokenizer.py --threads 2 \
        --output benchmarks/results/cross_tokenizer_cpu_2threads.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from harness import (  # run from the repository root or benchmarks/
    ForwardCounter,
    assistant_with_gamma,
    interleaved,
    write_results,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationMixin

import hf_specdec
from hf_specdec import zoo
from hf_specdec.theory import expected_speedup
from hf_specdec.zoo.tasks import load_prompts

RUNS = Path("/work/runs/cross_tokenizer")


@torch.no_grad()
def first_token_exactness(target, ids, ours: dict, theirs: dict, gamma: int, args) -> dict:
    """Sampling exactness on the real pair: the first new token's marginal, sampled `--exactness-samples` times by
    each method at T=1, against the target's exact next-token distribution (chi-square, the tests' helper)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_sampling_distribution import goodness_of_fit

    p = target(ids).logits[0, -1].float().softmax(-1)  # [V]
    table = {(i,): p[i].item() for i in torch.nonzero(p > 1e-6).flatten().tolist()}
    total = sum(table.values())
    table = {key: value / total for key, value in table.items()}
    common = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=3)
    runs = {
        "ours": lambda: target.generate(
            ids, speculative_gamma=gamma, speculative_gamma_policy="constant", **ours, **common
        ),
        "transformers": lambda: GenerationMixin.generate(target, ids, **theirs, **common),
    }
    report = {"samples": args.exactness_samples, "support": len(table)}
    for name, run in runs.items():
        torch.manual_seed(args.seed)
        samples = [(int(run()[0, ids.shape[1]]),) for _ in range(args.exactness_samples)]
        inside = [sample for sample in samples if sample in table]
        report[name] = {
            "outside_support": len(samples) - len(inside),
            "p_value": goodness_of_fit(table, inside),
            "top_token_frequency": samples.count(max(table, key=table.get)) / len(samples),
            "top_token_probability": max(table.values()),
        }
        print(f"first-token exactness {name}: {report[name]}", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per task")
    parser.add_argument("--tasks", nargs="+", default=["completion", "continuation"])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="keep the last N prompt tokens")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--drafter-dir", type=Path, default=RUNS / "drafter")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved passes; each prompt's median is used")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exactness-samples", type=int, default=300, help="0: skip the first-token check")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, same_drafter, tokenizer = zoo.load_default()
    target = hf_specdec.enable(target)
    cross_drafter = AutoModelForCausalLM.from_pretrained(args.drafter_dir, dtype=torch.float32).eval()
    cross_tokenizer = AutoTokenizer.from_pretrained(args.drafter_dir)
    gamma = args.gamma
    ours = {
        "same_tokenizer": dict(assistant_model=same_drafter),
        "cross_tokenizer": dict(
            assistant_model=cross_drafter, tokenizer=tokenizer, assistant_tokenizer=cross_tokenizer
        ),
    }
    theirs = {
        "same_tokenizer": dict(assistant_model=assistant_with_gamma(same_drafter, gamma)),
        # a deep copy: when sampling, transformers replaces the assistant's head by a pruned one in place
        # (`set_output_embeddings`), which a shallow copy would share with the model our runs use
        "cross_tokenizer": dict(
            assistant_model=assistant_with_gamma(copy.deepcopy(cross_drafter), gamma),
            tokenizer=tokenizer,
            assistant_tokenizer=cross_tokenizer,
        ),
    }
    counter = ForwardCounter(target)
    warm = tokenizer("def f(x):\n    return", return_tensors="pt").input_ids
    for kwargs in ours.values():
        target.generate(warm, max_new_tokens=8, do_sample=False, speculative_gamma=gamma, **kwargs)
        target.generate(warm, max_new_tokens=8, do_sample=True, speculative_gamma=gamma, **kwargs)
    for kwargs in theirs.values():
        GenerationMixin.generate(target, warm, max_new_tokens=8, do_sample=False, **kwargs)

    prompts = load_prompts()
    inputs = [
        tokenizer(item["prompt"], return_tensors="pt").input_ids[:, -args.max_prompt_tokens :]
        for task in args.tasks
        for item in prompts[task][: args.prompts]
    ]
    results = {
        "threads": torch.get_num_threads(),
        "max_new_tokens": args.max_new_tokens,
        "gamma": gamma,
        "prompts": len(inputs),
        "repeats": args.repeats,
        "tasks": args.tasks,
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "same_drafter_parameters": sum(p.numel() for p in same_drafter.parameters()),
        "cross_drafter_parameters": sum(p.numel() for p in cross_drafter.parameters()),
        "tokenizers": {
            "target": f"byte-level BPE, {len(tokenizer)} tokens",
            "cross_drafter": f"Metaspace BPE, {len(cross_tokenizer)} tokens",
        },
        "runs": [],
    }
    training = args.drafter_dir / "training.json"
    if training.exists():
        results["cross_drafter_training"] = json.loads(training.read_text())
    for temperature in args.temperatures:
        sampling = (
            dict(do_sample=False)
            if temperature == 0
            else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        )
        common = dict(max_new_tokens=args.max_new_tokens, **sampling)
        methods = ["plain"] + [f"ours/{name}" for name in ours] + [f"transformers/{name}" for name in theirs]
        seconds = {method: 0.0 for method in methods}
        tokens = {method: 0 for method in methods}
        calls = {method: 0 for method in methods}
        exact = {method: True for method in methods}
        errors = {}
        stats = {name: [] for name in ours}
        times = {method: [[] for _ in inputs] for method in methods}  # [method][prompt]: seconds per repeat
        greedy_outputs = {}  # (repeat, prompt) -> method -> sequences, at T=0

        def generate_with(method):
            kind, _, name = method.partition("/")
            if kind == "plain":
                options = {}
            elif kind == "ours":
                options = dict(
                    speculative_gamma=gamma,
                    speculative_gamma_policy="constant",
                    return_dict_in_generate=True,
                    **ours[name],
                )
            else:
                options = theirs[name]
            generate = target.generate if kind == "ours" else lambda *a, **k: GenerationMixin.generate(target, *a, **k)

            def run(item):
                index, ids = item
                if method in errors:  # failed before: not run again (its times are not used)
                    return None
                torch.manual_seed(args.seed + index)
                try:
                    return generate(ids, attention_mask=torch.ones_like(ids), **options, **common)
                except Exception as error:
                    errors[method] = f"{type(error).__name__}: {str(error)[:300]}"
                    print(f"{method} failed: {errors[method]}", flush=True)
                    return None

            return run

        def record(run):
            forwards = counter.take()
            if run.output is None:
                return
            times[run.name][run.index].append(run.seconds)
            out = run.output
            if run.name.startswith("ours/"):
                if not run.repeat:
                    stats[run.name.partition("/")[2]].append(out.speculative_stats)
                out = out.sequences
            if not run.repeat:  # counts from the first pass (the same seed per prompt draws the same tokens)
                calls[run.name] += forwards
                tokens[run.name] += out.shape[1] - inputs[run.index].shape[1]
            if temperature == 0:
                greedy_outputs.setdefault((run.repeat, run.index), {})[run.name] = out

        counter.take()
        runs = {method: generate_with(method) for method in methods}
        interleaved(runs, args.repeats, warmup=0, inputs=list(enumerate(inputs)), on_run=record)
        for outputs in greedy_outputs.values():
            for method, out in outputs.items():
                exact[method] &= torch.equal(out, outputs["plain"])
        for method in methods:  # each prompt's median over the repeats, summed over the prompts
            seconds[method] = sum(statistics.median(runs) for runs in times[method] if runs)
        plain_step = seconds["plain"] / tokens["plain"]

        def rate(method):
            return tokens[method] / seconds[method]

        for name in ours:
            runs = stats[name]
            alpha = sum(s.beta_sum for s in runs) / max(1, sum(s.beta_count for s in runs))
            drafted = sum(s.drafted_tokens for s in runs)
            c = sum(s.draft_time_s for s in runs) / max(1, drafted) / plain_step
            method, other = f"ours/{name}", f"transformers/{name}"
            row = {
                "temperature": temperature,
                "drafter": name,
                "gamma": gamma,
                "alpha": alpha,
                "acceptance_rate": sum(s.accepted_tokens for s in runs) / max(1, drafted),
                "drafted_per_round": drafted / max(1, sum(s.row_rounds for s in runs)),
                "tokens_per_target_call": tokens[method] / calls[method],
                "c": c,
                "plain_s": seconds["plain"],
                "ours_s": seconds[method],
                "plain_tokens": tokens["plain"],
                "ours_tokens": tokens[method],
                "speedup_over_plain": rate(method) / rate("plain"),
                "theorem_3_8": expected_speedup(alpha=min(alpha, 1 - 1e-9), gamma=gamma, c=c),
            }
            if other in errors:
                row["transformers_error"] = errors[other]
            else:
                row.update(
                    {
                        "transformers_s": seconds[other],
                        "transformers_tokens": tokens[other],
                        "transformers_tokens_per_target_call": tokens[other] / calls[other],
                        "transformers_speedup_over_plain": rate(other) / rate("plain"),
                        "speedup_over_transformers": rate(method) / rate(other),
                    }
                )
            if temperature == 0:
                row["exact_match_vs_plain"] = exact[method]
                if other not in errors:
                    row["transformers_exact_match_vs_plain"] = exact[other]
            results["runs"].append(row)
            over = (
                f" x{row['speedup_over_transformers']:.2f} vs transformers "
                f"(theirs x{row['transformers_speedup_over_plain']:.2f}, "
                f"{row['transformers_tokens_per_target_call']:.2f} tok/call)"
                if "speedup_over_transformers" in row
                else " transformers failed"
            )
            print(
                f"T={temperature:g} {name:16s} g={gamma} alpha {alpha:.3f} acc {row['acceptance_rate']:.3f} "
                f"tok/call {row['tokens_per_target_call']:.2f} c {c:.3f} speedup x{row['speedup_over_plain']:.2f} "
                f"(Thm 3.8 x{row['theorem_3_8']:.2f}){over}"
                + (f" exact {row['exact_match_vs_plain']}" if temperature == 0 else ""),
                flush=True,
            )
    if args.exactness_samples:
        try:
            results["first_token_exactness"] = first_token_exactness(
                target, inputs[0], ours["cross_tokenizer"], theirs["cross_tokenizer"], gamma, args
            )
        except Exception as error:
            results["first_token_exactness"] = {"error": f"{type(error).__name__}: {error}"}
    if args.output:
        write_results(args.output, results)


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"{time.perf_counter() - start:.0f} s")
