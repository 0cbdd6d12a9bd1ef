"""α during decoding of the shipped KL-distilled drafter vs a TV-distilled one (same steps, same data), held-out
prompts, γ=4, 8 prompts x 96 tokens per task. The TV drafter comes from
`python scripts/build_zoo.py drafter --objective tv --steps 450 --batch-size 16 --lr 2e-3 --bf16 --output build/zoo/drafter_tv`.
No timing: α is the mean β over the rounds (`speculative_stats`), the results one "task T=t objective" key each.

    OMP_NUM_THREADS=1 python benchmarks/bench_distill_objectives.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from harness import write_results  # run from the repository root or benchmarks/

import hf_specdec
from hf_specdec import zoo
from hf_specdec.zoo.tasks import load_prompts

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "zoo_distill_objective_alpha.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tv-drafter", type=Path, default=REPO / "build" / "zoo" / "drafter_tv")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per task")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    target, kl, tokenizer = zoo.load_default()
    target = hf_specdec.enable(target)
    tv = AutoModelForCausalLM.from_pretrained(args.tv_drafter, dtype=torch.float32).eval()
    prompts = load_prompts()
    results = {}
    for task in ("completion", "editing", "continuation"):
        for name, drafter in (("kl", kl), ("tv", tv)):
            for temperature in (0.0, 1.0):
                beta_sum = beta_count = 0
                for index, item in enumerate(prompts[task][: args.prompts]):
                    ids = tokenizer(item["prompt"], return_tensors="pt").input_ids[:, -512:]
                    torch.manual_seed(index)
                    sampling = (
                        dict(do_sample=False)
                        if temperature == 0
                        else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
                    )
                    stats = target.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        assistant_model=drafter,
                        speculative_gamma=4,
                        max_new_tokens=args.max_new_tokens,
                        return_dict_in_generate=True,
                        **sampling,
                    ).speculative_stats
                    beta_sum += stats.beta_sum
                    beta_count += stats.beta_count
                results[f"{task} T={temperature:g} {name}"] = beta_sum / beta_count
                print(task, temperature, name, round(beta_sum / beta_count, 3), flush=True)
    write_results(args.output, results)


if __name__ == "__main__":
    main()
