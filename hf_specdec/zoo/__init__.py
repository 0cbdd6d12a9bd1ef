"""The embedded zoo: a small code model trained on the Python standard library, with its drafters.

`hf_specdec/zoo_models/` ships (float16 safetensors, together under 20 MB):

- `target/`: a 5.6M-parameter Llama (6 layers, hidden 256) trained on the train split of the stdlib corpus;
- `drafter/`: a 1-layer Llama distilled from the target ([`hf_specdec.distill.distill_drafter`]);
- `ngram/`: an [`NGramDrafter`] (n=3) counted on the same train split;
- `tokenizer/`: the 8192-token byte-level BPE all three share;
- `manifest.json` (every corpus file, its sha256 and split) and `heldout_prompts.json` (benchmark prompts).

`scripts/build_zoo.py` rebuilds all of it deterministically.

Example:

```python
>>> import torch, hf_specdec
>>> from hf_specdec.zoo import load_default
>>> target, drafter, tokenizer = load_default()
>>> target = hf_specdec.enable(target)
>>> ids = tokenizer("import os\\nimport", return_tensors="pt").input_ids
>>> out = target.generate(ids, assistant_model=drafter, max_new_tokens=8, do_sample=False)
>>> print(tokenizer.decode(out[0]))
import os
import sys
import sys
import sys
>>> torch.equal(out, target.generate(ids, max_new_tokens=8, do_sample=False))  # plain greedy's tokens, exactly
True

```
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["ZOO_DIR", "load_default", "load_ngram", "load_tokenizer"]

ZOO_DIR = Path(__file__).resolve().parent.parent / "zoo_models"
"""The folder of the embedded zoo's files (`hf_specdec/zoo_models/` in the installed package)."""


def _path(name: str) -> Path:
    path = ZOO_DIR / name
    if not (path / "config.json").is_file() and not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"The embedded zoo model {name!r} is missing from {ZOO_DIR}. Reinstall hf-specdec, "
            "or rebuild it with `python scripts/build_zoo.py` from a source checkout."
        )
    return path


def load_tokenizer():
    """The zoo's byte-level BPE tokenizer (`PreTrainedTokenizerFast`, 8192 tokens)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_path("tokenizer"))


def load_default(dtype: torch.dtype = torch.float32):
    """Returns `(target, drafter, tokenizer)`: the zoo's code model, its distilled 1-layer drafter, the tokenizer.

    The weights are stored in float16; they are loaded in `dtype` (float32 by default: fastest on CPUs), in eval mode.
    """
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(_path("target"), dtype=dtype, use_safetensors=True).eval()
    drafter = AutoModelForCausalLM.from_pretrained(_path("drafter"), dtype=dtype, use_safetensors=True).eval()
    return target, drafter, load_tokenizer()


def load_ngram(**options):
    """The zoo's [`NGramDrafter`] (trigram table on the train split); `options` go to `from_pretrained`."""
    from ..drafters import NGramDrafter

    return NGramDrafter.from_pretrained(_path("ngram"), **options)
