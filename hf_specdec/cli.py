"""The `hf-specdec` command line."""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["main"]


def demo(args: argparse.Namespace) -> int:
    """Runs the embedded default pair: plain greedy vs speculative, same prompt, same process."""
    import torch

    import hf_specdec
    from hf_specdec.toy import build_early_exit_pair, decode_ids

    torch.set_num_threads(args.threads) if args.threads else None
    target, drafter = build_early_exit_pair()
    target = hf_specdec.enable(target)
    ids = torch.randint(0, target.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(args.seed))
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    target.generate(ids, max_new_tokens=4)  # warm-up
    start = time.perf_counter()
    plain = target.generate(ids, **kwargs)
    plain_s = time.perf_counter() - start
    start = time.perf_counter()
    out = target.generate(ids, assistant_model=drafter, speculative_gamma=args.gamma, return_dict_in_generate=True,
                          **kwargs)
    spec_s = time.perf_counter() - start
    stats = out.speculative_stats
    new = out.sequences[0, ids.shape[1]:].tolist()
    print("Embedded default: 8-layer Llama-style target + its 1-layer early-exit drafter, built from configs.")
    print(f"Generated ({len(new)} tokens, one character per token id):\n{decode_ids(new)!r}")
    print(f"plain generate:       {plain_s:.3f} s")
    print(f"speculative (gamma={args.gamma}): {spec_s:.3f} s  -> speedup {plain_s / spec_s:.2f}x")
    print(f"alpha {stats.alpha:.3f}, acceptance rate {stats.acceptance_rate:.3f}, "
          f"mean tokens per target call {stats.mean_accepted_length:.2f}")
    same = torch.equal(out.sequences, plain)
    print(f"output identical to plain generate: {same}")
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-specdec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="speculative vs plain generate on the embedded default pair")
    demo_parser.add_argument("--max-new-tokens", type=int, default=128)
    demo_parser.add_argument("--gamma", type=int, default=5)
    demo_parser.add_argument("--seed", type=int, default=0)
    demo_parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    demo_parser.set_defaults(func=demo)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError) as err:
        print(f"hf-specdec: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
