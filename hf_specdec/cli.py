"""The `hf-specdec` command line: `demo`, `generate`, `bench`, `build-ngram`, `distill`.

Every user error (missing file, drafter whose vocabulary does not fit the target, empty corpus, corrupt checkpoint)
ends as one line `hf-specdec: error: ...` on stderr and exit status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

__all__ = ["main"]

DEFAULT_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


class CLIError(Exception):
    """A user error, printed as one line."""


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _set_threads(threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)


# ----- loading ---------------------------------------------------------------------------------------------------


def _load_target(name: str | None, dtype: str = "float32"):
    """`(target, tokenizer)`: the embedded default when `name` is None, else a local directory or a Hub id."""
    import torch

    import hf_specdec
    from hf_specdec import zoo

    if name is None:
        target, _, tokenizer = zoo.load_default(dtype=getattr(torch, dtype))
        return hf_specdec.enable(target), tokenizer
    from transformers import AutoTokenizer

    target = hf_specdec.enable(_load_model(name, dtype))
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except Exception as err:  # noqa: BLE001 - any loading failure is a user-facing one-liner
        raise CLIError(f"could not load a tokenizer from {name!r}: {_one_line(err)}") from None
    return target, tokenizer


def _load_model(name: str, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    if not Path(name).exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise CLIError(f"no such model directory: {name!r}")
    try:
        return AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype)).eval()
    except Exception as err:  # noqa: BLE001 - corrupt checkpoints raise many types (OSError, SafetensorsError...)
        raise CLIError(f"could not load a model from {name!r}: {_one_line(err)}") from None


def _load_drafter(spec: list[str] | None, *, embedded_target: bool, dtype: str = "float32"):
    """`--drafter KIND [PATH]` -> what `generate` takes: `{"assistant_model": ...}` or `{"drafter": ...}`."""
    from hf_specdec import NGramDrafter, zoo

    kind, path = (spec or ["model"])[0], (spec[1] if spec and len(spec) > 1 else None)
    if len(spec or []) > 2:
        raise CLIError(f"--drafter takes a kind and at most one path, got {' '.join(spec)!r}")
    if kind == "prompt_lookup":
        if path is not None:
            raise CLIError("--drafter prompt_lookup takes no path")
        return {"drafter": "prompt_lookup"}
    if kind not in ("ngram", "model"):
        raise CLIError(f"--drafter must be 'prompt_lookup', 'ngram [PATH]' or 'model [PATH]', got {kind!r}")
    if path is None and not embedded_target:
        raise CLIError(f"--drafter {kind} needs a PATH (or Hub id) when --target is not the embedded default")
    if kind == "ngram":
        if path is None:
            return {"drafter": zoo.load_ngram()}
        if not Path(path).exists() and path.startswith((".", "/", "~")):
            raise CLIError(f"no such n-gram drafter directory: {path!r}")
        try:
            return {"drafter": NGramDrafter.from_pretrained(path)}
        except Exception as err:  # noqa: BLE001
            raise CLIError(f"could not load an n-gram drafter from {path!r}: {_one_line(err)}") from None
    if path is None:
        import torch

        return {"assistant_model": zoo.load_default(dtype=getattr(torch, dtype))[1]}
    return {"assistant_model": _load_model(path, dtype)}


def _check_vocabulary(target, drafter_kwargs: dict) -> None:
    """Fails early (before any timing) when the drafter cannot draft for this target."""
    from hf_specdec.drafters.model import logits_width

    width = logits_width(target)
    model = drafter_kwargs.get("assistant_model")
    table = drafter_kwargs.get("drafter")
    if model is not None and logits_width(model) != width:
        raise CLIError(f"the drafter has a vocabulary of {logits_width(model)} tokens but the target has {width}; "
                       "a drafter must share the target's tokenizer")
    if hasattr(table, "vocab_size") and table.vocab_size != width:
        raise CLIError(f"the n-gram drafter was built for a vocabulary of {table.vocab_size} tokens but the target "
                       f"has {width}; rebuild it with `hf-specdec build-ngram` and the target's tokenizer")


def _read_prompt(args) -> str:
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text()
        except OSError as err:
            raise CLIError(f"cannot read --prompt-file {args.prompt_file!r}: {err.strerror or err}") from None
        if not text:
            raise CLIError(f"--prompt-file {args.prompt_file!r} is empty")
        return text
    return args.prompt if args.prompt is not None else DEFAULT_PROMPT


def _read_texts(files: list[str]) -> list[str]:
    texts = []
    for name in files:
        path = Path(name)
        paths = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in paths:
            try:
                texts.append(file.read_text(errors="replace"))
            except OSError as err:
                raise CLIError(f"cannot read {str(file)!r}: {err.strerror or err}") from None
    if not any(text.strip() for text in texts):
        raise CLIError(f"the corpus is empty: {' '.join(files)} holds no text")
    return texts


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


# ----- commands --------------------------------------------------------------------------------------------------


def demo(args: argparse.Namespace) -> int:
    """Plain greedy vs speculative on a held-out prompt with the embedded trained models, same process."""
    import torch
    from transformers import GenerationMixin

    from hf_specdec.zoo.tasks import load_prompts

    _set_threads(args.threads)
    target, tokenizer = _load_target(None)
    names = ["prompt_lookup", "ngram", "model"] if args.drafter == "all" else [args.drafter]
    drafters = {name: _load_drafter([name], embedded_target=True) for name in names}
    example = load_prompts()[args.task][args.index % 16]
    ids = tokenizer(example["prompt"], return_tensors="pt").input_ids
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
    warm = dict(max_new_tokens=4, do_sample=False)
    GenerationMixin.generate(target, ids[:, :8], **warm)
    for drafter_kwargs in drafters.values():
        target.generate(ids[:, :8], speculative_gamma=args.gamma, **drafter_kwargs, **warm)
    plain_s, plain = _timed(lambda: GenerationMixin.generate(target, ids, **common))
    print("Embedded zoo: 5.6M-parameter Llama code model trained on the Python standard library (train split).")
    print(f"Held-out {args.task} prompt {example['id']} ({ids.shape[1]} tokens), ending:")
    print("\n".join(example["prompt"].rstrip("\n").splitlines()[-5:]))
    print(f"--- generated ({plain.shape[1] - ids.shape[1]} tokens, plain greedy generate: {plain_s:.2f} s) ---")
    print(tokenizer.decode(plain[0, ids.shape[1]:]))
    print("---")
    labels = {"prompt_lookup": "prompt lookup", "ngram": "n-gram table (n=3)", "model": "distilled 1-layer drafter"}
    all_same = True
    print(f"{'drafter (gamma=' + str(args.gamma) + ')':28s} {'seconds':>8} {'speedup':>8} {'alpha':>6} "
          f"{'tokens/call':>11} {'identical':>9}")
    for name, drafter_kwargs in drafters.items():
        spec_s, out = _timed(lambda: target.generate(ids, speculative_gamma=args.gamma, return_dict_in_generate=True,
                                                     **drafter_kwargs, **common))
        stats = out.speculative_stats
        same = torch.equal(out.sequences, plain)
        all_same &= same
        print(f"{labels[name]:28s} {spec_s:8.2f} {plain_s / spec_s:7.2f}x {stats.alpha:6.3f} "
              f"{stats.mean_accepted_length:11.2f} {str(same):>9}")
    print(f"output identical to plain generate: {all_same}")
    return 0 if all_same else 1


def generate(args: argparse.Namespace) -> int:
    import torch

    _set_threads(args.threads)
    prompt = _read_prompt(args)
    target, tokenizer = _load_target(args.target, args.dtype)
    drafter_kwargs = _load_drafter(args.drafter, embedded_target=args.target is None, dtype=args.dtype)
    _check_vocabulary(target, drafter_kwargs)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise CLIError("the prompt is empty after tokenization; pass a non-empty --prompt")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    sampling = dict(do_sample=True, temperature=args.temperature) if args.do_sample else dict(do_sample=False)
    elapsed, out = _timed(lambda: target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, speculative_gamma=args.gamma,
        return_dict_in_generate=True, **sampling, **drafter_kwargs))
    new = out.sequences[0, ids.shape[1]:]
    print(prompt + tokenizer.decode(new, skip_special_tokens=True))
    stats = out.speculative_stats
    print(f"[{len(new)} tokens in {elapsed:.2f} s, alpha {stats.alpha:.3f}, "
          f"{stats.mean_accepted_length:.2f} tokens per target call]", file=sys.stderr)
    return 0


def bench(args: argparse.Namespace) -> int:
    import torch
    from transformers import GenerationMixin

    from hf_specdec.theory import expected_speedup

    _set_threads(args.threads)
    if args.plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise CLIError("--plot needs matplotlib, which is not installed: `pip install matplotlib`") from None
    if args.prompt is not None or args.prompt_file is not None:
        prompts = [_read_prompt(args)]
    else:
        from hf_specdec.zoo.tasks import load_prompts

        prompts = [item["prompt"] for item in load_prompts()[args.task][: args.prompts]]
    target, tokenizer = _load_target(args.target, args.dtype)
    drafter_kwargs = _load_drafter(args.drafter, embedded_target=args.target is None, dtype=args.dtype)
    _check_vocabulary(target, drafter_kwargs)
    gammas = args.gamma
    ids_list = [tokenizer(p, return_tensors="pt").input_ids for p in prompts]
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    def plain(ids):
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
        elif drafter_kwargs.get("drafter") == "prompt_lookup":
            extra = {"prompt_lookup_num_tokens": gamma}
        else:
            return None  # transformers has no n-gram table drafter
        return GenerationMixin.generate(target, ids, attention_mask=torch.ones_like(ids), **extra, **common)

    def ours(ids, gamma):
        return target.generate(ids, attention_mask=torch.ones_like(ids), speculative_gamma=gamma,
                               return_dict_in_generate=True, **drafter_kwargs, **common)

    plain(ids_list[0][:, :8])  # warm-up
    ours(ids_list[0][:, :8], gammas[0])
    rows = []
    for gamma in gammas:
        seconds = {"plain": 0.0, "transformers": 0.0, "hf_specdec": 0.0}
        identical, stats_list, has_assisted, plain_tokens = True, [], True, 0
        for _ in range(args.repeats):
            for ids in ids_list:
                plain_s, reference = _timed(lambda: plain(ids))
                seconds["plain"] += plain_s
                plain_tokens += reference.shape[1] - ids.shape[1]
                assisted_s, assisted_out = _timed(lambda: assisted(ids, gamma))
                has_assisted = assisted_out is not None
                seconds["transformers"] += assisted_s
                ours_s, out = _timed(lambda: ours(ids, gamma))
                seconds["hf_specdec"] += ours_s
                identical &= torch.equal(out.sequences, reference)
                stats_list.append(out.speculative_stats)
        alpha = sum(s.beta_sum for s in stats_list) / max(1, sum(s.beta_count for s in stats_list))
        plain_step = seconds["plain"] / max(1, plain_tokens)  # the paper's T: one plain decoding step
        c = sum(s.draft_time_s for s in stats_list) / max(1, sum(s.drafted_tokens for s in stats_list)) / plain_step
        rows.append({
            "gamma": gamma, "alpha": alpha, "c": c,
            "tokens_per_target_call": sum(s.emitted_tokens for s in stats_list) / sum(s.target_calls for s in stats_list),
            "plain_s": seconds["plain"], "transformers_s": seconds["transformers"] if has_assisted else None,
            "hf_specdec_s": seconds["hf_specdec"],
            "speedup_over_plain": seconds["plain"] / seconds["hf_specdec"],
            "speedup_over_transformers": seconds["transformers"] / seconds["hf_specdec"] if has_assisted else None,
            "theorem_3_8": expected_speedup(alpha=min(alpha, 1 - 1e-9), gamma=gamma, c=c),
            "identical_to_plain": identical,
        })
    print(f"{len(prompts)} prompt(s) x {args.repeats} repeat(s), {args.max_new_tokens} new tokens, greedy, "
          f"drafter {' '.join(args.drafter or ['model'])}, {torch.get_num_threads()} thread(s)")
    header = (f"{'gamma':>5} {'plain s':>8} {'transf. s':>9} {'ours s':>8} {'x plain':>8} {'x transf.':>9} "
              f"{'alpha':>6} {'c':>6} {'Thm 3.8':>8} {'same':>5}")
    print(header)
    for row in rows:
        transformers_s = f"{row['transformers_s']:9.2f}" if row["transformers_s"] is not None else f"{'n/a':>9}"
        over = f"{row['speedup_over_transformers']:9.2f}" if row["speedup_over_transformers"] else f"{'n/a':>9}"
        print(f"{row['gamma']:>5} {row['plain_s']:8.2f} {transformers_s} {row['hf_specdec_s']:8.2f} "
              f"{row['speedup_over_plain']:8.2f} {over} {row['alpha']:6.3f} {row['c']:6.3f} "
              f"{row['theorem_3_8']:8.2f} {str(row['identical_to_plain']):>5}")
    if args.output:
        Path(args.output).write_text(json.dumps({"rows": rows, "prompts": len(prompts)}, indent=1) + "\n")
    if args.plot is not None:
        figure, axes = plt.subplots(figsize=(5, 3.5))
        alpha = sum(r["alpha"] for r in rows) / len(rows)
        c = sum(r["c"] for r in rows) / len(rows)
        curve = list(range(1, max(gammas) + 2))
        axes.plot(curve, [expected_speedup(alpha=min(alpha, 1 - 1e-9), gamma=g, c=c) for g in curve],
                  label=f"Theorem 3.8 (alpha={alpha:.2f}, c={c:.2f})")
        axes.plot(gammas, [r["speedup_over_plain"] for r in rows], "o", label="measured (hf_specdec)")
        axes.axhline(1.0, color="grey", lw=0.5)
        axes.set_xlabel("gamma")
        axes.set_ylabel("speedup over plain generate")
        axes.legend()
        figure.tight_layout()
        figure.savefig(args.plot)
        print(f"plot written to {args.plot}")
    return 0 if all(row["identical_to_plain"] for row in rows) else 1


def build_ngram(args: argparse.Namespace) -> int:
    from hf_specdec import NGramDrafter, zoo

    texts = _read_texts(args.files)
    if args.tokenizer is None:
        tokenizer = zoo.load_tokenizer()
    else:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        except Exception as err:  # noqa: BLE001
            raise CLIError(f"could not load a tokenizer from {args.tokenizer!r}: {_one_line(err)}") from None
    table = NGramDrafter.from_texts(texts, tokenizer=tokenizer, n=args.n, top_k=args.top_k, show_progress=True,
                                    batch_size=16, corpus_description=f"{len(texts)} files from {' '.join(args.files)}")
    table.save_pretrained(args.output)
    print(f"n-gram drafter (n={args.n}, {len(texts)} files) written to {args.output}")
    return 0


def distill(args: argparse.Namespace) -> int:
    import copy

    import torch
    from accelerate import Accelerator

    from hf_specdec.distill import distill_drafter

    _set_threads(args.threads)
    texts = _read_texts(args.files)
    target, tokenizer = _load_target(args.target)
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = args.layers
    if hasattr(config, "layer_types"):
        config.layer_types = None
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    drafter = distill_drafter(target, texts, config, tokenizer=tokenizer, objective=args.objective,
                              num_steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                              learning_rate=args.lr, seed=args.seed, accelerator=accelerator,
                              output_dir=args.output)
    tokenizer.save_pretrained(args.output)
    print(f"{args.layers}-layer drafter ({sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters) "
          f"written to {args.output}")
    return 0


# ----- parser ----------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-specdec", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def threads(sub):
        sub.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")

    def model_args(sub, gamma_nargs=None):
        sub.add_argument("--target", default=None, help="local directory or Hub id (default: the embedded zoo model)")
        sub.add_argument("--drafter", nargs="+", metavar="KIND [PATH]", default=None,
                         help="prompt_lookup | ngram [PATH] | model [PATH] (default: the embedded distilled drafter)")
        if gamma_nargs:
            sub.add_argument("--gamma", type=int, nargs=gamma_nargs, default=[4], help="one or more draft lengths")
        else:
            sub.add_argument("--gamma", type=int, default=4, help="draft length (default: 4)")
        sub.add_argument("--max-new-tokens", type=int, default=128)
        sub.add_argument("--prompt", default=None)
        sub.add_argument("--prompt-file", default=None)
        sub.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        threads(sub)

    sub = commands.add_parser("demo", help="speculative vs plain generate with the embedded trained code model")
    sub.add_argument("--drafter", default="all", choices=["all", "prompt_lookup", "ngram", "model"])
    sub.add_argument("--task", default="completion", choices=["completion", "editing", "continuation"])
    sub.add_argument("--index", type=int, default=0, help="which held-out prompt of the task (0-15)")
    sub.add_argument("--max-new-tokens", type=int, default=96)
    sub.add_argument("--gamma", type=int, default=4)
    threads(sub)
    sub.set_defaults(func=demo)

    sub = commands.add_parser("generate", help="generate with any target and drafter")
    model_args(sub)
    sub.add_argument("--do-sample", action="store_true")
    sub.add_argument("--temperature", type=float, default=1.0)
    sub.add_argument("--seed", type=int, default=None)
    sub.set_defaults(func=generate)

    sub = commands.add_parser("bench", help="plain vs transformers' assisted vs hf_specdec, side by side")
    model_args(sub, gamma_nargs="+")
    sub.add_argument("--task", default="completion", choices=["completion", "editing", "continuation"])
    sub.add_argument("--prompts", type=int, default=4, help="held-out prompts of --task (without --prompt)")
    sub.add_argument("--repeats", type=int, default=1)
    sub.add_argument("--plot", default=None, help="write speedup vs gamma with the Theorem 3.8 curve (matplotlib)")
    sub.add_argument("--output", default=None, help="write the rows as JSON")
    sub.set_defaults(func=bench)

    sub = commands.add_parser("build-ngram", help="count an NGramDrafter from text files")
    sub.add_argument("files", nargs="+", help="text files, or directories (their *.py files)")
    sub.add_argument("--output", required=True)
    sub.add_argument("--tokenizer", default=None, help="local directory or Hub id (default: the zoo tokenizer)")
    sub.add_argument("--n", type=int, default=3)
    sub.add_argument("--top-k", type=int, default=8)
    sub.set_defaults(func=build_ngram)

    sub = commands.add_parser("distill", help="distill a small drafter from a target on text files")
    sub.add_argument("files", nargs="+", help="text files, or directories (their *.py files)")
    sub.add_argument("--output", required=True)
    sub.add_argument("--target", default=None, help="local directory or Hub id (default: the embedded zoo model)")
    sub.add_argument("--layers", type=int, default=1)
    sub.add_argument("--objective", default="kl", choices=["kl", "tv"])
    sub.add_argument("--steps", type=int, default=None, help="default: one epoch")
    sub.add_argument("--batch-size", type=int, default=8)
    sub.add_argument("--seq-len", type=int, default=256)
    sub.add_argument("--lr", type=float, default=1e-3)
    sub.add_argument("--seed", type=int, default=0)
    sub.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    sub.add_argument("--cpu", action="store_true", help="force the CPU even when an accelerator is present")
    threads(sub)
    sub.set_defaults(func=distill)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # weight-loading bars would bury the one line that matters (the commands' own bars use tqdm directly)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    try:
        return args.func(args)
    except (CLIError, ValueError, TypeError, OSError) as err:
        print(f"hf-specdec: error: {_one_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
