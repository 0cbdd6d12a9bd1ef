"""Continuous batching with and without speculation: transformers' plain continuous batching against hf_specdec's
drafting inside it (`init_continuous_batching(..., drafter=...)`), same requests, greedy, one process.

Workloads (the embedded zoo model and its tokenizer, held-out prompts of `hf_specdec/zoo_models/heldout_prompts.json`):
`editing` is copy-heavy (a function, then its renamed signature: the continuation repeats the body), `continuation`
is open text (a window of a held-out file), where copying rarely helps. Each request asks for `--max-new-tokens`.

For each number of slots B (`max_requests_per_batch`) in `--slots`, `--requests-per-slot` x B requests (at least
`--min-requests`), many more than slots, are submitted at once to a started manager that has already served one
warm-up request (start-up and first-call costs excluded). Methods: `plain` (transformers' manager), `prompt_lookup`,
`suffix`, `ngram` (the zoo's trigram table) and `model` (the zoo's distilled 1-layer draft model, each request drafting
with a draft cache of its own), drafting up to `--gamma` under the default `auto` policy (drafts priced on each step's
total query tokens), and each `<drafter>_constant` at constant γ. Every request's output is checked against
plain's. Per method and B: tokens per second over the whole batch of requests (from the first submission to the last
result), p50 / p95 latency per request (submission to completion), tokens per target call, and the speedup over
plain in tokens per second. Methods run one after another at each B in an order rotated each repeat; medians over
`--repeats`.

    python benchmarks/bench_continuous_batching.py --threads 2 --slots 1 2 4 8 16 32 --repeats 3 \\
        --output benchmarks/results/continuous_batching_zoo_cpu_2threads.json

`--memory-bound` serves the memory-bound pair's target of `bench_memory_bound.py` instead (TinyLlama-1.1B's shape,
bfloat16 with the head in float32, or `--dtype float32`; random weights) made a copier with `hf_specdec.toy.copying_target` (its attention adds
nothing, so its next token depends on the current one only): task `copy` asks it to continue S + C + S, where C is its
own continuation of a random S (it writes C again, like a model returning a block of code), task `no_match` a random
prompt. Only copy drafters make sense there (`--methods plain prompt_lookup prompt_lookup_constant suffix`):

    python benchmarks/bench_continuous_batching.py --memory-bound --threads 2 --slots 1 4 16 --repeats 2 \
        --methods plain prompt_lookup prompt_lookup_constant --output benchmarks/results/continuous_batching_memory_bound_cpu_bf16.json

`--device cuda` serves on a GPU (the models are built there; `--threads` then only sets the host's threads), e.g.

    python benchmarks/bench_continuous_batching.py --device cuda --memory-bound --slots 1 8 --repeats 2 \
        --methods plain prompt_lookup prompt_lookup_constant \
        --output benchmarks/results/continuous_batching_memory_bound_cuda_bf16.json

With `--memory-bound`, `--tasks copy` or `--tasks no_match` keeps one of its two tasks.

`--smoke` runs a few requests at B in (1, 2) so the script is checked in the test suite.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from harness import write_results  # run from the repository root or benchmarks/
from pairs import FULL_PAIR, float32_head
from transformers import ContinuousBatchingConfig, GenerationConfig

import hf_specdec
from hf_specdec import zoo
from hf_specdec.benchmarking import rotated
from hf_specdec.toy import build_early_exit_pair, copying_target
from hf_specdec.zoo.tasks import load_prompts

METHODS = (
    "plain",
    "prompt_lookup",
    "prompt_lookup_constant",
    "suffix",
    "suffix_constant",
    "ngram",
    "ngram_constant",
    "model",
    "model_constant",
)


def drafting(method: str, gamma: int, draft_model=None) -> dict:
    """`<drafter>`: the default (`auto`) policy, drafts up to γ priced per step; `<drafter>_constant`: every draft
    up to γ verified. `model`: `draft_model` (the zoo's distilled drafter), each request with a draft cache of its own."""
    if method == "plain":
        return {}
    name = method.removesuffix("_constant")
    policy = "constant" if method.endswith("_constant") else "auto"
    options = dict(speculative_gamma=gamma, speculative_gamma_policy=policy)
    if name == "model":
        return dict(assistant_model=draft_model, **options)
    return dict(drafter=zoo.load_ngram() if name == "ngram" else name, **options)


def serve(model, prompts, method, slots, args, warm_prompt, draft_model=None):
    """One run: a started manager (warmed by one request) serves every prompt; returns outputs and timings."""
    longest = max(len(p) for p in prompts) + args.max_new_tokens + args.gamma + 1
    page = 64
    cache = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=slots * math.ceil(longest / page) + 8,
        max_batch_tokens=max(args.max_batch_tokens, slots * (args.gamma + 1)),
        max_requests_per_batch=slots,
        allow_block_sharing=False,
    )
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=-1)
    manager = model.init_continuous_batching(config, cache, **drafting(method, args.gamma, draft_model))
    manager.start()
    try:
        warm = manager.add_request(warm_prompt, max_new_tokens=8)
        next(r for r in manager.request_id_iter(warm) if r.is_finished())
        start = time.perf_counter()
        ids = [manager.add_request(prompt, request_id=f"r{i}") for i, prompt in enumerate(prompts)]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError(f"{method} at B={slots}: the manager stopped before every request finished")
            if result.is_finished():
                results[result.request_id] = result
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
    outputs = [results[i] for i in ids]
    latencies = sorted(r.lifespan[1] - r.created_time for r in outputs)
    stats = [getattr(r, "speculative_stats", None) for r in outputs]
    calls = sum(s.target_calls for s in stats) if stats[0] is not None else None
    tokens = sum(len(r.generated_tokens) for r in outputs)
    return {
        "tokens": [r.generated_tokens for r in outputs],
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "p50_s": latencies[len(latencies) // 2],
        "p95_s": latencies[min(len(latencies) - 1, math.ceil(0.95 * len(latencies)) - 1)],
        "tokens_per_call": tokens / calls if calls else 1.0,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--tasks", nargs="+", default=["editing", "continuation"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--requests-per-slot", type=int, default=3)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="keep the last N prompt tokens")
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--gamma", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory-bound", action="store_true", help="the 1.1B bfloat16 copier (see above)")
    parser.add_argument("--prompts", type=int, default=8, help="with --memory-bound: prompts per task")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="with --memory-bound: the copier's dtype (in bfloat16 a verify over several tokens rounds differently "
        "from a one-token step, so near ties flip and copies break off; float32 keeps them)",
    )
    parser.add_argument("--device", default="cpu", help="where the models are built and served (cpu, cuda)")
    parser.add_argument("--smoke", action="store_true", help="a few requests at B in (1, 2), one repeat")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.memory_bound and any(method.startswith("model") for method in args.methods):
        parser.error("--memory-bound serves a copier with no draft model: drop the `model` methods")
    if args.smoke:
        args.slots, args.requests_per_slot, args.min_requests, args.repeats = [1, 2], 1, 3, 1
        args.max_new_tokens, args.tasks = 12, ["editing"]
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        run(args)
    finally:
        torch.set_num_threads(threads)


def zoo_workload(args):
    target, draft_model, tokenizer = zoo.load_default()
    target, draft_model = target.to(args.device), draft_model.to(args.device)
    prompts = load_prompts()
    pools = {
        task: [tokenizer(p["prompt"]).input_ids[-args.max_prompt_tokens :] for p in prompts[task]]
        for task in args.tasks
    }
    return hf_specdec.enable(target), pools, draft_model


def memory_bound_workload(args):
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):  # built where it is served: no pass of the weights through the host
        target, drafter = build_early_exit_pair(**FULL_PAIR, head_logit_std=10.0, dtype=dtype)
    del drafter
    if dtype == torch.bfloat16:
        float32_head(target)
    model = hf_specdec.enable(copying_target(target))
    del target
    generator = torch.Generator().manual_seed(0)
    pools = {"copy": [], "no_match": []}
    for _ in range(args.prompts):
        seed = torch.randint(0, FULL_PAIR["vocab_size"], (1, 24), generator=generator)
        continuation = model.generate(seed.to(model.device), max_new_tokens=args.max_new_tokens, do_sample=False)
        pools["copy"].append(seed[0].tolist() + continuation[0, 24:].tolist() + seed[0].tolist())
        pools["no_match"].append(torch.randint(0, FULL_PAIR["vocab_size"], (64,), generator=generator).tolist())
    tasks = [task for task in ("copy", "no_match") if task in args.tasks] or ["copy", "no_match"]
    return model, {task: pools[task] for task in tasks}, None


def run(args) -> None:
    model, pools, draft_model = memory_bound_workload(args) if args.memory_bound else zoo_workload(args)
    results = {}
    for task, pool in pools.items():
        for slots in args.slots:
            count = max(args.min_requests, args.requests_per_slot * slots)
            prompts = [pool[i % len(pool)] for i in range(count)]
            runs = {method: [] for method in args.methods}
            for repeat in range(args.repeats):
                for method in rotated(args.methods, repeat):
                    runs[method].append(serve(model, prompts, method, slots, args, pool[-1][:32], draft_model))
            reference = runs["plain"][0]["tokens"] if "plain" in runs else None
            row = {"requests": count}
            for method, method_runs in runs.items():
                identical = reference is None or all(run["tokens"] == reference for run in method_runs)
                row[method] = {
                    key: statistics.median(run[key] for run in method_runs)
                    for key in ("tokens_per_s", "p50_s", "p95_s", "tokens_per_call", "seconds")
                }
                row[method]["identical_to_plain"] = identical
                if "plain" in runs:
                    row[method]["speedup"] = row[method]["tokens_per_s"] / row["plain"]["tokens_per_s"]
            results.setdefault(task, {})[f"B={slots}"] = row
            summary = ", ".join(
                f"{m} {row[m].get('speedup', 1):.2f}x ({row[m]['tokens_per_call']:.2f}/call"
                f"{'' if row[m]['identical_to_plain'] else ', DIFFERS'})"
                for m in args.methods
            )
            print(f"{task} B={slots} ({count} requests): {summary}", flush=True)
    settings = {key: value for key, value in vars(args).items() if key != "output"}
    payload = {"settings": settings, "results": results}
    if args.output:
        print(f"written to {write_results(args.output, payload)}")


if __name__ == "__main__":
    main()
