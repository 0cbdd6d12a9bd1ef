"""The `hf-specdec` command line: `demo`, `generate`, `bench`, `build-ngram`, `distill`, `train-drafter`.

Every user error (missing file, drafter whose vocabulary does not fit the target, empty corpus, corrupt checkpoint,
a number out of range) ends as one line `hf-specdec: error: ...` on stderr and exit status 2, without a traceback.
Models are loaded from safetensors only (`use_safetensors=True`): a directory holding only a pickle checkpoint is
refused before anything is unpickled. A GGUF file (`--gguf-file`, read by transformers' GGUF loader with the `gguf`
package) holds no pickle either.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

__all__ = ["main"]

DEFAULT_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
TASK_PROMPTS = 16  # held-out prompts per task in the embedded zoo (hf_specdec/zoo_models/heldout_prompts.json)


class CLIError(Exception):
    """A user error, printed as one line."""


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _set_threads(threads: int | None) -> str:
    """Sets torch's CPU threads and says what was used. By default no more threads than cores are idle (from the
    load average): with another process on the machine, torch's default of one thread per core oversubscribes the
    cores, and a benchmark then measures the scheduler (10-100x slower, and noisy)."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
        return f"{threads} thread(s) (--threads)"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        load = 0.0
    chosen = max(1, min(torch.get_num_threads(), cores, int(cores - load + 0.5)))
    torch.set_num_threads(chosen)
    return f"{chosen} thread(s) ({cores} cores, load {load:.1f}; pass --threads N to choose)"


def _progress(total: int, description: str):
    """A progress bar on stderr that shows up only when the work takes longer than a couple of seconds."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, delay=2.0, file=sys.stderr, leave=False, unit="run")


def _check_output_file(flag: str, name: str | None) -> None:
    """Fails before any work when a result file could not be written at the end."""
    if name is None:
        return
    path = Path(name).expanduser()
    folder = path.parent
    if not folder.is_dir():
        raise CLIError(
            f"{flag} {name!r}: the folder {str(folder)!r} does not exist; create it first or pick another path"
        )
    if path.is_dir():
        raise CLIError(f"{flag} {name!r} is a directory; pass a file name")
    if not os.access(folder, os.W_OK):
        raise CLIError(f"{flag} {name!r}: the folder {str(folder)!r} is not writable")


def _check_output_dir(flag: str, name: str) -> None:
    path = Path(name).expanduser()
    if path.exists() and not path.is_dir():
        raise CLIError(f"{flag} {name!r} is a file; pass a directory (it is created if missing)")


# ----- loading ---------------------------------------------------------------------------------------------------


def _load_target(name: str | None, dtype: str = "float32", gguf_file: str | None = None, **placement):
    """`(target, tokenizer)`: the embedded default when `name` is None, else a local directory or a Hub id (with
    `gguf_file`: that GGUF file in it). `placement`: `device_map`, `offload_folder` or `distributed_config`, passed
    to `from_pretrained`."""
    import torch

    import hf_specdec
    from hf_specdec import zoo

    if name is None:
        if placement:
            raise CLIError(
                "--device-map, --offload-folder and --tp-plan need --target PATH (the embedded zoo model "
                "is loaded whole)"
            )
        target, _, tokenizer = zoo.load_default(dtype=getattr(torch, dtype))
        return hf_specdec.enable(target), tokenizer
    from transformers import AutoTokenizer

    target = hf_specdec.enable(_load_model(name, dtype, gguf_file, **placement))
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **({"gguf_file": gguf_file} if gguf_file else {}))
    except Exception as err:
        raise CLIError(f"could not load a tokenizer from {name!r}: {_one_line(err)}") from None
    return target, tokenizer


def _load_model(name: str, dtype: str = "float32", gguf_file: str | None = None, **placement):
    import torch
    from transformers import AutoModelForCausalLM

    if not Path(name).exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise CLIError(f"no such model directory: {name!r}")
    if gguf_file is not None:
        if Path(name).is_dir() and not (Path(name) / gguf_file).is_file():
            raise CLIError(f"--gguf-file {gguf_file!r} is not a file in {name!r}")
        try:
            return AutoModelForCausalLM.from_pretrained(name, gguf_file=gguf_file, dtype=getattr(torch, dtype)).eval()
        except Exception as err:
            raise CLIError(
                f"could not load {gguf_file!r} from {name!r} (GGUF needs `pip install gguf`): {_one_line(err)}"
            ) from None
    try:
        # safetensors only: a directory holding only a pickle checkpoint never reaches the unpickler
        return AutoModelForCausalLM.from_pretrained(
            name, dtype=getattr(torch, dtype), use_safetensors=True, **placement
        ).eval()
    except Exception as err:
        hint = ""
        if Path(name).is_dir() and not any(Path(name).glob("*.safetensors")):
            hint = (
                "; hf-specdec loads safetensors only and never unpickles: load the pickle checkpoint where you "
                "trust it and re-save it with `save_pretrained` (which writes safetensors)"
            )
        raise CLIError(f"could not load a model from {name!r}: {_one_line(err)}{hint}") from None


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
        except Exception as err:
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
        raise CLIError(
            f"the drafter has a vocabulary of {logits_width(model)} tokens but the target has {width}; "
            "a drafter must share the target's tokenizer"
        )
    if hasattr(table, "vocab_size") and table.vocab_size != width:
        raise CLIError(
            f"the n-gram drafter was built for a vocabulary of {table.vocab_size} tokens but the target "
            f"has {width}; rebuild it with `hf-specdec build-ngram` and the target's tokenizer"
        )


def _read_text_file(path: Path) -> str | None:
    """The file's text, or None when it is binary (NUL bytes, or not UTF-8)."""
    data = path.read_bytes()
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _read_prompt(args) -> str:
    if args.prompt_file is not None:
        try:
            text = _read_text_file(Path(args.prompt_file))
        except OSError as err:
            raise CLIError(f"cannot read --prompt-file {args.prompt_file!r}: {err.strerror or err}") from None
        if text is None:
            raise CLIError(
                f"--prompt-file {args.prompt_file!r} is not a UTF-8 text file (binary data); pass a text file"
            )
        if not text:
            raise CLIError(f"--prompt-file {args.prompt_file!r} is empty")
        return text
    if args.prompt is not None and not args.prompt:
        raise CLIError("--prompt is empty; pass some text, or drop --prompt for the default prompt")
    return args.prompt if args.prompt is not None else DEFAULT_PROMPT


def _read_texts(files: list[str]) -> list[str]:
    """The texts of `files` (directories: their *.py files). A binary file named on the command line is an error;
    binary files found inside a directory are skipped, and said so on stderr."""
    texts, skipped = [], []
    for name in files:
        path = Path(name)
        paths = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in paths:
            try:
                text = _read_text_file(file)
            except OSError as err:
                raise CLIError(f"cannot read {str(file)!r}: {err.strerror or err}") from None
            if text is None:
                if not path.is_dir():
                    raise CLIError(f"{str(file)!r} is not a UTF-8 text file (binary data); drop it from the corpus")
                skipped.append(str(file))
                continue
            texts.append(text)
    if skipped:
        print(
            f"hf-specdec: warning: skipped {len(skipped)} binary or non-UTF-8 file(s): {', '.join(skipped[:5])}"
            f"{' ...' if len(skipped) > 5 else ''}",
            file=sys.stderr,
        )
    if not any(text.strip() for text in texts):
        raise CLIError(f"the corpus is empty: {' '.join(files)} holds no text")
    return texts


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _rotated(names: list[str], shift: int) -> list[str]:
    """The methods in another order each time, so that none always runs first (or right after a slow one)."""
    shift %= len(names)
    return names[shift:] + names[:shift]


def _interleaved(methods: dict, repeats: int, description: str) -> tuple[dict, dict]:
    """Runs every method `repeats` times, in an order rotated each repeat: (seconds per method, last outputs)."""
    seconds, outputs = {name: [] for name in methods}, {}
    with _progress(repeats * len(methods), description) as bar:
        for repeat in range(repeats):
            for name in _rotated(list(methods), repeat):
                elapsed, outputs[name] = _timed(methods[name])
                seconds[name].append(elapsed)
                bar.update()
    return seconds, outputs


def _spread(times: list[float]) -> float:
    """(max - min) / median of one method's repeated timings: how far to trust a ratio of medians."""
    return (max(times) - min(times)) / statistics.median(times) if len(times) > 1 else 0.0


# ----- commands --------------------------------------------------------------------------------------------------


DEMO_LABELS = {"prompt_lookup": "prompt lookup", "ngram": "n-gram table (n=3)", "model": "distilled 1-layer drafter"}
DEMO_TOKENS = 96  # tokens generated for a prompt the demo did not pick (--task/--index, --model)


def demo(args: argparse.Namespace) -> int:
    """Plain greedy vs speculative `generate` streamed side by side on the demo's held-out prompts (or a local
    model), then the summary table over all of them."""
    from hf_specdec.demo import Console

    console = Console()
    threads = _set_threads(args.threads)
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

        target, tokenizer = _load_target(None)
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
        drafters = {DEMO_LABELS[name]: _load_drafter([name], embedded_target=True) for name in names}
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
        target, tokenizer = _load_target(args.model, gguf_file=args.gguf_file)
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
    seconds, outputs = _interleaved(methods, args.repeats, "measuring")
    median = {name: statistics.median(times) for name, times in seconds.items()}
    reference = outputs["plain generate"]
    generated = sum(out.shape[1] - ids.shape[1] for out, (_, _, ids, _) in zip(reference, inputs))
    rows = [Row("plain generate", median["plain generate"], _spread(seconds["plain generate"]), 1.0, None, 1.0, True)]
    for label in drafters:
        stats = SpeculativeStats()
        for out in outputs[label]:
            stats.merge(out.speculative_stats)
        same = all(torch.equal(out.sequences, plain_out) for out, plain_out in zip(outputs[label], reference))
        rows.append(
            Row(
                label,
                median[label],
                _spread(seconds[label]),
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


def train_drafter(args: argparse.Namespace) -> int:
    from accelerate import Accelerator

    from hf_specdec.distill import train_eagle_drafter

    threads = _set_threads(args.threads)
    _check_output_dir("--output", args.output)
    if args.prompts is None and not args.texts and not args.synthetic_prompts:
        raise CLIError(
            "train-drafter needs data: --prompts FILE (one instruction per line, the target answers them), "
            "--texts FILE [FILE ...] and/or --synthetic-prompts N (the target writes N instructions)"
        )
    if args.minutes is None and args.steps is None:
        raise CLIError("train-drafter needs a budget: --minutes M and/or --steps N")
    prompts = None
    if args.prompts is not None:
        content = _read_text_file(Path(args.prompts))
        if content is None:
            raise CLIError(f"--prompts {args.prompts!r} is not a readable UTF-8 text file")
        prompts = [line.strip() for line in content.splitlines() if line.strip()]
    texts = _read_texts(args.texts) if args.texts else None
    target, tokenizer = _load_target(args.target, gguf_file=args.gguf_file)
    print(threads, file=sys.stderr)
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
            except json.JSONDecodeError as err:
                raise CLIError(
                    f"--device-map {args.device_map!r} is not valid JSON ({err.msg}); pass 'auto', a "
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

    _set_threads(args.threads)
    if args.dataset is not None:
        return _generate_dataset(args)
    for flag, value in (
        ("--output", args.output),
        ("--resume", args.resume or None),
        ("--batch-size", args.batch_size),
        ("--text-field", args.text_field),
    ):
        if value is not None:
            raise CLIError(f"{flag} goes with --dataset FILE (generation over a dataset); drop it, or pass --dataset")
    prompt = _read_prompt(args)
    target, tokenizer = _load_target(args.target, args.dtype, **_placement(args))
    drafter_kwargs = _load_drafter(args.drafter, embedded_target=args.target is None, dtype=args.dtype)
    _check_vocabulary(target, drafter_kwargs)
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(execution_device(target))
    if ids.shape[1] == 0:
        raise CLIError("the prompt is empty after tokenization; pass a non-empty --prompt")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    elapsed, out = _timed(
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
    _check_output_file("--output", args.output)
    if Path(args.output).exists() and not args.resume:
        raise CLIError(
            f"--output {args.output!r} exists; pass --resume to continue it after an interruption, or "
            "choose another path"
        )
    text_field = args.text_field or "prompt"
    dataset = Path(args.dataset)
    if dataset.is_dir():  # a `datasets` dataset saved with `save_to_disk`
        import datasets

        try:
            loaded = datasets.load_from_disk(str(dataset))
        except Exception as err:
            raise CLIError(f"could not load a `datasets` dataset from {args.dataset!r}: {_one_line(err)}") from None
        if isinstance(loaded, datasets.DatasetDict):
            raise CLIError(
                f"--dataset {args.dataset!r} holds the splits {sorted(loaded)}; pass one split's folder, "
                f"e.g. {str(dataset / sorted(loaded)[0])!r}"
            )
        rows = load_rows(loaded, text_field)
    elif dataset.is_file():
        rows = load_rows(dataset, text_field)  # errors name the line, before any model is loaded
    else:
        raise CLIError(f"--dataset {args.dataset!r} is neither a JSONL file nor a saved `datasets` folder")
    placement = _placement(args)
    target, tokenizer = _load_target(args.target, args.dtype, **placement)
    drafter_kwargs = _load_drafter(args.drafter, embedded_target=args.target is None, dtype=args.dtype)
    _check_vocabulary(target, drafter_kwargs)
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


def _verify_cost_line(rows: list[dict]):
    """v(γ), the verify forward's cost in plain steps: v(0) = 1 (a forward over one token is a plain step) plus a
    least-squares slope through the measured rows, never negative."""
    slope = sum(row["gamma"] * (row["v"] - 1.0) for row in rows) / sum(row["gamma"] ** 2 for row in rows)
    return lambda gamma: 1.0 + max(0.0, slope) * gamma


def bench(args: argparse.Namespace) -> int:
    import torch
    from transformers import GenerationMixin

    from hf_specdec.theory import expected_speedup, expected_tokens_per_round

    _check_output_file("--output", args.output)
    _check_output_file("--plot", args.plot)
    if args.plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise CLIError(
                '--plot needs matplotlib, which is not installed: `pip install "hf-specdec[plot]"` '
                "(or `pip install matplotlib`)"
            ) from None
    if args.prompt is not None or args.prompt_file is not None:
        prompts = [_read_prompt(args)]
    else:
        from hf_specdec.zoo.tasks import load_prompts

        if args.prompts > TASK_PROMPTS:
            raise CLIError(
                f"--prompts {args.prompts}: the {args.task} task has {TASK_PROMPTS} held-out prompts; "
                f"pass --prompts {TASK_PROMPTS} or fewer"
            )
        prompts = [item["prompt"] for item in load_prompts()[args.task][: args.prompts]]
    threads = _set_threads(args.threads)
    target, tokenizer = _load_target(args.target, args.dtype)
    drafter_kwargs = _load_drafter(args.drafter, embedded_target=args.target is None, dtype=args.dtype)
    _check_vocabulary(target, drafter_kwargs)
    gammas = args.gamma
    ids_list = [tokenizer(p, return_tensors="pt").input_ids for p in prompts]
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

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
        del methods["transformers"]  # transformers has no n-gram table drafter
    for method in methods.values():  # warm-up, untimed: first calls pay one-off costs (allocations, lazy init)
        method(ids_list[0][:, :16], gammas[0])
    rows = []
    with _progress(len(gammas) * args.repeats * len(ids_list) * len(methods), "bench") as bar:
        for gamma in gammas:
            seconds = {name: [0.0] * args.repeats for name in methods}
            identical, stats_list, references = True, [], {}
            for repeat in range(args.repeats):
                for index, ids in enumerate(ids_list):
                    for name in _rotated(list(methods), repeat + index):  # interleaved, in a changing order
                        elapsed, out = _timed(lambda: methods[name](ids, gamma))
                        seconds[name][repeat] += elapsed
                        bar.update()
                        if name == "plain":
                            references[index] = out
                        elif name == "hf_specdec":
                            produced = out
                    identical &= torch.equal(produced.sequences, references[index])
                    if repeat == 0:
                        stats_list.append(produced.speculative_stats)
            median = {name: statistics.median(times) for name, times in seconds.items()}
            plain_tokens = sum(references[i].shape[1] - ids.shape[1] for i, ids in enumerate(ids_list))
            plain_step = median["plain"] / max(1, plain_tokens)  # the paper's T: one plain decoding step
            alpha = sum(s.beta_sum for s in stats_list) / max(1, sum(s.beta_count for s in stats_list))
            drafted = sum(s.drafted_tokens for s in stats_list)
            c = sum(s.draft_time_s for s in stats_list) / max(1, drafted) / plain_step
            calls = sum(s.target_calls for s in stats_list)
            v = sum(s.verify_time_s for s in stats_list) / max(1, calls) / plain_step
            clipped = min(alpha, 1 - 1e-9)
            rows.append(
                {
                    "gamma": gamma,
                    "alpha": alpha,
                    "c": c,
                    "v": v,
                    "tokens_per_target_call": sum(s.emitted_tokens for s in stats_list) / max(1, calls),
                    "plain_s": median["plain"],
                    "transformers_s": median.get("transformers"),
                    "hf_specdec_s": median["hf_specdec"],
                    "runs_s": seconds,
                    "spread": max(_spread(times) for times in seconds.values()),
                    "speedup_over_plain": median["plain"] / median["hf_specdec"],
                    "transformers_speedup_over_plain": (
                        median["plain"] / median["transformers"] if "transformers" in median else None
                    ),
                    "speedup_over_transformers": (
                        median["transformers"] / median["hf_specdec"] if "transformers" in median else None
                    ),
                    "theorem_3_8": expected_speedup(alpha=clipped, gamma=gamma, c=c),
                    "theorem_3_8_at_measured_v": expected_tokens_per_round(clipped, gamma) / (gamma * c + v),
                    "identical_to_plain": identical,
                    "gammas_drafted": sorted({g for s in stats_list for g in s.gamma_history}),
                }
            )
    drafter_name = " ".join(args.drafter or ["model"])
    print(
        f"{len(prompts)} prompt(s) x {args.repeats} interleaved repeat(s) after a warm-up, {args.max_new_tokens} "
        f"new tokens, greedy, drafter {drafter_name}, {threads}"
    )
    print(
        "times: medians over repeats; spread: (max - min) / median, the worst method; c: drafter step / plain "
        "step; v: verify forward / plain step; Thm 3.8: as stated (v = 1), and at the measured v"
    )
    header = (
        f"{'gamma':>5} {'plain s':>8} {'transf. s':>9} {'ours s':>8} {'x plain':>8} {'x transf.':>9} "
        f"{'spread':>6} {'alpha':>6} {'c':>6} {'v':>5} {'Thm 3.8':>8} {'at v':>6} {'same':>5}"
    )
    print(header)
    for row in rows:
        transformers_s = f"{row['transformers_s']:9.2f}" if row["transformers_s"] is not None else f"{'n/a':>9}"
        over = f"{row['speedup_over_transformers']:9.2f}" if row["speedup_over_transformers"] else f"{'n/a':>9}"
        spread = f"{row['spread']:6.0%}" if args.repeats > 1 else f"{'n/a':>6}"
        print(
            f"{row['gamma']:>5} {row['plain_s']:8.2f} {transformers_s} {row['hf_specdec_s']:8.2f} "
            f"{row['speedup_over_plain']:8.2f} {over} {spread} {row['alpha']:6.3f} {row['c']:6.3f} "
            f"{row['v']:5.2f} {row['theorem_3_8']:8.2f} {row['theorem_3_8_at_measured_v']:6.2f} "
            f"{str(row['identical_to_plain']):>5}"
        )
    if args.repeats > 1 and max(row["spread"] for row in rows) > 0.2:
        print(
            "warning: repeated timings differ by more than 20%: the machine is busy; read the ratios with care, "
            "or rerun with more --repeats or fewer --threads",
            file=sys.stderr,
        )
    if args.output:
        Path(args.output).write_text(
            json.dumps(
                {
                    "rows": rows,
                    "prompts": len(prompts),
                    "repeats": args.repeats,
                    "threads": threads,
                    "drafter": drafter_name,
                },
                indent=1,
            )
            + "\n"
        )
    if args.plot is not None:
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
        axes.plot(
            gammas, [r["speedup_over_plain"] for r in rows], "o", color="tab:orange", label="hf_specdec (measured)"
        )
        if "transformers" in methods:
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
            f"\n{len(prompts)} prompt(s) x {args.repeats} repeat(s), {args.max_new_tokens} new tokens, "
            f"greedy, {threads.split(' (')[0]}",
            fontsize=9,
        )
        axes.set_xlabel("gamma (drafted tokens per round)")
        axes.xaxis.get_major_locator().set_params(integer=True)
        axes.set_ylabel("speedup over plain generate")
        axes.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(args.plot)
        print(
            f"plot written to {args.plot} (dashed: Theorem 3.8 with a verify forward as cheap as one decoding step, "
            "as the paper assumes; solid: priced at the measured verify cost, the closer bound on this machine)"
        )
    return 0 if all(row["identical_to_plain"] for row in rows) else 1


def build_ngram(args: argparse.Namespace) -> int:
    from hf_specdec import NGramDrafter, zoo

    _check_output_dir("--output", args.output)
    texts = _read_texts(args.files)
    if args.tokenizer is None:
        tokenizer = zoo.load_tokenizer()
        tokenizer_name = "hf-specdec/stdlib-llama-5m (the embedded zoo tokenizer, `hf_specdec.zoo.load_tokenizer()`)"
    else:
        tokenizer_name = None  # from_texts records a Hub id as is, a local directory by its name only
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        except Exception as err:
            raise CLIError(f"could not load a tokenizer from {args.tokenizer!r}: {_one_line(err)}") from None
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

    _set_threads(args.threads)
    _check_output_dir("--output", args.output)
    texts = _read_texts(args.files)
    target, tokenizer = _load_target(args.target)
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
    tokenizer.save_pretrained(args.output)
    print(
        f"{args.layers}-layer drafter ({sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters) "
        f"written to {args.output}"
    )
    return 0


# ----- parser ----------------------------------------------------------------------------------------------------


def _int_at_least(minimum: int, wording: str):
    """An argparse `type` accepting ints >= `minimum`, with errors that say what is expected."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wording}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {wording}, got {value} (for example {minimum})")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive int")
_non_negative_int = _int_at_least(0, "an int >= 0")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every default, and `--drafter KIND [PATH]` as one kind with an optional path (argparse would print
    `KIND [PATH] [KIND [PATH] ...]`, as if the option repeated)."""

    def _format_args(self, action, default_metavar):
        if action.metavar == "KIND [PATH]":
            return action.metavar
        return super()._format_args(action, default_metavar)

    def _get_help_string(self, action):
        if action.default is None or action.default is argparse.SUPPRESS or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from hf_specdec import __version__

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"hf-specdec {__version__} (torch {installed('torch')}, transformers {installed('transformers')})"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-specdec", description=__doc__.splitlines()[0], formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, help):
        return commands.add_parser(name, help=help, description=help, formatter_class=_Formatter)

    def threads(sub):
        sub.add_argument(
            "--threads",
            type=_positive_int,
            default=None,
            metavar="N",
            help="torch CPU threads (default: no more than the idle cores, from the load average)",
        )

    def training(sub):
        sub.add_argument("--lr", type=_positive_float, default=1e-3, help="learning rate")
        sub.add_argument("--seed", type=int, default=0, help="torch seed")
        sub.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"], help="accelerate's setting")
        sub.add_argument("--cpu", action="store_true", help="force the CPU even when an accelerator is present")
        threads(sub)

    def model_args(sub, gamma_nargs=None):
        sub.add_argument(
            "--target",
            default=None,
            metavar="PATH",
            help="local directory or Hub id of a causal LM, safetensors only (default: the embedded zoo model)",
        )
        sub.add_argument(
            "--drafter",
            nargs="+",
            metavar="KIND [PATH]",
            default=None,
            help="prompt_lookup | ngram [PATH] | model [PATH]: PATH is a local directory or Hub id, "
            "optional with the embedded target (default: model, the embedded distilled drafter)",
        )
        if gamma_nargs:
            sub.add_argument(
                "--gamma",
                type=_positive_int,
                nargs=gamma_nargs,
                default=[4],
                metavar="N",
                help="one or more draft lengths, each measured at a constant γ",
            )
        else:
            sub.add_argument(
                "--gamma",
                type=_positive_int,
                default=None,
                metavar="N",
                help="draft length (default: the drafter's own, as in `generate`: 10 for prompt lookup, else 5)",
            )
        sub.add_argument(
            "--max-new-tokens", type=_positive_int, default=128, metavar="N", help="tokens to generate per prompt"
        )
        sub.add_argument(
            "--prompt", default=None, metavar="TEXT", help="the prompt text (default: a short Python function header)"
        )
        sub.add_argument(
            "--prompt-file", default=None, metavar="FILE", help="read the prompt from this UTF-8 text file"
        )
        sub.add_argument(
            "--dtype",
            default="float32",
            choices=["float32", "bfloat16", "float16"],
            help="dtype the models are loaded in",
        )
        threads(sub)

    tasks = ["completion", "editing", "continuation"]
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
        type=_positive_int,
        default=None,
        metavar="N",
        help="time the first N of the demo's prompts (default: all of them)",
    )
    sub.add_argument(
        "--task",
        default=None,
        choices=tasks,
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
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"tokens to generate per prompt (default: for each demo prompt, the tokens the model writes before it "
        f"starts repeating itself; else {DEMO_TOKENS})",
    )
    sub.add_argument(
        "--gamma",
        type=_positive_int,
        default=None,
        metavar="N",
        help="the draft length the default γ policy (auto) starts from and adapts (default: each drafter's own: 10 "
        "for prompt lookup, else 5)",
    )
    sub.add_argument(
        "--repeats",
        type=_positive_int,
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
    threads(sub)
    sub.set_defaults(func=demo)

    sub = command(
        "generate",
        "generate with any target and drafter, for one prompt or a whole dataset "
        "(data-parallel under `accelerate launch`)",
    )
    model_args(sub)
    sub.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    sub.add_argument("--temperature", type=_positive_float, default=1.0, help="sampling temperature (--do-sample)")
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
        type=_positive_int,
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

    sub = command("bench", "plain vs transformers' assisted vs hf_specdec, side by side")
    model_args(sub, gamma_nargs="+")
    sub.add_argument("--task", default="completion", choices=tasks, help="which kind of held-out prompt")
    sub.add_argument(
        "--prompts",
        type=_positive_int,
        default=4,
        metavar="N",
        help=f"held-out prompts of --task, at most {TASK_PROMPTS} (ignored with --prompt/--prompt-file)",
    )
    sub.add_argument(
        "--repeats",
        type=_positive_int,
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

    sub = command("build-ngram", "count an NGramDrafter from text files")
    sub.add_argument("files", nargs="+", help="UTF-8 text files, or directories (their *.py files)")
    sub.add_argument("--output", required=True, help="directory to write the drafter to (created if missing)")
    sub.add_argument("--tokenizer", default=None, help="local directory or Hub id (default: the zoo tokenizer)")
    sub.add_argument("--n", type=_positive_int, default=3, help="longest n-gram counted (contexts of n - 1 tokens)")
    sub.add_argument("--top-k", type=_positive_int, default=8, help="continuations kept per context")
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
    sub.add_argument("--layers", type=_positive_int, default=1, help="decoder layers of the drafter")
    sub.add_argument(
        "--objective",
        default="kl",
        choices=["kl", "tv"],
        help="kl: KL(p || q); tv: total variation, 1 - beta, the acceptance rate directly",
    )
    sub.add_argument("--steps", type=_positive_int, default=None, help="optimizer steps (default: one epoch)")
    sub.add_argument("--batch-size", type=_positive_int, default=8, help="windows per step")
    sub.add_argument("--seq-len", type=_positive_int, default=256, help="tokens per window")
    training(sub)
    sub.set_defaults(func=distill)

    sub = command("train-drafter", "train an EAGLE-3 head for a target (hf_specdec.distill.train_eagle_drafter)")
    sub.add_argument("--target", required=True, metavar="DIR", help="local directory or Hub id of the target")
    sub.add_argument("--gguf-file", default=None, metavar="FILE", help="a GGUF file inside --target DIR")
    sub.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="instructions, one per line: the target answers them and the head learns the answers",
    )
    sub.add_argument("--texts", nargs="+", default=None, metavar="FILE", help="texts to train on as they are")
    sub.add_argument("--output", required=True, help="directory for the head, checkpoints and data (created)")
    sub.add_argument("--minutes", type=_positive_float, default=None, help="wall-clock budget of the whole run")
    sub.add_argument("--steps", type=_positive_int, default=None, help="optimizer steps")
    sub.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --output")
    sub.add_argument(
        "--draft-vocab-size",
        type=_positive_int,
        default=None,
        help="draft vocabulary (default: every token of the data, at most 32000)",
    )
    sub.add_argument("--ttt-steps", type=_positive_int, default=7, help="training-time-test unroll")
    sub.add_argument("--max-answer-tokens", type=_positive_int, default=256, help="longest answer to a prompt")
    sub.add_argument("--batch-size", type=_positive_int, default=8, help="sequences per step")
    sub.add_argument(
        "--synthetic-prompts",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="instructions the target first writes itself (Magpie), answered with --prompts",
    )
    sub.add_argument(
        "--answer-dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="answer with a copy of the target in this dtype (default: the target's own)",
    )
    sub.add_argument(
        "--feature-dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="read the features the head learns from with a copy of the target in this dtype "
        "(default: the target's own; bfloat16 is ~4x faster on CPUs with bfloat16 matrix units)",
    )
    sub.add_argument("--generation-batch-size", type=_positive_int, default=16, help="prompts answered at once")
    training(sub)
    sub.set_defaults(func=train_drafter)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    threads = torch.get_num_threads()  # the commands set their own; a caller in the same process keeps its own
    # weight-loading bars would bury the one line that matters (the commands' own bars use tqdm directly)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    try:
        return args.func(args)
    except (CLIError, ValueError, TypeError, OSError) as err:
        print(f"hf-specdec: error: {_one_line(err)}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
