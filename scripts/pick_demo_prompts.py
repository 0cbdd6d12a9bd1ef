"""Picks the prompts `hf-specdec demo` shows, by measuring the embedded zoo model on its held-out prompts.

The zoo model is small (5.6M parameters): on most prompts it writes a few sensible lines, then loops (a line over and
over, or one word repeated along a line). Every held-out prompt (`hf_specdec/zoo_models/heldout_prompts.json`, all
tasks) is scored on the model's greedy output of `--max-new-tokens` tokens:

- `sensible_tokens`: the generated tokens up to the end of the longest run of complete lines that (1) still parses
  as Python when appended to the prompt's last function or class (`ast.parse`, with a `pass` closing an open
  block), (2) repeat no line (a short one, such as `else:` or `return None`, at most once) and (3) hold no line that
  repeats a word along itself. The demo generates exactly this many tokens for the prompt, so it stops at the end
  of a line, before the model derails;
- `parses` / `distinct_lines`: the share of the whole output's lines that parse, and of its lines that are distinct
  (for the record: how soon the model derails after the sensible part);
- `speedup`: plain greedy `generate` seconds / speculative seconds over `sensible_tokens` tokens, for each embedded
  drafter with the library's default γ and γ policy (medians of `--repeats` interleaved runs; every output is
  checked equal to plain greedy).

A prompt qualifies with at least `--min-tokens` sensible tokens. A drafter whose geometric-mean speedup over all the
qualifying prompts is under `--min-speedup` is left out of the demo's default table (it does not pay on code the model
writes sensibly; `hf-specdec demo --drafter NAME` still shows it). The qualifying prompts are ranked by `score` =
sensible tokens x the geometric-mean speedup of the drafters kept (the most sensible code, the most sped up), at most
one per held-out file, and the best `--count` are written, with their scores (and those of every qualifying
candidate), to `hf_specdec/zoo_models/demo_prompts.json`, which the demo reads; the demo streams the first.

    python scripts/pick_demo_prompts.py            # about a minute on one idle CPU thread
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import statistics
import sys
import textwrap
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
from transformers import GenerationMixin

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import hf_specdec  # noqa: E402
from hf_specdec import zoo  # noqa: E402
from hf_specdec.zoo.tasks import TASKS, load_prompts  # noqa: E402

OUTPUT = REPO / "hf_specdec" / "zoo_models" / "demo_prompts.json"
_BLOCK_STARTS = ("def ", "async def ", "class ", "@")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _parses(text: str) -> bool:
    """Whether `text` (dedented) parses, as it is or with one `pass` closing an open block."""
    text = textwrap.dedent(text).rstrip()
    last = text.splitlines()[-1] if text else ""
    for closer in ("", "\n" + " " * (_indent(last) + 4) + "pass", "\n" + " " * _indent(last) + "pass"):
        try:
            ast.parse(text + closer)
            return True
        except (SyntaxError, ValueError):
            continue
    return False


def _block_start(prompt: str) -> int:
    """Offset of the line the parse check starts from: the prompt's last `def`/`class` (with its decorators) that no
    later prompt line is indented less than, else its last unindented line."""
    lines = prompt.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    lowest, fallback = math.inf, None
    for number in range(len(lines) - 1, -1, -1):
        line = lines[number]
        if not line.strip():
            continue
        if _indent(line) <= lowest and line.lstrip().startswith(_BLOCK_STARTS):
            while number > 0 and lines[number - 1].lstrip().startswith("@"):
                number -= 1
            return offsets[number]
        if _indent(line) == 0 and fallback is None:
            fallback = offsets[number]
        lowest = min(lowest, _indent(line))
    return fallback if fallback is not None else 0


def _loops_along(line: str) -> bool:
    """A line that repeats a word along itself (`str, str, str, ...`): at least 6 words, under half distinct."""
    words = re.findall(r"\w+", line)
    return len(words) >= 6 and len(set(words)) < len(words) / 2


def complete_lines(generated: str, ended: bool) -> list[str]:
    """The generated lines; the last one only when generation ended on its own (else it may be cut)."""
    lines = generated.split("\n")
    return lines if ended else lines[:-1]


def sensible_chars(prompt: str, generated: str, ended: bool) -> int:
    """Length of the longest prefix of `generated` made of whole lines that parse after the prompt's last block and
    do not loop (see the module docstring); it ends at the end of a line, before its newline."""
    lines = complete_lines(generated, ended)
    seen: dict[str, int] = {}
    usable = 0
    for line in lines:
        key = line.strip()
        seen[key] = seen.get(key, 0) + 1
        if _loops_along(line) or (key and seen[key] > (1 if len(key) > 12 else 2)):
            break
        usable += 1
    head = prompt[_block_start(prompt) :]
    # the longest parsing prefix (a few dozen lines: a linear scan from the longest is cheap enough)
    count = next((count for count in range(usable, 0, -1) if _parses(head + "\n".join(lines[:count]))), 0)
    return len("\n".join(lines[:count])) if any(line.strip() for line in lines[:count]) else 0


def parse_share(prompt: str, generated: str, ended: bool) -> float:
    """The share of the output's non-blank lines in its longest prefix that parses (loops or not)."""
    lines = complete_lines(generated, ended)
    head = prompt[_block_start(prompt) :]
    count = next((count for count in range(len(lines), 0, -1) if _parses(head + "\n".join(lines[:count]))), 0)
    total = sum(1 for line in lines if line.strip())
    return sum(1 for line in lines[:count] if line.strip()) / total if total else 0.0


def distinct_line_share(generated: str) -> float:
    lines = [line.strip() for line in generated.split("\n") if line.strip()]
    return len(set(lines)) / len(lines) if lines else 0.0


def tokens_within(tokenizer, new_ids: list[int], chars: int) -> int:
    """The most leading tokens of `new_ids` whose text fits in `chars` characters."""
    count = 0
    while count < len(new_ids) and len(tokenizer.decode(new_ids[: count + 1])) <= chars:
        count += 1
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated to score a prompt")
    parser.add_argument("--min-tokens", type=int, default=32, help="sensible tokens a prompt needs to qualify")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed runs per method and prompt")
    parser.add_argument("--count", type=int, default=3, help="prompts to keep")
    parser.add_argument(
        "--min-speedup",
        type=float,
        default=1.1,
        help="geometric-mean speedup over the qualifying prompts a drafter needs to be in the default table",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, drafter_model, tokenizer = zoo.load_default()
    target = hf_specdec.enable(target)
    drafters = {
        "prompt_lookup": {"drafter": "prompt_lookup"},
        "ngram": {"drafter": zoo.load_ngram()},
        "model": {"assistant_model": drafter_model},
    }
    warm = tokenizer("def f(x):\n    return x", return_tensors="pt").input_ids
    for kwargs in [{}, *drafters.values()]:  # first calls pay one-off costs
        target.generate(warm, max_new_tokens=8, do_sample=False, **kwargs)

    scored = []
    prompts = load_prompts()
    for task in TASKS:
        for index, example in enumerate(prompts[task]):
            ids = tokenizer(example["prompt"], return_tensors="pt").input_ids
            mask = torch.ones_like(ids)
            plain = GenerationMixin.generate(
                target, ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False
            )
            new_ids = plain[0, ids.shape[1] :].tolist()
            ended = new_ids[-1] == tokenizer.eos_token_id
            generated = tokenizer.decode(new_ids, skip_special_tokens=True)
            chars = sensible_chars(example["prompt"], generated, ended)
            row = {
                "task": task,
                "index": index,
                "id": example["id"],
                "prompt_tokens": ids.shape[1],
                "sensible_tokens": tokens_within(tokenizer, new_ids, chars),
                "parses": round(parse_share(example["prompt"], generated, ended), 3),
                "distinct_lines": round(distinct_line_share(generated), 3),
            }
            qualifies = row["sensible_tokens"] >= args.min_tokens
            print(
                f"{task:12s} {index:2d} {example['id']:34s} sensible tokens {row['sensible_tokens']:3d}, parses "
                f"{row['parses']:.2f}, distinct lines {row['distinct_lines']:.2f}{'' if qualifies else ' (skipped)'}",
                flush=True,
            )
            if qualifies:
                expected = plain[:, : ids.shape[1] + row["sensible_tokens"]]
                common = dict(attention_mask=mask, max_new_tokens=row["sensible_tokens"], do_sample=False)
                row["speedup"] = measure(target, ids, expected, drafters, common, args.repeats)
                print(f"{'':16s}speedup {row['speedup']}", flush=True)
                scored.append(row)

    # drafters that do not pay on the code the model writes sensibly are left out of the demo's default table
    overall = {name: _geomean([row["speedup"][name] for row in scored]) for name in drafters}
    kept = [name for name in drafters if overall[name] >= args.min_speedup]
    for row in scored:
        row["speedup_geomean"] = _geomean([row["speedup"][name] for name in kept]) if kept else 1.0
        row["score"] = round(row["sensible_tokens"] * row["speedup_geomean"], 1)
    ranked = sorted(scored, key=lambda row: -row["score"])
    chosen, files = [], set()
    for row in ranked:
        file = row["id"].rsplit(":", 1)[0]
        if file not in files and len(chosen) < args.count:
            chosen.append(row)
            files.add(file)
    args.output.write_text(
        json.dumps(
            {
                "description": "Held-out prompts `hf-specdec demo` shows, each generated for `sensible_tokens` "
                "tokens, and the drafters its default table shows (those whose geometric-mean speedup over every "
                "qualifying prompt is at least `min_speedup`); chosen and scored by scripts/pick_demo_prompts.py "
                "(its docstring says how).",
                "scored_with": {
                    "max_new_tokens": args.max_new_tokens,
                    "min_tokens": args.min_tokens,
                    "min_speedup": args.min_speedup,
                    "repeats": args.repeats,
                    "threads": args.threads,
                    "torch": torch.__version__,
                },
                "drafters": kept,
                "speedup_over_qualifying_prompts": overall,
                "prompts": chosen,
                "candidates": ranked,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {len(chosen)} prompts to {args.output}")
    return 0


def _geomean(values: list[float]) -> float:
    return round(math.exp(statistics.mean(map(math.log, values))), 3) if values else 1.0


def measure(target, ids, expected, drafters, common, repeats) -> dict[str, float]:
    """Plain seconds / speculative seconds per drafter: medians of `repeats` interleaved runs; every output is
    checked against plain greedy."""
    methods = {"plain": lambda: GenerationMixin.generate(target, ids, **common)}
    for name, kwargs in drafters.items():
        methods[name] = (lambda kwargs: lambda: target.generate(ids, **kwargs, **common))(kwargs)
    seconds = {name: [] for name in methods}
    for repeat in range(repeats):
        names = list(methods)
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            start = time.perf_counter()
            out = methods[name]()
            seconds[name].append(time.perf_counter() - start)
            assert torch.equal(out, expected), f"{name} differs from plain greedy generate"
    plain_s = statistics.median(seconds["plain"])
    return {name: round(plain_s / statistics.median(seconds[name]), 3) for name in drafters}


if __name__ == "__main__":
    sys.exit(main())
