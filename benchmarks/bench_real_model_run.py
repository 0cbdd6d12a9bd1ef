"""The measuring half of `bench_real_model.py` (see its docstring): every method on every held-out prompt,
interleaved (the order rotates each repeat), medians per prompt, then the geometric mean of speedups per kind."""

from __future__ import annotations

import json
import math
import platform
import statistics
import time

import torch
from real_model_prompts import EVAL_PROMPTS


def _methods(target, args):
    from bench_real_model import early_exit
    from transformers import AutoModelForCausalLM

    import hf_specdec

    eagle = hf_specdec.EagleDrafter.from_pretrained(args.train_dir / "eagle", target=target)
    distilled = AutoModelForCausalLM.from_pretrained(args.train_dir / "distilled", dtype=target.dtype).eval()
    exit_model = early_exit(target)
    # transformers' assisted generation with the same drafter, its constant schedule and no confidence stop
    hf_distilled = AutoModelForCausalLM.from_pretrained(args.train_dir / "distilled", dtype=target.dtype).eval()
    hf_distilled.generation_config.num_assistant_tokens_schedule = "constant"
    hf_distilled.generation_config.assistant_confidence_threshold = 0.0
    hf_distilled.generation_config.num_assistant_tokens = 5
    return {
        "plain": {},
        "transformers prompt lookup": {"prompt_lookup_num_tokens": 10},
        "ours prompt lookup": {"drafter": "prompt_lookup"},  # γ = 10, the drafter's default since stop 33
        "ours prompt lookup, γ = 5": {"drafter": "prompt_lookup", "speculative_gamma": 5},  # the default before
        "EAGLE head, chain": {"drafter": eagle},
        f"EAGLE head, tree {args.tree_budget}": {"drafter": eagle, "speculative_tree_budget": args.tree_budget},
        "distilled 1-layer": {"assistant_model": distilled},
        "transformers assisted, distilled 1-layer": {"assistant_model": hf_distilled, "hf": True},
        "early exit 6/30 (untrained), defaults": {"assistant_model": exit_model},
    }


def _generate(target, ids, method: dict, max_new_tokens: int, sample: bool):
    kwargs = {key: value for key, value in method.items() if key != "hf"}
    generation = dict(
        max_new_tokens=max_new_tokens, do_sample=sample, pad_token_id=target.generation_config.eos_token_id
    )
    if sample:
        generation.update(temperature=0.7, top_k=0, top_p=1.0)
    if method.get("hf"):
        # transformers' own assisted generation, bypassing hf_specdec's mixin
        from transformers import GenerationMixin

        start = time.perf_counter()
        out = GenerationMixin.generate(target, ids, **generation, **kwargs)
        return out, time.perf_counter() - start, None
    start = time.perf_counter()
    if kwargs.get("drafter") is not None or "assistant_model" in kwargs:
        out = target.generate(ids, return_dict_in_generate=True, **generation, **kwargs)
        elapsed = time.perf_counter() - start
        return out.sequences, elapsed, out.speculative_stats
    out = target.generate(ids, **generation, **kwargs)
    return out, time.perf_counter() - start, None


def _cost_curve(target, args) -> dict:
    """The target's cached forwards over k causal tokens and over trees of k - 1 nodes, in one-token forwards, at a
    context of 200 (`bench_memory_bound.cost_curves`): what tree budgets and γ must be chosen from."""
    from bench_memory_bound import cost_curves
    from bench_real_model import early_exit

    sizes = sorted({1, 2, 3, 4, 6, 9, args.tree_budget + 1, 17})
    costs = cost_curves(target, early_exit(target), 200, sizes, [args.tree_budget + 1, 17], [1], repeats=7)
    return {key: costs[key] for key in ("target_step_ms", "v_causal", "v_tree_mask")}


def run_benchmark(target, tokenizer, args):
    from bench_memory_bound import divergence

    import hf_specdec

    dtype = getattr(torch, getattr(args, "dtype", "float32"))
    target = hf_specdec.enable(target.to(dtype))
    methods = _methods(target, args)
    names = list(methods)
    results = {
        "device": f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads, {dtype}",
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "rows": [],
    }
    results["cost_curve"] = _cost_curve(target, args)
    print("cost curve (one-token forwards):", json.dumps(results["cost_curve"]), flush=True)
    training = {}
    for name in ("eagle", "distilled"):
        for file in ("training_log.json", "timing.json", "distill_log.json"):
            path = args.train_dir / name / file
            if path.exists():
                record = json.loads(path.read_text())
                training[f"{name}/{file}"] = record.get("info", {k: v for k, v in record.items() if k != "log"})
    results["training"] = training
    for sample in (False, True):
        kinds = {kind: prompts[: args.prompts_per_kind] for kind, prompts in EVAL_PROMPTS.items()}
        if sample:
            kinds = {"open": EVAL_PROMPTS["open"][: args.sampled_prompts]}
        chosen = names if not sample else [n for n in names if "transformers" not in n and "early" not in n]
        for kind, prompts in kinds.items():
            for text in prompts:
                ids = tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}],
                    add_generation_prompt=True,
                    return_tensors="pt",
                    return_dict=True,
                )["input_ids"]
                times = {name: [] for name in chosen}
                rates = {name: [] for name in chosen}  # new tokens per second, each repeat (samples differ in length)
                outputs, stats = {}, {}
                _generate(target, ids, methods["plain"], 8, sample)  # warm-up
                for repeat in range(args.repeats):
                    order = chosen[repeat % len(chosen) :] + chosen[: repeat % len(chosen)]
                    for name in order:
                        torch.manual_seed(repeat)
                        out, elapsed, stat = _generate(target, ids, methods[name], args.max_new_tokens, sample)
                        times[name].append(elapsed)
                        rates[name].append((out.shape[1] - ids.shape[1]) / elapsed)
                        outputs.setdefault(name, out)
                        if stat is not None:
                            stats[name] = stat
                plain_s = statistics.median(times["plain"])
                for name in chosen:
                    # the median tokens per second against plain's: outputs that diverge (bfloat16 near ties, or
                    # samples) may differ in length, and a time ratio would count a shorter answer as a faster one
                    row = {
                        "sampling": sample,
                        "kind": kind,
                        "prompt": text[:60],
                        "method": name,
                        "median_s": statistics.median(times[name]),
                        "speedup": statistics.median(rates[name]) / statistics.median(rates["plain"]),
                        "time_ratio": plain_s / statistics.median(times[name]),
                        "new_tokens": outputs[name].shape[1] - ids.shape[1],
                    }
                    if not sample:
                        plain = outputs["plain"]
                        row["identical_to_plain"] = bool(
                            outputs[name].shape == plain.shape and torch.equal(outputs[name], plain)
                        )
                        if not row["identical_to_plain"]:
                            width = min(outputs[name].shape[1], plain.shape[1])
                            row["divergence"] = divergence(
                                target, ids[0], plain[0, ids.shape[1] : width], outputs[name][0, ids.shape[1] : width]
                            )
                    if name in stats:
                        row["tokens_per_call"] = stats[name].emitted_tokens / max(stats[name].target_calls, 1)
                        row["acceptance"] = stats[name].accepted_tokens / max(stats[name].drafted_tokens, 1)
                    results["rows"].append(row)
                    print(json.dumps(row), flush=True)
    summarize(results)
    if args.output is not None:
        args.output.write_text(json.dumps(results, indent=1) + "\n")


def summarize(results: dict) -> None:
    """Adds `summary` to `results` (the geometric mean of the rows' speedups and the mean tokens per call, per mode,
    kind and method) and prints it as a table."""
    summary = {}
    for row in results["rows"]:
        key = (("T=0.7" if row["sampling"] else "greedy"), row["kind"], row["method"])
        summary.setdefault(key, []).append(row)
    table = []
    for (mode, kind, method), rows in summary.items():
        entry = {
            "mode": mode,
            "kind": kind,
            "method": method,
            "prompts": len(rows),
            "speedup_geomean": math.exp(sum(math.log(r["speedup"]) for r in rows) / len(rows)),
        }
        calls = [r["tokens_per_call"] for r in rows if "tokens_per_call" in r]
        if calls:
            entry["tokens_per_call_mean"] = sum(calls) / len(calls)
        if mode == "greedy":
            entry["identical"] = f"{sum(r['identical_to_plain'] for r in rows)}/{len(rows)}"
        table.append(entry)
    results["summary"] = table
    print(f"\n{'mode':7} {'kind':10} {'method':44} {'speedup':>8} {'tok/call':>8} identical")
    for entry in table:
        print(
            f"{entry['mode']:7} {entry['kind']:10} {entry['method']:44} {entry['speedup_geomean']:8.2f} "
            f"{entry.get('tokens_per_call_mean', float('nan')):8.2f} {entry.get('identical', '')}"
        )
