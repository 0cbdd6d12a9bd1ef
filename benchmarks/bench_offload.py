"""Beyond one device and one process (issue 21), on this CPU: a disk-offloaded target, and data-parallel generation.

**Offloaded target.** The memory-bound pair of `bench_memory_bound.py` (TinyLlama's shape, 1.1B parameters in
bfloat16, built from a config with seeded weights; its drafter is the 1-layer early exit) is saved with safetensors
and the target loaded back with `device_map` putting every decoder layer on "disk" (`offload_folder`), embeddings,
final norm and head on the CPU: accelerate's hooks then bring each layer's weights in for every forward, so a forward
costs the weights' traffic whatever the number of tokens it verifies, the regime where transformers' blog reports up
to 10x for assisted generation. The drafter stays in memory. In one process, greedy, batch 1, seeded random prompts,
interleaved repeats (order rotated), medians:

- plain `GenerationMixin.generate` on the offloaded target;
- transformers' assisted generation with the same drafter (constant `num_assistant_tokens` = γ, no confidence cut);
- ours with constant γ, and with the default γ policy (`auto`).

Reported: speedups over plain and over transformers, tokens per target call (forwards counted by a hook, the same
way for every method), α, whether each output equals plain greedy; v(k) = the offloaded target's cached forward over
k tokens / over one token, c = the drafter's one-token forward / the target's, and Theorem 3.8 at v = 1 and priced at
the measured v(γ + 1).

**Data-parallel generation.** `hf-specdec generate --dataset` over the embedded zoo's held-out prompts (its 5.6M
code model and distilled drafter, constant γ), with 1 process (1 thread and 2 threads) and with 2 processes of one
thread each under `ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 --num_machines 1`, the
command that starts two CPU processes with accelerate 1.15. Rows per second of the generation itself (model loading
excluded) and of the whole command; the 2-process output is checked against the 1-process one row for row.

    python benchmarks/bench_offload.py                         # both parts, 2 threads
    python benchmarks/bench_offload.py --quick --output /tmp/offload_quick.json    # a small pair: a smoke test
    python benchmarks/bench_offload.py [--gamma 8] [--prompts 2] [--repeats 2] [--max-new-tokens 32]
        [--skip-offload] [--skip-data-parallel] [--dp-prompts 48] [--dp-max-new-tokens 64] [--dp-repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from harness import (  # run from the repository root or benchmarks/
    ForwardCounter,
    assistant_with_gamma,
    cost_curves,
    interleaved,
    merged_stats,
    rotated,
    time_summary,
    write_results,
)
from pairs import FULL_PAIR, QUICK_PAIR, random_prompts
from transformers import AutoModelForCausalLM, GenerationMixin

import hf_specdec
from hf_specdec.theory import expected_speedup, expected_tokens_per_round, optimal_gamma
from hf_specdec.toy import build_early_exit_pair

DEFAULT_OUTPUT = Path(__file__).parent / "results" / "offload_cpu_bf16_tinyllama.json"
QUICK_DEFAULTS = dict(
    prompts=1, repeats=1, max_new_tokens=12, prompt_length=16, dp_prompts=8, dp_max_new_tokens=16, dp_repeats=1
)
REPOSITORY = Path(__file__).resolve().parent.parent


def disk_map(num_layers: int) -> dict:
    """Every decoder layer on disk; embeddings, final norm and head on the CPU (the execution device here)."""
    return {
        "model.embed_tokens": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
        **{f"model.layers.{i}": "disk" for i in range(num_layers)},
    }


def run_offload(args, folder: Path) -> dict:
    shape = QUICK_PAIR if args.quick else FULL_PAIR
    start = time.perf_counter()
    target, drafter = build_early_exit_pair(**shape, head_logit_std=4.0, dtype=torch.bfloat16, seed=args.seed)
    target.save_pretrained(folder / "target")
    parameters = sum(p.numel() for p in target.parameters())
    del target
    device_map = disk_map(shape["num_layers"])
    target = AutoModelForCausalLM.from_pretrained(
        folder / "target", device_map=device_map, dtype=torch.bfloat16, offload_folder=folder / "offload"
    ).eval()
    target.generation_config.eos_token_id = None
    target = hf_specdec.enable(target)
    setup_s = time.perf_counter() - start
    counter = ForwardCounter(target)
    print(
        f"offloaded target ready in {setup_s:.1f} s: {parameters / 1e9:.3f}B parameters, "
        f"{shape['num_layers']} layers on disk, {torch.get_num_threads()} threads",
        flush=True,
    )

    gamma = args.gamma
    context = args.prompt_length + args.max_new_tokens // 2
    costs = cost_curves(
        target,
        drafter,
        context,
        sorted({1, 2, 4, gamma + 1, 2 * gamma + 1}),
        [],
        [1],
        args.cost_repeats,
        seed=args.seed,
    )
    print(
        f"offloaded target step {costs['target_step_ms']:.0f} ms; v: "
        + " ".join(f"{k}:{v:.2f}" for k, v in costs["v_causal"].items())
        + f"; drafter step {costs['drafter_ms'][1]:.1f} ms (c {costs['c_frontier'][1]:.4f})",
        flush=True,
    )

    prompts = random_prompts(args.prompts, args.prompt_length, shape["vocab_size"], seed=args.seed)
    assistant = assistant_with_gamma(drafter, gamma)
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    methods = {
        "plain": lambda ids: GenerationMixin.generate(target, ids, attention_mask=torch.ones_like(ids), **common),
        "transformers_assisted": lambda ids: GenerationMixin.generate(
            target, ids, attention_mask=torch.ones_like(ids), assistant_model=assistant, **common
        ),
        "ours_constant": lambda ids: target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            assistant_model=drafter,
            speculative_gamma=gamma,
            speculative_gamma_policy="constant",
            return_dict_in_generate=True,
            **common,
        ),
        "ours_auto": lambda ids: target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            assistant_model=drafter,
            speculative_gamma=gamma,
            return_dict_in_generate=True,
            **common,
        ),
    }
    names = list(methods)
    seconds = {name: [[0.0] * len(prompts) for _ in range(args.repeats)] for name in names}
    forwards = {name: 0 for name in names}
    stats = {name: [] for name in names}
    outputs = {name: [None] * len(prompts) for name in names}
    for name in ("plain", "ours_constant"):  # warm-up: first calls pay one-off costs (ours: the target's one-off
        methods[name](prompts[0][:, :8])  # multi-token-forward probe, 7 forwards, once per model)

    def record(run):
        seconds[run.name][run.repeat][run.index] = run.seconds
        forwards[run.name] += counter.take()
        sequences = run.output.sequences if hasattr(run.output, "sequences") else run.output
        outputs[run.name][run.index] = sequences[0, prompts[run.index].shape[1] :]
        if getattr(run.output, "speculative_stats", None) is not None:
            stats[run.name].append(run.output.speculative_stats)
        print(f"  repeat {run.repeat} prompt {run.index} {run.name:22s} {run.seconds:7.1f} s", flush=True)

    counter.take()  # the warm-up's forwards
    interleaved(methods, args.repeats, warmup=0, inputs=prompts, on_run=record)

    new_tokens = args.repeats * sum(int(outputs["plain"][p].shape[0]) for p in range(len(prompts)))
    rows = {}
    for name in names:
        summary = time_summary(seconds[name], seconds["plain"])
        summary["tokens_per_target_call"] = new_tokens / max(1, forwards[name])
        summary["identical_to_plain"] = all(
            torch.equal(outputs[name][p], outputs["plain"][p]) for p in range(len(prompts))
        )
        if stats[name]:
            summary["stats"] = merged_stats(stats[name])
        transformers_median = statistics.median(s for r in seconds["transformers_assisted"] for s in r)
        summary["speedup_over_transformers_ratio_of_medians"] = transformers_median / summary["median_s"]
        rows[name] = summary

    alpha = rows["ours_constant"]["stats"]["alpha"]
    c = costs["c_frontier"][1]
    v = costs["v_causal"][gamma + 1]
    theory = {
        "alpha": alpha,
        "c": c,
        "gamma": gamma,
        "v_gamma_plus_1": v,
        "theorem_3_8_at_v1": expected_speedup(alpha, gamma, c),
        "theorem_3_8_at_measured_v": expected_tokens_per_round(alpha, gamma) / (gamma * c + v),
        "optimal_gamma_at_v1": optimal_gamma(alpha, c),
    }
    theory["ours_constant_fraction_of_theorem_at_measured_v"] = (
        rows["ours_constant"]["speedup_ratio_of_medians"] / theory["theorem_3_8_at_measured_v"]
    )
    return {
        "pair": {
            **shape,
            "dtype": "bfloat16",
            "target_parameters": parameters,
            "device_map": "layers on disk, embeddings/norm/head on cpu",
            "setup_s": setup_s,
        },
        "costs": costs,
        "methods": rows,
        "theory": theory,
    }


def _launch(command: list[str], env: dict) -> tuple[float, float, str]:
    """`(generation seconds, whole-command seconds, stderr)` of one `hf-specdec generate --dataset` run."""
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    found = re.search(r"(\d+) row\(s\) generated in ([\d.]+) s", result.stderr)
    return float(found.group(2)), wall, result.stderr


def run_data_parallel(args, folder: Path) -> dict:
    from hf_specdec.zoo.tasks import load_prompts

    prompts = [item["prompt"] for task in load_prompts().values() for item in task][: args.dp_prompts]
    dataset = folder / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in prompts), encoding="utf-8")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1"
    )
    generate = [
        "-m",
        "hf_specdec.cli",
        "generate",
        "--drafter",
        "model",
        "--dataset",
        str(dataset),
        "--batch-size",
        str(args.dp_batch_size),
        "--max-new-tokens",
        str(args.dp_max_new_tokens),
        "--gamma",
        str(args.dp_gamma),
        "--gamma-policy",
        "constant",
    ]
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--main_process_port",
        "29561",
    ]
    configs = {
        "1 process x 1 thread": ([sys.executable, *generate, "--threads", "1"], env),
        "1 process x 2 threads": ([sys.executable, *generate, "--threads", "2"], env),
        "2 processes x 1 thread": ([*launch, *generate, "--threads", "1"], dict(env, ACCELERATE_USE_CPU="true")),
    }
    times = {name: {"generation_s": [], "command_s": []} for name in configs}
    names = list(configs)
    for repeat in range(args.dp_repeats):  # whole commands, each reporting its own generation time: not `interleaved`
        for name in rotated(names, repeat):
            command, environment = configs[name]
            output = folder / f"dp_{len(times[name]['command_s'])}_{names.index(name)}.jsonl"
            generation, wall, _ = _launch([*command, "--output", str(output)], environment)
            times[name]["generation_s"].append(generation)
            times[name]["command_s"].append(wall)
            print(f"  repeat {repeat} {name:24s} generation {generation:6.1f} s, command {wall:6.1f} s", flush=True)

    def rows_of(index):
        return [
            {k: v for k, v in json.loads(line).items() if k != "speculative_stats"}
            for line in (folder / f"dp_0_{index}.jsonl").read_text().splitlines()
        ]

    one, two = rows_of(0), rows_of(2)
    stats = [json.loads(line)["speculative_stats"] for line in (folder / "dp_0_0.jsonl").read_text().splitlines()]
    tokens = sum(json.loads(line)["num_new_tokens"] for line in (folder / "dp_0_0.jsonl").read_text().splitlines())
    rows = {}
    for name in names:
        generation = statistics.median(times[name]["generation_s"])
        command = statistics.median(times[name]["command_s"])
        rows[name] = {
            **times[name],
            "median_generation_s": generation,
            "median_command_s": command,
            "rows_per_s": len(prompts) / generation,
            "new_tokens_per_s": tokens / generation,
            "rows_per_s_whole_command": len(prompts) / command,
        }
    base = rows["1 process x 1 thread"]["median_generation_s"]
    for name in names:
        rows[name]["throughput_over_1_process_1_thread"] = base / rows[name]["median_generation_s"]
    return {
        "rows": len(prompts),
        "new_tokens": tokens,
        "batch_size": args.dp_batch_size,
        "max_new_tokens": args.dp_max_new_tokens,
        "gamma": args.dp_gamma,
        "tokens_per_target_call_batches": sum(s["emitted_tokens"] for s in stats)
        / max(1, sum(s["target_calls"] for s in stats)),
        "two_processes_equal_one_process_row_for_row": one == two,
        "configs": rows,
    }


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    return ["| " + " | ".join(cells) + " |" for cells in [header, ["---"] * len(header), *rows]]


def markdown(results: dict) -> str:
    lines = []
    offload = results.get("offload")
    if offload:
        lines += table(
            [
                "offloaded target (layers on disk)",
                "median s",
                "speedup vs plain",
                "vs transformers",
                "tokens/call",
                "identical",
            ],
            [
                [
                    name,
                    f"{row['median_s']:.1f}",
                    f"{row['speedup_ratio_of_medians']:.2f}x",
                    f"{row['speedup_over_transformers_ratio_of_medians']:.2f}x",
                    f"{row['tokens_per_target_call']:.2f}",
                    str(row["identical_to_plain"]),
                ]
                for name, row in offload["methods"].items()
            ],
        )
        t = offload["theory"]
        lines.append(
            f"\nα {t['alpha']:.3f}, c {t['c']:.4f}, γ {t['gamma']}, v(γ+1) {t['v_gamma_plus_1']:.2f}: "
            f"Theorem 3.8 {t['theorem_3_8_at_v1']:.2f}x at v = 1, {t['theorem_3_8_at_measured_v']:.2f}x at "
            f"measured v; optimal γ at v = 1: {t['optimal_gamma_at_v1']}\n"
        )
    dp = results.get("data_parallel")
    if dp:
        lines += table(
            [
                "data-parallel (zoo, `--drafter model`)",
                "generation s",
                "rows/s",
                "new tokens/s",
                "throughput",
                "whole command s",
            ],
            [
                [
                    name,
                    f"{row['median_generation_s']:.1f}",
                    f"{row['rows_per_s']:.2f}",
                    f"{row['new_tokens_per_s']:.0f}",
                    f"{row['throughput_over_1_process_1_thread']:.2f}x",
                    f"{row['median_command_s']:.1f}",
                ]
                for name, row in dp["configs"].items()
            ],
        )
        lines.append(
            f"\n2-process output equals 1-process output row for row: "
            f"{dp['two_processes_equal_one_process_row_for_row']}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small pair and few tokens: a smoke test")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (offload part)")
    parser.add_argument("--gamma", type=int, default=8, help="γ of ours and of transformers")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--cost-repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-offload", action="store_true")
    parser.add_argument("--skip-data-parallel", action="store_true")
    parser.add_argument("--dp-prompts", type=int, default=48, help="held-out zoo prompts (48 at most)")
    parser.add_argument("--dp-max-new-tokens", type=int, default=64)
    parser.add_argument("--dp-batch-size", type=int, default=8)
    parser.add_argument("--dp-gamma", type=int, default=4)
    parser.add_argument("--dp-repeats", type=int, default=2)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    if parser.parse_known_args()[0].quick:
        parser.set_defaults(**QUICK_DEFAULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {
        "benchmark": "offload_and_data_parallel",
        "quick": args.quick,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "environment": {
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "hf_specdec": hf_specdec.__version__,
            "machine": platform.machine(),
            "cores": os.cpu_count(),
            "load_average_at_start": os.getloadavg()[0],
        },
    }
    with tempfile.TemporaryDirectory() as folder:
        if not args.skip_offload:
            results["offload"] = run_offload(args, Path(folder))
        if not args.skip_data_parallel:
            results["data_parallel"] = run_data_parallel(args, Path(folder))
    results["environment"]["load_average_at_end"] = os.getloadavg()[0]
    results["markdown"] = markdown(results)
    print()
    print(results["markdown"])
    write_results(args.output, results)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
