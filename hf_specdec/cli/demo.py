"""`hf-specdec demo`: plain vs speculative `generate` streamed side by side, then timed on every prompt."""

from __future__ import annotations

import argparse
import json
import statistics

from ..benchmarking import interleaved, spread
from . import loading
from .arguments import add_threads, positive_int
from .common import TASK_PROMPTS, TASKS, CLIError, progress, set_threads

DEMO_LABELS = {"prompt_lookup": "prompt lookup", "ngram": "n-gram table (n=3)", "model": "distilled 1-layer drafter"}
DEMO_TOKENS = 96  # tokens generated for a prompt the demo did not pick (--task/--index, --model)


def demo(args: argparse.Namespace) -> int:
    """Plain greedy vs speculative `generate` streamed side by side on the demo's held-out prompts (or a local
    model), then the summary table over all of them."""
    from hf_specdec.demo import Console

    console = Console()
    threads = set_threads(args.threads)
    if args.model is not None:
        return _demo_model(args, threads, console)
    for flag, value in (("--gguf-file", args.gguf_file), ("--eagle", args.eagle), ("--prompt", args.prompt)):
        if value is not None:
            raise CLIError(f"{flag} goes with --model DIR (the demo on a local model); pass --model too")
    if args.prompts is not None and (args.task is not None or args.index is not None):
        raise CLIError("--prompts counts the demo's own prompts; --task/--index run one held-out prompt instead")
    with console.status("loading the embedded zoo model and its drafters"):
        from hf_specdec import zoo
        from hf_specdec.zoo.tasks import load_prompts

        target, tokenizer = loading.load_target(None)
        picked = json.loads((zoo.ZOO_DIR / "demo_prompts.json").read_text())
        held_out = load_prompts()
        if args.task is None and args.index is None:
            examples = [
                (
                    f"held-out {item['task']} prompt {item['id']}",
                    held_out[item["task"]][item["index"]]["prompt"],
                    args.max_new_tokens or item["sensible_tokens"],
                )
                for item in picked["prompts"][: args.prompts]
            ]
        else:
            task, index = args.task or "completion", args.index or 0
            example = held_out[task][index]
            examples = [
                (f"held-out {task} prompt {example['id']}", example["prompt"], args.max_new_tokens or DEMO_TOKENS)
            ]
        # "all": the drafters that beat plain generate on these prompts (prompt lookup, if ever none did)
        names = (picked["drafters"] or ["prompt_lookup"]) if args.drafter == "all" else [args.drafter]
        drafters = {DEMO_LABELS[name]: loading.load_drafter([name], embedded_target=True) for name in names}
    console.print(
        f"{console.bold('hf-specdec demo')}: the embedded 5.6M-parameter code model, on code from files it never saw"
    )
    inputs = [
        (title, prompt, tokenizer(prompt, return_tensors="pt").input_ids, tokens) for title, prompt, tokens in examples
    ]
    return _demo_run(console, target, tokenizer, inputs, drafters, args, threads)


DEMO_INSTRUCTION = (
    "Rewrite this function with clearer names and a docstring:\n\ndef f(a, b):\n    c = 0\n"
    "    for x in a:\n        if x > b:\n            c = c + x\n    return c\n"
)


def _demo_model(args: argparse.Namespace, threads: str, console) -> int:
    """The demo on any local model: plain greedy `generate` against prompt lookup (and an EAGLE-3 head with
    `--eagle DIR`), with the tokenizer's chat template when it has one."""
    from hf_specdec import EagleDrafter

    for flag, value in (("--task", args.task), ("--index", args.index), ("--prompts", args.prompts)):
        if value is not None:
            raise CLIError(f"{flag} picks the embedded zoo's prompts; with --model DIR pass --prompt TEXT instead")
    if args.drafter not in ("all", "prompt_lookup"):
        raise CLIError(
            f"--drafter {args.drafter} is an embedded zoo drafter; with --model DIR the demo runs prompt lookup"
        )
    with console.status(f"loading {args.model}"):
        target, tokenizer = loading.load_target(args.model, gguf_file=args.gguf_file)
        drafters = {"prompt lookup": {"drafter": "prompt_lookup"}}
        if args.eagle is not None:
            drafters["EAGLE-3 head"] = {"drafter": EagleDrafter.from_pretrained(args.eagle, target=target)}
    text = args.prompt or DEMO_INSTRUCTION
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    else:
        ids = tokenizer(text, return_tensors="pt").input_ids
    console.print(f"{console.bold('hf-specdec demo')}: {type(target).__name__} from {args.model}")
    inputs = [("the prompt", text, ids, args.max_new_tokens or DEMO_TOKENS)]
    return _demo_run(console, target, tokenizer, inputs, drafters, args, threads)


def _demo_run(console, target, tokenizer, inputs: list[tuple], drafters: dict, args, threads: str) -> int:
    """Streams plain vs the first drafter on the first prompt side by side, then times every method on every prompt
    (interleaved repeats) and prints the table; exit status 1 when any output differs from plain `generate`.
    `inputs`: (title, prompt text, input ids, max new tokens) per prompt; `drafters`: label -> `generate` kwargs."""
    import torch
    from transformers import GenerationMixin

    from hf_specdec.demo import Row, print_prompt, print_stream_summary, print_table, stream_pair
    from hf_specdec.stats import SpeculativeStats

    def plain(ids, tokens, **extra):
        return GenerationMixin.generate(
            target, ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False, **extra
        )

    def speculative(drafter_kwargs, ids, tokens, **extra):
        return target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            do_sample=False,
            speculative_gamma=args.gamma,
            return_dict_in_generate=True,
            **drafter_kwargs,
            **extra,
        )

    with console.status("warming up"):  # first calls pay one-off costs (allocations, lazy init)
        first_ids = inputs[0][2]
        plain(first_ids, 8)
        for drafter_kwargs in drafters.values():
            speculative(drafter_kwargs, first_ids, 8)
    title, text, ids, tokens = inputs[0]
    streamed = next(iter(drafters))
    print_prompt(console, title, text, ids.shape[1])
    (left, right), view = stream_pair(
        console,
        target,
        tokenizer,
        lambda streamer: plain(ids, tokens, streamer=streamer),
        lambda streamer: speculative(drafters[streamed], ids, tokens, streamer=streamer),
        ("plain generate", f"speculative: {streamed}"),
    )
    streamed_same = torch.equal(right.sequences, left)
    print_stream_summary(console, view, streamed_same)

    methods = {"plain generate": lambda: [plain(ids, tokens) for _, _, ids, tokens in inputs]}
    for label, drafter_kwargs in drafters.items():
        methods[label] = (
            lambda drafter_kwargs: lambda: [speculative(drafter_kwargs, ids, tokens) for _, _, ids, tokens in inputs]
        )(drafter_kwargs)
    outputs = {}  # each method's last output
    with progress(args.repeats * len(methods), "measuring") as bar:

        def record(run):
            outputs[run.name] = run.output
            bar.update()

        seconds = interleaved(methods, args.repeats, warmup=0, on_run=record)  # warmed up above
    median = {name: statistics.median(times) for name, times in seconds.items()}
    reference = outputs["plain generate"]
    generated = sum(out.shape[1] - ids.shape[1] for out, (_, _, ids, _) in zip(reference, inputs))
    rows = [Row("plain generate", median["plain generate"], spread(seconds["plain generate"]), 1.0, None, 1.0, True)]
    for label in drafters:
        stats = SpeculativeStats()
        for out in outputs[label]:
            stats.merge(out.speculative_stats)
        same = all(torch.equal(out.sequences, plain_out) for out, plain_out in zip(outputs[label], reference))
        rows.append(
            Row(
                label,
                median[label],
                spread(seconds[label]),
                median["plain generate"] / median[label],
                stats.alpha,
                stats.mean_accepted_length,
                same,
            )
        )
    console.print()
    console.print(f"{len(inputs)} prompt(s), {generated} tokens per method; {threads}")
    console.print(
        f"seconds: medians of {args.repeats} interleaved run(s) (spread: (max - min) / median); default "
        f"{console.gamma} policy (auto)"
    )
    print_table(console, rows)
    all_same = streamed_same and all(row.identical for row in rows)
    console.print(f"output identical to plain generate: {all_same}")
    return 0 if all_same else 1


def add_parser(command) -> None:
    """The `demo` command and its options."""
    sub = command("demo", "plain vs speculative generate, streamed side by side, with the embedded code model")
    sub.add_argument(
        "--drafter",
        default="all",
        choices=["all", "prompt_lookup", "ngram", "model"],
        help="which embedded drafter to run against plain generate (all: those that beat plain generate on the "
        "demo's prompts, as measured by scripts/pick_demo_prompts.py)",
    )
    sub.add_argument(
        "--prompts",
        type=positive_int,
        default=None,
        metavar="N",
        help="time the first N of the demo's prompts (default: all of them)",
    )
    sub.add_argument(
        "--task",
        default=None,
        choices=TASKS,
        help="run on a held-out prompt of this task instead of the demo's prompts (with --index; default completion)",
    )
    sub.add_argument(
        "--index",
        type=int,
        default=None,
        choices=range(TASK_PROMPTS),
        metavar=f"0-{TASK_PROMPTS - 1}",
        help="run on this held-out prompt of --task instead of the demo's prompts (default 0)",
    )
    sub.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"tokens to generate per prompt (default: for each demo prompt, the tokens the model writes before it "
        f"starts repeating itself; else {DEMO_TOKENS})",
    )
    sub.add_argument(
        "--gamma",
        type=positive_int,
        default=None,
        metavar="N",
        help="the draft length the default γ policy (auto) starts from and adapts (default: each drafter's own: 10 "
        "for prompt lookup, else 5)",
    )
    sub.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        metavar="N",
        help="interleaved timed runs of each method; the median is shown",
    )
    sub.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="run the demo on this local model instead of the embedded zoo (plain vs prompt lookup)",
    )
    sub.add_argument("--gguf-file", default=None, metavar="FILE", help="a GGUF file inside --model DIR")
    sub.add_argument("--eagle", default=None, metavar="DIR", help="with --model: an EAGLE-3 head for it, too")
    sub.add_argument(
        "--prompt", default=None, metavar="TEXT", help="with --model: the instruction (default: a code rewrite)"
    )
    add_threads(sub)
    sub.set_defaults(func=demo)
