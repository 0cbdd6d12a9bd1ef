"""LayerSkip self-speculation (`assistant_early_exit=k`, `drafter="early_exit"`): the target's own first k layers draft.

Greedy identity with plain `generate` when the exit always agrees (the later layers add nothing), partly agrees
(random weights) and rarely agrees (the last layer pushes one token to the top); chains, trees, padded batches and a
static draft cache; sampling against the enumerated target distribution, with a power check; the weights are the
target's own, and the target is never changed.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import prompt, tiny_model
from test_sampling_distribution import exact_distribution, goodness_of_fit
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin

import hf_specdec
from hf_specdec.drafters.early_exit import early_exit_view

sys.path.insert(0, str(Path(__file__).parent / "sweep"))
from tiny import tiny_model as sweep_model

CONSTANT = dict(speculative_gamma_policy="constant", speculative_gamma=3)


def layered(seed: int = 0, agree: str = "partly"):
    """A tiny 4-layer Llama. `agree="always"`: layers 2 and 3 add nothing to the residual stream, so exiting after
    layer 2 predicts exactly what the full model predicts. `agree="rarely"`: the last layer's MLP adds a large
    constant along one token's row of the head, so the full model almost always predicts that token and the exit
    almost never does."""
    model = tiny_model("llama", seed=seed, num_hidden_layers=4)
    with torch.no_grad():
        if agree == "always":
            for layer in model.model.layers[2:]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        elif agree == "rarely":
            down = model.model.layers[3].mlp.down_proj
            down.weight.zero_()
            down.bias = torch.nn.Parameter(1000.0 * model.lm_head.weight[7] / model.lm_head.weight[7].norm())
    return hf_specdec.enable(model)


def plain(model, ids, **kwargs):
    return model.generate(ids, do_sample=False, max_new_tokens=16, **kwargs)


@pytest.mark.parametrize("agree", ["always", "partly", "rarely"])
@pytest.mark.parametrize("layout", ["chain", "tree", "static"])
def test_greedy_identical_to_plain_generate(agree, layout):
    model = layered(agree=agree)
    options = {"tree": dict(speculative_tree_budget=6), "static": {}, "chain": {}}[layout]
    drafter_kwargs = {"exit_layer": 2, **({"cache_implementation": "static"} if layout == "static" else {})}
    if layout == "tree":  # one child per node when the exit always agrees: every depth of every round is accepted
        drafter_kwargs["tree_top_k"] = 1 if agree == "always" else 2
    rates = []
    for seed in range(3):
        ids = prompt(7, seed=seed)
        out = model.generate(
            ids,
            do_sample=False,
            max_new_tokens=16,
            drafter="early_exit",
            drafter_kwargs=drafter_kwargs,
            return_dict_in_generate=True,
            **CONSTANT,
            **options,
        )
        assert torch.equal(out.sequences, plain(model, ids))
        rates.append(out.speculative_stats.alpha)
    rate = sum(rates) / len(rates)
    # the three regimes are what they claim to be
    if agree == "always":
        assert rate == 1.0
    elif agree == "rarely":
        assert rate < 0.2
    else:
        assert 0.0 < rate < 1.0


def test_assistant_early_exit_is_the_same_request():
    model = layered(agree="partly")
    ids = prompt(7, seed=1)
    ours = model.generate(
        ids, do_sample=False, max_new_tokens=16, assistant_early_exit=2, return_dict_in_generate=True, **CONSTANT
    )
    named = model.generate(
        ids,
        do_sample=False,
        max_new_tokens=16,
        drafter="early_exit",
        drafter_kwargs={"exit_layer": 2},
        return_dict_in_generate=True,
        **CONSTANT,
    )
    assert torch.equal(ours.sequences, plain(model, ids))
    assert torch.equal(ours.sequences, named.sequences)
    # served by hf_specdec's loop (transformers' own path has no speculative_stats)
    assert ours.speculative_stats.target_calls == named.speculative_stats.target_calls > 0
    # from a generation config too, which stays as the user passed it
    config = model.generation_config.__class__(assistant_early_exit=2, max_new_tokens=16, do_sample=False)
    out = model.generate(ids, generation_config=config, return_dict_in_generate=True, **CONSTANT)
    assert torch.equal(out.sequences, ours.sequences) and out.speculative_stats.target_calls > 0
    assert config.assistant_early_exit == 2


def test_padded_batch():
    model = layered(agree="partly")
    ids = torch.cat([prompt(7, seed=3), prompt(7, seed=4)])
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0  # left padding
    expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    out = model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=12,
        assistant_early_exit=2,
        **CONSTANT,
    )
    assert torch.equal(out, expected)


@pytest.mark.parametrize("model_type", ["mamba2", "falcon_h1"])
def test_configs_whose_layer_types_are_derived(model_type):
    """Mamba2's and Falcon-H1's configs compute `layer_types` from other fields (a property without a setter, which
    raised `AttributeError` when the view's config was cut): the view's follows its `num_hidden_layers`, and the
    output is plain generate's."""
    model = hf_specdec.enable(sweep_model(model_type))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7]])
    assert len(early_exit_view(model, 1).config.layer_types) == 1
    assert torch.equal(model.generate(ids, assistant_early_exit=1, **CONSTANT, max_new_tokens=16), plain(model, ids))


def test_an_exit_before_the_first_attention_layer_is_refused_by_name():
    """A hybrid whose first layers are all linear-attention / SSM layers: its forward builds an attention mask from a
    key/value layer of the cache, which a view of those layers would not have (it failed in its first forward with
    transformers' own "`get_seq_length` can only be called on Attention layers"); an exit past one is served."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7]])
    qwen = hf_specdec.enable(sweep_model("qwen3_5_text"))  # linear attention, then full attention
    with pytest.raises(ValueError, match=r"`assistant_early_exit=1` .* Exit at layer 2 or later"):
        qwen.generate(ids, assistant_early_exit=1, max_new_tokens=4)
    model = hf_specdec.enable(sweep_model("nemotron_h"))  # Mamba2, Mamba2, attention, Mamba2
    kinds = [isinstance(layer, CacheLayerMixin) for layer in DynamicCache(config=model.config).layers]
    assert kinds == [False, False, True, False]
    for exit_layer in (1, 2):
        with pytest.raises(
            ValueError,
            match=rf"`assistant_early_exit={exit_layer}` .* {'first layer' if exit_layer == 1 else 'first 2 layers'}, "
            r"linear-attention / state-space layers only, .* Exit at layer 3 or later \(its first attention layer is "
            r"layer 2\)",
        ):
            model.generate(ids, assistant_early_exit=exit_layer, max_new_tokens=4)
    out = model.generate(ids, assistant_early_exit=3, **CONSTANT, max_new_tokens=8)
    assert torch.equal(out, model.generate(ids, do_sample=False, max_new_tokens=8))


def test_sampling_follows_the_target():
    # a target whose exit is far from it: the last layer adds a push towards one token, so the drafts are mostly
    # rejected and the recovered tokens carry the distribution
    model = layered(seed=2, agree="partly")
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.mul_(6.0)
    config = dict(temperature=1.0, top_k=4)
    ids = prompt(5, seed=5)
    table = exact_distribution(model, ids, config, length=2)

    def draw(n, **kwargs):
        torch.manual_seed(99)
        return [
            tuple(model.generate(ids, do_sample=True, max_new_tokens=2, **config, **kwargs)[0, ids.shape[1] :].tolist())
            for _ in range(n)
        ]

    assert goodness_of_fit(table, draw(1200, assistant_early_exit=2, **CONSTANT)) > 1e-3
    # power: a verifier that accepts (almost) every draft samples the exit's distribution, which this test rejects
    assert goodness_of_fit(table, draw(1200, assistant_early_exit=2, speculative_lenience=0.02, **CONSTANT)) < 1e-3


def test_the_weights_are_the_targets_own_and_the_target_is_unchanged():
    model = layered()
    view = early_exit_view(model, 2)
    own = {p.data_ptr() for p in model.parameters()}
    assert {p.data_ptr() for p in view.parameters()} <= own  # nothing copied
    assert view.lm_head is model.lm_head and view.model.embed_tokens is model.model.embed_tokens
    assert all(a is b for a, b in zip(view.model.layers, model.model.layers[:2]))
    assert len(view.model.layers) == 2 and view.config.num_hidden_layers == 2
    assert len(model.model.layers) == 4 and model.config.num_hidden_layers == 4  # the target keeps every layer
    # the view's forward is the model's own, exited early: equal to running the first two layers by hand
    ids = prompt(6, seed=8)
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states[2]
        by_hand = model.lm_head(model.model.norm(states))
        assert torch.allclose(view(ids).logits, by_hand, atol=1e-5)


def test_the_view_is_its_own_module():
    """Hooks on the model and a `forward` replaced on the instance (as accelerate's dispatch does) belong to the
    model, not to the view: the view runs its own first layers and tells the model's hooks nothing."""
    model = layered()
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    own_forward = model.forward
    model.forward = lambda *args, **kwargs: own_forward(*args, **kwargs)  # a wrapper on the instance
    try:
        view = early_exit_view(model, 2)
        ids = prompt(6, seed=9)
        with torch.no_grad():
            logits = view(ids).logits
            states = model(ids, output_hidden_states=True).hidden_states[2]
        assert len(calls) == 1  # the model's own call only
        assert torch.allclose(logits, model.lm_head(model.model.norm(states)), atol=1e-5)
    finally:
        handle.remove()
        del model.forward


def test_concurrent_calls_stay_exact():
    """The view never changes the shared model or its config, so a plain call beside an early-exit call on the
    same target (transformers' own early exit lowers the shared config's layer count while it drafts) stays
    exact."""
    model = layered(agree="partly")
    ids = [prompt(7, seed=s) for s in range(4)]
    expected = [plain(model, i) for i in ids]
    results, errors = {}, []

    def run(index, kwargs):
        try:
            results[index] = plain(model, ids[index % 4], **kwargs)
        except Exception as error:
            errors.append(error)

    threads = [
        threading.Thread(target=run, args=(i, dict(assistant_early_exit=2, **CONSTANT) if i % 2 else {}))
        for i in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for index, out in results.items():
        assert torch.equal(out, expected[index % 4])


def test_bad_requests_name_the_fix():
    model = layered()
    ids = prompt(5)
    with pytest.raises(ValueError, match=r"exit_layer.*\[1, 3\].*got 4"):
        model.generate(ids, assistant_early_exit=4, max_new_tokens=3)
    with pytest.raises(ValueError, match="positive int"):
        model.generate(ids, drafter="early_exit", drafter_kwargs={"exit_layer": 0}, max_new_tokens=3)
    with pytest.raises(ValueError, match="assistant_early_exit=2.*also passes `assistant_model`"):
        model.generate(ids, assistant_early_exit=2, assistant_model=layered(seed=1), max_new_tokens=3)
    with pytest.raises(ValueError, match="disagree"):
        model.generate(
            ids, assistant_early_exit=2, drafter="early_exit", drafter_kwargs={"exit_layer": 3}, max_new_tokens=3
        )


def test_a_static_early_exit_drafter_keeps_its_cache_from_call_to_call():
    # as `ModelDrafter(cache_implementation="static")`: the next call empties and reuses it (its view of the target
    # is built per call, its cache is not)
    model = layered()
    drafter = hf_specdec.EarlyExitDrafter(2, cache_implementation="static")
    caches = []
    for seed in range(3):
        ids = prompt(7, seed=seed)
        out = model.generate(ids, do_sample=False, max_new_tokens=16, drafter=drafter, **CONSTANT)
        assert torch.equal(out, plain(model, ids))
        ((_, _, cache),) = drafter.static_caches.idle
        caches.append(cache)
    assert caches[0] is caches[1] is caches[2]
