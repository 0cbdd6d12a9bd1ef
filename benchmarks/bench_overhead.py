"""The decoding loop's own cost: ms per round and host reads per round on a nearly free forward.

A tiny fp32 Llama (hidden 64, 2 layers) on one thread makes each forward cost next to nothing, so what is left is
the loop: bookkeeping, checks, and the reads of tensor values on the host (`HostReads`, outside the models'
forwards), each of which waits for the device on a GPU. The drafter is an exact copy of the target, so every draft is accepted and every
round emits γ + 1 tokens. Greedy, constant γ, batch 1, one process, every method interleaved and repeated:

- plain `GenerationMixin.generate` (one forward per token: its per-token cost is the floor);
- transformers' assisted generation with the copy as assistant (constant `num_assistant_tokens` = γ);
- ours, `speculative_gamma_policy="constant"`;
- a minimal loop written here over the same transformers forwards: draft γ tokens with the copy, verify them in one
  target forward, keep the agreeing prefix and the target's next token, crop both `DynamicCache`s, and read the
  device once per round (the accepted count).

Reported per method: ms per round (wall time / target forwards), host reads per target forward, and ours' speed
relative to the minimal loop's and to transformers'. Speed is measured here, never asserted in tests.

    python benchmarks/bench_overhead.py [--hidden 64] [--gamma 4] [--max-new-tokens 128] [--repeats 15]
        [--output benchmarks/results/overhead_cpu_fp32_h64.json]
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from harness import (  # run from benchmarks/
    ForwardCounter,
    HostReads,
    assistant_with_gamma,
    interleaved,
    summarize,
    write_results,
)
from transformers import DynamicCache, GenerationMixin, LlamaConfig, LlamaForCausalLM

import hf_specdec
from hf_specdec.caches import CACHE_KWARG

DEFAULT_OUTPUT = Path(__file__).parent / "results" / "overhead_cpu_fp32_h64.json"


def build_pair(hidden: int, layers: int, vocab: int, seed: int = 0):
    """A tiny Llama built from a config and an exact copy of it as the drafter (every draft accepted)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper logits: no argmax near-ties between the two identical models' forwards
        target.lm_head.weight.mul_(8.0)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = None
    return hf_specdec.enable(target), copy.deepcopy(target)


@torch.no_grad()
def minimal_loop(target, drafter, input_ids: torch.LongTensor, max_new_tokens: int, gamma: int) -> torch.LongTensor:
    """Greedy speculative decoding in its least code: one host read per round (how many drafts were accepted)."""
    target_cache, drafter_cache = DynamicCache(), DynamicCache()
    prompt_length = input_ids.shape[1]
    logits = target(input_ids, **{CACHE_KWARG: target_cache}, use_cache=True).logits
    sequence = torch.cat([input_ids, logits[:, -1:].argmax(-1)], dim=-1)  # [1, length]
    drafter_length = 0  # tokens of `sequence` in the drafter's cache
    length = sequence.shape[1]
    while length - prompt_length < max_new_tokens:
        new = sequence[:, drafter_length:]
        drafts = []
        for _ in range(gamma):
            logits = drafter(new, **{CACHE_KWARG: drafter_cache}, use_cache=True).logits
            new = logits[:, -1:].argmax(-1)  # [1, 1]
            drafts.append(new)
        drafts = torch.cat(drafts, dim=-1)  # [1, gamma]
        logits = target(torch.cat([sequence[:, -1:], drafts], dim=-1), **{CACHE_KWARG: target_cache}).logits
        verdict = logits.argmax(-1)  # [1, gamma + 1]: the target's token after each position
        accepted = int((drafts == verdict[:, :gamma]).cumprod(-1).sum())  # the round's one host read
        sequence = torch.cat([sequence, drafts[:, :accepted], verdict[:, accepted : accepted + 1]], dim=-1)
        length += accepted + 1
        # both caches keep every committed token but the newest (it is the next round's first input)
        target_cache.crop(-(gamma - accepted))
        drafter_length = min(drafter_cache.get_seq_length(), length - 1)
        if drafter_cache.get_seq_length() > drafter_length:
            drafter_cache.crop(-(drafter_cache.get_seq_length() - drafter_length))
    return sequence[:, : prompt_length + max_new_tokens]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)


def run(args) -> dict:
    target, drafter = build_pair(args.hidden, args.layers, args.vocab)
    ids = torch.randint(0, args.vocab, (1, args.prompt_length), generator=torch.Generator().manual_seed(0))
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    assistant = assistant_with_gamma(drafter, args.gamma)
    methods = {
        "plain": lambda: GenerationMixin.generate(target, ids, **common),
        "transformers": lambda: GenerationMixin.generate(target, ids, assistant_model=assistant, **common),
        "ours": lambda: target.generate(
            ids, assistant_model=drafter, speculative_gamma=args.gamma, speculative_gamma_policy="constant", **common
        ),
        "minimal": lambda: minimal_loop(target, drafter, ids, args.max_new_tokens, args.gamma),
    }
    reference = methods["plain"]()
    results = {}
    for name, method in methods.items():  # outputs, target forwards and host reads, outside the timed runs
        method()  # first calls probe the model once (capabilities): count a warm call, as the timed ones are
        counter = ForwardCounter(target)
        with HostReads(outside_of=[target, drafter]) as reads:  # the loop's reads, not the forwards' own
            out = method()
        counter.close()
        results[name] = {
            "identical_to_plain": bool(torch.equal(out, reference)),
            "target_forwards": counter.count,
            "host_reads": reads.count,
            "host_reads_per_round": reads.count / counter.count,
        }
    seconds = interleaved(methods, args.repeats)
    for name in methods:
        summary = summarize(seconds[name])
        results[name]["seconds"] = summary
        results[name]["ms_per_round"] = 1000 * summary["median"] / results[name]["target_forwards"]
        results[name]["speedup"] = results["plain"]["seconds"]["median"] / summary["median"]
        results[name]["tokens_per_target_call"] = args.max_new_tokens / results[name]["target_forwards"]
    speed = {name: 1 / results[name]["seconds"]["median"] for name in methods}
    payload = {
        "benchmark": "overhead",
        "settings": {key: value for key, value in vars(args).items() if key != "output"},
        "results": results,
        "ours_vs_minimal": speed["ours"] / speed["minimal"],
        "ours_vs_transformers": speed["ours"] / speed["transformers"],
    }
    print(f"{'method':<14}{'ms/round':>10}{'reads/round':>13}{'forwards':>10}  equals plain")
    for name, row in results.items():
        print(
            f"{name:<14}{row['ms_per_round']:>10.2f}{row['host_reads_per_round']:>13.1f}"
            f"{row['target_forwards']:>10}  {row['identical_to_plain']}"
        )
    print(
        f"ours / minimal loop speed: {payload['ours_vs_minimal']:.2f}x; ours / transformers: "
        f"{payload['ours_vs_transformers']:.2f}x"
    )
    write_results(args.output, payload)
    return payload


if __name__ == "__main__":
    main()
