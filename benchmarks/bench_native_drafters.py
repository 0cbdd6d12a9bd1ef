"""Drafters that ship with the model, against transformers' own path for each: LayerSkip early exit.

The target is the memory-bound pair's (`pairs.FULL_PAIR`, TinyLlama-1.1B's shape in bfloat16, built by
`hf_specdec.toy.build_early_exit_pair`): its layers after the first add little to the residual stream, as in a
checkpoint trained for early exit, so its own first layer, final norm and head draft well. Methods, interleaved and
repeated in one process, greedy:

- `plain`: `GenerationMixin.generate` (one forward per token);
- `transformers`: transformers' own `generate(assistant_early_exit=1)` (`EarlyExitCandidateGenerator`);
- `ours`: `generate(assistant_early_exit=1)` on the enabled model, default settings;
- `ours_tree`: the same with `speculative_tree_budget=8`.

Reported: median seconds, speedup over plain, tokens per target call (verify forwards only: transformers' drafts run
the same model with its config's layer count lowered, and are not counted), identity with plain, and with `--memory`
the peak resident memory of a fresh process that loads the target and decodes plainly, with transformers' early exit
and with ours (each its own process).

    python benchmarks/bench_native_drafters.py [--quick] [--repeats 3] [--prompts 3] [--max-new-tokens 64]
        [--threads 2] [--memory] [--output benchmarks/results/native_drafters_cpu_bf16.json]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from harness import interleaved, summarize, write_results
from pairs import FULL_PAIR, QUICK_PAIR, random_prompts
from transformers import GenerationMixin

import hf_specdec
from hf_specdec.toy import build_early_exit_pair

DEFAULT_OUTPUT = Path(__file__).parent / "results" / "native_drafters_cpu_bf16.json"
EXIT_LAYER = 1


class VerifyCounter:
    """Counts the target's forwards that run every layer (transformers' early exit drafts through the same model
    with `config.num_hidden_layers` lowered; our view is a module of its own, which no hook on the target sees)."""

    def __init__(self, model):
        self.model, self.full, self.count = model, model.config.num_hidden_layers, 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += module.model.config.num_hidden_layers == self.full

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def build(quick: bool):
    shape = QUICK_PAIR if quick else FULL_PAIR
    target, _ = build_early_exit_pair(**shape, dtype=torch.bfloat16, head_logit_std=4.0)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = None
    return hf_specdec.enable(target), shape["vocab_size"]


def methods_for(target, new_tokens: int):
    common = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return {
        "plain": lambda ids: GenerationMixin.generate(target, ids, **common),
        "transformers": lambda ids: GenerationMixin.generate(target, ids, assistant_early_exit=EXIT_LAYER, **common),
        "ours": lambda ids: target.generate(ids, assistant_early_exit=EXIT_LAYER, **common),
        "ours_tree": lambda ids: target.generate(
            ids, assistant_early_exit=EXIT_LAYER, speculative_tree_budget=8, **common
        ),
    }


def peak_memory_mb(method: str, quick: bool, new_tokens: int, threads: int) -> float:
    """Peak resident memory (MB) of a fresh process that builds the target and runs `method` once on one prompt."""
    code = (
        f"import resource, sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); torch.set_num_threads({threads});"
        "import bench_native_drafters as b; from pairs import random_prompts;"
        f"target, vocab = b.build({quick}); ids = random_prompts(1, 32, vocab)[0];"
        f"b.methods_for(target, {new_tokens})[{method!r}](ids);"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out.split()[-1]) / 1024  # ru_maxrss is in KiB on Linux


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smoke-test shape instead of the 1.1B one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory", action="store_true", help="also measure peak resident memory per method")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)


def run(args) -> dict:
    target, vocab = build(args.quick)
    prompts = random_prompts(args.prompts, args.prompt_length, vocab)
    methods = methods_for(target, args.max_new_tokens)
    counter = VerifyCounter(target)
    reference = [methods["plain"](ids) for ids in prompts]
    calls, identical = {}, {}
    for name, method in methods.items():  # outputs and target calls, outside the timed runs
        method(prompts[0])  # a first call probes the model once (capabilities): count warm calls, as the timed ones
        counter.take()
        outputs = [method(ids) for ids in prompts]
        calls[name] = counter.take()
        identical[name] = sum(bool(torch.equal(out, ref)) for out, ref in zip(outputs, reference))
    counter.handle.remove()
    seconds = interleaved(methods, args.repeats, inputs=prompts)
    plain = statistics.median(seconds["plain"])
    tokens = args.prompts * args.max_new_tokens
    results = {
        name: {
            "seconds": summarize(seconds[name]),
            "speedup": plain / statistics.median(seconds[name]),
            "tokens_per_target_call": tokens / calls[name],
            "identical_to_plain": f"{identical[name]}/{args.prompts}",
        }
        for name in methods
    }
    results["ours"]["over_transformers"] = statistics.median(seconds["transformers"]) / statistics.median(
        seconds["ours"]
    )
    results["ours_tree"]["over_transformers"] = statistics.median(seconds["transformers"]) / statistics.median(
        seconds["ours_tree"]
    )
    memory = None
    if args.memory:
        memory = {
            name: peak_memory_mb(name, args.quick, args.max_new_tokens, args.threads)
            for name in ("plain", "transformers", "ours")
        }
    payload = {
        "family": "early_exit",
        "exit_layer": EXIT_LAYER,
        "shape": QUICK_PAIR if args.quick else FULL_PAIR,
        "dtype": "bfloat16",
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "results": results,
        "peak_memory_mb": memory,
    }
    write_results(args.output, payload)
    print(f"{'method':14} {'speedup':>8} {'tok/call':>9} {'identical':>10} {'x transformers':>15}")
    for name, row in results.items():
        over = row.get("over_transformers")
        print(
            f"{name:14} {row['speedup']:8.2f} {row['tokens_per_target_call']:9.2f} {row['identical_to_plain']:>10} "
            f"{'' if over is None else f'{over:15.2f}'}"
        )
    if memory:
        print("peak resident memory (MB):", {name: round(value) for name, value in memory.items()})
    return payload


if __name__ == "__main__":
    main()
