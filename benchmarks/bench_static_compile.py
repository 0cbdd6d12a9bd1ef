"""Static cache + `torch.compile` with a drafter, against what a speed-minded user runs without one.

The memory-bound pair of `bench_memory_bound.py` (TinyLlama's shape in bfloat16 from a config, its 1-layer early
exit as the drafter), greedy, batch 1, in one process, every method interleaved per prompt and repeated:

- `plain_eager`: plain `generate` (dynamic cache, eager);
- `plain_compiled`: plain `generate(cache_implementation="static", compile_config=...)`: transformers compiles the
  one-token decoding forward;
- `transformers_assisted`: transformers' assisted generation with the same drafter (dynamic cache, eager);
- `transformers_assisted_compiled`: the same with the static cache and compile config, where the installed
  transformers serves it (5.24 and later compile its verify forward; earlier releases refuse static caches, and the
  row is left out, its refusal recorded under `transformers_assisted_static_cache_refused`);
- `ours_eager`: `generate(assistant_model=drafter, speculative_gamma=γ)` with the dynamic cache;
- `ours_compiled`: the same with the static cache and the compiled verify forwards (padded to a few sizes);
- `ours_optimal_compiled`: the same with `speculative_gamma_policy="optimal"` (γ varies: the padded sizes bound the
  graphs compiled);
- `ours_tree_compiled` (with `--tree-budget N`): a token tree of N nodes, depth `--tree-depth`, on the static cache;
- `..._static_drafter`: the compiled methods with the drafter's own static cache and compiled forward
  (`ModelDrafter(drafter, cache_implementation="static")`; `drafter_compilations` counts its graphs).

`--only NAME [NAME ...]` times the three references (`plain_eager`, `plain_compiled`, `transformers_assisted`) and
the named methods only.

Where an output differs from plain `generate` with the same cache (bf16 near ties: a compiled forward over several
tokens rounds differently from a one-token one), the first differing position and the target's top-2 logit gap there
are reported (`harness.divergence`).

On this CPU transformers compiles only when the compile config asks for every device (`_compile_all_devices`), which
this script sets; on a GPU drop it (`--device cuda` uses `mode="reduce-overhead"`, CUDA graphs). Compile time is
reported separately: each compiled method's first call (a warm-up on the first prompt, with the same lengths) is timed
on its own and excluded from the steady-state medians, and `target_compilations` counts the graphs built.

    python benchmarks/bench_static_compile.py                     # full pair, 2 threads
    python benchmarks/bench_static_compile.py --quick --output /tmp/static_quick.json
    python benchmarks/bench_static_compile.py [--gamma 5] [--tree-budget 8] [--prompts 3] [--repeats 3]
        [--prompt-length 64] [--max-new-tokens 64] [--threads 2] [--device cpu|cuda] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import platform
import statistics
from pathlib import Path

import torch
import transformers
from harness import (  # run from the repository root or benchmarks/
    assistant_with_gamma,
    divergence,
    interleaved,
    merged_stats,
    time_summary,
    timed,
    write_results,
)
from pairs import FULL_PAIR, QUICK_PAIR, random_prompts
from transformers import CompileConfig, GenerationMixin

import hf_specdec
from hf_specdec.theory import expected_tokens_per_round
from hf_specdec.toy import build_early_exit_pair

QUICK_DEFAULTS = dict(prompts=2, repeats=1, prompt_length=16, max_new_tokens=24)
DEFAULT_OUTPUT = Path(__file__).parent / "results" / "static_compile_cpu_bf16_tinyllama.json"


def compile_config(device: str) -> CompileConfig:
    if device == "cuda":
        return CompileConfig(fullgraph=True, mode="reduce-overhead")
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True  # transformers compiles on CPU only when asked to
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small pair and short runs (checks the script)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--tree-budget", type=int, default=0, help="also a compiled token tree of this many nodes")
    parser.add_argument("--tree-depth", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument(
        "--only", nargs="+", default=None, metavar="NAME", help="time the three references and these methods only"
    )
    if parser.parse_known_args()[0].quick:
        parser.set_defaults(**QUICK_DEFAULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    shape = QUICK_PAIR if args.quick else FULL_PAIR
    target, drafter = build_early_exit_pair(**shape, head_logit_std=4.0, dtype=torch.bfloat16, seed=args.seed)
    target, drafter = hf_specdec.enable(target.to(args.device)), drafter.to(args.device)
    assistant = assistant_with_gamma(drafter, args.gamma)
    config = compile_config(args.device)
    prompts = [
        ids.to(args.device)
        for ids in random_prompts(args.prompts, args.prompt_length, target.config.vocab_size, seed=args.seed)
    ]
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
    static = dict(cache_implementation="static", compile_config=config)
    ours = dict(assistant_model=drafter, speculative_gamma=args.gamma, speculative_gamma_policy="constant")
    methods = {
        "plain_eager": lambda ids: GenerationMixin.generate(target, ids, **common),
        "plain_compiled": lambda ids: GenerationMixin.generate(target, ids, **common, **static),
        "transformers_assisted": lambda ids: GenerationMixin.generate(target, ids, assistant_model=assistant, **common),
        "ours_eager": lambda ids, **kw: target.generate(ids, **{**ours, **kw}, **common),
        "ours_compiled": lambda ids, **kw: target.generate(ids, **{**ours, **kw}, **common, **static),
        "ours_optimal_compiled": lambda ids, **kw: target.generate(
            ids, **{**ours, "speculative_gamma_policy": "optimal", **kw}, **common, **static
        ),
    }
    if args.tree_budget:
        methods["ours_tree_compiled"] = lambda ids, **kw: target.generate(
            ids,
            **{**ours, "speculative_gamma": args.tree_depth, "speculative_tree_budget": args.tree_budget, **kw},
            **common,
            **static,
        )
    static_drafter = hf_specdec.ModelDrafter(drafter, cache_implementation="static")
    for name in [name for name in methods if name.startswith("ours_") and name.endswith("compiled")]:
        methods[name + "_static_drafter"] = lambda ids, run=methods[name]: run(
            ids, assistant_model=None, drafter=static_drafter
        )
    refused = None
    try:  # transformers serves a static cache in assisted generation from 5.24 on
        GenerationMixin.generate(
            target,
            prompts[0][:, :8],
            assistant_model=assistant,
            cache_implementation="static",
            disable_compile=True,
            **{**common, "max_new_tokens": 2},
        )  # compiles nothing
        methods["transformers_assisted_compiled"] = lambda ids: GenerationMixin.generate(
            target, ids, assistant_model=assistant, **common, **static
        )
    except ValueError as error:
        refused = str(error)
    names = list(methods)
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            parser.error(f"--only: unknown method(s) {unknown}; known: {names}")
        names = [
            name
            for name in names
            if name in ("plain_eager", "plain_compiled", "transformers_assisted") or name in args.only
        ]

    warmup = {}
    for name in names:  # first calls: compilation (and the capability probe) outside the steady-state timings
        torch._dynamo.utils.counters["stats"]["unique_graphs"]  # the counter exists before the first compile
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        first_s, _ = timed(lambda: methods[name](prompts[0]))
        warmup[name] = {
            "first_call_s": first_s,
            "graphs_compiled": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
        }
        print(
            f"{name}: first call {warmup[name]['first_call_s']:.1f} s, "
            f"{warmup[name]['graphs_compiled']} graphs compiled",
            flush=True,
        )

    seconds = {name: [[0.0] * args.prompts for _ in range(args.repeats)] for name in names}
    outputs = {name: [[None] * args.repeats for _ in range(args.prompts)] for name in names}
    stats = {name: [] for name in names}

    def record(run):
        seconds[run.name][run.repeat][run.index] = run.seconds
        outputs[run.name][run.index][run.repeat] = run.output.sequences[0, args.prompt_length :].cpu()
        if getattr(run.output, "speculative_stats", None) is not None:
            stats[run.name].append(run.output.speculative_stats)

    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    timed_methods = {name: methods[name] for name in names}
    interleaved(timed_methods, args.repeats, warmup=0, inputs=prompts, device=args.device, on_run=record)
    steady_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before

    results = {}
    for name in names:
        row = time_summary(seconds[name], seconds["plain_eager"])
        row["speedup_over_plain_compiled"] = (
            statistics.median(s for r in seconds["plain_compiled"] for s in r) / row["median_s"]
        )
        row["speedup_over_transformers_assisted"] = (
            statistics.median(s for r in seconds["transformers_assisted"] for s in r) / row["median_s"]
        )
        row["identical_to_plain_eager"] = sum(
            torch.equal(outputs[name][i][r], outputs["plain_eager"][i][0])
            for i in range(args.prompts)
            for r in range(args.repeats)
        )
        row["identical_to_plain_compiled"] = sum(
            torch.equal(outputs[name][i][r], outputs["plain_compiled"][i][0])
            for i in range(args.prompts)
            for r in range(args.repeats)
        )
        row["runs"] = args.prompts * args.repeats
        reference = "plain_compiled" if "compiled" in name else "plain_eager"
        row["divergences_from_" + reference] = [
            divergence(
                target, prompts[i][0], outputs[reference][i][0].to(args.device), outputs[name][i][0].to(args.device)
            )
            for i in range(args.prompts)
            if not torch.equal(outputs[name][i][0], outputs[reference][i][0])
        ]
        row.update(warmup[name])
        if stats[name]:
            row["speculative_stats"] = merged_stats(stats[name])
            row["speculative_stats"]["compiled_rounds"] = sum(s.compiled_rounds for s in stats[name])
            row["speculative_stats"]["target_compilations_steady_state"] = sum(
                s.target_compilations for s in stats[name]
            )
            row["speculative_stats"]["drafter_compilations_steady_state"] = sum(
                s.drafter_compilations for s in stats[name]
            )
        results[name] = row
    alpha = next(row["speculative_stats"]["alpha"] for name, row in results.items() if name.startswith("ours_"))
    bound = expected_tokens_per_round(alpha, args.gamma)
    output = {
        "benchmark": "static_compile",
        "quick": args.quick,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "pair": {**shape, "dtype": "bfloat16", "device": args.device},
        "environment": {
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "hf_specdec": hf_specdec.__version__,
            "machine": platform.machine(),
            "processor": platform.processor(),
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        },
        "compile_config": {k: v for k, v in config.to_dict().items() if k != "options"},
        "graphs_compiled_in_steady_state": steady_graphs,
        "transformers_assisted_static_cache_refused": refused,
        "theorem_3_8_at_v1": bound / (args.gamma * 0.1 + 1),  # c ≈ 0.1: the 1-layer drafter of a 22-layer target
        "results": results,
    }
    print(
        f"\n{'method':30} {'median s':>9} {'vs plain':>9} {'vs plain compiled':>18} {'vs transformers':>16} "
        f"{'identical':>10} {'first call s':>13}"
    )
    for name, row in results.items():
        print(
            f"{name:30} {row['median_s']:9.2f} {row['speedup_ratio_of_medians']:9.2f} "
            f"{row['speedup_over_plain_compiled']:18.2f} {row['speedup_over_transformers_assisted']:16.2f} "
            f"{row['identical_to_plain_eager']:>5}/{row['runs']:<4} {row['first_call_s']:13.1f}"
        )
    print(f"α {alpha:.3f}; graphs compiled after warm-up: {steady_graphs}")
    write_results(args.output, output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
