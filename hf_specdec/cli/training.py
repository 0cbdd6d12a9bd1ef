"""The commands that build drafters: `build-ngram` (count an n-gram table), `distill` (a small drafter from the
target), `train-drafter` (an EAGLE-3 head) and `train-mtp` (MTP layers saved with the target)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..file_writes import save_into
from . import loading
from .arguments import add_threads, add_training, non_negative_int, positive_float, positive_int
from .common import CLIError, check_output_dir, one_line, read_text_file, read_texts, set_threads


def _check_output(name: str) -> None:
    """`--output` is a folder or a path where one can be created: not a file, nor a broken link."""
    check_output_dir("--output", name)
    path = Path(name).expanduser()
    if path.is_symlink() and not path.exists():
        raise CLIError(f"--output {name!r} is a broken link; pass a directory (it is created if missing)")


def build_ngram(args: argparse.Namespace) -> int:
    from hf_specdec import NGramDrafter, zoo

    _check_output(args.output)
    texts = read_texts(args.files)
    if args.tokenizer is None:
        tokenizer = zoo.load_tokenizer()
        tokenizer_name = "hf-specdec/stdlib-llama-5m (the embedded zoo tokenizer, `hf_specdec.zoo.load_tokenizer()`)"
    else:
        tokenizer_name = None  # from_texts records a Hub id as is, a local directory by its name only
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        except Exception as err:
            raise CLIError(f"could not load a tokenizer from {args.tokenizer!r}: {one_line(err)}") from None
    names = " ".join(Path(name).name or name for name in args.files)  # no local absolute paths in a shared card
    metadata = {"tokenizer_name": tokenizer_name} if tokenizer_name else {}
    table = NGramDrafter.from_texts(
        texts,
        tokenizer=tokenizer,
        n=args.n,
        top_k=args.top_k,
        show_progress=True,
        batch_size=16,
        corpus_description=f"{len(texts)} files from {names}",
        **metadata,
    )
    table.save_pretrained(args.output)
    print(f"n-gram drafter (n={args.n}, {len(texts)} files) written to {args.output}")
    return 0


def distill(args: argparse.Namespace) -> int:
    import copy

    from accelerate import Accelerator

    from hf_specdec.distill import distill_drafter

    set_threads(args.threads)
    _check_output(args.output)
    texts = read_texts(args.files)
    target, tokenizer = loading.load_target(args.target)
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = args.layers
    if hasattr(config, "layer_types"):
        config.layer_types = None
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    drafter = distill_drafter(
        target,
        texts,
        config,
        tokenizer=tokenizer,
        objective=args.objective,
        num_steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        learning_rate=args.lr,
        seed=args.seed,
        accelerator=accelerator,
        output_dir=args.output,
    )
    save_into(args.output, tokenizer.save_pretrained)  # beside the drafter; a link there is replaced, not followed
    print(
        f"{args.layers}-layer drafter ({sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters) "
        f"written to {args.output}"
    )
    return 0


def train_drafter(args: argparse.Namespace) -> int:
    from accelerate import Accelerator

    from hf_specdec.distill import train_eagle_drafter

    target, tokenizer, prompts, texts = _self_distillation_inputs(
        args,
        "train-drafter",
        "--prompts FILE (one instruction per line, the target answers them), --texts FILE [FILE ...] and/or "
        "--synthetic-prompts N (the target writes N instructions)",
        bool(args.synthetic_prompts),
    )
    drafter = train_eagle_drafter(
        target,
        prompts,
        texts,
        tokenizer=tokenizer,
        max_minutes=args.minutes,
        num_steps=args.steps,
        accelerator=Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision),
        output_dir=args.output,
        resume_from_checkpoint=True if args.resume else None,
        draft_vocab_size=args.draft_vocab_size,
        ttt_steps=args.ttt_steps,
        max_answer_tokens=args.max_answer_tokens,
        batch_size=args.batch_size,
        num_synthetic_prompts=args.synthetic_prompts,
        answer_dtype=args.answer_dtype,
        feature_dtype=args.feature_dtype,
        generation_batch_size=args.generation_batch_size,
        learning_rate=args.lr,
        seed=args.seed,
    )
    info = drafter.training_info
    print(
        f"EAGLE-3 head written to {args.output}: {info['steps']} steps, {info['wall time']}, held-out top-1 "
        f"agreement per draft step {info['held-out top-1 agreement per draft step']}"
    )
    return 0


def read_prompts(name: str | None) -> list[str] | None:
    """The instructions of `--prompts FILE`, one per line (blank lines skipped)."""
    if name is None:
        return None
    content = read_text_file(Path(name))
    if content is None:
        raise CLIError(f"--prompts {name!r} is not a readable UTF-8 text file")
    # lines end at "\n" only: U+2028 and the like (which `str.splitlines` takes for line ends) stay in their prompt
    return [line.strip() for line in content.split("\n") if line.strip()]


def _self_distillation_inputs(args: argparse.Namespace, command: str, data: str, other_data: bool):
    """What `train-drafter` and `train-mtp` read before training: the threads (said on stderr), the checks of
    `--output`, the data (`data` says which flags give it; `other_data`: given otherwise) and the budget, the prompts
    and texts, and the target with its tokenizer. Returns `(target, tokenizer, prompts, texts)`."""
    threads = set_threads(args.threads)
    _check_output(args.output)
    if args.prompts is None and not args.texts and not other_data:
        raise CLIError(f"{command} needs data: {data}")
    if args.minutes is None and args.steps is None:
        raise CLIError(f"{command} needs a budget: --minutes M and/or --steps N")
    prompts = read_prompts(args.prompts)
    texts = read_texts(args.texts) if args.texts else None
    target, tokenizer = loading.load_target(args.target, gguf_file=args.gguf_file)
    print(threads, file=sys.stderr)
    return target, tokenizer, prompts, texts


def _add_self_distillation_options(sub, prompts_help: str, output_help: str) -> None:
    """The options `train-drafter` and `train-mtp` share: the target, the data, the output, the budget and the
    answering."""
    sub.add_argument("--target", required=True, metavar="DIR", help="local directory or Hub id of the target")
    sub.add_argument("--gguf-file", default=None, metavar="FILE", help="a GGUF file inside --target DIR")
    sub.add_argument("--prompts", default=None, metavar="FILE", help=prompts_help)
    sub.add_argument("--texts", nargs="+", default=None, metavar="FILE", help="texts to train on as they are")
    sub.add_argument("--output", required=True, help=output_help)
    sub.add_argument("--minutes", type=positive_float, default=None, help="wall-clock budget of the whole run")
    sub.add_argument("--steps", type=positive_int, default=None, help="optimizer steps")
    sub.add_argument("--max-answer-tokens", type=positive_int, default=256, help="longest answer to a prompt")
    sub.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step")
    sub.add_argument(
        "--answer-dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="answer with a copy of the target in this dtype (default: the target's own)",
    )
    sub.add_argument("--generation-batch-size", type=positive_int, default=16, help="prompts answered at once")


def train_mtp(args: argparse.Namespace) -> int:
    from hf_specdec.distill import train_mtp_layers

    target, tokenizer, prompts, texts = _self_distillation_inputs(
        args,
        "train-mtp",
        "--prompts FILE (one instruction per line, the target answers them) and/or --texts FILE [FILE ...]",
        False,
    )
    layers = train_mtp_layers(
        target,
        prompts,
        texts,
        tokenizer=tokenizer,
        num_mtp_layers=args.num_mtp_layers,
        max_minutes=args.minutes,
        num_steps=args.steps,
        output_dir=args.output,
        max_answer_tokens=args.max_answer_tokens,
        answer_dtype=args.answer_dtype,
        generation_batch_size=args.generation_batch_size,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        seed=args.seed,
    )
    save_into(args.output, tokenizer.save_pretrained)
    summary = layers.training_summary
    print(
        f"{len(layers.layers)} MTP layer(s) written with the model to {args.output} (load it and decode with "
        f'drafter="mtp" or use_mtp=True): {summary["steps"]} steps, held-out top-1 agreement per layer '
        f"{[round(a, 3) for a in summary['agreement_before']]} -> {[round(a, 3) for a in summary['agreement_after']]}"
    )
    return 0


def add_parser(command) -> None:
    """The `build-ngram`, `distill`, `train-drafter` and `train-mtp` commands and their options."""
    sub = command("build-ngram", "count an NGramDrafter from text files")
    sub.add_argument("files", nargs="+", help="UTF-8 text files, or directories (their *.py files)")
    sub.add_argument("--output", required=True, help="directory to write the drafter to (created if missing)")
    sub.add_argument("--tokenizer", default=None, help="local directory or Hub id (default: the zoo tokenizer)")
    sub.add_argument("--n", type=positive_int, default=3, help="longest n-gram counted (contexts of n - 1 tokens)")
    sub.add_argument("--top-k", type=positive_int, default=8, help="continuations kept per context")
    sub.set_defaults(func=build_ngram)

    sub = command("distill", "distill a small drafter from a target on text files")
    sub.add_argument("files", nargs="+", help="UTF-8 text files, or directories (their *.py files)")
    sub.add_argument("--output", required=True, help="directory to write the drafter to (created if missing)")
    sub.add_argument(
        "--target",
        default=None,
        metavar="PATH",
        help="local directory or Hub id, safetensors only (default: the embedded zoo model)",
    )
    sub.add_argument("--layers", type=positive_int, default=1, help="decoder layers of the drafter")
    sub.add_argument(
        "--objective",
        default="kl",
        choices=["kl", "tv"],
        help="kl: KL(p || q); tv: total variation, 1 - beta, the acceptance rate directly",
    )
    sub.add_argument("--steps", type=positive_int, default=None, help="optimizer steps (default: one epoch)")
    sub.add_argument("--batch-size", type=positive_int, default=8, help="windows per step")
    sub.add_argument("--seq-len", type=positive_int, default=256, help="tokens per window")
    add_training(sub)
    sub.set_defaults(func=distill)

    sub = command("train-drafter", "train an EAGLE-3 head for a target (hf_specdec.distill.train_eagle_drafter)")
    _add_self_distillation_options(
        sub,
        "instructions, one per line: the target answers them and the head learns the answers",
        "directory for the head, checkpoints and data (created)",
    )
    sub.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --output")
    sub.add_argument(
        "--draft-vocab-size",
        type=positive_int,
        default=None,
        help="draft vocabulary (default: every token of the data, at most 32000)",
    )
    sub.add_argument("--ttt-steps", type=positive_int, default=7, help="training-time-test unroll")
    sub.add_argument(
        "--synthetic-prompts",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="instructions the target first writes itself (Magpie), answered with --prompts",
    )
    sub.add_argument(
        "--feature-dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="read the features the head learns from with a copy of the target in this dtype "
        "(default: the target's own; bfloat16 is ~4x faster on CPUs with bfloat16 matrix units)",
    )
    add_training(sub)
    sub.set_defaults(func=train_drafter)

    sub = command("train-mtp", "fit MTP layers to a target and save both (hf_specdec.distill.train_mtp_layers)")
    _add_self_distillation_options(
        sub,
        "instructions, one per line: the target answers them",
        "directory for the model with its MTP layers (created)",
    )
    sub.add_argument(
        "--num-mtp-layers", type=positive_int, default=None, help="MTP layers (default: the config's, else 1)"
    )
    sub.add_argument(
        "--lr", type=positive_float, default=None, help="learning rate (default: 1e-4, from the target's first layer)"
    )
    sub.add_argument("--seed", type=int, default=0, help="torch seed")
    add_threads(sub)
    sub.set_defaults(func=train_mtp)
