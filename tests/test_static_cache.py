"""Static caches (`cache_implementation="static"`) and the compiled forward with a drafter: exact, rolled back in place,
compiled a bounded number of times."""

import pytest
import torch
from conftest import ScriptedDrafter, noisy_copy, prompt, source, tiny_model, tiny_seq2seq
from test_sampling_distribution import CONFIGS, P_THRESHOLD, SAMPLES, exact_two_token_distribution, goodness_of_fit
from transformers import AutoConfig, AutoModelForCausalLM, CompileConfig, StaticCache

import hf_specdec
from hf_specdec.caches import CACHE_KWARG, cache_of, cached_length, rewind_cache

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
        out = static(
            model,
            ids,
            speculative_gamma=4,
            speculative_gamma_policy="constant",
            return_dict_in_generate=True,
            **kwargs,
            **drafter,
        )
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
        out = static(
            llama,
            ids,
            speculative_gamma=3,
            speculative_tree_budget=6,
            return_dict_in_generate=True,
            speculative_gamma_policy="constant",
            **kwargs,
            **drafter,
        )
        assert torch.equal(out.sequences, plain)
        assert out.speculative_stats.target_calls < NEW_TOKENS or "drafter" in drafter


def test_inductor_compiled_rounds_are_exact(llama):
    """The real compiler (inductor kernels, not the tracing-only backend): greedy still identical."""
    ids = prompt(seed=5)
    config = compile_config("inductor")
    plain = static(llama, ids, compile_config=config)
    out = static(
        llama,
        ids,
        assistant_model=noisy_copy(llama, 0.05),
        speculative_gamma=3,
        speculative_gamma_policy="constant",
        compile_config=config,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    assert out.speculative_stats.compiled_rounds == out.speculative_stats.target_calls - 1  # all but the prompt's


@pytest.mark.parametrize("arch,compiled", [("t5", False), ("bart", False), ("t5", True)])
def test_encoder_decoder_targets_with_a_static_cache(arch, compiled):
    model = hf_specdec.enable(tiny_seq2seq(arch))
    ids = source(seed=2)
    kwargs = dict(compile_config=compile_config()) if compiled else {}
    plain = static(model, ids, **kwargs)
    for drafter in (
        dict(assistant_model=model),
        dict(assistant_model=noisy_copy(model, 0.2)),
        dict(drafter=ScriptedDrafter(plain, period=2)),
    ):
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
    out = static(
        llama,
        ids,
        attention_mask=mask,
        assistant_model=noisy_copy(llama, 0.05),
        speculative_gamma=3,
        return_dict_in_generate=True,
        **kwargs,
    )
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
        out = target.generate(
            ids,
            do_sample=True,
            max_new_tokens=2,
            cache_implementation="static",
            assistant_model=drafter,
            speculative_gamma=2,
            **config,
        )
        samples.append(tuple(out[0, ids.shape[1] :].tolist()))
    assert goodness_of_fit(table, samples) > P_THRESHOLD
    # power: the same test rejects the drafter's own samples
    torch.manual_seed(1234)
    drafter_samples = [
        tuple(
            hf_specdec.enable(drafter)
            .generate(ids, do_sample=True, max_new_tokens=2, **config)[0, ids.shape[1] :]
            .tolist()
        )
        for _ in range(SAMPLES)
    ]
    assert any(s not in table for s in drafter_samples) or goodness_of_fit(table, drafter_samples) < P_THRESHOLD


def test_compilations_do_not_grow_with_the_rounds(llama):
    """γ varies (the auto policy, a drafter that proposes fewer tokens than asked, prompt lookup without a match),
    shapes are not marked dynamic, and still the forwards compile at most once per padded size (1, 2, 4, 7 new
    tokens) for a cache shape: three calls of a few dozen rounds each compile at most four graphs together."""
    config = compile_config(dynamic=False)
    ids = prompt(seed=8)
    kwargs = dict(max_new_tokens=3 * NEW_TOKENS, do_sample=False, cache_implementation="static", compile_config=config)
    reference = llama.generate(ids, **kwargs)
    calls = [
        llama.generate(
            ids, drafter=drafter, speculative_gamma=6, return_dict_in_generate=True, **kwargs
        ).speculative_stats
        for drafter in (ScriptedDrafter(reference, period=4), "prompt_lookup", ScriptedDrafter(reference, period=4))
    ]
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
    config = AutoConfig.for_model(
        "mistral",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=40,
    )
    torch.manual_seed(0)
    model = hf_specdec.enable(AutoModelForCausalLM.from_config(config).eval())
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    ids = prompt(seed=10)
    plain = static(model, ids)  # 8 + 24 tokens: within the window
    assert torch.equal(static(model, ids, assistant_model=noisy_copy(model, 0.1), speculative_gamma=3), plain)
    with pytest.raises(
        ValueError,
        match=r"static cache .* sliding-window layers keep 40 positions.*max_length=58.*"
        r"`cache_implementation=None`",
    ):
        model.generate(ids, max_new_tokens=50, cache_implementation="static", drafter="prompt_lookup")


@pytest.mark.parametrize("implementation", ["offloaded", "offloaded_static"])
def test_a_target_cache_that_offloads_its_layers_is_refused(llama, implementation):
    """An offloading cache (its layers moved to the CPU between forwards) is refused before decoding, naming the
    argument and the fix (its prefetch stream could not even be copied by the probe: a TypeError deep inside)."""
    with pytest.raises(ValueError, match=rf"offloads its layers .*cache_implementation='{implementation}'.*None"):
        llama.generate(prompt(seed=9), max_new_tokens=4, cache_implementation=implementation, drafter="prompt_lookup")


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
    plain = llama.generate(
        ids, max_new_tokens=NEW_TOKENS, **{CACHE_KWARG: StaticCache(config=llama.config, max_cache_len=40)}
    )
    cache = StaticCache(config=llama.config, max_cache_len=40)
    out = llama.generate(
        ids,
        max_new_tokens=NEW_TOKENS,
        assistant_model=noisy_copy(llama, 0.05),
        speculative_gamma=4,
        return_dict_in_generate=True,
        **{CACHE_KWARG: cache},
    )
    assert torch.equal(out.sequences, plain)
    assert cache_of(out) is cache and cached_length(cache) == out.sequences.shape[1] - 1


# --- the drafter's own static cache: `ModelDrafter(draft, cache_implementation="static")` ---


def static_drafter(model, **kwargs):
    return hf_specdec.ModelDrafter(model, cache_implementation="static", **kwargs)


def contrary_copy(model):
    """A copy of `model` whose head is negated: it drafts the target's least likely token, never its greedy one."""
    contrary = noisy_copy(model, 0.0)
    with torch.no_grad():
        contrary.get_output_embeddings().weight.neg_()
    return contrary


@pytest.mark.parametrize("tree_budget", [None, 6], ids=["chain", "tree"])
@pytest.mark.parametrize("target_cache", [None, "static"], ids=["dynamic_target", "static_target"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_static_draft_cache_drafts_what_a_dynamic_one_drafts(llama, tree_budget, target_cache, compiled):
    """Greedy identity with plain `generate` for drafters always, partly and never right; and the same drafts, round
    by round, as the drafter's dynamic cache, eager or compiled (a rollback that left a stale key visible, lost an
    accepted one, or kept a padded forward's filler would change them)."""
    ids = prompt(seed=14)
    kwargs = dict(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        cache_implementation=target_cache,
        speculative_gamma=4,
        speculative_gamma_policy="constant",
        speculative_tree_budget=tree_budget,
        return_dict_in_generate=True,
    )
    if compiled:
        kwargs["compile_config"] = compile_config()
    plain = llama.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation=target_cache)
    compilations = 0
    for name, draft in [
        ("always_right", noisy_copy(llama, 0.0)),
        ("partly_right", noisy_copy(llama, 0.3)),
        ("never_right", contrary_copy(llama)),
    ]:
        # 3 children per node: depths of 1 to 3 nodes, padded to 3 when compiled
        static_run = llama.generate(ids, drafter=static_drafter(draft, tree_top_k=3), **kwargs)
        dynamic_run = llama.generate(ids, drafter=hf_specdec.ModelDrafter(draft, tree_top_k=3), **kwargs)
        assert torch.equal(static_run.sequences, plain), name
        ours, theirs = static_run.speculative_stats, dynamic_run.speculative_stats
        assert ours.drafted_history == theirs.drafted_history, name
        assert ours.accepted_length_histogram == theirs.accepted_length_histogram, name
        if name == "always_right":
            assert ours.acceptance_rate == 1.0 if tree_budget is None else ours.mean_accepted_length > 2
        if name == "never_right":
            assert ours.accepted_tokens == 0 and ours.drafted_tokens > 0
        compilations += ours.drafter_compilations
        assert theirs.drafter_compilations == 0  # a dynamic draft cache is never compiled
    assert (compilations > 0) == compiled  # how many: `test_a_static_draft_cache_compiles_a_bounded_number_of_times`


def test_a_static_draft_cache_compiles_a_bounded_number_of_times(llama):
    """Shapes not marked dynamic, tails of 1 to 3 tokens, tree depths of 1 to `tree_top_k` nodes: over calls of
    dozens of rounds each, the drafter's forwards compile one graph for a chain (every forward 2 tokens) and one more
    for a tree's depths (padded to `tree_top_k` nodes), not one per round or per size."""
    config = compile_config(dynamic=False)
    ids = prompt(seed=15)
    kwargs = dict(
        max_new_tokens=3 * NEW_TOKENS,
        do_sample=False,
        compile_config=config,
        speculative_gamma=4,
        speculative_gamma_policy="constant",
        return_dict_in_generate=True,
    )
    draft = noisy_copy(llama, 0.3)
    chains = [llama.generate(ids, drafter=static_drafter(draft), **kwargs).speculative_stats for _ in range(2)]
    assert all(len(stats.drafted_history) >= 15 for stats in chains)
    assert len({a for stats in chains for a, count in enumerate(stats.accepted_length_histogram) if count}) >= 3
    assert [stats.drafter_compilations for stats in chains] == [1, 0]
    trees = [
        llama.generate(
            ids, drafter=static_drafter(draft, tree_top_k=3), speculative_tree_budget=6, **kwargs
        ).speculative_stats
        for _ in range(2)
    ]
    assert all(len(stats.drafted_history) >= 10 for stats in trees)
    # the depths' forward, and the 2-token one again for a cache with room for the tree's nodes (a cache of another
    # size is another graph, as for plain `generate` with another `max_length`)
    assert [stats.drafter_compilations for stats in trees] == [2, 0]


def test_compiled_tree_drafting_computes_the_drafters_own_distributions(llama, monkeypatch):
    """Every depth of a compiled tree is padded to `tree_top_k` nodes; the filler must leave the cache before the next
    depth. Each depth's log q equals the draft model's own, recomputed without a cache over the context and the path,
    including depths that follow a padded one (a sharp drafter, whose trees often narrow to one likely path)."""
    from hf_specdec.drafters import model as model_drafter

    draft = noisy_copy(llama, 0.3)
    with torch.no_grad():
        draft.get_output_embeddings().weight.mul_(10)
    seen = {"context": None, "checked": 0, "after_padded": 0, "padded": False}
    propose_tree, grow = model_drafter.ModelDrafter._propose_tree, model_drafter.DynamicTree.grow

    def recording_propose_tree(self, input_ids, num_tokens):
        seen["context"], seen["padded"] = input_ids, False
        return propose_tree(self, input_ids, num_tokens)

    def checked_grow(tree, log_q):
        paths = tree.newest_paths[tree.frontier - tree.newest_start]  # [f, depth]
        with torch.no_grad():
            sequences = torch.cat([seen["context"].expand(paths.shape[0], -1), paths], dim=-1)
            expected = draft(sequences).logits[:, -1].float().log_softmax(-1)
        assert torch.allclose(log_q, expected, atol=1e-4), (log_q - expected).abs().max()
        seen["checked"] += 1
        seen["after_padded"] += seen["padded"]
        seen["padded"] = paths.shape[0] < 3
        return grow(tree, log_q)

    monkeypatch.setattr(model_drafter.ModelDrafter, "_propose_tree", recording_propose_tree)
    monkeypatch.setattr(model_drafter.DynamicTree, "grow", checked_grow)
    ids = prompt(seed=14)
    plain = llama.generate(ids, max_new_tokens=3 * NEW_TOKENS, do_sample=False)
    out = llama.generate(
        ids,
        max_new_tokens=3 * NEW_TOKENS,
        do_sample=False,
        drafter=static_drafter(draft, tree_top_k=3),
        speculative_gamma=6,
        speculative_tree_budget=8,
        compile_config=compile_config(),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    assert out.speculative_stats.drafter_compilations > 0
    assert seen["checked"] >= 20 and seen["after_padded"] >= 3, seen


def test_a_drafter_past_the_recompile_limit_drafts_eagerly(llama):
    """`fullgraph=True` turns torch's recompile limit into an error: the drafter then drafts eagerly (with a warning)
    instead of failing the call, and the output is still plain `generate`'s."""
    ids = prompt(seed=19)
    plain = llama.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    # torch's own context manager, not monkeypatch: pytest >= 9.2 undoes a setattr it found outside the module's
    # `__dict__` by deleting it, which hides the config entry for the rest of the process
    with torch._dynamo.config.patch(recompile_limit=1):
        out = llama.generate(
            ids,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            compile_config=compile_config(),
            drafter=static_drafter(noisy_copy(llama, 0.1)),
            speculative_gamma=3,
            speculative_tree_budget=5,
            return_dict_in_generate=True,
        )
    assert torch.equal(out.sequences, plain)
    assert out.speculative_stats.drafter_compilations == 1  # the chain's graph; the tree's second one hit the limit


def test_a_deep_copy_of_a_compiled_model_drafts_with_its_own_weights(llama):
    """`copy.deepcopy` of a model transformers compiled keeps its `_compiled_call`, which runs the original's weights:
    the drafter then drafts eagerly with its own (the drafts of its dynamic cache), never with the target's."""
    import copy

    ids = prompt(seed=20)
    kwargs = dict(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        speculative_gamma=4,
        speculative_gamma_policy="constant",
        compile_config=compile_config(),
        return_dict_in_generate=True,
    )
    static(llama, ids, compile_config=compile_config())  # transformers compiles the target's forward
    draft = copy.deepcopy(llama)
    assert draft._compiled_call is llama._compiled_call
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn_like(param) * 0.3 * param.std())
    ours = llama.generate(ids, drafter=static_drafter(draft), **kwargs)
    eager = llama.generate(ids, drafter=hf_specdec.ModelDrafter(draft), **kwargs)
    assert torch.equal(ours.sequences, eager.sequences)
    assert ours.speculative_stats.drafter_compilations == 0
    assert ours.speculative_stats.accepted_length_histogram == eager.speculative_stats.accepted_length_histogram
    assert ours.speculative_stats.acceptance_rate < 1.0  # the target's own drafts would all be accepted


def test_a_static_draft_cache_serves_batches_and_left_padding(llama):
    """A batch's rows are drafted one at a time (a static draft cache holds one sequence), whether the target decodes
    them as a padded batch (dynamic cache) or one by one (static cache); a single left-padded prompt's padding
    stays hidden from the drafter."""
    ids = torch.cat([prompt(10, seed=16), prompt(10, seed=17)])
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    draft = noisy_copy(llama, 0.1)
    for target_cache in (None, "static"):
        kwargs = dict(
            attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation=target_cache
        )
        plain = llama.generate(ids, **kwargs)
        for compiled in (False, True):
            extra = dict(compile_config=compile_config()) if compiled else {}
            out = llama.generate(ids, drafter=static_drafter(draft), speculative_gamma=3, **kwargs, **extra)
            assert torch.equal(out, plain), (target_cache, compiled)
            one = llama.generate(
                ids[1:],
                drafter=static_drafter(draft),
                speculative_gamma=3,
                speculative_tree_budget=5,
                **{**kwargs, "attention_mask": mask[1:]},
                **extra,
            )
            assert torch.equal(one, plain[1:]), (target_cache, compiled)


def test_sampling_with_a_static_draft_cache_follows_the_target():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    drafter = static_drafter(tiny_model("llama", seed=1))
    config = CONFIGS["temperature_top_k"]
    ids = prompt(6, seed=11)
    table = exact_two_token_distribution(target, ids, config)
    torch.manual_seed(1234)
    samples = [
        tuple(
            target.generate(ids, do_sample=True, max_new_tokens=2, drafter=drafter, speculative_gamma=2, **config)[
                0, ids.shape[1] :
            ].tolist()
        )
        for _ in range(SAMPLES)
    ]
    assert goodness_of_fit(table, samples) > P_THRESHOLD
    # power: the same test rejects samples whose second token comes from the drafter's own distribution
    torch.manual_seed(1234)
    mixed = []
    for _ in range(SAMPLES):
        first = target.generate(ids, do_sample=True, max_new_tokens=1, **config)
        mixed.append(
            tuple(
                hf_specdec.enable(drafter.model)
                .generate(first, do_sample=True, max_new_tokens=1, **config)[0, ids.shape[1] :]
                .tolist()
            )
        )
    assert any(s not in table for s in mixed) or goodness_of_fit(table, mixed) < P_THRESHOLD


def test_a_static_draft_cache_is_refused_where_it_cannot_serve(llama):
    ids = prompt(seed=18)
    with pytest.raises(
        ValueError,
        match=r"`cache_implementation` of a `ModelDrafter` must be None, 'dynamic' or "
        r"'static', got 'offloaded'",
    ):
        hf_specdec.ModelDrafter(llama, cache_implementation="offloaded")
    with pytest.raises(ValueError, match=r"beam search .* cannot use `ModelDrafter\(cache_implementation='static'\)`"):
        llama.generate(ids, num_beams=2, max_new_tokens=4, drafter=static_drafter(noisy_copy(llama, 0.1)))
    t5 = hf_specdec.enable(tiny_seq2seq("t5"))
    with pytest.raises(
        ValueError,
        match=r"drafts for decoder-only targets, but the target \(T5ForConditionalGeneration"
        r"\) is an encoder-decoder model",
    ):
        t5.generate(source(), max_new_tokens=4, drafter=static_drafter(tiny_seq2seq("t5", seed=1)))
    config = AutoConfig.for_model(
        "mistral",
        vocab_size=llama.config.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
    )
    windowed = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(
        ValueError,
        match=r"cannot roll the drafter's static cache of \d+ positions back: its "
        r"sliding-window layers keep 16 positions",
    ):
        llama.generate(ids, max_new_tokens=NEW_TOKENS, drafter=static_drafter(windowed))


def test_a_static_draft_cache_is_kept_from_call_to_call(llama):
    """One `ModelDrafter(cache_implementation="static")` for several calls, as a user keeps it: the next call reuses
    its cache in place when it is large enough (so graphs captured over its tensors replay) and drafts exactly what a
    fresh drafter drafts; a call that needs more room gets a new cache."""
    config = compile_config(dynamic=False)
    draft = noisy_copy(llama, 0.3)
    kept = static_drafter(draft)
    kwargs = dict(
        do_sample=False,
        compile_config=config,
        speculative_gamma=4,
        speculative_gamma_policy="constant",
        return_dict_in_generate=True,
    )
    caches = []
    for seed, new_tokens in ((3, 2 * NEW_TOKENS), (4, NEW_TOKENS), (3, 2 * NEW_TOKENS), (4, 3 * NEW_TOKENS)):
        ids = prompt(seed=seed)
        out = llama.generate(ids, drafter=kept, max_new_tokens=new_tokens, **kwargs)
        fresh = llama.generate(ids, drafter=static_drafter(draft), max_new_tokens=new_tokens, **kwargs)
        assert torch.equal(out.sequences, fresh.sequences), seed
        assert out.speculative_stats.drafted_history == fresh.speculative_stats.drafted_history
        assert out.speculative_stats.accepted_length_histogram == fresh.speculative_stats.accepted_length_histogram
        assert 0 < out.speculative_stats.acceptance_rate < 1
        ((_, _, cache),) = kept.static_caches.idle  # back once the call's copy is gone
        caches.append(cache)
    assert caches[1] is caches[0] and caches[2] is caches[0]  # smaller or equal: the same tensors, emptied
    assert caches[3] is not caches[0]  # a longer call needs a larger cache


def test_concurrent_calls_with_one_static_drafter_each_hold_their_own_cache(llama):
    """Two threads generate at once with the same `ModelDrafter(cache_implementation="static")`: each call takes a
    cache of its own from the drafter's pool (a shared one would mix the two sequences' keys), and each output equals
    plain greedy decoding's."""
    import threading

    draft = noisy_copy(llama, 0.3)
    kept = static_drafter(draft)
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, speculative_gamma=3, speculative_gamma_policy="constant")
    prompts = [prompt(seed=21), prompt(seed=22)]
    plain = [llama.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False) for ids in prompts]
    llama.generate(prompts[0], drafter=kept, **kwargs)  # a cache is idle in the pool now
    taken, barrier = [], threading.Barrier(2)
    take = kept.static_caches.take

    def take_and_wait(owner, *args):
        cache, capacity = take(owner, *args)
        taken.append(cache)
        barrier.wait(timeout=60)  # both calls hold their caches at once
        return cache, capacity

    kept.static_caches.take = take_and_wait
    try:
        outputs = [None, None]

        def run(i):
            outputs[i] = llama.generate(prompts[i], drafter=kept, **kwargs)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        del kept.static_caches.take
    assert len(taken) == 2 and taken[0] is not taken[1]
    for out, reference in zip(outputs, plain):
        assert torch.equal(out, reference)
