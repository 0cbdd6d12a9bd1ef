"""The GPU benchmark: real model shapes in bfloat16 on one accelerator, ours against plain and transformers' decoding.

Two pairs, built from configs with seeded random weights (no download):

- `8b`: a Llama-3.1-8B-shaped target (hidden 4096, 32 layers, intermediate 14336, 32 heads, 8 KV heads, vocab 128256,
  untied head, rope θ 500000), initialized directly on the device, with two drafters:
  - `early_exit`, the target's own first layer (copies of its embedding, layer 0, final norm and head: 1.3B
    parameters, 1.05B of them the embedding and head). It agrees with the target by construction, as in
    `hf_specdec.toy.build_early_exit_pair`: the deeper layers' (1..31) `o_proj` and `down_proj` are scaled by 0.05,
    so the target's next token depends mostly on the embedding -> layer 0 -> head path that the drafter computes
    too; the head is then rescaled so that the target's logits have standard deviation 4 (peaked next-token
    distributions, as a trained model's). α is measured and reported, not set (the 1.1B pair built the same way
    measures about 0.5 on the CPU).
  - `1b`: a Llama-3.2-1B-shaped drafter (hidden 2048, 16 layers, intermediate 8192, 32 heads, 8 KV heads, vocab
    128256, tied embeddings), seeded independently. Random models of different shapes never agree (α ≈ 0): it
    measures the drafter cost c of a real 8B/1B pairing and shows the default policy stopping to draft when drafts
    do not pay. `theorem_3_8_if_1b_agreed_like_early_exit` prices the 1B's c at the early exit's α.
- `1.1b`: the memory-bound pair of `bench_memory_bound.py` (TinyLlama's shape, its 1-layer early exit as drafter),
  built by the same call (`build_early_exit_pair(**pairs.FULL_PAIR, head_logit_std=4.0)`, on the host) and moved to
  the device.

For each pair and batch size (`--batches`; prompts of mixed lengths, left-padded, from `pairs.padded_prompts`),
greedy, the methods are interleaved and repeated (`harness.interleaved`), summarized by medians:

- `plain`: `GenerationMixin.generate`;
- `plain_compiled`: the same with `cache_implementation="static"` and a `CompileConfig` (the reference for the
  compiled row: what a speed-minded user runs without a drafter);
- `transformers` (batch 1 only: transformers' assisted generation refuses batches): `GenerationMixin.generate` with
  the early exit as assistant, constant `num_assistant_tokens` = `--gamma`;
- `ours`: `generate(assistant_model=early_exit)` with our defaults;
- `ours_tree` (batch 1 only: token trees are verified one sequence at a time): the same with
  `speculative_tree_budget=--tree-budget`;
- `ours_compiled`: the defaults with `cache_implementation="static"` and the `CompileConfig` (`mode=
  "reduce-overhead"` on a GPU: CUDA graphs); at batch 1 the drafter keeps its own static cache
  (`ModelDrafter(cache_implementation="static")`), so its step is compiled and captured too. In a batch, hf_specdec
  decodes static caches one row at a time (exact, without the batching speedup): measured as it is;
- `ours_constant_<γ>` (`--constant-gammas`, default 1, 2, 3): the first drafter at a constant γ, what the default
  policy's choice of γ (and of when to draft at all) is measured against;
- `ours_1b` (8b pair): our defaults with the 1B drafter.

A method whose first call raises is reported under the group's `failed` (the error) and left out of the timings.
Reported per method: median seconds and speedup over `plain` (compiled rows also over `plain_compiled`), new tokens per
target call (all rows' tokens over target forwards: plain decoding's is the batch size; forwards from
`speculative_stats`, a forward hook for transformers, one per token for plain), ours' mean accepted length, α, host
reads per target call (`HostReads` outside the models' forwards), ms per round split into drafter, verify and the rest
(from `speculative_stats`' host timers), how many output rows equal plain greedy's (bfloat16 near ties may flip a token:
reported, never asserted), the compile time of the first call, and Theorem 3.8 (`hf_specdec.theory.expected_speedup`)
from the row's α, its drafter's c and its γ (the mean γ of its drafting rounds), and at the best γ for that α and c
(a chain's bound, v = 1 assumed; a tree may pass it).
Costs, measured per pair and batch size: one cached target forward over 1, γ + 1 and tree-budget + 1 new tokens,
each drafter's over 1 token, c = drafter / target per token and v = (γ + 1 tokens) / (1 token).

cuDNN's attention (torch's default for bfloat16 attention on Hopper GPUs: torch 2.11, cuDNN 9.19) sets itself up anew
for each new pair of query and key lengths: on one H200 an 8B-shaped forward at a length not seen before took 55 ms,
22 ms once set up (with `TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1` too). Plain decoding meets a new length per token in a
first call; repeats of one prompt then find its lengths set up, while speculation's verify forwards meet many more
pairs (stalls of 30-40 ms). Our calls therefore run with cuDNN's attention off by default
(`speculative_cudnn_attention=False`); plain decoding keeps torch's default. `--cudnn-rows` adds each eager row of ours
again with `speculative_cudnn_attention=True`, as `<name>_cudnn` (what our rows measured before that default).
`--no-cudnn-attention` runs every method, plain too, with cuDNN's attention off
(`torch.backends.cuda.enable_cudnn_sdp(False)`: flash or memory-efficient attention), into
`*_no_cudnn_attention.json`. `--methods` runs plain and the named methods only (the rest are listed as skipped). Each
drafting row records its first timed call's `gamma_history`.

Compiling an 8B graph takes tens of seconds per shape; to keep the whole run within ~8 minutes on one GPU, the
compiled rows run only in the (pair, batch) groups that start within `--compile-before-s` seconds (batch 1 first, then
batch 8, each for both pairs); the JSON lists what was skipped. Results go to
`benchmarks/results/gpu_<pair>_<device>.json`, rewritten after each group.

`--smoke` runs every method on tiny shapes in float32 on the CPU (the compiled rows with dynamo's tracing-only "eager"
backend: the same graphs and guards, no code generation), one repeat, into a temporary folder: the test suite runs it
so that this script cannot rot. Its timings mean nothing.

    python benchmarks/bench_gpu.py                   # on a GPU: both pairs, batches 1 and 8
    python benchmarks/bench_gpu.py --smoke           # tiny shapes on the CPU
    python benchmarks/bench_gpu.py [--pairs 8b,1.1b] [--batches 1,8] [--repeats 5] [--max-new-tokens 128]
        [--gamma 5] [--tree-budget 8] [--compile-before-s 240] [--device cuda] [--output-dir benchmarks/results]
        [--constant-gammas 1,2,3] [--no-cudnn-attention] [--cudnn-rows] [--methods ours,ours_tree]
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from harness import (  # run from the repository root or benchmarks/
    ForwardCounter,
    HostReads,
    assistant_with_gamma,
    cached_forward_ms,
    interleaved,
    summarize,
    synchronize,
    timed,
    write_results,
)
from pairs import FULL_PAIR, PAD, padded_prompts
from transformers import AutoConfig, AutoModelForCausalLM, CompileConfig, GenerationMixin

import hf_specdec
from hf_specdec.theory import expected_speedup, optimal_gamma
from hf_specdec.toy import build_early_exit_pair

RESULTS = Path(__file__).parent / "results"
LLAMA_3_1_8B = dict(
    num_layers=32,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
)
LLAMA_3_2_1B = dict(
    num_hidden_layers=16,
    hidden_size=2048,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=True,
)
ROPE_THETA = 500000.0
HEAD_LOGIT_STD = 4.0
# --smoke: the same constructions at tiny sizes (a shared vocabulary, so the 1B stand-in can draft for the target)
SMOKE_8B = dict(
    num_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256
)
SMOKE_1B = dict(
    num_hidden_layers=2,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    tie_word_embeddings=True,
)
SMOKE_1_1B = dict(
    num_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256
)
SMOKE_DEFAULTS = dict(repeats=1, max_new_tokens=16, cost_repeats=2)
PAIRS = ("8b", "1.1b")


@dataclass
class Pair:
    target: torch.nn.Module
    drafters: dict[
        str, torch.nn.Module
    ]  # the first one drafts for `transformers`, `ours`, `ours_tree`, `ours_compiled`
    construction: dict


@dataclass
class Method:
    run: Callable[[], object]
    drafter: str | None = None  # whose c prices the row's Theorem 3.8 bound; None: no drafter (plain decoding)
    compiled: bool = False


def set_rope_theta(model, theta: float) -> None:
    """Rebuilds a Llama's rotary embedding with base `theta` (on the current default device)."""
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_theta": theta}
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config).to(model.device)


@torch.no_grad()
def scale_head_to_logit_std(target, drafters, std: float, seed: int) -> float:
    """Rescales the heads of `target` and of the drafters sharing it so that the target's logits over seeded random
    tokens have standard deviation `std` (what `build_early_exit_pair(head_logit_std=...)` does before copying the
    head, done here after it so that the probe runs on the device). Returns the factor applied."""
    probe = torch.randint(
        0, target.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(seed), device="cpu"
    )
    factor = std / float(target(probe.to(target.device), use_cache=False).logits.float().std())
    for model in (target, *drafters):
        model.lm_head.weight.mul_(factor)
    return factor


def build_8b(smoke: bool, dtype: torch.dtype, device: torch.device, seed: int) -> Pair:
    shape, small_shape = (SMOKE_8B, SMOKE_1B) if smoke else (LLAMA_3_1_8B, LLAMA_3_2_1B)
    with torch.device(device):  # the weights are initialized on the device: no 16 GB pass through the host
        target, early_exit = build_early_exit_pair(**shape, dtype=dtype, seed=seed)
        for model in (target, early_exit):
            set_rope_theta(model, ROPE_THETA)
        head_scale = scale_head_to_logit_std(target, [early_exit], HEAD_LOGIT_STD, seed)
        config = AutoConfig.for_model(
            "llama",
            **small_shape,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        torch.manual_seed(seed + 1)
        small = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    for model in (target, early_exit, small):
        model.generation_config.eos_token_id = model.generation_config.bos_token_id = None
        model.generation_config.pad_token_id = None
    construction = {
        "target": {**shape, "rope_theta": ROPE_THETA, "tie_word_embeddings": False},
        "drafters": {
            "early_exit": "the target's embedding, layer 0, final norm and head",
            "1b": {**small_shape, "rope_theta": ROPE_THETA, "seed": seed + 1},
        },
        "deep_layer_scale": 0.05,
        "head_logit_std": HEAD_LOGIT_STD,
        "head_scale": head_scale,
    }
    return Pair(hf_specdec.enable(target), {"early_exit": early_exit, "1b": small}, construction)


def build_1_1b(smoke: bool, dtype: torch.dtype, device: torch.device, seed: int) -> Pair:
    shape = SMOKE_1_1B if smoke else FULL_PAIR
    # on the host, as bench_memory_bound builds it (its head calibration probes on the host): the same weights
    target, early_exit = build_early_exit_pair(**shape, head_logit_std=HEAD_LOGIT_STD, dtype=dtype, seed=seed)
    construction = {
        "target": shape,
        "drafters": {"early_exit": "the target's embedding, layer 0, final norm and head"},
        "deep_layer_scale": 0.05,
        "head_logit_std": HEAD_LOGIT_STD,
    }
    return Pair(hf_specdec.enable(target.to(device)), {"early_exit": early_exit.to(device)}, construction)


BUILDERS = {"8b": build_8b, "1.1b": build_1_1b}


def compile_config(device: torch.device, smoke: bool) -> CompileConfig:
    if device.type == "cuda":
        return CompileConfig(fullgraph=True, mode="reduce-overhead")  # CUDA graphs
    # tracing only on the CPU smoke run (inductor's code generation would take minutes); transformers compiles on
    # the CPU only when the config asks for every device
    config = CompileConfig(fullgraph=True, backend="eager", mode=None) if smoke else CompileConfig(mode="default")
    config._compile_all_devices = True
    return config


def methods_for(pair: Pair, ids, mask, batch: int, compiled: bool, args) -> tuple[dict[str, Method], dict[str, str]]:
    """The group's methods, and the ones left out with the reason."""
    target = pair.target
    first = next(iter(pair.drafters))
    drafter = pair.drafters[first]
    common = dict(
        attention_mask=mask,
        max_new_tokens=args.max_new_tokens,
        do_sample=False,
        pad_token_id=PAD,
        return_dict_in_generate=True,
    )
    static = dict(cache_implementation="static", compile_config=compile_config(args.device, args.smoke))
    assistant = assistant_with_gamma(drafter, args.gamma)
    tree = dict(speculative_tree_budget=args.tree_budget)

    # one sequence: the drafter's own static cache (kept by the `ModelDrafter` from call to call), whose step is
    # compiled too (CUDA graphs on a GPU); a batch: the dynamic draft cache (a static draft cache holds one sequence)
    static_drafter = hf_specdec.ModelDrafter(drafter, cache_implementation="static")

    def compiled_drafting() -> dict:
        return dict(drafter=static_drafter) if batch == 1 else dict(assistant_model=drafter)

    def ours_methods(extra: dict, suffix: str) -> dict[str, Method]:
        """Our rows, each call also given `extra`, named with `suffix`."""
        ours = {**common, **extra}
        rows = {
            "ours": Method(lambda: target.generate(ids, assistant_model=drafter, **ours), first),
            "ours_tree": Method(lambda: target.generate(ids, assistant_model=drafter, **tree, **ours), first),
            "ours_compiled": Method(lambda: target.generate(ids, **compiled_drafting(), **ours, **static), first, True),
        }
        for gamma in args.constant_gammas:  # what the default policy's choice is measured against
            rows[f"ours_constant_{gamma}"] = Method(
                lambda gamma=gamma: target.generate(
                    ids, assistant_model=drafter, speculative_gamma=gamma, speculative_gamma_policy="constant", **ours
                ),
                first,
            )
        for name, other in list(pair.drafters.items())[1:]:
            rows[f"ours_{name}"] = Method(lambda other=other: target.generate(ids, assistant_model=other, **ours), name)
        return {f"{name}{suffix}": method for name, method in rows.items()}

    methods = {
        "plain": Method(lambda: GenerationMixin.generate(target, ids, **common)),
        "plain_compiled": Method(lambda: GenerationMixin.generate(target, ids, **common, **static), None, True),
        "transformers": Method(
            lambda: GenerationMixin.generate(target, ids, assistant_model=assistant, **common), first
        ),
        **ours_methods({}, ""),
    }
    if args.cudnn_rows:  # our eager rows again, letting torch pick cuDNN's attention as plain decoding does
        cudnn = ours_methods({"speculative_cudnn_attention": True}, "_cudnn")
        methods.update({name: method for name, method in cudnn.items() if not method.compiled})
    skipped = {}
    if batch > 1:
        skipped["transformers"] = "transformers' assisted generation refuses batches larger than one"
        skipped["ours_tree"] = "hf_specdec verifies token trees one sequence at a time (it refuses batches)"
    if not compiled:
        skipped.update(
            {name: "the group started after --compile-before-s" for name, m in methods.items() if m.compiled}
        )
    if args.methods is not None:
        unknown = sorted(set(args.methods) - set(methods))
        if unknown:
            raise ValueError(f"--methods: unknown method(s) {unknown}; known: {sorted(methods)}")
        skipped.update({name: "not in --methods" for name in methods if name != "plain" and name not in args.methods})
    return {name: m for name, m in methods.items() if name not in skipped}, skipped


def costs(pair: Pair, batch: int, context: int, args) -> dict:
    """Cached forwards at about the mid-generation context: the target over 1, γ + 1 and tree + 1 new tokens, each
    drafter over 1; c and v from them."""
    sizes = sorted({1, args.gamma + 1, args.tree_budget + 1})
    target_ms = {k: cached_forward_ms(pair.target, batch, context, k, args.cost_repeats) for k in sizes}
    drafter_ms = {
        name: cached_forward_ms(model, batch, context, 1, args.cost_repeats) for name, model in pair.drafters.items()
    }
    return {
        "context": context,
        "target_ms": target_ms,
        "v": {k: ms / target_ms[1] for k, ms in target_ms.items()},
        "drafter_ms": drafter_ms,
        "c": {name: ms / target_ms[1] for name, ms in drafter_ms.items()},
    }


def bound(alpha: float | None, gamma: int | None, c: float) -> dict:
    """Theorem 3.8 at the row's γ and at the best γ for its α and c (v = 1 assumed)."""
    if alpha is None:
        return {"theorem_3_8": None, "theorem_3_8_best": None, "best_gamma": None}
    best = optimal_gamma(alpha, c)
    return {
        "theorem_3_8": None if gamma is None else expected_speedup(alpha, gamma, c),
        "theorem_3_8_best": expected_speedup(alpha, best, c),
        "best_gamma": best,
    }


def rows_equal(out, reference) -> int:
    return int((out.sequences == reference.sequences).all(dim=-1).sum())


def run_group(pair: Pair, batch: int, compiled: bool, args) -> dict:
    device = args.device
    ids, mask = padded_prompts(batch, pair.target.config.vocab_size, seed=batch)
    ids, mask = ids.to(device), mask.to(device)
    methods, skipped = methods_for(pair, ids, mask, batch, compiled, args)
    models = [pair.target, *pair.drafters.values()]
    if compiled:
        torch._dynamo.reset()  # graphs of the previous group's shapes would count against the recompile limit

    def synchronized(method: Method):
        def run():
            out = method.run()
            synchronize(device)
            return out

        return run

    rows, outputs, failed = {}, {}, {}
    for name, method in list(methods.items()):  # first calls: compilation and capability probes, timed on their own
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        try:
            first_s, _ = timed(synchronized(method))
        except Exception as error:  # reported in the results, the other methods still measured
            if name == "plain":
                raise
            failed[name] = f"{type(error).__name__}: {error}"[:2000]
            print(f"  {name}: FAILED {failed[name][:300]}", flush=True)
            del methods[name]
            continue
        rows[name] = {
            "first_call_s": first_s,
            "graphs_compiled": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
        }
        counter = ForwardCounter(pair.target)
        try:
            with HostReads(outside_of=models) as reads:  # a warm call, counted
                out = synchronized(method)()
        finally:
            counter.close()
        stats = getattr(out, "speculative_stats", None)
        if stats is not None:
            forwards, accepted_length = stats.target_calls, stats.mean_accepted_length
        elif method.drafter is None:  # plain decoding: one forward per new token, the prefill's included
            forwards, accepted_length = args.max_new_tokens, 1.0
        else:  # transformers' assisted generation runs eagerly: the hook sees every forward
            forwards, accepted_length = counter.count, args.max_new_tokens / counter.count
        outputs[name] = out
        rows[name].update(
            target_calls=forwards,
            tokens_per_target_call=batch * args.max_new_tokens / forwards,
            mean_accepted_length=accepted_length,
            alpha=None if stats is None else stats.alpha,
            host_reads_per_target_call=reads.count / forwards,
        )
        print(f"  {name}: first call {first_s:.1f} s", flush=True)

    timed_stats = {name: [] for name in methods}

    def record(run):
        stats = getattr(run.output, "speculative_stats", None)
        if stats is not None:
            timed_stats[run.name].append(stats)

    runs = {name: method.run for name, method in methods.items()}
    seconds = interleaved(runs, args.repeats, warmup=0, device=device, on_run=record)
    group_costs = costs(pair, batch, int(ids.shape[1]) + args.max_new_tokens // 2, args)
    alpha_of_drafter = {}  # ours' α with each drafter, for the transformers row (transformers does not measure it)
    for name, method in methods.items():
        if method.drafter is not None and rows[name]["alpha"] is not None:
            alpha_of_drafter.setdefault(method.drafter, rows[name]["alpha"])
    plain_s = statistics.median(seconds["plain"])
    for name, method in methods.items():
        row = rows[name]
        row["seconds"] = summarize(seconds[name])
        row["speedup"] = plain_s / row["seconds"]["median"]
        if method.compiled and "plain_compiled" in methods:
            row["speedup_over_plain_compiled"] = statistics.median(seconds["plain_compiled"]) / row["seconds"]["median"]
        row["rows_equal_plain"] = rows_equal(outputs[name], outputs["plain"])
        row["equals_plain"] = row["rows_equal_plain"] == batch
        if method.compiled:
            row["rows_equal_plain_compiled"] = rows_equal(outputs[name], outputs["plain_compiled"])
        if timed_stats[name]:
            per_round = [
                (
                    1000 * s.draft_time_s / s.target_calls,
                    1000 * s.verify_time_s / s.target_calls,
                    1000 * t / s.target_calls,
                )
                for s, t in zip(timed_stats[name], seconds[name])
            ]
            draft, verify, total = (statistics.median(column) for column in zip(*per_round))
            row["ms_per_round"] = {"total": total, "draft": draft, "verify": verify, "other": total - draft - verify}
            row["graphs_compiled_while_timed"] = sum(
                s.target_compilations + s.drafter_compilations for s in timed_stats[name]
            )  # 0 unless a timed call recompiled: its median would include compile time
            gammas = [g for g in timed_stats[name][0].gamma_history if g > 0]
            row["mean_gamma"] = statistics.mean(gammas) if gammas else 0.0
            row["gamma_history"] = list(timed_stats[name][0].gamma_history)  # the first timed call's γ per round
        if method.drafter is None:
            continue
        if row["alpha"] is None:  # transformers: constant γ, with ours' α for the same drafter
            row["alpha_from"] = "ours with the same drafter"
            alpha, gamma = alpha_of_drafter.get(method.drafter), args.gamma
        else:
            alpha, gamma = row["alpha"], max(1, round(row["mean_gamma"])) if row["mean_gamma"] else None
        row.update(bound(alpha, gamma, group_costs["c"][method.drafter]))
    group = {
        "batch": batch,
        "prompt_lengths": mask.sum(-1).tolist(),
        "costs": group_costs,
        "methods": rows,
        "skipped": skipped,
        "failed": failed,
    }
    if "1b" in pair.drafters and "early_exit" in alpha_of_drafter:
        group["theorem_3_8_if_1b_agreed_like_early_exit"] = bound(
            alpha_of_drafter["early_exit"], args.gamma, group_costs["c"]["1b"]
        )
    if compiled:
        torch._dynamo.reset()
    return group


def print_group(pair_name: str, group: dict) -> None:
    costs_ = group["costs"]
    print(
        f"\n{pair_name} batch {group['batch']}: target step {costs_['target_ms'][1]:.2f} ms, v "
        + " ".join(f"{k}:{v:.2f}" for k, v in costs_["v"].items())
        + ", c "
        + " ".join(f"{k}:{v:.3f}" for k, v in costs_["c"].items())
    )
    print(
        f"{'method':<16}{'median s':>9}{'speedup':>8}{'tok/call':>9}{'alpha':>7}{'reads/call':>11}"
        f"{'ms/round d+v+o':>20}{'=plain':>8}{'thm3.8':>7}{'best':>6}{'first s':>8}"
    )
    for name, row in group["methods"].items():
        split = row.get("ms_per_round")
        split_text = f"{split['draft']:.1f}+{split['verify']:.1f}+{split['other']:.1f}" if split else ""
        alpha = "" if row["alpha"] is None else f"{row['alpha']:.3f}"
        theorem = "" if row.get("theorem_3_8") is None else f"{row['theorem_3_8']:.2f}"
        best = "" if row.get("theorem_3_8_best") is None else f"{row['theorem_3_8_best']:.2f}"
        print(
            f"{name:<16}{row['seconds']['median']:>9.3f}{row['speedup']:>8.2f}{row['tokens_per_target_call']:>9.2f}"
            f"{alpha:>7}{row['host_reads_per_target_call']:>11.1f}{split_text:>20}"
            f"{row['rows_equal_plain']:>5}/{group['batch']:<2}{theorem:>7}{best:>6}{row['first_call_s']:>8.1f}"
        )


def device_slug(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def parse_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def main(argv=None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=parse_list, default=list(PAIRS), help="comma-separated: 8b, 1.1b")
    parser.add_argument("--batches", type=lambda text: [int(b) for b in parse_list(text)], default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=5, help="transformers' constant γ, and the γ of the bounds")
    parser.add_argument("--tree-budget", type=int, default=8)
    parser.add_argument(
        "--constant-gammas",
        type=lambda text: [int(g) for g in parse_list(text)],
        default=[1, 2, 3],
        help="comma-separated constant γ rows ('' for none)",
    )
    parser.add_argument("--cost-repeats", type=int, default=9, help="repeats of each cost forward")
    parser.add_argument(
        "--compile-before-s",
        type=float,
        default=240.0,
        help="compiled rows only in groups starting within this many seconds (--smoke: no limit)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny float32 shapes on the CPU (checks the script)")
    parser.add_argument("--device", default=None, help="default: cpu with --smoke, else cuda when available")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-cudnn-attention",
        action="store_true",
        help="every method (plain too) without cuDNN's attention (torch.backends.cuda.enable_cudnn_sdp(False)), "
        "which sets itself up anew for each new query and key length; results go to *_no_cudnn_attention.json",
    )
    parser.add_argument(
        "--cudnn-rows",
        action="store_true",
        help="also run each eager row of ours (`ours*`) with `speculative_cudnn_attention=True` (torch's choice of "
        "attention kernels, cuDNN's on Hopper, as plain decoding gets), as `<name>_cudnn`",
    )
    parser.add_argument(
        "--methods",
        type=parse_list,
        default=None,
        help="comma-separated methods to run (plain always runs; default: all); the rest are listed as skipped",
    )
    parser.add_argument(
        "--output-dir", type=Path, default=None, help="default: benchmarks/results; --smoke: a temp dir"
    )
    if parser.parse_known_args(argv)[0].smoke:
        parser.set_defaults(**SMOKE_DEFAULTS, compile_before_s=None)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.pairs) - set(PAIRS))
    if unknown:
        parser.error(f"--pairs: unknown pair(s) {unknown}; known: {list(PAIRS)}")
    if args.device is None:
        args.device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    args.device = torch.device(args.device)
    if args.output_dir is None:
        args.output_dir = Path(tempfile.mkdtemp(prefix="bench_gpu_smoke_")) if args.smoke else RESULTS
    elif args.smoke and args.output_dir.resolve() == RESULTS.resolve():
        parser.error("--smoke writes no results into benchmarks/results: pass another --output-dir")
    threads, cudnn_attention = torch.get_num_threads(), torch.backends.cuda.cudnn_sdp_enabled()
    if args.smoke:
        torch.set_num_threads(1)  # tiny models gain nothing from threads, and the CPU may be shared
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)
        torch.backends.cuda.enable_cudnn_sdp(cudnn_attention)
        torch._dynamo.reset()


def run(args) -> dict[str, dict]:
    dtype = torch.float32 if args.smoke else torch.bfloat16
    start = time.perf_counter()
    pairs, payloads, paths = {}, {}, {}
    for name in args.pairs:
        built_s, pairs[name] = timed(lambda name=name: BUILDERS[name](args.smoke, dtype, args.device, args.seed))
        pair = pairs[name]
        parameters = {
            model_name: sum(p.numel() for p in model.parameters())
            for model_name, model in {"target": pair.target, **pair.drafters}.items()
        }
        print(f"built {name} in {built_s:.1f} s: {parameters} parameters", flush=True)
        payloads[name] = {
            "benchmark": "gpu",
            "pair": name,
            "smoke": args.smoke,
            "dtype": str(dtype).removeprefix("torch."),
            "settings": {k: (str(v) if isinstance(v, (Path, torch.device)) else v) for k, v in vars(args).items()},
            "construction": {**pair.construction, "parameters": parameters, "build_s": built_s},
            "batches": {},
        }
        suffix = "_no_cudnn_attention" if args.no_cudnn_attention else ""
        paths[name] = Path(args.output_dir) / f"gpu_{name}_{device_slug(args.device)}{suffix}.json"
    for batch in args.batches:  # batch 1 of every pair first: the compiled rows go to the earliest groups
        for name, pair in pairs.items():
            compiled = args.compile_before_s is None or time.perf_counter() - start < args.compile_before_s
            print(f"{name} batch {batch}{'' if compiled else ' (compiled rows skipped)'}", flush=True)
            group = run_group(pair, batch, compiled, args)
            payloads[name]["batches"][str(batch)] = group
            payloads[name]["elapsed_s"] = time.perf_counter() - start
            write_results(paths[name], payloads[name])
            print_group(name, group)
    print(f"\n{time.perf_counter() - start:.0f} s in all; wrote " + ", ".join(str(p) for p in paths.values()))
    return payloads


if __name__ == "__main__":
    main()
