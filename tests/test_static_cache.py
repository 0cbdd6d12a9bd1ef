"""Static caches (`cache_implementation="static"`) and the compiled forward with a drafter: exact, rolled back in place,
compiled a bounded number of times."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, CompileConfig, StaticCache

import hf_specdec
from hf_specdec.caches import CACHE_KWARG, cache_of, cached_length, rewind_cache
from conftest import ScriptedDrafter, noisy_copy, prompt, source, tiny_model, tiny_seq2seq
from test_sampling_distribution import CONFIGS, P_THRESHOLD, SAMPLES, exact_two_token_distribution, goodness_of_fit

NEW_TOKENS = 24


def compile_config(backend: str = "eager", **kwargs) -> CompileConfig:
    """A compile config that `generate` honours on this CPU (transformers compiles on CPU only when asked to for
    every device). The "eager" backend traces and guards exactly as inductor does, without code generation."""
    config = CompileConfig(backend=backend, fullgraph=True, mode=None if backend == "eager" else "default", **kwargs)
    config._compile_all_devices = True
    return config


def static(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static", **kwargs)


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Dynamo caches graphs per code object, across model instances: each test starts without them (the
    recompile limit would otherwise count every earlier test's models)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def llama():
    return hf_specdec.enable(tiny_model("llama"))


def drafters(model, ids, **plain_kwargs):
    reference = static(model, ids, **plain_kwargs)
    return {
        "always_right": dict(drafter=ScriptedDrafter(reference)),
        "never_right": dict(drafter=ScriptedDrafter(reference, period=1)),
        "partly_right": dict(drafter=ScriptedDrafter(reference, period=3)),
        "assistant": dict(assistant_model=noisy_copy(model, 0.05)),
        "prompt_lookup": dict(drafter="prompt_lookup"),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "gemma"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_greedy_identity_with_a_static_cache(arch, compiled):
    model = hf_specdec.enable(tiny_model(arch))
    ids = prompt(seed=3)
    kwargs = dict(compile_config=compile_config()) if compiled else {}
    plain = static(model, ids, **kwargs)
    for name, drafter in drafters(model, ids, **kwargs).items():
        out = static(model, ids, speculative_gamma=4, speculative_gamma_policy="constant", return_dict_in_generate=True,
                     **kwargs, **drafter)
        assert torch.equal(out.sequences, plain), (arch, name)
        stats = out.speculative_stats
        assert (stats.compiled_rounds > 0) == compiled, (name, stats.compiled_rounds)
        if name == "always_right":
            assert stats.acceptance_rate == 1.0
        if name == "never_right":
            assert stats.accepted_tokens == 0 and stats.drafted_tokens > 0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_token_trees_on_a_static_cache(llama, compiled):
    ids = prompt(seed=4)
    kwargs = dict(compile_config=compile_config()) if compiled else {}
    plain = static(llama, ids, **kwargs)
    for drafter in (dict(assistant_model=noisy_copy(llama, 0.3)), dict(drafter="prompt_lookup")):
        out = static(llama, ids, speculative_gamma=3, speculative_tree_budget=6, return_dict_in_generate=True,
                     speculative_gamma_policy="constant", **kwargs, **drafter)
        assert torch.equal(out.sequences, plain)
        assert out.speculative_stats.target_calls < NEW_TOKENS or "drafter" in drafter


def test_inductor_compiled_rounds_are_exact(llama):
    """The real compiler (inductor kernels, not the tracing-only backend): greedy still identical."""
    ids = prompt(seed=5)
    config = compile_config("inductor")
    plain = static(llama, ids, compile_config=config)
    out = static(llama, ids, assistant_model=noisy_copy(llama, 0.05), speculative_gamma=3,
                 speculative_gamma_policy="constant", compile_config=config, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.speculative_stats.compiled_rounds == out.speculative_stats.target_calls - 1  # all but the prompt's


@pytest.mark.parametrize("arch,compiled", [("t5", False), ("bart", False), ("t5", True)])
def test_encoder_decoder_targets_with_a_static_cache(arch, compiled):
    model = hf_specdec.enable(tiny_seq2seq(arch))
    ids = source(seed=2)
    kwargs = dict(compile_config=compile_config()) if compiled else {}
    plain = static(model, ids, **kwargs)
    for drafter in (dict(assistant_model=model), dict(assistant_model=noisy_copy(model, 0.2)),
                    dict(drafter=ScriptedDrafter(plain, period=2))):
        out = static(model, ids, speculative_gamma=3, return_dict_in_generate=True, **kwargs, **drafter)
        assert torch.equal(out.sequences, plain)
        assert (out.speculative_stats.compiled_rounds > 0) == compiled
    assert out.speculative_stats.accepted_tokens > 0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_batches_with_a_static_cache(llama, compiled):
    ids = torch.cat([prompt(seed=6), prompt(seed=7)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on the second row
    kwargs = dict(compile_config=compile_config()) if compiled else {}
    plain = static(llama, ids, attention_mask=mask, **kwargs)
    out = static(llama, ids, attention_mask=mask, assistant_model=noisy_copy(llama, 0.05), speculative_gamma=3,
                 return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, plain)
    assert (out.speculative_stats.compiled_rounds > 0) == compiled


def test_sampling_with_a_static_cache_follows_the_target():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    drafter = tiny_model("llama", seed=1)
    config = CONFIGS["temperature_top_k"]
    ids = prompt(6, seed=11)
    table = exact_two_token_distribution(target, ids, config)
    torch.manual_seed(1234)
    samples = []
    for _ in range(SAMPLES):
        out = target.generate(ids, do_sample=True, max_new_tokens=2, cache_implementation="static",
                              assistant_model=drafter, speculative_gamma=2, **config)
        samples.append(tuple(out[0, ids.shape[1]:].tolist()))
    assert goodness_of_fit(table, samples) > P_THRESHOLD
    # power: the same test rejects the drafter's own samples
    torch.manual_seed(1234)
    drafter_samples = [tuple(hf_specdec.enable(drafter).generate(ids, do_sample=True, max_new_tokens=2, **config)[
        0, ids.shape[1]:].tolist()) for _ in range(SAMPLES)]
    assert any(s not in table for s in drafter_samples) or goodness_of_fit(table, drafter_samples) < P_THRESHOLD


def test_compilations_do_not_grow_with_the_rounds(llama):
    """γ varies (the auto policy, a drafter that proposes fewer tokens than asked, prompt lookup without a match),
    shapes are not marked dynamic, and still the forwards compile at most once per padded size (1, 2, 4, 7 new
    tokens) for a cache shape: three calls of a few dozen rounds each compile at most four graphs together."""
    config = compile_config(dynamic=False)
    ids = prompt(seed=8)
    kwargs = dict(max_new_tokens=3 * NEW_TOKENS, do_sample=False, cache_implementation="static", compile_config=config)
    reference = llama.generate(ids, **kwargs)
    calls = [llama.generate(ids, drafter=drafter, speculative_gamma=6, return_dict_in_generate=True,
                            **kwargs).speculative_stats
             for drafter in (ScriptedDrafter(reference, period=4), "prompt_lookup", ScriptedDrafter(reference, period=4))]
    assert len({min(g, 6) for stats in calls for g in stats.drafted_history[1:]}) >= 2  # the drafted lengths varied
    assert all(stats.compiled_rounds >= 15 for stats in calls)
    assert calls[0].target_compilations >= 1
    assert sum(stats.target_compilations for stats in calls) <= 4  # over some 60 compiled rounds


def test_static_cache_rewinds_in_place():
    """A rewind moves the write position back without reallocating; the next forward overwrites the stale keys and
    computes what a cache that never held them computes."""
    model = tiny_model("llama")
    ids = prompt(12, seed=9)
    cache = StaticCache(config=model.config, max_cache_len=32)
    model(ids[:, :10], **{CACHE_KWARG: cache})
    keys = cache.layers[0].keys
    rewind_cache(cache, 6)
    assert cached_length(cache) == 6 and cache.layers[0].keys is keys
    rewound = model(ids[:, 6:12], **{CACHE_KWARG: cache}).logits
    fresh = StaticCache(config=model.config, max_cache_len=32)
    model(ids[:, :6], **{CACHE_KWARG: fresh})
    assert torch.allclose(rewound, model(ids[:, 6:12], **{CACHE_KWARG: fresh}).logits, atol=1e-5)


def test_a_static_sliding_window_is_served_within_the_window_and_refused_past_it():
    config = AutoConfig.for_model("mistral", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, sliding_window=40)
    torch.manual_seed(0)
    model = hf_specdec.enable(AutoModelForCausalLM.from_config(config).eval())
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    ids = prompt(seed=10)
    plain = static(model, ids)  # 8 + 24 tokens: within the window
    assert torch.equal(static(model, ids, assistant_model=noisy_copy(model, 0.1), speculative_gamma=3), plain)
    with pytest.raises(ValueError, match=r"static cache .* sliding-window layers keep 40 positions.*max_length=58.*"
                                         r"`cache_implementation=None`"):
        model.generate(ids, max_new_tokens=50, cache_implementation="static", drafter="prompt_lookup")


def test_nothing_but_transformers_own_compiled_call_is_left_on_the_model():
    model = hf_specdec.enable(tiny_model("llama"))
    ids = prompt(seed=12)
    before = set(vars(model))
    static(model, ids, compile_config=compile_config())
    after_plain = set(vars(model))
    static(model, ids, drafter="prompt_lookup", compile_config=compile_config())
    assert set(vars(model)) == after_plain  # what transformers itself keeps (`_compiled_call`, ...), nothing more
    assert after_plain - before <= {"_compiled_call", "_last_compile_config", "_previous_max_cache_length", "_cache"}


def test_a_static_cache_the_user_passes_is_served(llama):
    ids = prompt(seed=13)
    # the cache argument's name in this transformers: `cache` (>= 5.24) or `past_key_values`
    plain = llama.generate(ids, max_new_tokens=NEW_TOKENS,
                           **{CACHE_KWARG: StaticCache(config=llama.config, max_cache_len=40)})
    cache = StaticCache(config=llama.config, max_cache_len=40)
    out = llama.generate(ids, max_new_tokens=NEW_TOKENS, assistant_model=noisy_copy(llama, 0.05), speculative_gamma=4,
                         return_dict_in_generate=True, **{CACHE_KWARG: cache})
    assert torch.equal(out.sequences, plain)
    assert cache_of(out) is cache and cached_length(cache) == out.sequences.shape[1] - 1
