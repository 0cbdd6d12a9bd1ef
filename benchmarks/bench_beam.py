"""Speculative beam search (the paper's Appendix A.4) against plain beam search, on two pairs:

- `memory_bound`: the decoder-only pair of `bench_memory_bound.py` (TinyLlama's shape, 1.1B parameters, bfloat16,
  seeded random weights with the deeper layers damped; the drafter is its 1-layer early exit);
- `seq2seq`: a T5 built as `examples/text2text.py` builds its pair (gated-GELU, the deeper decoder layers' output
  projections damped, the drafter is the same model with one decoder layer: an early exit), scaled up to
  d_model 1024, 12 decoder layers and a 32128-token vocabulary in bfloat16, so that a decoder step is memory-bound
  as well. `--quick` uses the example's own tiny pair (d_model 64) instead, where nothing can pay.

For each pair, `num_beams` w in `--beams`, and each (γ, u) in `--configs`: seeded random prompts (token ids; the
encoder's source for T5), every method interleaved per prompt and repeated (`harness.interleaved`), wall times
summarized by medians. Methods:
plain `generate(num_beams=w)`; transformers with `assistant_model` (it drops the assistant under beam search and
runs plain beam search, with a warning: timed to show it); ours. Reported per method: speedup over plain (median of
per-prompt time ratios), beam steps per target forward (`speculative_stats.mean_accepted_length`: the rounds'
steps, the prefill's plain step included), the target forward's mean size in positions against w per plain step,
the drafter's share of the time, and whether `sequences` equal plain beam search's (bfloat16: a forward over
several tokens rounds differently, so a near tie between two beams can flip; the first differing position is
reported). Also measured: the cost of a target forward over k positions (rows x positions) relative to one over w
rows of one position, which is what a round pays for its steps.

Theorem 3.8 does not apply to beam search (the paper leaves its analysis open): a round takes 1 + a steps, where a
is the number of leading depths at which *every* running beam is among the drafter's u beams, and it costs the
drafter's γ beam steps plus one target forward over about (u + dead branches) x (γ + 1) positions. The figure to
compare with is steps per round / (round cost in plain steps), printed as `bound`.

    python benchmarks/bench_beam.py                                # both pairs, w = 2 and 4, 2 threads
    python benchmarks/bench_beam.py --quick --threads 1 --output /tmp/beam_quick.json
    python benchmarks/bench_beam.py [--pairs memory_bound,seq2seq] [--beams 2,4] [--configs 2x1,3x1,2x2,3x2]
        [--prompts 2] [--repeats 1] [--prompt-length 32] [--max-new-tokens 32] [--threads 2]

`--configs` lists γ x (u / w): `3x2` is γ = 3 with u = 2w.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from harness import (  # run from the repository root or benchmarks/
    ForwardCounter,
    interleaved,
    parse_ints,
    timed,
    write_results,
)
from pairs import FULL_PAIR, QUICK_PAIR, random_prompts
from transformers import AutoConfig, AutoModelForSeq2SeqLM, GenerationMixin

import hf_specdec
from hf_specdec.caches import CACHE_KWARG, cache_of
from hf_specdec.toy import build_early_exit_pair

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))  # text2text.py's tiny T5 pair (--quick)

DEFAULT_OUTPUT = Path(__file__).parent / "results" / "beam_cpu_bf16.json"
# as many encoder as decoder layers: transformers 5.23 sizes a T5's decoder cache by `num_layers`
T5_MEMORY_BOUND = dict(
    d_model=1024, d_ff=2816, d_kv=64, num_heads=16, num_layers=12, num_decoder_layers=12, vocab_size=32128
)


def parse_configs(text: str) -> list[tuple[int, int]]:
    """ "2x1,3x2" -> [(γ=2, u/w=1), (γ=3, u/w=2)]."""
    return [tuple(int(part) for part in item.split("x")) for item in text.split(",") if item.strip()]


def build_t5_pair(dtype: torch.dtype, seed: int = 0, **shape):
    """`examples/text2text.py`'s recipe at any size: a T5 target whose deeper decoder layers' output projections are
    damped (x 0.1) and whose other matrices are scaled up (x 4, so that its output varies), and the early exit that
    keeps its encoder, embeddings and first decoder layer."""
    config = AutoConfig.for_model(
        "t5", feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **shape
    )
    torch.manual_seed(seed)
    target = AutoModelForSeq2SeqLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in target.named_parameters():
            if param.dim() != 2 or name == "shared.weight":
                continue
            deep = name.startswith("decoder.block.") and name.split(".")[2] != "0"
            # x 4 everywhere, and x 0.1 more on the deeper decoder layers' output projections
            param.mul_(0.4 if deep and name.endswith((".o.weight", ".wo.weight")) else 4.0)
    drafter_config = copy.deepcopy(config)
    drafter_config.num_decoder_layers = 1
    drafter = AutoModelForSeq2SeqLM.from_config(drafter_config).eval()
    drafter.load_state_dict(target.state_dict(), strict=False)
    for model in (target, drafter):
        model.generation_config.eos_token_id = None  # random weights: run to max_new_tokens, as every method does
    return target.to(dtype), drafter.to(dtype)


def build_pair(name: str, quick: bool, seed: int):
    if name == "memory_bound":
        shape = QUICK_PAIR if quick else FULL_PAIR
        target, drafter = build_early_exit_pair(**shape, head_logit_std=4.0, dtype=torch.bfloat16, seed=seed)
        return target, drafter, {"kind": "llama early exit", **shape, "dtype": "bfloat16"}
    if quick:
        from text2text import build_tiny_pair, train_tokenizer

        target, drafter = build_tiny_pair(train_tokenizer(), seed=seed)
        for model in (target, drafter):
            model.generation_config.eos_token_id = None
        return target, drafter, {"kind": "examples/text2text.py tiny T5 pair", "dtype": "float32"}
    target, drafter = build_t5_pair(torch.bfloat16, seed=seed, **T5_MEMORY_BOUND)
    return target, drafter, {"kind": "T5 early exit (text2text recipe)", **T5_MEMORY_BOUND, "dtype": "bfloat16"}


@torch.no_grad()
def forward_costs(target, prompt: torch.LongTensor, num_beams: int, sizes, repeats: int) -> dict:
    """Median ms of a cached target forward over rows x positions (after the prompt), for each (rows, positions)
    in `sizes`, relative to w rows of one position (a plain beam step)."""
    kwargs = dict(max_new_tokens=1, num_beams=1, return_dict_in_generate=True)
    times = {size: [] for size in [(num_beams, 1), *sizes]}
    for _ in range(repeats + 1):  # the first pass warms up
        for rows, positions in times:
            inputs = prompt.expand(rows, -1)
            out = GenerationMixin.generate(target, inputs, **kwargs)  # a cache of the prompt, per rows
            cache = cache_of(out)
            new = torch.randint(3, target.config.vocab_size, (rows, positions))
            feed = dict(decoder_input_ids=new) if target.config.is_encoder_decoder else dict(input_ids=new)
            if target.config.is_encoder_decoder:
                feed["encoder_outputs"] = target.get_encoder()(inputs)
            elapsed, _ = timed(lambda: target(**feed, **{CACHE_KWARG: cache}, use_cache=True))
            times[rows, positions].append(elapsed)
    ms = {size: 1000 * statistics.median(values[1:]) for size, values in times.items()}
    step = ms[num_beams, 1]
    return {
        "plain_step_ms": step,
        "relative": {f"{rows}x{positions}": ms[rows, positions] / step for rows, positions in sizes},
    }


def first_difference(plain: torch.LongTensor, ours: torch.LongTensor) -> int | None:
    if plain.shape == ours.shape and torch.equal(plain, ours):
        return None
    width = min(plain.shape[1], ours.shape[1])
    different = (plain[:, :width] != ours[:, :width]).any(dim=0).nonzero()
    return int(different[0]) if len(different) else width


def run_pair(name: str, args, results: dict, save) -> None:
    """Runs one pair into `results`; `save()` after each beam width (a partial run keeps what it measured)."""
    start = time.perf_counter()
    target, drafter, description = build_pair(name, args.quick, args.seed)
    target = hf_specdec.enable(target)
    counter = ForwardCounter(target)
    description["build_s"] = time.perf_counter() - start
    description["target_parameters"] = sum(p.numel() for p in target.parameters())
    description["drafter_parameters"] = sum(p.numel() for p in drafter.parameters())
    print(
        f"[{name}] built in {description['build_s']:.1f} s: {description['target_parameters'] / 1e6:.0f}M parameters",
        flush=True,
    )
    prompts = random_prompts(args.prompts, args.prompt_length, target.config.vocab_size, seed=args.seed, low=3)
    results.update(pair=description, beams={})
    for num_beams in args.beams:
        base = dict(
            num_beams=num_beams,
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
        )
        methods = {"plain": dict(), "transformers (assistant dropped)": dict(assistant_model=drafter)}
        for gamma, ratio in args.configs:
            methods[f"ours γ={gamma} u={ratio * num_beams}"] = dict(
                assistant_model=drafter, speculative_gamma=gamma, speculative_draft_beams=ratio * num_beams
            )
        seconds = {method: [[] for _ in prompts] for method in methods}
        records = {method: [None] * len(prompts) for method in methods}

        def record(run):
            seconds[run.name][run.index].append(run.seconds)
            stats = getattr(run.output, "speculative_stats", None)
            records[run.name][run.index] = {
                "sequences": run.output.sequences,
                "target_calls": counter.take(),
                "steps_per_call": stats.mean_accepted_length if stats else 1.0,
                "forward_positions": (
                    statistics.mean(stats.target_forward_tokens[1:])
                    if stats and len(stats.target_forward_tokens) > 1
                    else num_beams
                ),
                "draft_share": stats.draft_time_s / run.seconds if stats else 0.0,
                "beam_steps_history": stats.beam_steps_history if stats else None,
            }

        def method_for(extra, generate):
            return lambda prompt: generate(target, prompt, **base, **extra)

        runs = {
            method: method_for(
                extra, GenerationMixin.generate if method.startswith("transformers") else type(target).generate
            )
            for method, extra in methods.items()
        }
        for run in runs.values():  # warm-up, on the first prompt
            run(prompts[0])
        counter.take()
        interleaved(runs, args.repeats, warmup=0, inputs=prompts, on_run=record)
        summary = {}
        plain_median = [statistics.median(times) for times in seconds["plain"]]
        for method in methods:
            medians = [statistics.median(times) for times in seconds[method]]
            rows = records[method]
            summary[method] = {
                "median_s_per_prompt": medians,
                "speedup": statistics.median(p / m for p, m in zip(plain_median, medians)),
                "total_speedup": sum(plain_median) / sum(medians),
                "steps_per_target_call": statistics.mean(r["steps_per_call"] for r in rows),
                "target_calls": [r["target_calls"] for r in rows],
                "mean_forward_positions": statistics.mean(r["forward_positions"] for r in rows),
                "draft_time_share": statistics.mean(r["draft_share"] for r in rows),
                "identical_to_plain": [
                    first_difference(records["plain"][i]["sequences"], r["sequences"]) is None
                    for i, r in enumerate(rows)
                ],
                "first_differing_position": [
                    first_difference(records["plain"][i]["sequences"], r["sequences"]) for i, r in enumerate(rows)
                ],
                "beam_steps_history": [r["beam_steps_history"] for r in rows],
            }
        # what a round costs: a forward over its rows x positions, against a plain step over w rows x 1
        sizes = sorted(
            {
                (max(1, round(summary[m]["mean_forward_positions"] / (gamma + 1))), gamma + 1)
                for m, (gamma, _) in zip(list(methods)[2:], args.configs)
            }
        )
        costs = forward_costs(target, prompts[0], num_beams, sizes, args.cost_repeats)
        for method, (gamma, _) in zip(list(methods)[2:], args.configs):
            entry = summary[method]
            rows_per_round = max(1, round(entry["mean_forward_positions"] / (gamma + 1)))
            relative = costs["relative"][f"{rows_per_round}x{gamma + 1}"]
            entry["round_forward_cost_in_plain_steps"] = relative
            # steps per round over what a round costs in plain steps (forward + drafter), measured parts only
            draft = entry["draft_time_share"] * statistics.mean(entry["median_s_per_prompt"])
            plain_step_s = statistics.mean(plain_median) / args.max_new_tokens
            rounds = statistics.mean(len(h) for h in entry["beam_steps_history"])
            entry["bound"] = entry["steps_per_target_call"] / (relative + draft / rounds / plain_step_s)
        for method, entry in summary.items():
            print(
                f"[{name}] w={num_beams} {method:>34}: {entry['speedup']:.2f}x plain, "
                f"{entry['steps_per_target_call']:.2f} steps/call, {entry['mean_forward_positions']:.0f} positions"
                f"/forward, identical {entry['identical_to_plain']}"
                + (f", bound {entry['bound']:.2f}x" if "bound" in entry else ""),
                flush=True,
            )
        results["beams"][num_beams] = {"costs": costs, "methods": summary}
        save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small pairs and few tokens: a smoke test")
    parser.add_argument("--pairs", default="memory_bound,seq2seq")
    parser.add_argument("--beams", type=parse_ints, default="2,4")
    parser.add_argument("--configs", type=parse_configs, default="2x1,3x1,2x2", help="γ x (u / w), comma-separated")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--cost-repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {
        "benchmark": "beam",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "environment": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
        },
        "pairs": {},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)

    def save():
        write_results(args.output, results)

    for name in args.pairs.split(","):
        run_pair(name, args, results["pairs"].setdefault(name, {}), save)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
