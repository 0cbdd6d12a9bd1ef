"""Drafters that ship with the model, against transformers' own path for each: LayerSkip early exit, and MTP layers
trained here (`train_mtp_layers`).

The target is the memory-bound pair's (`pairs.FULL_PAIR`, TinyLlama-1.1B's shape in bfloat16, built by
`hf_specdec.toy.build_early_exit_pair`): its layers after the first add little to the residual stream, as in a
checkpoint trained for early exit, so its own first layer, final norm and head draft well. Methods, interleaved and
repeated in one process, greedy:

`--family early_exit` (default):
- `plain`: `GenerationMixin.generate` (one forward per token);
- `transformers`: transformers' own `generate(assistant_early_exit=1)` (`EarlyExitCandidateGenerator`);
- `ours`: `generate(assistant_early_exit=1)` on the enabled model, default settings;
- `ours_tree`: the same with `speculative_tree_budget=8`.

`--family mtp`: `--mtp-layers` MTP layers (default 1) trained for the target by `hf_specdec.distill.train_mtp_layers`
(`--mtp-steps` steps on its own greedy continuations of `--mtp-texts` random prompts, starting from its first layer),
then
- `plain`;
- `transformers`: transformers' own `generate(use_mtp=True)` when it can serve the target (transformers 5.24 serves
  MTP only for model types whose config declares `num_mtp_layers` and whose class registers MTP key patterns; a
  Llama does neither, so the row records its error);
- `ours`: `generate(drafter=MtpDrafter(layers))`, default settings;
- `ours_constant_3`: the same with `speculative_gamma=3, speculative_gamma_policy="constant"`;
- `ours_tree`: the same with `speculative_tree_budget=8` (a dynamic tree grown with the MTP layers);
- `ours_use_mtp` (DeepSeek-V3): transformers' own request `use_mtp=True` on the enabled model;
- `early_exit`: ours with `assistant_early_exit=1` on the same target, for reference.

With `--batch N` every call decodes a left-padded batch of N prompts (between half `--prompt-length` and all of it):
transformers' assisted generation takes one sequence at a time (its row records the refusal), trees are left out
(verified for one sequence at a time), and `ours_rows` decodes each row alone with ours' defaults, as hf_specdec did
for these drafters before it verified every row in one forward. Tokens per target call then count every row's.

Reported: median seconds, speedup over plain, tokens per target call (verify forwards only: transformers' drafts run
the same model with its config's layer count lowered, and are not counted), identity with plain, and with `--memory`
(early exit) the peak resident memory of a fresh process that loads the target and decodes plainly, with
transformers' early exit and with ours (each its own process). Greedy outputs that leave plain's are recorded per
row with the target's top-2 logit gap where they first differ (bfloat16 near ties). With `--goodness-of-fit N`,
sampling exactness: N samples of three tokens from transformers' path, ours and ours with a tree, each against the
exactly enumerated target (chi-square p-value), on the family's target at the smoke-test size in float32.

    python benchmarks/bench_native_drafters.py [--family early_exit|mtp] [--quick] [--repeats 3] [--prompts 3]
        [--batch 1] [--max-new-tokens 64] [--threads 2] [--memory] [--target llama|deepseek_v3] [--mtp-steps 30]
        [--mtp-texts 32] [--mtp-layers 1] [--goodness-of-fit 1000]
        [--output benchmarks/results/native_drafters_cpu_bf16.json]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from harness import divergence, interleaved, summarize, write_results
from pairs import FULL_PAIR, QUICK_PAIR, padded_prompts, random_prompts, trained_mtp_layers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin

import hf_specdec
from hf_specdec.toy import build_early_exit_pair

DEFAULT_OUTPUT = Path(__file__).parent / "results" / "native_drafters_cpu_bf16.json"
EXIT_LAYER = 1


class VerifyCounter:
    """Counts the target's forwards that run every layer (transformers' early exit drafts through the same model
    with `config.num_hidden_layers` lowered; our view is a module of its own, which no hook on the target sees)."""

    def __init__(self, model):
        self.model, self.full, self.count = model, model.config.num_hidden_layers, 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += module.model.config.num_hidden_layers == self.full

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def build(quick: bool, dtype: torch.dtype = torch.bfloat16):
    shape = QUICK_PAIR if quick else FULL_PAIR
    target, _ = build_early_exit_pair(**shape, dtype=dtype, head_logit_std=4.0)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = None
    return hf_specdec.enable(target), shape["vocab_size"]


def deepseek_config(quick: bool, mtp_layers: int = 1):
    """DeepSeek-V3 (transformers serves its MTP layers with `use_mtp=True`): 61 dense decoder layers (its MTP keys are
    found under `model.layers.61.*`, `model.layers.62.*`, ...), about 1.1B parameters (a smoke-test size with
    `quick`), `mtp_layers` MoE MTP layers whose shared expert has the dense layers' MLP shape."""
    size = (
        dict(hidden_size=256, intermediate_size=704, num_attention_heads=4, vocab_size=2048, kv_lora_rank=64)
        if quick
        else dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, vocab_size=32000, kv_lora_rank=512)
    )
    return AutoConfig.for_model(
        "deepseek_v3",
        num_hidden_layers=61,
        first_k_dense_replace=61,
        num_key_value_heads=size["num_attention_heads"],
        moe_intermediate_size=size["intermediate_size"],
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=None,
        qk_rope_head_dim=32,
        qk_nope_head_dim=32,
        v_head_dim=64,
        num_mtp_layers=mtp_layers,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        **size,
    )


def build_deepseek(
    quick: bool,
    dtype: torch.dtype = torch.bfloat16,
    deep_layer_scale: float = 0.05 * 21 / 60,
    head_logit_std: float = 4.0,
    mtp_layers: int = 1,
):
    """A DeepSeek-V3 target built as `build_early_exit_pair` builds its Llama: the layers after the first add little
    (their output projections scaled by `deep_layer_scale`; by default so that its 60 later layers add what the
    1.1B Llama's 21 do at 0.05), the head rescaled to logits of std `head_logit_std`; its config declares
    `mtp_layers` MTP layers."""
    config = deepseek_config(quick, mtp_layers)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(deep_layer_scale)
            layer.mlp.down_proj.weight.mul_(deep_layer_scale)
        probe = torch.randint(0, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
        target.lm_head.weight.mul_(head_logit_std / float(target(probe, use_cache=False).logits.float().std()))
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = None
    return target, config.vocab_size


def methods_for(target, new_tokens: int):
    common = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return {
        "plain": lambda inputs: GenerationMixin.generate(target, **inputs, **common),
        "transformers": lambda inputs: GenerationMixin.generate(
            target, **inputs, assistant_early_exit=EXIT_LAYER, **common
        ),
        "ours": lambda inputs: target.generate(**inputs, assistant_early_exit=EXIT_LAYER, **common),
        "ours_tree": lambda inputs: target.generate(
            **inputs, assistant_early_exit=EXIT_LAYER, speculative_tree_budget=8, **common
        ),
    }


def mtp_methods_for(target, drafter, new_tokens: int, from_checkpoint: bool):
    """The MTP rows; with `from_checkpoint` (a target loaded from a checkpoint holding its MTP layers) also
    `ours_use_mtp`: transformers' own request, `use_mtp=True`, served by hf_specdec (the layers loaded per call, as
    transformers loads them)."""
    common = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    methods = {
        "plain": lambda inputs: GenerationMixin.generate(target, **inputs, **common),
        "transformers": lambda inputs: GenerationMixin.generate(target, **inputs, use_mtp=True, **common),
        "ours": lambda inputs: target.generate(**inputs, drafter=drafter, **common),
        "ours_constant_3": lambda inputs: target.generate(
            **inputs, drafter=drafter, speculative_gamma=3, speculative_gamma_policy="constant", **common
        ),
        "ours_tree": lambda inputs: target.generate(**inputs, drafter=drafter, speculative_tree_budget=8, **common),
        "early_exit": lambda inputs: target.generate(**inputs, assistant_early_exit=EXIT_LAYER, **common),
    }
    if from_checkpoint:
        methods["ours_use_mtp"] = lambda inputs: target.generate(**inputs, use_mtp=True, **common)
    refused = None
    try:
        methods["transformers"]({"input_ids": torch.zeros((1, 4), dtype=torch.long)})
    except (ValueError, TypeError, RuntimeError) as error:
        refused = f"{type(error).__name__}: {error}"
        del methods["transformers"]
    return methods, refused


def mtp_target(args, folder: str, quick: bool, dtype: torch.dtype = torch.bfloat16):
    """`(target, vocab, drafter, methods, refused, training)` for `--family mtp`: the target and its MTP layer
    trained here;
    for DeepSeek-V3 both are saved to `folder` and the target is loaded back from it (transformers' `use_mtp=True`
    loads MTP layers from the checkpoint a model was loaded from)."""
    from hf_specdec.drafters.mtp import MtpDrafter
    from hf_specdec.drafters.mtp_checkpoint import save_mtp_layers

    target, vocab = (
        build_deepseek(quick, dtype, mtp_layers=args.mtp_layers)
        if args.target == "deepseek_v3"
        else build(quick, dtype)
    )
    layers = trained_mtp_layers(
        target, args.mtp_steps, args.mtp_texts, args.prompt_length, args.max_new_tokens, layers=args.mtp_layers
    )
    training = layers.training_summary
    if args.target == "deepseek_v3":
        save_mtp_layers(target, layers, folder)
        del target, layers
        target = hf_specdec.enable(AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval())
        target.generation_config.eos_token_id = None
        target.generation_config.pad_token_id = None
        drafter = MtpDrafter.from_target(target)
    else:
        drafter = MtpDrafter(layers)
    methods, refused = mtp_methods_for(target, drafter, args.max_new_tokens, args.target == "deepseek_v3")
    return target, vocab, drafter, methods, refused, training


def sampling_exactness(args, folder: str) -> dict:
    """Chi-square p-values of transformers' path and ours against the exactly enumerated target: the family's target
    at the smoke-test size in float32 (bfloat16's near ties aside), three new tokens at temperature 1 and top-k 4,
    `--goodness-of-fit` samples per method (the tests' enumeration and chi-square helpers)."""
    threads = torch.get_num_threads()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    try:
        from test_sampling_distribution import exact_distribution, goodness_of_fit
    finally:
        torch.set_num_threads(threads)  # the tests' conftest sets one thread when imported
    config = dict(temperature=1.0, top_k=4)
    common = dict(do_sample=True, max_new_tokens=3, min_new_tokens=3, **config)
    ours = dict(speculative_gamma=3, speculative_gamma_policy="constant")
    if args.family == "mtp":
        target, vocab, drafter, _, refused, _ = mtp_target(args, folder, quick=True, dtype=torch.float32)
        theirs = dict(use_mtp=True)
        ours.update(drafter=drafter)
    else:
        target, vocab = build(True, torch.float32)
        target, refused = hf_specdec.enable(target), None
        theirs = dict(assistant_early_exit=EXIT_LAYER)
        ours.update(theirs)
    runs = {
        "transformers": lambda inputs: GenerationMixin.generate(target, **inputs, **theirs, **common),
        "ours": lambda inputs: target.generate(**inputs, **ours, **common),
        "ours_tree": lambda inputs: target.generate(**inputs, speculative_tree_budget=4, **ours, **common),
    }
    if refused is not None:
        del runs["transformers"]
    ids = random_prompts(1, args.prompt_length, vocab, seed=7)[0]
    table = exact_distribution(target, ids, config, length=3)
    report = {"samples": args.goodness_of_fit, "outcomes": len(table), "dtype": "float32", **config}
    for name, run in runs.items():
        torch.manual_seed(0)
        samples = [tuple(run({"input_ids": ids})[0, ids.shape[1] :].tolist()) for _ in range(args.goodness_of_fit)]
        inside = [sample for sample in samples if sample in table]
        report[name] = {"p_value": float(goodness_of_fit(table, inside)), "outside_support": len(samples) - len(inside)}
    return report


def peak_memory_mb(method: str, quick: bool, new_tokens: int, threads: int) -> float:
    """Peak resident memory (MB) of a fresh process that builds the target and runs `method` once on one prompt."""
    code = (
        f"import resource, sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); torch.set_num_threads({threads});"
        "import bench_native_drafters as b; from pairs import random_prompts;"
        f"target, vocab = b.build({quick}); ids = random_prompts(1, 32, vocab)[0];"
        f"b.methods_for(target, {new_tokens})[{method!r}]({{'input_ids': ids}});"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out.split()[-1]) / 1024  # ru_maxrss is in KiB on Linux


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smoke-test shape instead of the 1.1B one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument(
        "--batch", type=int, default=1, help="rows per call: left-padded batches of `--prompts` calls (default 1)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory", action="store_true", help="also measure peak resident memory per method")
    parser.add_argument("--family", choices=("early_exit", "mtp"), default="early_exit")
    parser.add_argument(
        "--target", choices=("llama", "deepseek_v3"), default="llama", help="the target of `--family mtp`"
    )
    parser.add_argument("--mtp-steps", type=int, default=30, help="training steps of the MTP layer")
    parser.add_argument("--mtp-texts", type=int, default=32, help="continuations the MTP layer trains on")
    parser.add_argument("--mtp-layers", type=int, default=1, help="MTP layers to train (`--family mtp`)")
    parser.add_argument(
        "--goodness-of-fit",
        type=int,
        default=0,
        help="samples per method of the sampling exactness check on a float32 smoke-size target (0: none)",
    )
    parser.add_argument("--output", type=Path, default=None, help="defaults to results/native_drafters_*.json")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)


def run(args) -> dict:
    refused, training = None, None
    with tempfile.TemporaryDirectory(prefix="native_drafters_") as folder:
        if args.family == "mtp":
            target, vocab, _, methods, refused, training = mtp_target(args, f"{folder}/timed", args.quick)
        else:
            target, vocab = build(args.quick)
            methods = methods_for(target, args.max_new_tokens)
        exactness = sampling_exactness(args, f"{folder}/exactness") if args.goodness_of_fit else None
        return measure(args, target, vocab, methods, refused, training, exactness)


def rows_one_at_a_time(method):
    """`method` on each row of a left-padded batch alone (without its padding), assembled as the batch's output: how
    hf_specdec decoded a batch for a drafter that reads the target's hidden states before it verified every row in
    one forward."""

    def run(inputs):
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        rows = []
        for row in range(ids.shape[0]):
            padding = int((mask[row] == 0).sum())
            out = method({"input_ids": ids[row : row + 1, padding:]})
            rows.append(torch.cat([ids[row : row + 1, :padding], out], dim=-1))
        return torch.cat(rows)

    return run


@torch.no_grad()
def row_divergences(target, prompts: list[dict], reference: list, outputs: list) -> list[dict]:
    """Each row whose greedy output leaves plain's: the call, the row, and where and by what logit gap
    (`harness.divergence`: bfloat16 near ties that a forward over another number of tokens breaks the other way)."""
    found = []
    for call, (inputs, plain, other) in enumerate(zip(prompts, reference, outputs)):
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        for row in range(ids.shape[0]):
            start = 0 if mask is None else int((mask[row] == 0).sum())
            gap = divergence(target, ids[row, start:], plain[row, ids.shape[1] :], other[row, ids.shape[1] :])
            if gap is not None:
                found.append({"call": call, "row": row, **gap})
    return found


def measure(args, target, vocab: int, methods: dict, refused, training, exactness) -> dict:
    if args.batch > 1:  # left-padded batches of rows between half the prompt length and all of it
        batches = [
            padded_prompts(args.batch, vocab, seed=i, shortest=args.prompt_length // 2, longest=args.prompt_length)
            for i in range(args.prompts)
        ]
        prompts = [{"input_ids": ids, "attention_mask": mask} for ids, mask in batches]
        methods = dict(methods, ours_rows=rows_one_at_a_time(methods["ours"]))
        methods.pop("ours_tree", None)  # token trees are verified for one sequence at a time
        if "transformers" in methods:
            try:  # transformers' assisted generation takes one sequence at a time
                methods["transformers"](prompts[0])
            except (ValueError, TypeError, RuntimeError) as error:
                refused = f"{type(error).__name__}: {error}"
                del methods["transformers"]
    else:
        prompts = [{"input_ids": ids} for ids in random_prompts(args.prompts, args.prompt_length, vocab)]
    counter = VerifyCounter(target)
    reference = [methods["plain"](inputs) for inputs in prompts]
    calls, identical, diverged = {}, {}, {}
    for name, method in methods.items():  # outputs and target calls, outside the timed runs
        method(prompts[0])  # a first call probes the model once (capabilities): count warm calls, as the timed ones
        counter.take()
        outputs = [method(inputs) for inputs in prompts]
        calls[name] = counter.take()
        identical[name] = sum(bool(torch.equal(out, ref)) for out, ref in zip(outputs, reference))
        diverged[name] = row_divergences(target, prompts, reference, outputs)
    counter.handle.remove()
    seconds = interleaved(methods, args.repeats, inputs=prompts)
    plain = statistics.median(seconds["plain"])
    tokens = args.prompts * args.max_new_tokens * args.batch  # every row's: a batched forward serves them all
    results = {
        name: {
            "seconds": summarize(seconds[name]),
            "speedup": plain / statistics.median(seconds[name]),
            "tokens_per_target_call": tokens / calls[name],
            "identical_to_plain": f"{identical[name]}/{args.prompts}",
            "divergences": diverged[name],
        }
        for name in methods
    }
    for name in results:
        if name.startswith("ours") and "transformers" in seconds:
            over = statistics.median(seconds["transformers"]) / statistics.median(seconds[name])
            results[name]["over_transformers"] = over
    if refused is not None:
        results["transformers"] = {"refused": refused}
    memory = None
    if args.memory and args.family == "early_exit":
        memory = {
            name: peak_memory_mb(name, args.quick, args.max_new_tokens, args.threads)
            for name in ("plain", "transformers", "ours")
        }
    payload = {
        "family": args.family,
        "target": type(target).__name__,
        "exit_layer": EXIT_LAYER,
        "mtp_training": training,
        "shape": (QUICK_PAIR if args.quick else FULL_PAIR)
        if args.target == "llama" or args.family != "mtp"
        else deepseek_config(args.quick, args.mtp_layers).to_diff_dict(),
        "dtype": "bfloat16",
        "prompts": args.prompts,
        "batch": args.batch,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "results": results,
        "peak_memory_mb": memory,
        "sampling_exactness": exactness,
    }
    output = args.output
    if output is None:
        name = "cpu_bf16" if args.family == "early_exit" else f"mtp_{args.target}_cpu_bf16"
        name += f"_{args.mtp_layers}layers" if args.family == "mtp" and args.mtp_layers > 1 else ""
        name += f"_batch{args.batch}" if args.batch > 1 else ""
        output = DEFAULT_OUTPUT.with_name(f"native_drafters_{name}.json")
    write_results(output, payload)
    print(f"{'method':14} {'speedup':>8} {'tok/call':>9} {'identical':>10} {'x transformers':>15}")
    for name, row in results.items():
        if "refused" in row:
            print(f"{name:14} refused: {row['refused'][:200]}")
            continue
        over = row.get("over_transformers")
        print(
            f"{name:14} {row['speedup']:8.2f} {row['tokens_per_target_call']:9.2f} {row['identical_to_plain']:>10} "
            f"{'' if over is None else f'{over:15.2f}'}"
        )
    if exactness:
        print("sampling exactness (chi-square p-values):", exactness)
    if memory:
        print("peak resident memory (MB):", {name: round(value) for name, value in memory.items()})
    return payload


if __name__ == "__main__":
    main()
