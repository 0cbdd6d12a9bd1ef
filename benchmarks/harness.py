"""The benchmark harness: methods timed side by side in one process, interleaved and rotated, summarized by medians.

The timing core is the package's (`hf_specdec.benchmarking`, which `hf-specdec bench` uses too), re-exported here:
`interleaved` runs every method once per (repeat, input), in an order rotated by one each time, and returns each
method's seconds per repeat; `summarize` and `spread` give the median with its spread; `write_results` writes the
results JSON with the machine and date. What only the scripts need is added here: counting target forwards
(`ForwardCounter`) and host reads (`HostReads`: a tensor's value read on the host, `.item()`, `.tolist()`, `bool(t)`,
..., each of which waits for the device on a GPU), transformers' assistant at a constant γ, the cost of cached
forwards, and the summaries of times, statistics and diverging outputs that several scripts report. The model pairs
and prompts they share are in `pairs.py`. Scripts import these two modules and never each other.

    from harness import HostReads, assistant_with_gamma, interleaved, machine, summarize, timed, write_results
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from hf_specdec.benchmarking import (
    Run,
    interleaved,
    machine,
    rotated,
    spread,
    summarize,
    synchronize,
    timed,
    write_results,
)
from hf_specdec.devices import HostReads  # re-exported: benchmarks count reads with it

__all__ = [
    "ForwardCounter",
    "HostReads",
    "Run",
    "assistant_with_gamma",
    "cached_forward_ms",
    "cost_curves",
    "divergence",
    "interleaved",
    "machine",
    "merged_stats",
    "parse_ints",
    "rotated",
    "spread",
    "summarize",
    "synchronize",
    "time_summary",
    "timed",
    "write_results",
]


def parse_ints(text: str) -> list[int]:
    """A comma-separated command-line list: "1,4,8" -> [1, 4, 8] ("" -> [])."""
    return [int(item) for item in text.split(",") if item.strip()]


def assistant_with_gamma(drafter, gamma: int):
    """A shallow copy of `drafter` for transformers' assisted generation, which reads the draft length from the
    assistant's own generation config: constant `gamma`, no confidence cut-off (the user's drafter is untouched)."""
    assistant = copy.copy(drafter)
    assistant.generation_config = copy.deepcopy(drafter.generation_config)
    assistant.generation_config.num_assistant_tokens = gamma
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    return assistant


class ForwardCounter:
    """Counts a model's forwards (a forward pre-hook), the same way for every method: tokens per target call of plain
    `generate`, transformers' assisted generation and ours alike. `take()` returns the forwards since the last
    `take()` (or since the counter was made); `close()` removes the hook."""

    def __init__(self, model):
        self.count = 0
        self._taken = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1

    def take(self) -> int:
        forwards, self._taken = self.count - self._taken, self.count
        return forwards

    def close(self) -> None:
        self._handle.remove()


# ---------------------------------------------------------------------------------------------------------------
# the cost of forwards


@torch.no_grad()
def cached_forward_ms(model, batch: int, context: int, new_tokens: int, repeats: int = 7) -> float:
    """Median ms of one forward over `new_tokens` new tokens per row after `context` cached ones (a `DynamicCache`,
    cropped back to `context` after each forward), on the model's device, synchronized; one untimed forward first."""
    from transformers import DynamicCache

    from hf_specdec.caches import CACHE_KWARG

    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(1, vocab, (batch, context), generator=generator, device="cpu").to(model.device)
    tokens = torch.randint(1, vocab, (batch, new_tokens), generator=generator, device="cpu").to(model.device)
    cache = DynamicCache(config=model.config)
    model(prompt, **{CACHE_KWARG: cache}, use_cache=True)
    times = []
    for _ in range(repeats + 1):
        synchronize(model.device)
        start = time.perf_counter()
        model(tokens, **{CACHE_KWARG: cache}, use_cache=True, logits_to_keep=new_tokens)
        synchronize(model.device)
        times.append(time.perf_counter() - start)
        cache.crop(-new_tokens)
    return 1000 * statistics.median(times[1:])


@torch.no_grad()
def cost_curves(
    target,
    drafter,
    context: int,
    causal_sizes,
    tree_sizes,
    drafter_frontiers,
    repeats: int,
    batch: int = 1,
    seed: int = 0,
    padding: list[int] | None = None,
) -> dict:
    """Median ms of cached forwards, all measured interleaved (each repeat visits every size once): the target over
    k causal tokens, the target over a random tree of k - 1 nodes plus its root (explicit 4D mask, positions by
    depth), and the drafter over a causal frontier of k tokens. Every forward keeps the logits of all its tokens,
    as verification and tree drafting do. With `padding` (left padding per row, causal sizes only), every forward
    carries the attention mask and positions of a left-padded batch, as plain batched `generate` and our batch loop
    both pass them (on a CPU a masked forward over several tokens costs more than an unmasked one)."""
    from transformers import DynamicCache

    from hf_specdec.caches import CACHE_KWARG
    from hf_specdec.trees import tree_attention_bias, tree_depths

    generator = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    device = target.device
    largest = max([*causal_sizes, *tree_sizes, *drafter_frontiers])
    tokens = torch.randint(1, vocab, (batch, largest), generator=generator).to(device)
    prefix = torch.randint(1, vocab, (batch, context), generator=generator).to(device)
    target_cache = DynamicCache(config=target.config)
    drafter_cache = DynamicCache(config=drafter.config)
    for cache in (target_cache, drafter_cache):  # a sliding-window layer then keeps what each crop restores
        cache.activate_past_recording()
    masked = {}  # k -> the forward kwargs of a left-padded batch for k new tokens
    if padding is not None:
        prefix_mask = (torch.arange(context)[None, :] >= torch.tensor(padding)[:, None]).long().to(device)
        for k in {*causal_sizes, *drafter_frontiers}:
            mask = torch.cat([prefix_mask, prefix_mask.new_ones(batch, k)], dim=-1)  # [batch, context + k]
            masked[k] = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)[:, -k:])
        prefix_kwargs = dict(attention_mask=prefix_mask, position_ids=(prefix_mask.cumsum(-1) - 1).clamp(min=0))
    else:
        prefix_kwargs = {}
    target(prefix, **{CACHE_KWARG: target_cache}, use_cache=True, **prefix_kwargs)
    drafter(prefix, **{CACHE_KWARG: drafter_cache}, use_cache=True, **prefix_kwargs)

    trees = {}
    for size in tree_sizes:  # a random valid tree of size - 1 nodes under the root (the last context token)
        nodes = size - 1
        parents = (
            torch.tensor([[int(torch.randint(-1, i, (1,), generator=generator)) if i else -1 for i in range(nodes)]])
            .expand(batch, nodes)
            .to(device)
        )  # [batch, nodes]
        bias = tree_attention_bias(parents, past_length=context, tail_length=1, dtype=target.dtype)
        depths = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=device), tree_depths(parents)], dim=1)
        trees[size] = (bias, context + depths)  # [batch, 1, size, context + size], [batch, size]

    def target_causal(k):
        target(tokens[:, :k], **{CACHE_KWARG: target_cache}, use_cache=True, logits_to_keep=k, **masked.get(k, {}))
        target_cache.crop(-k)

    def target_tree(k):
        bias, positions = trees[k]
        target(
            tokens[:, :k],
            attention_mask=bias,
            position_ids=positions,
            **{CACHE_KWARG: target_cache},
            use_cache=True,
            logits_to_keep=k,
        )
        target_cache.crop(-k)

    def drafter_causal(k):
        drafter(tokens[:, :k], **{CACHE_KWARG: drafter_cache}, use_cache=True, logits_to_keep=k, **masked.get(k, {}))
        drafter_cache.crop(-k)

    jobs = {
        **{f"target {k}": (lambda k=k: target_causal(k)) for k in causal_sizes},
        **{f"tree {k}": (lambda k=k: target_tree(k)) for k in tree_sizes},
        **{f"drafter {k}": (lambda k=k: drafter_causal(k)) for k in drafter_frontiers},
    }
    seconds = interleaved(jobs, repeats, warmup=1, device=device)  # each repeat: one forward of every kind and size
    ms = {key: 1000 * statistics.median(values) for key, values in seconds.items()}
    step = ms["target 1"]
    return {
        "batch": batch,
        "context": context,
        "left_padding": padding,
        "target_step_ms": step,
        "target_ms": {k: ms[f"target {k}"] for k in causal_sizes},
        "v_causal": {k: ms[f"target {k}"] / step for k in causal_sizes},
        "v_tree_mask": {k: ms[f"tree {k}"] / step for k in tree_sizes},
        "drafter_ms": {k: ms[f"drafter {k}"] for k in drafter_frontiers},
        "c_frontier": {k: ms[f"drafter {k}"] / step for k in drafter_frontiers},
    }


# ---------------------------------------------------------------------------------------------------------------
# summaries


def time_summary(seconds: list[list[float]], plain: list[list[float]]) -> dict:
    """`seconds[repeat][prompt]` of one method and of plain decoding: medians, totals, and the speedups over plain
    they give."""
    flat, plain_flat = [s for row in seconds for s in row], [s for row in plain for s in row]
    return {
        "seconds": seconds,
        "median_s": statistics.median(flat),
        "total_s": sum(flat),
        "speedup_ratio_of_medians": statistics.median(plain_flat) / statistics.median(flat),
        "speedup_ratio_of_totals": sum(plain_flat) / sum(flat),
        "speedup_median_of_paired_ratios": statistics.median(p / s for p, s in zip(plain_flat, flat)),
    }


def merged_stats(stats_list) -> dict:
    """`speculative_stats` of several runs, summed: acceptance, tokens per target call, γ and timings."""
    target_calls = sum(s.target_calls for s in stats_list)
    row_rounds = sum(s.row_rounds for s in stats_list)
    drafted_history = [d for s in stats_list for d in s.drafted_history]
    gamma_history = [g for s in stats_list for g in s.gamma_history]
    return {
        "target_calls": target_calls,
        "emitted_tokens": sum(s.emitted_tokens for s in stats_list),
        "tokens_per_target_call": sum(s.emitted_tokens for s in stats_list) / max(1, target_calls),
        "mean_accepted_length": (sum(s.accepted_tokens for s in stats_list) + row_rounds) / max(1, row_rounds),
        "alpha": sum(s.beta_sum for s in stats_list) / max(1, sum(s.beta_count for s in stats_list)),
        "acceptance_rate": (
            sum(s.accepted_tokens for s in stats_list) / max(1, sum(s.drafted_tokens for s in stats_list))
        ),
        "mean_drafted_per_round": sum(drafted_history) / max(1, len(drafted_history)),
        "max_drafted_per_round": max(drafted_history, default=0),
        "mean_gamma": sum(gamma_history) / max(1, len(gamma_history)),
        "drafted_history_first_run": stats_list[0].drafted_history if stats_list else [],
        "gamma_history_first_run": stats_list[0].gamma_history if stats_list else [],
        "draft_time_s": sum(s.draft_time_s for s in stats_list),
        "verify_time_s": sum(s.verify_time_s for s in stats_list),
    }


@torch.no_grad()
def divergence(target, prompt_row, plain_new, other_new) -> dict | None:
    """Where `other_new` (`[new]`) first leaves plain greedy's `plain_new` (`[new]`) after `prompt_row`
    (`[prompt]`, padding removed), and the target's top-2 logit gap there (one plain forward over the prefix):
    in bfloat16 a gap of a fraction of an ulp is a near tie that a forward over a different number of tokens may
    break the other way. None when they are equal."""
    different = (plain_new != other_new).nonzero()
    if len(different) == 0:
        return None
    position = int(different[0])
    prefix = torch.cat([prompt_row, plain_new[:position]])[None]  # [1, prompt + position]
    logits = target(prefix, use_cache=False, logits_to_keep=1).logits[0, -1].float()  # [vocab]
    top = logits.topk(2)
    plain_token, method_token = int(plain_new[position]), int(other_new[position])
    return {
        "first_differing_position": position,
        "plain_token": plain_token,
        "method_token": method_token,
        "top2_logit_gap": float(top.values[0] - top.values[1]),
        "method_token_is_top2": method_token == int(top.indices[1]),
        # this forward over the whole prefix rounds differently again: the two contested tokens' logits in it
        "plain_minus_method_logit": float(logits[plain_token] - logits[method_token]),
        "method_token_rank": int((logits > logits[method_token]).sum()),
    }
