"""Speculation on hybrid and state-space models, memory-bound on the CPU: a Qwen3.5-shaped hybrid (gated delta rule
+ full attention) and a Mamba2-shaped model, ~1B parameters each in bfloat16, built from configs.

transformers refuses speculation on these models ("assisted generation is not supported with stateful models"); the
benchmark records its error. hf_specdec rolls their recurrent state back from checkpoints (`hf_specdec.recurrent`):
a copy of the recurrent states before each verify forward, and, after a round that rejected drafts, the kept tokens
fed again in the next round's forward (`hf_specdec.sequence.FOLDED_TAIL`; 0 feeds them in a forward of their own).

The models: random weights, seeded, the deeper layers' output projections (`out_proj` of the recurrent layers,
`o_proj` of the attention layers, `down_proj` of the MLPs) scaled by 0.05 as in `bench_memory_bound.py`, the head
rescaled so that the logits' std is 4; the drafter of each is its 1-layer early exit (embedding, layer 0, final
norm, head; the Qwen3.5 drafter also keeps the first attention layer, as a model of recurrent layers only cannot count
its positions), itself stateful (its recurrent state is rolled back from checkpoints too). In one process, greedy,
batch 1, seeded random prompts, every method interleaved per prompt and repeated, medians of wall times:

- plain `generate`; transformers' assisted generation with the same drafter (refused: its error is recorded);
- ours with the early-exit drafter at the default settings, at constant γ, and at constant γ with `FOLDED_TAIL = 0`;
- ours with prompt lookup (default settings);
- ours with the early-exit drafter at the default settings, its verify forwards in the recurrent kernel's default
  chunks (`hf_specdec.recurrent.CHUNK_LIMIT = 1`: no `chunk_size` passed), to compare with one chunk per verify;
- on the Qwen3.5-shaped hybrid, ours with one MTP layer fitted to it by `hf_specdec.distill.train_mtp_layers`
  (`--mtp-steps` steps on its own greedy continuations of `--mtp-texts` random prompts; 0: no MTP rows), at the
  default settings and at constant γ (transformers refuses these models with any drafter).

Reported for each: speedup over plain, tokens per target call, α, identity with plain greedy (bf16 near ties can
flip: where an output differs, the first differing position and the target's top-2 logit gap there). Costs measured
in the same process: v(k) (a cached forward over k new tokens / a one-token forward), the drafter's cost c, the
recurrent state a checkpoint copies (bytes) and the time of one copy, against a one-token forward.

With `--batches 2,4`, left-padded batches of those sizes too (`run_batches`): rows in lockstep against rows decoded
one at a time.

    python benchmarks/bench_hybrid.py                                   # both models, 2 threads
    python benchmarks/bench_hybrid.py --models qwen3_5 --prompts 2 --repeats 2 --max-new-tokens 48
    python benchmarks/bench_hybrid.py --quick --output /tmp/hybrid_quick.json   # small shapes, a smoke run
    python benchmarks/bench_hybrid.py --models qwen3_5 --mtp-steps 30 --mtp-texts 32
    python benchmarks/bench_hybrid.py --models qwen3_5 --batches 2,4 --mtp-steps 0   # left-padded batches too
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
import transformers
from harness import ForwardCounter, divergence, interleaved, merged_stats, time_summary, write_results
from pairs import PAD, padded_prompts, random_prompts, trained_mtp_layers
from transformers import AutoModelForCausalLM, DynamicCache, GenerationMixin

import hf_specdec
import hf_specdec.recurrent
import hf_specdec.sequence
from hf_specdec.caches import CACHE_KWARG
from hf_specdec.recurrent import RecurrentCheckpoints, chunk_kwargs, recurrent_layers, takes_chunk_size

DEEP_SCALE = 0.05  # the deeper layers' output projections, as in bench_memory_bound.py
HEAD_LOGIT_STD = 4.0

SHAPES = {
    # ~1.0B parameters: 12 gated-delta-rule layers and 4 full-attention layers (Qwen3.5's 3:1 pattern)
    "qwen3_5": dict(
        model_type="qwen3_5_text",
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        tie_word_embeddings=False,
    ),
    # ~0.9B parameters: 32 Mamba2 layers
    "mamba2": dict(
        model_type="mamba2",
        vocab_size=32000,
        hidden_size=2048,
        num_hidden_layers=32,
        state_size=128,
        expand=2,
        head_dim=64,
        num_heads=64,
        n_groups=1,
        tie_word_embeddings=False,
    ),
}
QUICK = {
    "qwen3_5": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, vocab_size=2048,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64),
    "mamba2": dict(hidden_size=256, num_hidden_layers=4, vocab_size=2048, num_heads=8, head_dim=64, state_size=16),
}  # fmt: skip


def build_pair(name: str, quick: bool, dtype: torch.dtype, seed: int = 0):
    """The target and its early-exit drafter (the target's embedding, layer 0, final norm and head; for a hybrid whose
    layer 0 is recurrent, also its first attention layer)."""
    values = dict(SHAPES[name])
    if quick:
        values.update(QUICK[name])
    model_type = values.pop("model_type")
    config = transformers.AutoConfig.for_model(
        model_type, bos_token_id=None, eos_token_id=None, pad_token_id=None, **values
    )
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    layers = target.model.layers if hasattr(target, "model") else target.backbone.layers
    with torch.no_grad():
        for layer in layers[1:]:
            for module in layer.modules():
                for projection in ("out_proj", "o_proj", "down_proj"):
                    linear = getattr(module, projection, None)
                    if isinstance(linear, torch.nn.Linear):
                        linear.weight.mul_(DEEP_SCALE)
        probe = torch.randint(0, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(seed))
        std = target(probe, use_cache=False).logits.float().std()
        target.lm_head.weight.mul_(HEAD_LOGIT_STD / float(std))
    # the drafter's layers: layer 0, and the first attention layer where layer 0 is recurrent (a model of recurrent
    # layers only cannot count its positions, and transformers' Qwen3.5 cannot run without one)
    kept = [0]
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "full_attention" in layer_types and layer_types[0] != "full_attention":
        kept.append(layer_types.index("full_attention"))
    drafter_config = copy.deepcopy(config)
    drafter_config.num_hidden_layers = len(kept)
    if len(kept) > 1:  # (Mamba2's `layer_types` is derived from the layer count)
        drafter_config.layer_types = [layer_types[i] for i in kept]
    drafter = AutoModelForCausalLM.from_config(drafter_config, dtype=dtype).eval()
    prefix = "model.layers." if hasattr(target, "model") else "backbone.layers."
    state = {}
    for key, value in target.state_dict().items():
        if not key.startswith(prefix):
            state[key] = value
            continue
        index, rest = key[len(prefix) :].split(".", 1)
        if int(index) in kept:
            state[f"{prefix}{kept.index(int(index))}.{rest}"] = value
    drafter.load_state_dict(state)
    for model in (target, drafter):
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = None
    return hf_specdec.enable(target), drafter


def mtp_drafter(target, args):
    """One MTP layer fitted to `target` on its own greedy continuations of seeded random prompts (`--mtp-texts` of
    them, `--max-new-tokens` long), `--mtp-steps` steps; returns its drafter and the training summary."""
    from hf_specdec.drafters.mtp import MtpDrafter

    layers = trained_mtp_layers(
        target, args.mtp_steps, args.mtp_texts, args.prompt_length, args.max_new_tokens, generation_batch=8
    )
    return MtpDrafter(layers), layers.training_summary


@torch.no_grad()
def costs(target, drafter, prompt, repeats: int) -> dict:
    """v(k) for k = 1, 5, 9, 13 at the prompt's context, the drafter's c, and one checkpoint's size and copy time."""

    def forward_ms(model, new_tokens: int, chunked: bool = True) -> float:
        cache = DynamicCache(config=model.config)
        model(prompt, **{CACHE_KWARG: cache}, use_cache=True)
        checkpoints = RecurrentCheckpoints(cache, prompt.shape[1])
        checkpoints.save()
        tokens = prompt[:, -new_tokens:] if new_tokens <= prompt.shape[1] else prompt[:, :1].expand(1, new_tokens)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            # as the rounds run it: one chunk of the recurrent kernel where the model takes `chunk_size`
            model(
                tokens, **{CACHE_KWARG: cache}, use_cache=True, **(chunk_kwargs(model, new_tokens) if chunked else {})
            )
            times.append(time.perf_counter() - start)
            checkpoints.fed(new_tokens)
            checkpoints.rewind(prompt.shape[1])
        return 1000 * statistics.median(times[1:])

    takes_chunk_size(target)
    takes_chunk_size(drafter)
    one = forward_ms(target, 1)
    v = {k: forward_ms(target, k) / one for k in (5, 9, 13)}
    v_default_chunks = {k: forward_ms(target, k, chunked=False) / one for k in (5, 9, 13)}
    cache = DynamicCache(config=target.config)
    target(prompt, **{CACHE_KWARG: cache}, use_cache=True)
    checkpoints = RecurrentCheckpoints(cache, prompt.shape[1])
    state_bytes = sum(
        state.numel() * state.element_size()
        for layer in recurrent_layers(cache)
        for state in layer.recurrent_states.values()
        if state is not None
    )
    copies = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        checkpoints.save()
        copies.append(time.perf_counter() - start)
    return {
        "target_one_token_ms": one,
        "v": v,
        "chunk_size_taken": takes_chunk_size(target),
        "v_default_chunks": v_default_chunks,
        "c": forward_ms(drafter, 1) / one,
        "checkpoint_bytes": state_bytes,
        "checkpoint_ms": 1000 * statistics.median(copies[1:]),
    }


def run_batches(target, drafter, args) -> dict:
    """Left-padded batches (`--batches`, rows of `--prompt-length` / 2 to `--prompt-length` tokens, greedy): plain
    batched `generate` against ours with the rows in lockstep (one verify forward per round for the whole batch,
    `hf_specdec.batching`) at the defaults and at constant γ, and against ours decoding the rows one at a time (what
    a batch on a hybrid ran before lockstep: `batching._rolls_back_rows` forced off), interleaved and repeated.
    Reported per batch and method: speedup over plain, tokens per target call (all rows' new tokens over the target's
    forwards), the share of target forwards that carried the whole batch, and the rows equal to plain's."""
    from hf_specdec import batching

    results = {}
    for batch in args.batches:
        ids, mask = padded_prompts(
            batch, target.config.vocab_size, seed=args.seed + batch, shortest=max(2, args.prompt_length // 2),
            longest=args.prompt_length,
        )  # fmt: skip
        common = dict(attention_mask=mask, pad_token_id=PAD, max_new_tokens=args.max_new_tokens, do_sample=False)
        constant = dict(speculative_gamma=args.gamma, speculative_gamma_policy="constant")

        def rows_apart(_):
            original = batching._rolls_back_rows
            batching._rolls_back_rows = lambda model, cache: False
            try:
                return target.generate(ids, assistant_model=drafter, **common)
            finally:
                batching._rolls_back_rows = original

        methods = {
            "plain": lambda _: GenerationMixin.generate(target, ids, **common),
            "lockstep (defaults)": lambda _: target.generate(ids, assistant_model=drafter, **common),
            f"lockstep (constant γ {args.gamma})": lambda _: target.generate(
                ids, assistant_model=drafter, **constant, **common
            ),
            "rows one at a time (defaults)": rows_apart,
        }
        sizes: list[int] = []
        hook = target.register_forward_pre_hook(
            lambda module, positional, named: sizes.append(
                (named["input_ids"] if named.get("input_ids") is not None else positional[0]).shape[0]
            ),
            with_kwargs=True,
        )
        seconds, forwards, outputs = {m: [] for m in methods}, {m: [] for m in methods}, {}

        def on_run(run):
            seconds[run.name].append(run.seconds)
            forwards[run.name].append(list(sizes))
            outputs[run.name] = run.output

        def counted(method):
            def call(item):
                sizes.clear()  # forwards run between timed calls are not this call's
                return method(item)

            return call

        try:
            interleaved(
                {m: counted(f) for m, f in methods.items()}, args.repeats, warmup=1, inputs=[None], on_run=on_run
            )
        finally:
            hook.remove()
        plain_s = statistics.median(seconds["plain"])
        rows = {}
        for method in methods:
            calls = forwards[method][-1]
            rows[method] = {
                "median_s": statistics.median(seconds[method]),
                "speedup": plain_s / statistics.median(seconds[method]),
                "tokens_per_target_call": batch * args.max_new_tokens / max(1, len(calls)),
                "whole_batch_forwards": sum(size == batch for size in calls) / max(1, len(calls)),
                "rows_equal_plain": int((outputs[method] == outputs["plain"]).all(-1).sum()),
            }
            row = rows[method]
            print(
                f"batch {batch} | {method}: {row['speedup']:.2f}x plain, {row['tokens_per_target_call']:.2f} "
                f"tokens/call, whole-batch forwards {row['whole_batch_forwards']:.2f}, rows equal "
                f"{row['rows_equal_plain']}/{batch}",
                flush=True,
            )
        results[str(batch)] = {"prompt_lengths": mask.sum(-1).tolist(), "methods": rows}
    return results


def run_model(name: str, args) -> dict:
    dtype = getattr(torch, args.dtype)
    target, drafter = build_pair(name, args.quick, dtype)
    parameters = sum(p.numel() for p in target.parameters())
    prompts = random_prompts(args.prompts, args.prompt_length, target.config.vocab_size, seed=args.seed)
    new = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    counter = ForwardCounter(target)
    last_stats: dict = {}

    def ours(label, folded=hf_specdec.sequence.FOLDED_TAIL, chunk_limit=hf_specdec.recurrent.CHUNK_LIMIT, **kwargs):
        def call(prompt):
            before = hf_specdec.sequence.FOLDED_TAIL, hf_specdec.recurrent.CHUNK_LIMIT
            hf_specdec.sequence.FOLDED_TAIL, hf_specdec.recurrent.CHUNK_LIMIT = folded, chunk_limit
            try:
                out = target.generate(prompt, return_dict_in_generate=True, **new, **kwargs)
            finally:
                hf_specdec.sequence.FOLDED_TAIL, hf_specdec.recurrent.CHUNK_LIMIT = before
            last_stats[label] = out.speculative_stats
            return out.sequences

        return call

    transformers_error = None
    try:
        GenerationMixin.generate(target, prompts[0], assistant_model=drafter, max_new_tokens=4, do_sample=False)
    except Exception as error:  # recorded: the benchmark reports what transformers does
        transformers_error = f"{type(error).__name__}: {error}"
    constant = dict(speculative_gamma=args.gamma, speculative_gamma_policy="constant")
    labels = {
        "defaults": "ours, early-exit drafter (defaults)",
        "constant": f"ours, early-exit drafter (constant γ {args.gamma})",
        "apart": f"ours, early-exit drafter (constant γ {args.gamma}, kept tokens refed in a forward of their own)",
        "lookup": "ours, prompt lookup (defaults)",
        "default_chunks": "ours, early-exit drafter (defaults, verify forwards in the kernel's default chunks)",
    }
    methods = {
        "plain": lambda prompt: GenerationMixin.generate(target, prompt, **new),
        labels["defaults"]: ours(labels["defaults"], assistant_model=drafter),
        labels["constant"]: ours(labels["constant"], assistant_model=drafter, **constant),
        labels["apart"]: ours(labels["apart"], folded=0, assistant_model=drafter, **constant),
        labels["lookup"]: ours(labels["lookup"], drafter="prompt_lookup"),
        labels["default_chunks"]: ours(labels["default_chunks"], chunk_limit=1, assistant_model=drafter),
    }
    mtp_training = None
    if args.mtp_steps and "full_attention" in (getattr(target.config, "layer_types", None) or ()):  # its MTP block
        mtp, mtp_training = mtp_drafter(target, args)
        for label, kwargs in (
            ("ours, MTP layer (defaults)", {}),
            (f"ours, MTP layer (constant γ {args.gamma})", constant),
        ):
            methods[label] = ours(label, drafter=mtp, **kwargs)
    seconds = {m: [[0.0] * len(prompts) for _ in range(args.repeats)] for m in methods}
    calls: dict[str, int] = dict.fromkeys(methods, 0)
    outputs: dict[str, dict[int, torch.Tensor]] = {m: {} for m in methods}
    stats: dict[str, list] = {m: [] for m in methods}

    def on_run(run):
        seconds[run.name][run.repeat][run.index] = run.seconds
        calls[run.name] += counter.take()
        outputs[run.name][run.index] = run.output
        if run.name in last_stats:
            stats[run.name].append(last_stats[run.name])

    def counted(method):
        def call(prompt):
            counter.take()  # forwards of anything run between timed calls are not this call's
            return method(prompt)

        return call

    interleaved({m: counted(f) for m, f in methods.items()}, args.repeats, warmup=1, inputs=prompts, on_run=on_run)
    rows = {}
    plain_out = outputs["plain"]
    for method in methods:
        row = time_summary(seconds[method], seconds["plain"])
        row["tokens_per_target_call"] = args.max_new_tokens * len(prompts) * args.repeats / max(1, calls[method])
        row["identical_to_plain"] = [bool(torch.equal(outputs[method][i], plain_out[i])) for i in range(len(prompts))]
        row["divergence"] = [
            divergence(
                target,
                prompts[i][0],
                plain_out[i][0, args.prompt_length :],
                outputs[method][i][0, args.prompt_length :],
            )
            for i in range(len(prompts))
        ]
        if stats[method]:
            row["speculative_stats"] = merged_stats(stats[method])
        rows[method] = row
        print(
            f"{name} | {method}: {row['speedup_ratio_of_totals']:.2f}x plain, "
            f"{row['tokens_per_target_call']:.2f} tokens/call, identical {sum(row['identical_to_plain'])}/{len(prompts)}",
            flush=True,
        )
    counter.close()
    return {
        "batches": run_batches(target, drafter, args) if args.batches else None,
        "parameters": parameters,
        "mtp_training": mtp_training,
        "config": target.config.to_dict(),
        "transformers_assisted_generation": transformers_error or "ran",
        "costs": costs(target, drafter, prompts[0], args.cost_repeats),
        "methods": rows,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--cost-repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small shapes: a smoke run")
    parser.add_argument("--mtp-steps", type=int, default=30, help="training steps of the MTP layer (0: no MTP rows)")
    parser.add_argument("--mtp-texts", type=int, default=32, help="continuations the MTP layer trains on")
    parser.add_argument(
        "--batches",
        type=lambda text: [int(b) for b in text.split(",") if b.strip()],
        default=[],
        help="comma-separated sizes of left-padded batches to run too (lockstep against rows one at a time)",
    )
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        results = {"args": vars(args), "models": {name: run_model(name, args) for name in args.models}}
    finally:
        torch.set_num_threads(threads)
    output = args.output or Path(__file__).parent / "results" / f"hybrid_cpu_{args.dtype}.json"
    print(f"wrote {write_results(output, results)}")
    return results


if __name__ == "__main__":
    main()
