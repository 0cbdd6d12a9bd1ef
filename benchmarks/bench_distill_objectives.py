"""α during decoding of the shipped KL-distilled drafter vs a TV-distilled one (same steps, same data), held-out
prompts, γ=4, 8 prompts x 96 tokens per task. The TV drafter comes from
`python scripts/build_zoo.py drafter --objective tv --steps 450 --batch-size 16 --lr 2e-3 --bf16 --output build/zoo/drafter_tv`.

    OMP_NUM_THREADS=1 python benchmarks/bench_distill_objectives.py
"""

import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM  # noqa: E402  (after the path insert)

import hf_specdec  # noqa: E402
from hf_specdec import zoo  # noqa: E402
from hf_specdec.zoo.tasks import load_prompts  # noqa: E402

target, kl, tok = zoo.load_default()
target = hf_specdec.enable(target)
tv = AutoModelForCausalLM.from_pretrained(REPO / "build" / "zoo" / "drafter_tv", dtype=torch.float32).eval()
out = {}
for task in ("completion", "editing", "continuation"):
    for name, d in (("kl", kl), ("tv", tv)):
        for T in (0.0, 1.0):
            bs = bc = 0
            for i, item in enumerate(load_prompts()[task][:8]):
                ids = tok(item["prompt"], return_tensors="pt").input_ids[:, -512:]
                torch.manual_seed(i)
                kw = dict(do_sample=False) if T == 0 else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
                s = target.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    assistant_model=d,
                    speculative_gamma=4,
                    max_new_tokens=96,
                    return_dict_in_generate=True,
                    **kw,
                ).speculative_stats
                bs += s.beta_sum
                bc += s.beta_count
            out[f"{task} T={T:g} {name}"] = bs / bc
            print(task, T, name, round(bs / bc, 3), flush=True)
json.dump(out, open(REPO / "benchmarks" / "results" / "zoo_distill_objective_alpha.json", "w"), indent=1)
