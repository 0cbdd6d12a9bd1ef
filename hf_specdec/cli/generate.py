"""`hf-specdec generate`: any target and drafter, for one prompt or every row of a dataset (data-parallel under
`accelerate launch`, or sharded with `--device-map` / `--tp-plan`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ..benchmarking import timed
from . import loading
from .arguments import add_model_args, positive_float, positive_int
from .common import CLIError, check_output_file, one_line, read_prompt, set_threads


def _placement(args: argparse.Namespace) -> dict:
    """`from_pretrained` kwargs that place the target: accelerate's `device_map` (with `offload_folder`) or
    transformers' tensor parallelism (`tp_plan`, under `torchrun`)."""
    placement = {}
    if args.offload_folder is not None and args.device_map is None:
        raise CLIError(
            "--offload-folder needs --device-map (e.g. --device-map auto); it is where layers that fit "
            "nowhere else are offloaded to disk"
        )
    if args.device_map is not None:
        if args.tp_plan is not None:
            raise CLIError(
                "--device-map and --tp-plan exclude each other: pick accelerate's dispatch (--device-map) "
                "or tensor parallelism (--tp-plan)"
            )
        device_map = args.device_map
        if device_map.lstrip().startswith("{"):
            try:
                device_map = json.loads(device_map)
            except (json.JSONDecodeError, RecursionError) as err:
                reason = getattr(err, "msg", "nested too deeply")
                raise CLIError(
                    f"--device-map {args.device_map[:200]!r} is not valid JSON ({reason}); pass 'auto', a "
                    'device such as \'cpu\', or a JSON object {"module name": "device"}'
                ) from None
        placement["device_map"] = device_map
        if args.offload_folder is not None:
            placement["offload_folder"] = args.offload_folder
    if args.tp_plan is not None:
        if int(os.environ.get("WORLD_SIZE", "1")) < 2:
            raise CLIError(
                "--tp-plan shards the target over the processes of a launch: run it under `torchrun "
                "--nproc-per-node N -m hf_specdec.cli generate ...` with N >= 2"
            )
        from transformers import DistributedConfig

        placement["distributed_config"] = DistributedConfig(tp_plan=args.tp_plan)
    return placement


def generate(args: argparse.Namespace) -> int:
    import torch

    from hf_specdec.devices import execution_device

    set_threads(args.threads)
    if args.dataset is not None:
        return _generate_dataset(args)
    for flag, value in (
        ("--output", args.output),
        ("--resume", args.resume or None),
        ("--batch-size", args.batch_size),
        ("--text-field", args.text_field),
        ("--completion-field", args.completion_field),
    ):
        if value is not None:
            raise CLIError(f"{flag} goes with --dataset FILE (generation over a dataset); drop it, or pass --dataset")
    prompt = read_prompt(args)
    target, tokenizer = loading.load_target(args.target, args.dtype, **_placement(args))
    drafter_kwargs = loading.load_drafter(args.drafter, embedded_target=args.target is None, dtype=args.dtype)
    loading.check_vocabulary(target, drafter_kwargs)
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(execution_device(target))
    if ids.shape[1] == 0:
        raise CLIError("the prompt is empty after tokenization; pass a non-empty --prompt")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    elapsed, out = timed(
        lambda: target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.max_new_tokens,
            speculative_gamma=args.gamma,
            return_dict_in_generate=True,
            **_sampling(args),
            **drafter_kwargs,
        )
    )
    new = out.sequences[0, ids.shape[1] :]
    if _is_main_process():
        print(prompt + tokenizer.decode(new, skip_special_tokens=True))
        stats = out.speculative_stats
        print(
            f"[{len(new)} tokens in {elapsed:.2f} s, alpha {stats.alpha:.3f}, "
            f"{stats.mean_accepted_length:.2f} tokens per target call]",
            file=sys.stderr,
        )
    return 0


def _sampling(args: argparse.Namespace) -> dict:
    """The decoding options of `generate` (sampling or greedy, and the γ policy when one is named)."""
    options = dict(do_sample=True, temperature=args.temperature) if args.do_sample else dict(do_sample=False)
    if args.gamma_policy is not None:
        options["speculative_gamma_policy"] = args.gamma_policy
    return options


def _is_main_process() -> bool:
    """Rank 0 of a launch (or the only process): the one that prints."""
    return int(os.environ.get("RANK", "0")) == 0


def _generate_dataset(args: argparse.Namespace) -> int:
    """`generate --dataset`: every row of a JSONL file or a saved `datasets` dataset into `--output`, data-parallel
    over the processes of `accelerate launch` / `torchrun` (`hf_specdec.generate_dataset`)."""
    from hf_specdec.dataset_generation import generate_dataset, load_rows, process_state
    from hf_specdec.devices import execution_device

    if args.prompt is not None or args.prompt_file is not None:
        raise CLIError("--dataset takes the prompts from the dataset; drop --prompt/--prompt-file")
    if args.output is None:
        raise CLIError("--dataset needs --output FILE, the JSONL file the completions are written to")
    check_output_file("--output", args.output)
    if Path(args.output).is_symlink():
        raise CLIError(
            f"--output {args.output!r} is a symbolic link; hf-specdec never writes through a link: pass the path of "
            "the file itself"
        )
    if Path(args.output).exists() and not args.resume:
        raise CLIError(
            f"--output {args.output!r} exists; pass --resume to continue it after an interruption, or "
            "choose another path"
        )
    text_field = args.text_field or "prompt"
    completion_field = args.completion_field or "completion"
    dataset = Path(args.dataset)
    if dataset.is_dir():  # a `datasets` dataset saved with `save_to_disk`
        import datasets

        try:
            loaded = datasets.load_from_disk(str(dataset))
        except Exception as err:
            raise CLIError(f"could not load a `datasets` dataset from {args.dataset!r}: {one_line(err)}") from None
        if isinstance(loaded, datasets.DatasetDict):
            raise CLIError(
                f"--dataset {args.dataset!r} holds the splits {sorted(loaded)}; pass one split's folder, "
                f"e.g. {str(dataset / sorted(loaded)[0])!r}"
            )
        rows = load_rows(loaded, text_field, completion_field=completion_field)
    elif dataset.is_file():
        # errors name the line, before any model is loaded
        rows = load_rows(dataset, text_field, completion_field=completion_field)
    else:
        raise CLIError(f"--dataset {args.dataset!r} is neither a JSONL file nor a saved `datasets` folder")
    placement = _placement(args)
    target, tokenizer = loading.load_target(args.target, args.dtype, **placement)
    drafter_kwargs = loading.load_drafter(args.drafter, embedded_target=args.target is None, dtype=args.dtype)
    loading.check_vocabulary(target, drafter_kwargs)
    if not placement:  # one whole copy per process, on that process's device
        device = process_state().device
        target.to(device)
        if "assistant_model" in drafter_kwargs:
            drafter_kwargs["assistant_model"].to(device)
    start = time.perf_counter()
    written = generate_dataset(
        target,
        tokenizer,
        rows,
        args.output,
        text_field=text_field,
        completion_field=completion_field,
        batch_size=args.batch_size or 8,
        resume=args.resume,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        speculative_gamma=args.gamma,
        **_sampling(args),
        **drafter_kwargs,
    )
    if _is_main_process():
        print(
            f"{written} row(s) generated in {time.perf_counter() - start:.1f} s on {execution_device(target)}; "
            f"{len(rows)} row(s) in {args.output}",
            file=sys.stderr,
        )
    return 0


def add_parser(command) -> None:
    """The `generate` command and its options."""
    sub = command(
        "generate",
        "generate with any target and drafter, for one prompt or a whole dataset "
        "(data-parallel under `accelerate launch`)",
    )
    add_model_args(sub)
    sub.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    sub.add_argument("--temperature", type=positive_float, default=1.0, help="sampling temperature (--do-sample)")
    sub.add_argument(
        "--seed",
        type=int,
        default=None,
        help="torch seed for sampling (default: unseeded; with "
        "--dataset each batch is seeded with it plus its first row's index)",
    )
    sub.add_argument(
        "--gamma-policy",
        default=None,
        metavar="NAME",
        help="how γ is chosen each round: 'constant' keeps --gamma (reproducible rounds), 'auto' "
        "adapts it to measured acceptance and cost (default: the library's default, "
        "`hf_specdec.policies.list_gamma_policies()` lists them)",
    )
    sub.add_argument(
        "--dataset",
        default=None,
        metavar="FILE",
        help="generate for every row of this JSONL file (or folder saved by `datasets`' save_to_disk); "
        "rows may carry per-row `generate` options in a 'generation_kwargs' object",
    )
    sub.add_argument("--output", default=None, metavar="JSONL", help="with --dataset: the file the rows go to")
    sub.add_argument(
        "--resume", action="store_true", help="with --dataset: continue an --output left partial by an interrupted run"
    )
    sub.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --dataset: rows per generate call, length-sorted (default 8)",
    )
    sub.add_argument(
        "--text-field",
        default=None,
        metavar="NAME",
        help="with --dataset: the row field holding the prompt (default 'prompt')",
    )
    sub.add_argument(
        "--completion-field",
        default=None,
        metavar="NAME",
        help="with --dataset: the output field holding the completion (default 'completion')",
    )
    sub.add_argument(
        "--device-map",
        default=None,
        metavar="MAP",
        help="load --target with accelerate's device_map: 'auto', a device, or a JSON object of module "
        "names to devices ('cpu', 'disk', 0, ...)",
    )
    sub.add_argument(
        "--offload-folder",
        default=None,
        metavar="DIR",
        help="with --device-map: where layers offloaded to disk are kept",
    )
    sub.add_argument(
        "--tp-plan",
        default=None,
        choices=["auto"],
        help="shard --target with transformers' tensor parallelism, under `torchrun --nproc-per-node N`",
    )
    sub.set_defaults(func=generate)
