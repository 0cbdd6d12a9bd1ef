"""The architecture sweep with a static cache (`cache_implementation="static"`): every model type whose own plain
`generate` runs with a static cache, decoded greedily with speculation (the target as its own drafter, with a
dynamic and with a static draft cache; prompt lookup) on the same static cache kind and compared token for token with plain static `generate`, or refused with a
message naming the model class and the reason. Part of the sweep CI step (`pytest -m sweep tests/sweep`).

`STATIC_NOT_RUN` lists the model types whose plain static `generate` fails on the generic tiny config (or that the
main sweep cannot build), with the error, asserted as in the main sweep so the list stays true.
"""

import re
import warnings

import pytest
import torch
import transformers
from packaging import version
from test_sweep import DRAFTER_IGNORED, GAMMA, KNOWN_DEFECTS, NOT_RUN, REFUSALS, greedy, inputs_for
from tiny import mapping_types, tiny_model

import hf_specdec

pytestmark = pytest.mark.sweep

# a sliding window shorter than the generation: its static layers drop keys for good once full
STATIC_REFUSALS = [
    *REFUSALS,
    r"The target's static cache \(\w+, cache_implementation=.*\) cannot be rolled back here: "
    r"its sliding-window layers keep \d+ positions",
    r"Speculative beam search needs the target's cache to be a croppable dynamic cache",
    # a hybrid or state-space drafter's recurrent state is rolled back in a dynamic draft cache only
    r"`assistant_model` \(\w+\) keeps recurrent state, which hf_specdec rolls back in a dynamic draft cache",
    # the drafter's own static cache (`ModelDrafter(..., cache_implementation="static")`)
    STATIC_DRAFTER := r"`ModelDrafter\(cache_implementation='static'\)`",
]

# model type -> start of the error plain static `generate` raises on the tiny model (not speculation's limits)
STATIC_NOT_RUN = {
    # BLT's own static generate fails in its self-attention: the mask keeps the tokens' length, not the cache's
    "blt": "RuntimeError: The size of tensor a (9) must match the size o",
    "cpmant": "IndexError: index_copy_(): index 27 is out of bounds for dim",
    "deepseek_v4": "KeyError: 'heavily_compressed_attention'",
    "prophetnet": "RuntimeError: expand(torch.FloatTensor{[1, 1, 1, 1, 1, 1, 20",
}
if version.parse(transformers.__version__) >= version.parse("5.24"):
    # 5.24's XLM sizes its attention mask by the tokens seen, not by the static cache's length (5.23 served it)
    STATIC_NOT_RUN["xlm"] = "RuntimeError: The expanded size of the tensor (27) must matc"


def static_generate(model, inputs, **kwargs):
    return greedy(model, inputs, cache_implementation="static", **kwargs)


@pytest.mark.parametrize("model_type", [t for t in mapping_types() if t not in NOT_RUN])
def test_architecture_with_a_static_cache(model_type):
    warnings.simplefilter("ignore")
    model = tiny_model(model_type)
    inputs = inputs_for(model, 1)
    expected_failure = STATIC_NOT_RUN.get(model_type)
    try:
        plain = static_generate(model, inputs).sequences
    except Exception as error:
        assert expected_failure is not None, (
            f"{model_type}: plain static generate failed: {type(error).__name__}: {error}"
        )
        assert f"{type(error).__name__}: {error}".splitlines()[0][:60] == expected_failure
        return
    assert expected_failure is None, f"{model_type} now generates with a static cache: move it out of STATIC_NOT_RUN"
    hf_specdec.enable(model)
    results = {}
    known_runs, known_error = KNOWN_DEFECTS.get(model_type, ((), None))
    drafters = {
        "self": dict(assistant_model=model),
        "prompt_lookup": dict(drafter="prompt_lookup"),
        "self_static": dict(drafter=hf_specdec.ModelDrafter(model, cache_implementation="static")),
    }
    for label, drafter in drafters.items():
        try:
            spec = static_generate(model, inputs, speculative_gamma=GAMMA, **drafter)
        except Exception as error:
            message = str(error)
            if isinstance(error, ValueError) and any(re.search(pattern, message) for pattern in STATIC_REFUSALS):
                results[label] = "refused: " + message
                continue
            assert label in known_runs and known_error in message, f"{label}: {type(error).__name__}: {message}"
            results[label] = "known defect"
            continue
        assert label not in known_runs, f"{model_type} with {label} no longer fails: remove it from KNOWN_DEFECTS"
        assert torch.equal(spec.sequences, plain), f"{label}: silent mismatch:\n{plain}\n{spec.sequences}"
        ignored = spec.speculative_stats.target_calls == 0  # the class's `generate` did not run hf_specdec's loop
        assert ignored == (model_type in DRAFTER_IGNORED), f"{label}: drafter ignored: {ignored}"
        results[label] = "identical"
    refused = {label for label, result in results.items() if result.startswith("refused")}
    refused_drafter = {r for r in refused if "assistant_model" in results[r] or re.search(STATIC_DRAFTER, results[r])}
    assert refused in (set(), set(results)) or refused == refused_drafter, results
