"""`hf-specdec bench`: plain `generate`, transformers' assisted generation and hf_specdec on the same prompts,
interleaved and repeated (`hf_specdec.benchmarking`), at each γ asked, beside Theorem 3.8.

Each γ is measured as itself (`speculative_gamma_policy="constant"`, transformers' constant schedule), so that the
table and the plot set a measured speedup beside the theorem at that γ. The measured costs come from hf_specdec's
own timers (`speculative_stats`): c, a drafter step over a plain decoding step, and v, a verify forward over a plain
step (the paper takes v = 1).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from ..benchmarking import interleaved, spread, write_results
from . import loading
from .arguments import add_model_args, positive_int
from .common import TASK_PROMPTS, TASKS, CLIError, check_output_file, progress, read_prompt, set_threads


def bench(args: argparse.Namespace) -> int:
    check_output_file("--output", args.output)
    check_output_file("--plot", args.plot)
    if args.plot is not None:
        try:
            import matplotlib
        except ImportError:
            raise CLIError(
                '--plot needs matplotlib, which is not installed: `pip install "hf-specdec[plot]"` '
                "(or `pip install matplotlib`)"
            ) from None
        matplotlib.use("Agg")
    if args.prompt is not None or args.prompt_file is not None:
        prompts = [read_prompt(args)]
    else:
        from hf_specdec.zoo.tasks import load_prompts

        if args.prompts > TASK_PROMPTS:
            raise CLIError(
                f"--prompts {args.prompts}: the {args.task} task has {TASK_PROMPTS} held-out prompts; "
                f"pass --prompts {TASK_PROMPTS} or fewer"
            )
        prompts = [item["prompt"] for item in load_prompts()[args.task][: args.prompts]]
    threads = set_threads(args.threads)
    target, tokenizer = loading.load_target(args.target, args.dtype)
    drafter_kwargs = loading.load_drafter(args.drafter, embedded_target=args.target is None, dtype=args.dtype)
    loading.check_vocabulary(target, drafter_kwargs)
    ids_list = [tokenizer(p, return_tensors="pt").input_ids for p in prompts]
    methods = _methods(target, drafter_kwargs, args.max_new_tokens)
    for method in methods.values():  # warm-up, untimed: first calls pay one-off costs (allocations, lazy init)
        method(ids_list[0][:, :16], args.gamma[0])
    with progress(len(args.gamma) * args.repeats * len(ids_list) * len(methods), "bench") as bar:
        rows = [_measure(methods, ids_list, gamma, args.repeats, bar) for gamma in args.gamma]
    drafter_name = " ".join(args.drafter or ["model"])
    _print_table(rows, args, len(prompts), drafter_name, threads)
    if args.output:
        payload = {"rows": rows, "prompts": len(prompts), "repeats": args.repeats, "threads": threads}
        write_results(args.output, {**payload, "drafter": drafter_name})
    if args.plot is not None:
        _plot(rows, args, "transformers" in methods, f"{len(prompts)} prompt(s)", drafter_name, threads)
    return 0 if all(row["identical_to_plain"] for row in rows) else 1


def _methods(target, drafter_kwargs: dict, max_new_tokens: int) -> dict:
    """name -> `method(ids, gamma)`: plain `generate`, transformers' assisted generation (for a draft model or
    prompt lookup: transformers has no n-gram table drafter) and hf_specdec, greedy."""
    import torch
    from transformers import GenerationMixin

    common = dict(max_new_tokens=max_new_tokens, do_sample=False)

    def plain(ids, gamma):
        return GenerationMixin.generate(target, ids, attention_mask=torch.ones_like(ids), **common)

    def assisted(ids, gamma):
        # transformers reads the draft length from the assistant's generation config: set it on a copy
        if "assistant_model" in drafter_kwargs:
            import copy

            assistant = copy.copy(drafter_kwargs["assistant_model"])
            assistant.generation_config = copy.deepcopy(assistant.generation_config)
            assistant.generation_config.num_assistant_tokens = gamma
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            assistant.generation_config.assistant_confidence_threshold = 0.0
            extra = {"assistant_model": assistant}
        else:
            extra = {"prompt_lookup_num_tokens": gamma}
        return GenerationMixin.generate(target, ids, attention_mask=torch.ones_like(ids), **extra, **common)

    def ours(ids, gamma):
        # each γ measured as itself, as transformers' constant schedule and Theorem 3.8 at γ beside it (the default
        # policy would draft at most γ, fewer where fewer pay)
        return target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            speculative_gamma=gamma,
            speculative_gamma_policy="constant",
            return_dict_in_generate=True,
            **drafter_kwargs,
            **common,
        )

    methods = {"plain": plain, "transformers": assisted, "hf_specdec": ours}
    if not ("assistant_model" in drafter_kwargs or drafter_kwargs.get("drafter") == "prompt_lookup"):
        del methods["transformers"]
    return methods


def _measure(methods: dict, ids_list: list, gamma: int, repeats: int, bar) -> dict:
    """One row of the table: every method on every prompt at `gamma`, interleaved per prompt and repeated; the
    medians over repeats, the measured costs and Theorem 3.8 beside them."""
    import torch

    from hf_specdec.theory import expected_speedup, expected_tokens_per_round

    outputs = {}  # (method, repeat, prompt) -> output, plain's and ours

    def record(run):
        bar.update()
        if run.name != "transformers":
            outputs[run.name, run.repeat, run.index] = run.output

    timed_methods = {name: (lambda ids, method=method: method(ids, gamma)) for name, method in methods.items()}
    seconds = interleaved(timed_methods, repeats, warmup=0, inputs=ids_list, on_run=record)
    identical = all(
        torch.equal(outputs["hf_specdec", repeat, index].sequences, outputs["plain", repeat, index])
        for repeat in range(repeats)
        for index in range(len(ids_list))
    )
    stats_list = [outputs["hf_specdec", 0, index].speculative_stats for index in range(len(ids_list))]
    median = {name: statistics.median(times) for name, times in seconds.items()}
    plain_tokens = sum(outputs["plain", 0, i].shape[1] - ids.shape[1] for i, ids in enumerate(ids_list))
    plain_step = median["plain"] / max(1, plain_tokens)  # the paper's T: one plain decoding step
    alpha = sum(s.beta_sum for s in stats_list) / max(1, sum(s.beta_count for s in stats_list))
    drafted = sum(s.drafted_tokens for s in stats_list)
    c = sum(s.draft_time_s for s in stats_list) / max(1, drafted) / plain_step
    calls = sum(s.target_calls for s in stats_list)
    v = sum(s.verify_time_s for s in stats_list) / max(1, calls) / plain_step
    clipped = min(alpha, 1 - 1e-9)
    transformers = median.get("transformers")
    return {
        "gamma": gamma,
        "alpha": alpha,
        "c": c,
        "v": v,
        "tokens_per_target_call": sum(s.emitted_tokens for s in stats_list) / max(1, calls),
        "plain_s": median["plain"],
        "transformers_s": transformers,
        "hf_specdec_s": median["hf_specdec"],
        "runs_s": seconds,
        "spread": max(spread(times) for times in seconds.values()),
        "speedup_over_plain": median["plain"] / median["hf_specdec"],
        "transformers_speedup_over_plain": None if transformers is None else median["plain"] / transformers,
        "speedup_over_transformers": None if transformers is None else transformers / median["hf_specdec"],
        "theorem_3_8": expected_speedup(alpha=clipped, gamma=gamma, c=c),
        "theorem_3_8_at_measured_v": expected_tokens_per_round(clipped, gamma) / (gamma * c + v),
        "identical_to_plain": identical,
        "gammas_drafted": sorted({g for s in stats_list for g in s.gamma_history}),
    }


def _print_table(rows: list[dict], args: argparse.Namespace, prompts: int, drafter_name: str, threads: str) -> None:
    print(
        f"{prompts} prompt(s) x {args.repeats} interleaved repeat(s) after a warm-up, {args.max_new_tokens} "
        f"new tokens, greedy, drafter {drafter_name}, {threads}"
    )
    print(
        "times: medians over repeats; spread: (max - min) / median, the worst method; c: drafter step / plain "
        "step; v: verify forward / plain step; Thm 3.8: as stated (v = 1), and at the measured v"
    )
    print(
        f"{'gamma':>5} {'plain s':>8} {'transf. s':>9} {'ours s':>8} {'x plain':>8} {'x transf.':>9} "
        f"{'spread':>6} {'alpha':>6} {'c':>6} {'v':>5} {'Thm 3.8':>8} {'at v':>6} {'same':>5}"
    )
    for row in rows:
        transformers_s = f"{row['transformers_s']:9.2f}" if row["transformers_s"] is not None else f"{'n/a':>9}"
        over = f"{row['speedup_over_transformers']:9.2f}" if row["speedup_over_transformers"] else f"{'n/a':>9}"
        spread_text = f"{row['spread']:6.0%}" if args.repeats > 1 else f"{'n/a':>6}"
        print(
            f"{row['gamma']:>5} {row['plain_s']:8.2f} {transformers_s} {row['hf_specdec_s']:8.2f} "
            f"{row['speedup_over_plain']:8.2f} {over} {spread_text} {row['alpha']:6.3f} {row['c']:6.3f} "
            f"{row['v']:5.2f} {row['theorem_3_8']:8.2f} {row['theorem_3_8_at_measured_v']:6.2f} "
            f"{str(row['identical_to_plain']):>5}"
        )
    if args.repeats > 1 and max(row["spread"] for row in rows) > 0.2:
        print(
            "warning: repeated timings differ by more than 20%: the machine is busy; read the ratios with care, "
            "or rerun with more --repeats or fewer --threads",
            file=sys.stderr,
        )


def _verify_cost_line(rows: list[dict]):
    """v(γ), the verify forward's cost in plain steps: v(0) = 1 (a forward over one token is a plain step) plus a
    least-squares slope through the measured rows, never negative."""
    slope = sum(row["gamma"] * (row["v"] - 1.0) for row in rows) / sum(row["gamma"] ** 2 for row in rows)
    return lambda gamma: 1.0 + max(0.0, slope) * gamma


def _plot(rows: list[dict], args, with_transformers: bool, prompts: str, drafter_name: str, threads: str) -> None:
    """Speedup over plain against γ: the measured rows and Theorem 3.8's curves, into `args.plot`."""
    import matplotlib.pyplot as plt

    from hf_specdec.theory import expected_speedup, expected_tokens_per_round

    gammas = [row["gamma"] for row in rows]
    figure, axes = plt.subplots(figsize=(6.4, 4.4))
    alpha = sum(r["alpha"] for r in rows) / len(rows)
    c = sum(r["c"] for r in rows) / len(rows)
    verify_cost = _verify_cost_line(rows)
    clipped = min(alpha, 1 - 1e-9)
    curve = list(range(1, max(gammas) + 2))
    axes.plot(
        curve,
        [expected_speedup(alpha=clipped, gamma=g, c=c) for g in curve],
        "--",
        color="tab:blue",
        label=f"Theorem 3.8 as stated (a verify forward costs 1 step; alpha={alpha:.2f}, c={c:.2f})",
    )
    axes.plot(
        curve,
        [expected_tokens_per_round(clipped, g) / (g * c + verify_cost(g)) for g in curve],
        "-",
        color="tab:blue",
        label="Theorem 3.8 at the measured verify cost v (see table)",
    )
    axes.plot(gammas, [r["speedup_over_plain"] for r in rows], "o", color="tab:orange", label="hf_specdec (measured)")
    if with_transformers:
        axes.plot(
            gammas,
            [r["transformers_speedup_over_plain"] for r in rows],
            "s",
            color="tab:green",
            label="transformers' assisted generation (measured)",
        )
    axes.axhline(1.0, color="grey", lw=0.5)
    axes.set_title(
        f"Speedup over plain generate: drafter {drafter_name}, target {args.target or 'embedded zoo'}"
        f"\n{prompts} x {args.repeats} repeat(s), {args.max_new_tokens} new tokens, "
        f"greedy, {threads.split(' (')[0]}",
        fontsize=9,
    )
    axes.set_xlabel("gamma (drafted tokens per round)")
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.set_ylabel("speedup over plain generate")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(args.plot)
    plt.close(figure)
    print(
        f"plot written to {args.plot} (dashed: Theorem 3.8 with a verify forward as cheap as one decoding step, "
        "as the paper assumes; solid: priced at the measured verify cost, the closer bound on this machine)"
    )


def add_parser(command) -> None:
    """The `bench` command and its options."""
    sub = command("bench", "plain vs transformers' assisted vs hf_specdec, side by side")
    add_model_args(sub, gamma_nargs="+")
    sub.add_argument("--task", default="completion", choices=TASKS, help="which kind of held-out prompt")
    sub.add_argument(
        "--prompts",
        type=positive_int,
        default=4,
        metavar="N",
        help=f"held-out prompts of --task, at most {TASK_PROMPTS} (ignored with --prompt/--prompt-file)",
    )
    sub.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        metavar="N",
        help="interleaved repeats of every method; times are medians, with their spread",
    )
    sub.add_argument(
        "--plot",
        default=None,
        metavar="IMAGE",
        help="write speedup vs gamma with the Theorem 3.8 curves to this image (needs the `plot` extra: "
        'pip install "hf-specdec[plot]")',
    )
    sub.add_argument("--output", default=None, metavar="JSON", help="write the rows as JSON to this file")
    sub.set_defaults(func=bench)
