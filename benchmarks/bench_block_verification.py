"""Block verification against token-wise verification (`speculative_verification="block"` / `"token"`) when sampling.

The embedded zoo's code model with its distilled 1-layer drafter (`hf_specdec.zoo.load_default`), on the held-out
prompts of `hf_specdec/zoo_models/heldout_prompts.json` (`--tasks`, `--prompts` each), batch 1, constant γ
(`--gammas`), at each temperature of `--temperatures` (no top-k / top-p). Methods, interleaved per prompt and repeated
(`harness.interleaved`): plain `generate`, and ours with each verification at each γ. Every call is seeded the same
way for every method (the prompt's index and the repeat), so that the methods differ by their rule alone.

Reported per temperature, γ and method, over all prompts and repeats: tokens per target call (new tokens over target
forwards, the bonus or recovered token included), the accepted drafts per round, α (the mean β), generated tokens per
second (summed over the prompts, median over repeats) and the speedup over plain in tokens per second (sampled texts
differ in length, so wall-clock time alone would compare different amounts of work); block's gain over token-wise in
tokens per call and in speed. Sampled texts differ between the two rules, so those ratios carry the texts' noise too:
`expected_accepted_block_over_token` compares the rules on the same rounds instead, in an untimed pass that runs each
block row once more per prompt and sums, over its rounds, the expected accepted drafts under each rule given the round's
drafts, q and p (block: sum_i i P(τ = i) from the thresholds h; token-wise: sum_i prod_{j <= i} min(1, p_j / q_j)).

A direct speed ratio of two sampled runs carries a few percent of noise on a shared CPU, more than block's gain in
some rows, so the speed is also taken apart: the two rules' rounds run the same forwards and differ only in the
verification itself, so block's speed over token-wise's is (its tokens per call over token-wise's) / (1 + the time
block's verification adds to a round / token-wise's time per round). `tokens_per_target_call_95` is a 95% bootstrap
interval of the tokens-per-call ratio (calls resampled in (repeat, prompt) pairs, seeded alike for both rules),
`verify_extra_ms` the added time (`verdicts.verify_round` on a sampled chain of the target's vocabulary and γ, both
rules interleaved, medians of 300 calls), `round_ms_token` token-wise's seconds per target call in the timed runs, and
`speed_from_parts` / `speed_from_parts_95` the resulting speed ratio and interval.

With `--eagle-minutes M` (or `--eagle-head DIR`, a head saved in the EAGLE-3 layout) an EAGLE-3 head drafts too,
rows `eagle_token_g<γ>` / `eagle_block_g<γ>`: trained here for M minutes on the zoo corpus's train split as it is
(`hf_specdec.distill.train_eagle_drafter` with `texts=`, no answers generated), and saved, with its training data and
checkpoints, in a folder named after the results file.

With `--gguf FILE` the target is the real model (SmolLM2-135M-Instruct in float32, located as in
`bench_real_model.py`) and only its EAGLE-3 head (`--eagle-head DIR`, required) drafts, on `--prompts` chat prompts of
each kind of `real_model_prompts.EVAL_PROMPTS` (`--tasks` and `--max-prompt-tokens` are the zoo's).

    OMP_NUM_THREADS=1 python benchmarks/bench_block_verification.py --threads 1 --output /tmp/block.json
    python benchmarks/bench_block_verification.py --smoke   # one short prompt, into a temporary folder

`results/block_verification_zoo_eagle_cpu_1thread.json` holds the distilled drafter's rows and an EAGLE-3 head's, a
head trained for 40 minutes on 2 threads (what `--eagle-minutes 40` runs: the whole train split, batches of 4, a 4-step
unroll), then loaded:

    OMP_NUM_THREADS=1 python benchmarks/bench_block_verification.py --threads 1 --prompts 4 --eagle-head DIR \
        --output benchmarks/results/block_verification_zoo_eagle_cpu_1thread.json

`results/block_verification_zoo_g4_parts_cpu_1thread.json`: γ 4 on all 48 held-out prompts with the same head, where
block's gain is smallest:

    OMP_NUM_THREADS=1 python benchmarks/bench_block_verification.py --threads 1 --prompts 16 --gammas 4 --repeats 2 \
        --eagle-head DIR --output benchmarks/results/block_verification_zoo_g4_parts_cpu_1thread.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

import torch
from harness import interleaved, parse_ints, rotated, timed, write_results  # run from the repo root or benchmarks/
from transformers import GenerationMixin

import hf_specdec
from hf_specdec import verdicts, zoo
from hf_specdec.block_verification import block_thresholds
from hf_specdec.configuration import SpeculativeOptions
from hf_specdec.drafters.base import DraftProposal
from hf_specdec.modeling import logits_width
from hf_specdec.zoo.tasks import TASKS, load_prompts

RESULTS = Path(__file__).parent / "results"
VERIFICATIONS = ("token", "block")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--prompts", type=int, default=6, help="prompts per task")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-prompt-tokens", type=int, default=384, help="keep the last N prompt tokens")
    parser.add_argument("--gammas", type=parse_ints, default=[4, 8], help="comma-separated constant γ values")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="results JSON (default: none; --smoke: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="one short prompt per task, one repeat")
    parser.add_argument("--eagle-minutes", type=float, default=0.0, help="train an EAGLE-3 head this long (0: none)")
    parser.add_argument("--eagle-head", type=Path, default=None, help="an EAGLE-3 head to load instead of training")
    parser.add_argument("--eagle-files", type=int, default=None, help="train-split files the head trains on (all)")
    parser.add_argument(
        "--gguf",
        default=None,
        help="the real model's GGUF file (SmolLM2-135M-Instruct): its EAGLE-3 head (--eagle-head) drafts on the "
        "prompts of real_model_prompts.py instead of the zoo pair on the zoo's",
    )
    args = parser.parse_args(argv)
    if args.gguf and args.eagle_head is None:
        parser.error("--gguf needs --eagle-head DIR (an EAGLE-3 head trained for that model; the zoo has none)")
    if args.smoke:
        args.prompts, args.max_new_tokens, args.repeats, args.gammas = 1, 12, 1, [3]
        args.eagle_files = 4
        args.output = args.output or Path(tempfile.mkdtemp(prefix="bench_block_")) / "block.json"
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)


def eagle_head(target, tokenizer, args) -> hf_specdec.EagleDrafter | None:
    """The EAGLE-3 head of `--eagle-head`, or one trained for `--eagle-minutes` on the zoo's train split (saved beside
    the results), or None."""
    if args.eagle_head is not None:
        return hf_specdec.EagleDrafter.from_pretrained(args.eagle_head, target)
    if not args.eagle_minutes:
        return None
    from hf_specdec.distill import train_eagle_drafter
    from hf_specdec.zoo.corpus import load_manifest, read_split

    texts = read_split(load_manifest(zoo.ZOO_DIR / "manifest.json"), "train")[: args.eagle_files]
    output_dir = None if args.output is None else Path(args.output).with_suffix("") / "eagle_head"
    return train_eagle_drafter(
        target,
        texts=texts,
        tokenizer=tokenizer,
        max_minutes=args.eagle_minutes,
        batch_size=4,  # more, smaller steps in a CPU budget: ~4k positions each
        ttt_steps=4,  # the draft steps the rows use (γ 4); a longer unroll costs each step more
        output_dir=output_dir,
        seed=args.seed,
        show_progress=False,
    )


def saved_training(head: Path | None) -> dict:
    """What `train_eagle_drafter` recorded of a loaded head's training (its `training_log.json`), or {}."""
    log = None if head is None else Path(head) / "training_log.json"
    return json.loads(log.read_text()).get("info", {}) if log is not None and log.is_file() else {}


def expected_accepted(tokens, probs, target_probs) -> tuple[float, float]:
    """The expected accepted drafts of one round (summed over its rows) under block and under token-wise
    verification, given its drafts, q (`probs`, None for point masses) and p."""
    h, _ = block_thresholds(tokens, probs, target_probs)  # [batch, gamma]
    # P(τ = i) = h_i prod_{j > i} (1 - h_j): the last passing test is i's
    after = torch.cat([(1 - h).flip(1).cumprod(1).flip(1)[:, 1:], torch.ones_like(h[:, :1])], dim=1)
    positions = torch.arange(1, h.shape[1] + 1, dtype=h.dtype)
    block = (positions * h * after).sum()
    p_x = target_probs[:, : tokens.shape[1]].gather(-1, tokens[..., None]).squeeze(-1)
    q_x = torch.ones_like(p_x) if probs is None else probs.gather(-1, tokens[..., None]).squeeze(-1)
    token = (p_x / q_x).clamp(max=1.0).cumprod(1).sum()
    return float(block), float(token)


def fmt(value) -> str:
    """A printed value: 3 decimals, a list as [a, b]."""
    return "[" + ", ".join(f"{v:.3f}" for v in value) + "]" if isinstance(value, list) else f"{value:.3f}"


def ratio_interval(block: list[tuple[int, int]], token: list[tuple[int, int]], draws: int = 2000) -> tuple:
    """Block's over token-wise verification's tokens per target call, `(ratio, low, high)` with a 95% bootstrap
    interval: the calls (`(emitted tokens, target calls)` each, the same (repeat, prompt) at the same index for both
    rules, seeded alike) resampled in pairs."""

    def ratio(indices) -> float:
        def per_call(calls):
            return sum(calls[i][0] for i in indices) / sum(calls[i][1] for i in indices)

        return per_call(block) / per_call(token)

    generator = random.Random(0)
    count = len(block)
    draws_ = sorted(ratio([generator.randrange(count) for _ in range(count)]) for _ in range(draws))
    return ratio(range(count)), draws_[int(0.025 * draws)], draws_[int(0.975 * draws) - 1]


def verify_extra_seconds(vocab: int, gamma: int, calls: int = 300) -> float:
    """What block verification adds to a round, timed alone: `verdicts.verify_round` on a sampled chain (batch 1,
    `gamma` drafts drawn from q over `vocab`) under "block" minus under "token", the two interleaved, medians of
    `calls` calls each. It is the only work by which the two rules' rounds differ: the forwards are the same."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(1, gamma + 1, vocab, generator=generator) * 3  # a peaked target, as at T <= 1
    probs = (torch.randn(1, gamma, vocab, generator=generator) * 3).softmax(-1)
    proposal = DraftProposal(torch.multinomial(probs[0], 1, generator=generator).T, probs)
    options = {rule: SpeculativeOptions(speculative_verification=rule) for rule in VERIFICATIONS}
    times = {rule: [] for rule in VERIFICATIONS}
    for index in range(calls + 20):
        for rule in rotated(VERIFICATIONS, index):
            seconds, _ = timed(lambda rule=rule: verdicts.verify_round(True, proposal, scores, options[rule]))
            if index >= 20:  # warm-up
                times[rule].append(seconds)
    return statistics.median(times["block"]) - statistics.median(times["token"])


def paired_acceptance(generate, inputs) -> float:
    """Block's over token-wise verification's expected accepted drafts on the rounds `generate` (a block row) runs on
    `inputs`, untimed: each block round is also scored under both rules."""
    totals = [0.0, 0.0]
    original = verdicts.verify_block

    def scored(tokens, probs, target_probs, *args, **kwargs):
        block, token = expected_accepted(tokens, probs, target_probs)
        totals[0], totals[1] = totals[0] + block, totals[1] + token
        return original(tokens, probs, target_probs, *args, **kwargs)

    verdicts.verify_block = scored
    try:
        for ids in inputs:
            generate(ids)
    finally:
        verdicts.verify_block = original
    return totals[0] / totals[1]


def target_and_inputs(args) -> tuple:
    """`(target, zoo drafter or None, tokenizer, inputs)`: the zoo pair on `--prompts` held-out prompts of each of
    `--tasks`, or with `--gguf` the real model (no distilled drafter) on `--prompts` chat prompts of each kind of
    `real_model_prompts.EVAL_PROMPTS`."""
    if args.gguf:
        from pairs import encode, load_target
        from real_model_prompts import EVAL_PROMPTS

        target, tokenizer = load_target(args.gguf)
        texts = [text for prompts in EVAL_PROMPTS.values() for text in prompts[: args.prompts]]
        return target, None, tokenizer, [encode(tokenizer, text) for text in texts]
    target, drafter, tokenizer = zoo.load_default()
    prompts = load_prompts()
    inputs = [
        tokenizer(item["prompt"], return_tensors="pt").input_ids[:, -args.max_prompt_tokens :]
        for task in args.tasks
        for item in prompts[task][: args.prompts]
    ]
    return target, drafter, tokenizer, inputs


def run(args) -> dict:
    target, drafter, tokenizer, inputs = target_and_inputs(args)
    target = hf_specdec.enable(target)
    eagle = eagle_head(target, tokenizer, args)
    drafters = ({"": dict(assistant_model=drafter)} if drafter is not None else {}) | (
        {"eagle_": dict(drafter=eagle)} if eagle is not None else {}
    )
    results = {
        "benchmark": "block_verification",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "threads": torch.get_num_threads(),
        "target": type(target).__name__,
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "drafter_parameters": None if drafter is None else sum(p.numel() for p in drafter.parameters()),
        "eagle_head": None
        if eagle is None
        else {"training": eagle.training_info or saved_training(args.eagle_head), "files": args.eagle_files or "all"},
        "prompt_count": len(inputs),
        "runs": [],
    }
    vocab = logits_width(target)
    extra = {gamma: verify_extra_seconds(vocab, gamma) for gamma in args.gammas}  # seconds block adds to a round
    for temperature in args.temperatures:
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens)
        calls = {}  # method -> its calls so far: every method runs the (repeat, prompt) pairs in the same order

        def seeded(name, generate):
            def call(ids):
                calls[name] = calls.get(name, -1) + 1
                torch.manual_seed(args.seed + calls[name])  # the same seed for every method's n-th call
                return generate(ids)

            return call

        methods = {"plain": seeded("plain", lambda ids: GenerationMixin.generate(target, ids, **sampling))}
        for prefix, drafting in drafters.items():
            for gamma in args.gammas:
                for verification in VERIFICATIONS:
                    kwargs = dict(
                        speculative_gamma=gamma,
                        speculative_gamma_policy="constant",
                        speculative_verification=verification,
                        return_dict_in_generate=True,
                        **drafting,
                        **sampling,
                    )
                    name = f"{prefix}{verification}_g{gamma}"
                    methods[name] = seeded(name, lambda ids, kwargs=kwargs: target.generate(ids, **kwargs))
        tokens = {name: [0] * args.repeats for name in methods}
        stats = {name: [] for name in methods}

        def record(run_):
            output = run_.output
            sequences = output if isinstance(output, torch.Tensor) else output.sequences
            tokens[run_.name][run_.repeat] += sequences.shape[1] - inputs[run_.index].shape[1]
            if not isinstance(output, torch.Tensor):
                stats[run_.name].append(output.speculative_stats)

        seconds = interleaved(methods, args.repeats, warmup=0, inputs=inputs, on_run=record)
        rate = {name: statistics.median(t / s for t, s in zip(tokens[name], seconds[name])) for name in methods}
        rows = {"plain": {"tokens_per_second": rate["plain"], "speedup": 1.0}}
        for name in methods:
            if name == "plain":
                continue
            run_stats = stats[name]
            target_calls = sum(s.target_calls for s in run_stats)
            rounds_drafted = sum(len([d for d in s.drafted_history if d]) for s in run_stats)
            rows[name] = {
                "tokens_per_target_call": sum(s.emitted_tokens for s in run_stats) / target_calls,
                "accepted_per_drafting_round": sum(s.accepted_tokens for s in run_stats) / max(1, rounds_drafted),
                "alpha": statistics.fmean(s.alpha for s in run_stats if s.alpha is not None),
                "tokens_per_second": rate[name],
                "speedup": rate[name] / rate["plain"],
            }
        for prefix in drafters:
            for gamma in args.gammas:
                token, block = rows[f"{prefix}token_g{gamma}"], rows[f"{prefix}block_g{gamma}"]
                per_rule = {  # each call's (emitted tokens, target calls)
                    rule: [(s.emitted_tokens, s.target_calls) for s in stats[f"{prefix}{rule}_g{gamma}"]]
                    for rule in VERIFICATIONS
                }
                per_call, low, high = ratio_interval(per_rule["block"], per_rule["token"])
                round_seconds = sum(seconds[f"{prefix}token_g{gamma}"]) / sum(c for _, c in per_rule["token"])
                slower = 1.0 + extra[gamma] / round_seconds  # block's round over token-wise's
                rows[f"{prefix}block_over_token_g{gamma}"] = {
                    "tokens_per_target_call": per_call,
                    "tokens_per_target_call_95": [low, high],
                    "speed": block["tokens_per_second"] / token["tokens_per_second"],
                    "round_ms_token": 1e3 * round_seconds,
                    "verify_extra_ms": 1e3 * extra[gamma],
                    "speed_from_parts": per_call / slower,
                    "speed_from_parts_95": [low / slower, high / slower],
                    "expected_accepted_block_over_token": paired_acceptance(methods[f"{prefix}block_g{gamma}"], inputs),
                }
        results["runs"].append({"temperature": temperature, "methods": rows})
        print(f"T = {temperature}")
        for name, row in rows.items():
            print(f"  {name:22s} " + "  ".join(f"{k} {fmt(v)}" for k, v in row.items()), flush=True)
    if args.output is not None:
        write_results(args.output, results)
        print(f"wrote {args.output}")
    return results


if __name__ == "__main__":
    main()
