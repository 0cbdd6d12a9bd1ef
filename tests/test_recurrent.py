"""Hybrid and state-space models (linear attention, Mamba2, gated delta rule): rejected drafts are undone exactly
from checkpoints of the recurrent state (`hf_specdec.recurrent`), in the target's cache and a stateful draft
model's."""

import copy
import sys
from pathlib import Path

import pytest
import torch
from conftest import ScriptedDrafter, noisy_copy
from test_sampling_distribution import exact_distribution, goodness_of_fit
from transformers import AutoModelForCausalLM, CompileConfig, DynamicCache

import hf_specdec
from hf_specdec.capability import _MULTI_TOKEN_VERDICTS
from hf_specdec.recurrent import RecurrentCheckpoints, recurrent_layers

sys.path.insert(0, str(Path(__file__).parent / "sweep"))
from tiny import VOCAB
from tiny import tiny_model as sweep_model

NEW_TOKENS = 24
# a gated delta rule + full attention hybrid, a pure SSM cache (no attention layer counts the positions), and a
# layer holding attention beside its SSM (`LinearAttentionAndFullAttentionLayer`)
FAMILIES = ["qwen3_5_text", "mamba2", "zamba2"]
# every layer kind the checkpoints restore, in a table of their own (the state after a rollback)
STATE_FAMILIES = [
    *FAMILIES,
    "qwen3_next",
    "kimi_linear",
    "olmo_hybrid",
    "nemotron_h",
    "bamba",
    "granitemoehybrid",
    "bailing_hybrid",
    "zaya",
]


def prompt(length=9, seed=0, batch=1):
    return torch.randint(4, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def target(family):
    return hf_specdec.enable(sweep_model(family))


def plain(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


def speculative(model, ids, **kwargs):
    return model.generate(
        ids,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        speculative_gamma=4,
        speculative_gamma_policy="constant",
        return_dict_in_generate=True,
        **kwargs,
    )


def _states(cache) -> list[torch.Tensor]:
    """Every tensor a cache's layers hold for the next forward: recurrent states, convolution windows (their last
    kernel-size columns), keys and values."""
    out = []
    for layer in cache.layers:
        for index, state in getattr(layer, "recurrent_states", {}).items():
            if state is not None and layer.has_previous_state[index]:
                out.append(state)
        for index, window in getattr(layer, "conv_states", {}).items():
            if window is not None and layer.is_conv_states_initialized[index]:
                out.append(window[..., -layer.conv_kernel_size[index] :])
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                out.append(tensor)
    return out


def _forward(model, tokens, cache, checkpoints):
    # positions given, as generate gives them (some models count them from a layer the rollback crops)
    start = checkpoints.length
    positions = torch.arange(start, start + tokens.shape[1])[None]
    model(tokens, cache=cache, use_cache=True, position_ids=positions)
    checkpoints.fed(tokens.shape[1])


def _fed(model, tokens_list):
    """A recording cache and its checkpoints after a forward over each of `tokens_list`."""
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    checkpoints = RecurrentCheckpoints(cache, model=model)
    for tokens in tokens_list:
        _forward(model, tokens, cache, checkpoints)
    return cache, checkpoints


def _assert_same_states(cache, want):
    got_states, want_states = _states(cache), _states(want)
    assert len(got_states) == len(want_states) > 0
    for got, expected in zip(got_states, want_states, strict=True):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("model_type", STATE_FAMILIES)
def test_the_state_after_a_rollback_is_the_state_of_a_forward_over_the_kept_tokens(model_type):
    model = sweep_model(model_type)
    ids = prompt(12, seed=3)
    context, drafts = ids[:, :7], ids[:, 7:]
    assert recurrent_layers(DynamicCache(config=model.config))
    for kept in range(drafts.shape[1] + 1):
        cache, checkpoints = _fed(model, [context])
        checkpoints.save()
        _forward(model, drafts, cache, checkpoints)  # a verify forward over 5 drafted positions
        restored = checkpoints.rewind(7 + kept)
        # all kept: the state is the forward's own; otherwise back to the checkpoint before the forward, and the
        # kept tokens are fed again
        assert restored == (7 + kept if kept == drafts.shape[1] else 7)
        if restored < 7 + kept:
            _forward(model, drafts[:, :kept], cache, checkpoints)
        _assert_same_states(cache, _fed(model, [ids[:, : 7 + kept]])[0])


@torch.no_grad()
@pytest.mark.parametrize("model_type", STATE_FAMILIES)
def test_the_state_after_rolling_back_one_token_forwards_is_the_state_of_the_kept_tokens(model_type):
    """As a stateful draft model drafts: a checkpoint after each one-token forward, then back to an earlier one.
    Kimi-Linear and Bailing-hybrid shift their convolution windows in place in their one-token forwards, outside
    transformers' past recording: the windows come back from the checkpoints' copies. The context is 2 tokens,
    fewer than the convolution's kernel (left unpadded by the recording: padded as plain generate pads it)."""
    model = sweep_model(model_type)
    ids = prompt(6, seed=3)
    for kept in range(2, 6):
        cache, checkpoints = _fed(model, [ids[:, :2]])
        checkpoints.save()
        for position in range(2, 6):
            _forward(model, ids[:, position : position + 1], cache, checkpoints)
            checkpoints.save()
        assert checkpoints.rewind(kept) == kept
        _assert_same_states(cache, _fed(model, [ids[:, :2], *(ids[:, i : i + 1] for i in range(2, kept))])[0])


@pytest.mark.parametrize("model_type", ["kimi_linear", "bailing_hybrid"])
def test_targets_and_draft_models_that_shift_their_windows_in_place_decode_exactly(model_type):
    """Kimi-Linear and Bailing-hybrid (convolution windows shifted in place in one-token forwards): a prompt shorter
    than the kernel (it raised in the first one-token forward), a draft model of the family with other weights (its
    rollbacks raised) and one with the target's (every draft accepted: its state rolls back exactly)."""
    target = hf_specdec.enable(sweep_model(model_type))
    for ids in (prompt(2), prompt(9)):
        reference = plain(target, ids)
        for drafter in (
            dict(drafter="prompt_lookup"),
            dict(assistant_model=sweep_model(model_type, seed=7)),
            dict(assistant_model=sweep_model(model_type)),
        ):
            out = speculative(target, ids, **drafter)
            assert torch.equal(out.sequences, reference), (ids.shape, drafter)
        assert out.speculative_stats.acceptance_rate == 1.0


@pytest.mark.parametrize("period", [None, 1, 3], ids=["always_right", "never_right", "partly_right"])
@pytest.mark.parametrize("length", [9, 1], ids=["prompt", "one_token_prompt"])
def test_greedy_speculation_equals_plain_generate(target, period, length):
    """A one-token prompt has no prefill of its own: the first checkpoint is taken before any state exists."""
    ids = prompt(length)
    reference = plain(target, ids)
    out = speculative(target, ids, drafter=ScriptedDrafter(reference, period=period, vocab=VOCAB))
    assert torch.equal(out.sequences, reference)
    stats = out.speculative_stats
    if period is None:  # every round accepts everything: the state is never restored
        assert stats.accepted_tokens == stats.drafted_tokens > 0
        assert stats.target_calls <= NEW_TOKENS // 5 + 2
    elif period == 1:  # every round rejects its first draft: restored every round
        assert stats.accepted_tokens == 0 and stats.drafted_tokens > 0
    else:
        assert 0 < stats.accepted_tokens < stats.drafted_tokens


@pytest.mark.parametrize("period", [None, 1, 3], ids=["always_right", "never_right", "partly_right"])
def test_a_state_that_delays_one_input_is_read_and_rolled_back(period):
    """Zaya's recurrent state is the previous token's value projection: a forward over several tokens ends in the
    same state from a zeroed one, yet reads it (its logits differ), so the probe serves it; its own window update
    hands the cache a whole window, which only a cache that does not record its windows keeps at its kernel size."""
    model = hf_specdec.enable(sweep_model("zaya"))
    ids = prompt()
    reference = plain(model, ids)
    out = speculative(model, ids, drafter=ScriptedDrafter(reference, period))
    assert torch.equal(out.sequences, reference)
    assert out.speculative_stats.accepted_tokens > 0 if period != 1 else out.speculative_stats.drafted_tokens > 0


def test_a_stateful_draft_model_is_rolled_back_too(target):
    """The draft model is itself a hybrid: its checkpoints (one per drafted token) give the kept state."""
    ids = prompt(seed=4)
    reference = plain(target, ids)
    wrong = noisy_copy(target, 0.5, seed=5)
    with torch.no_grad():  # its logits of the target's most frequent token and another swapped (tiny models repeat)
        frequent = int(reference[0, ids.shape[1] :].mode().values)
        other = (frequent + 1) % VOCAB
        head = wrong.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight[[*range(VOCAB)]])  # untied from the input embeddings
        head.weight[[frequent, other]] = head.weight[[other, frequent]].clone()
    for drafter, accepts in ((target, "all"), (wrong, "not all")):
        out = speculative(target, ids, assistant_model=drafter)
        assert torch.equal(out.sequences, reference)
        stats = out.speculative_stats
        if accepts == "all":
            assert stats.accepted_tokens == stats.drafted_tokens > 0
        else:
            assert stats.accepted_tokens < stats.drafted_tokens


def test_the_returned_cache_holds_what_plain_generate_leaves(target):
    """A round that rolled back at the end of the call: the cache is brought back to every token but the newest."""
    ids = prompt(seed=6)
    reference = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True)
    out = speculative(target, ids, drafter=ScriptedDrafter(reference.sequences, period=3, vocab=VOCAB))
    assert torch.equal(out.sequences, reference.sequences)
    for got, expected in zip(_states(out.cache), _states(reference.cache), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_generation_continues_from_a_returned_cache(target, family):
    """A cache returned by an earlier call, passed back with the sequence: its attention layers count the positions
    it holds, and the rounds go on from there (it was refused as "already holds recurrent state"). A state-space
    cache counts nothing: refused, naming why."""
    ids = prompt(seed=16)
    first = target.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)

    def continued(**kwargs):
        cache = copy.deepcopy(first.cache)
        return target.generate(first.sequences, cache=cache, max_new_tokens=12, do_sample=False, **kwargs)

    reference = continued()
    assert torch.equal(reference, target.generate(ids, max_new_tokens=20, do_sample=False))
    if family == "mamba2":
        with pytest.raises(
            ValueError, match=r"already holds recurrent state, and it has no attention layer that counts"
        ):
            continued(drafter="prompt_lookup")
        return
    for period in (None, 1, 3):
        drafter = ScriptedDrafter(reference, period=period, vocab=VOCAB)
        out = continued(drafter=drafter, speculative_gamma=3, speculative_gamma_policy="constant")
        assert torch.equal(out, reference), period


def test_a_padded_batch_decodes_each_row_exactly(target):
    ids = prompt(batch=2, seed=7)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    reference = plain(target, ids, attention_mask=mask, pad_token_id=0)
    out = speculative(target, ids, attention_mask=mask, pad_token_id=0, drafter="prompt_lookup")
    assert torch.equal(out.sequences, reference)
    out = speculative(target, ids, attention_mask=mask, pad_token_id=0, assistant_model=target)
    assert torch.equal(out.sequences, reference)


def test_sampling_follows_the_target_distribution():
    """Chi-square goodness of fit of 3 sampled tokens (27 outcomes) against the enumerated target distribution,
    drafted by another hybrid (its own rollbacks included); power: the drafter's own samples fail the same test."""
    target = hf_specdec.enable(sweep_model("qwen3_5_text"))
    drafter = hf_specdec.enable(sweep_model("qwen3_5_text", seed=9))
    config = dict(temperature=0.9, top_k=3)
    ids = prompt(6, seed=11)
    table = exact_distribution(target, ids, config, length=3)

    def samples(model, **kwargs):
        torch.manual_seed(1234)
        return [
            tuple(model.generate(ids, do_sample=True, max_new_tokens=3, **config, **kwargs)[0, 6:].tolist())
            for _ in range(600)
        ]

    drawn = samples(target, assistant_model=drafter, speculative_gamma=2, speculative_gamma_policy="constant")
    assert goodness_of_fit(table, drawn) > 1e-3
    own = samples(drafter)
    assert any(s not in table for s in own) or goodness_of_fit(table, own) < 1e-3


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_static_cache_is_rolled_back_exactly(target, compiled):
    """`cache_implementation="static"`: the attention layers preallocate their keys and values (rewound by their write
    position), the recurrent layers keep windows of their kernel's size (restored in place from the checkpoints);
    compiled, each forward at its exact size (a filler position would run through the recurrence)."""
    ids = prompt(seed=12)
    options = {"cache_implementation": "static"}
    if compiled:
        config = CompileConfig(backend="eager", fullgraph=False, mode=None)
        config._compile_all_devices = True  # generate compiles on this CPU only when asked to for every device
        options["compile_config"] = config
    torch._dynamo.reset()
    try:
        reference = plain(target, ids, **options)
        assert torch.equal(reference, plain(target, ids))  # what the dynamic cache gives
        for period in (None, 1, 3):
            out = speculative(target, ids, drafter=ScriptedDrafter(reference, period=period, vocab=VOCAB), **options)
            assert torch.equal(out.sequences, reference), period
            stats = out.speculative_stats
            assert (stats.compiled_rounds > 0) == compiled, (period, stats.compiled_rounds)
            if period is None:
                assert stats.accepted_tokens == stats.drafted_tokens > 0
            elif period == 1:
                assert stats.accepted_tokens == 0 and stats.drafted_tokens > 0
        # a stateful draft model (its own dynamic cache), and a padded batch (one row at a time)
        out = speculative(
            target, ids, assistant_model=sweep_model(type(target).config_class.model_type, seed=2), **options
        )
        assert torch.equal(out.sequences, reference)
        batch = prompt(batch=2, seed=13)
        mask = torch.ones_like(batch)
        mask[1, :3] = 0
        batch[1, :3] = 0
        reference = plain(target, batch, attention_mask=mask, pad_token_id=0, **options)
        out = speculative(target, batch, attention_mask=mask, pad_token_id=0, drafter="prompt_lookup", **options)
        assert torch.equal(out.sequences, reference)
    finally:
        torch._dynamo.reset()


def test_short_convolutions_in_a_static_cache_are_rolled_back_from_checkpoints():
    """lfm2's short convolutions are not a stateful model's (transformers' crop rolls a dynamic cache back, which
    records its past), but a static cache does not record: its windows are rolled back from checkpoints. The
    capability check's verdict is kept per kind of cache, so a dynamic call before a static one does not vouch for it
    (its static calls went wrong after a dynamic one: windows never rolled back)."""
    target = hf_specdec.enable(sweep_model("lfm2", layer_types=["conv", "full_attention"], tie_word_embeddings=False))
    ids = prompt(seed=14)
    reference = plain(target, ids)
    out = speculative(target, ids, drafter=ScriptedDrafter(reference, period=2, vocab=VOCAB))
    assert torch.equal(out.sequences, reference)  # the dynamic call first
    static = plain(target, ids, cache_implementation="static")
    assert torch.equal(static, reference)
    for period in (None, 1, 2, 3):
        drafter = ScriptedDrafter(static, period=period, vocab=VOCAB)
        out = speculative(target, ids, drafter=drafter, cache_implementation="static")
        assert torch.equal(out.sequences, static), period
        if period == 1:
            assert out.speculative_stats.accepted_tokens == 0 < out.speculative_stats.drafted_tokens
    assert len(_MULTI_TOKEN_VERDICTS[target]) == 2  # probed once per kind of cache, each verdict kept
    # a draft model of short convolutions, told of a plain step before its first forward, and in a padded batch
    draft = sweep_model("lfm2", seed=3, layer_types=["conv", "full_attention"], tie_word_embeddings=False)
    out = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=draft)
    assert torch.equal(out, reference)
    batch = prompt(batch=2, seed=15)
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    batch[1, :3] = 0
    expected = plain(target, batch, attention_mask=mask, pad_token_id=0)
    out = speculative(target, batch, attention_mask=mask, pad_token_id=0, assistant_model=draft)
    assert torch.equal(out.sequences, expected)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_a_short_convolution_drafter_told_of_a_round_before_its_first_forward(cache_implementation):
    """A draft model whose cache proves itself croppable at its first forward (lfm2's short convolutions) may be
    told of a round first (the default policy's plain step, a padded batch): it was refused as unable to roll back."""
    layer_types = ["conv", "full_attention", "conv", "conv"]
    target = hf_specdec.enable(
        sweep_model("lfm2", num_hidden_layers=4, layer_types=layer_types, tie_word_embeddings=False)
    )
    batch = prompt(8, batch=2, seed=4)
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    batch[1, :3] = 0
    kwargs = dict(max_new_tokens=10, do_sample=False, attention_mask=mask, pad_token_id=0)
    kwargs["cache_implementation"] = cache_implementation
    assert torch.equal(target.generate(batch, assistant_early_exit=2, **kwargs), target.generate(batch, **kwargs))


def test_trees_and_static_draft_caches_are_refused_with_the_reason(target, family):
    ids = prompt()
    name = type(target).__name__
    with pytest.raises(ValueError, match=rf"Token trees \(speculative_tree_budget=4\) cannot be verified on {name}"):
        target.generate(ids, max_new_tokens=4, drafter="prompt_lookup", speculative_tree_budget=4)
    with pytest.raises(ValueError, match=rf"Speculative beam search \(`num_beams` > 1\) is not supported on {name}"):
        target.generate(ids, max_new_tokens=4, num_beams=2, assistant_model=target)
    stateful_draft = sweep_model(family, seed=2)
    # refused as a static draft cache of recurrent layers (or, where transformers preallocates the attention
    # layers, as a recurrent draft cache)
    with pytest.raises(ValueError, match=r"Leave the drafter's cache dynamic \(`cache_implementation=None`\)"):
        target.generate(
            ids,
            max_new_tokens=4,
            drafter=hf_specdec.ModelDrafter(stateful_draft, cache_implementation="static"),
        )


@pytest.mark.parametrize(
    "model_type, reason",
    [
        # Mamba-1's multi-token scan starts from zeros instead of the cached state (transformers' model code)
        (
            "mamba",
            r"MambaForCausalLM cannot be verified exactly .* ignores the state in the cache",
        ),
        # RecurrentGemma keeps its RG-LRU and convolution states on its modules, outside the cache
        (
            "recurrent_gemma",
            r"RecurrentGemmaForCausalLM cannot be verified exactly .*: it keeps recurrent state on its modules",
        ),
        ("rwkv", r"RwkvForCausalLM generates without a `Cache` object"),
    ],
)
def test_stateful_models_that_cannot_be_rolled_back_exactly_are_refused(model_type, reason):
    model = hf_specdec.enable(sweep_model(model_type))
    assert model._is_stateful
    with pytest.raises(ValueError, match=reason):
        model.generate(prompt(), drafter="prompt_lookup", max_new_tokens=NEW_TOKENS)


@pytest.mark.parametrize("model_type", ["mamba", "jamba"])
def test_a_scan_that_ignores_the_state_is_refused_after_a_one_token_prompt_too(model_type):
    # the probe's rounds after a one-token prompt would start from a prefill: it adds a prompt token of its own
    model = hf_specdec.enable(sweep_model(model_type))
    with pytest.raises(ValueError, match=r"cannot be verified exactly .* ignores the state in the cache"):
        model.generate(prompt(1), drafter="prompt_lookup", max_new_tokens=NEW_TOKENS)


def test_a_cache_passed_in_recording_its_past_is_left_recording(target):
    cache = DynamicCache(config=target.config)
    cache.activate_past_recording()
    recording = [getattr(layer, "record_past", None) for layer in cache.layers]
    reference = plain(target, prompt())
    out = speculative(target, prompt(), cache=cache, drafter="prompt_lookup")
    assert torch.equal(out.sequences, reference)
    assert [getattr(layer, "record_past", None) for layer in cache.layers] == recording


def test_a_feature_drafter_gets_each_position_s_hidden_state_once():
    """After a rollback the kept tokens are fed again in the next forward: their hidden states, already given to a
    drafter that reads them (the target's own MTP layer on a Qwen3.5 target), are not given twice."""
    from transformers import AutoConfig
    from transformers.modeling_layers import MtpModel

    from hf_specdec.drafters.mtp import MtpDrafter

    config = AutoConfig.for_model(
        "qwen3_5_text",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_mtp_layers=1,
        mtp_layer_types=["full_attention"],
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    target = hf_specdec.enable(AutoModelForCausalLM.from_config(config).eval())
    mtp = MtpModel(target, 1)
    with torch.no_grad():
        for weight in mtp.layers.parameters():
            torch.nn.init.normal_(weight, std=0.1)
    given = []

    class Counting(MtpDrafter):
        def on_verified(self, input_ids, num_accepted, **kwargs):
            super().on_verified(input_ids, num_accepted, **kwargs)
            # the positions whose hidden states it holds, against those whose next token is known
            given.append((self.exact + self.pending.shape[1], input_ids.shape[1] - 1))

    ids = prompt(seed=8)
    reference = plain(target, ids)
    out = speculative(target, ids, drafter=Counting(mtp))
    assert torch.equal(out.sequences, reference)
    assert out.speculative_stats.accepted_tokens < out.speculative_stats.drafted_tokens  # rounds rolled back
    assert len(given) > 3 and all(held == known for held, known in given), given


def drafter_of_kind(kind, target, reference, ids):
    """A drafter by kind; the copy drafters learn from the target's own output (its first half: partly right)."""
    seen = reference[0, : ids.shape[1] + NEW_TOKENS // 2].tolist()
    if kind == "prompt_lookup":
        return "prompt_lookup"
    if kind == "ngram":
        return hf_specdec.NGramDrafter.from_corpus([seen], n=3, vocab_size=VOCAB, top_k=1)
    if kind == "suffix":
        cache = hf_specdec.SuffixCache(max_requests=4, max_tokens=1000)
        cache.add(seen)
        return hf_specdec.SuffixDrafter(cache=cache)
    return hf_specdec.EagleDrafter.from_target(target, seed=3)  # an untrained EAGLE-3 head: mostly wrong


@pytest.mark.parametrize("kind", ["prompt_lookup", "ngram", "suffix", "eagle"])
def test_every_kind_of_drafter_decodes_a_hybrid_exactly(target, kind):
    """Prompt lookup, an n-gram table, suffix decoding and an EAGLE-3 head (fed the target's hidden states from the
    verify forward, whose recurrent layers are rolled back after each round) on the hybrid families."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10] * 2 + [5, 6, 7]])  # prompt lookup finds "6 7" earlier: it drafts
    reference = plain(target, ids)
    out = speculative(target, ids, drafter=drafter_of_kind(kind, target, reference, ids))
    assert torch.equal(out.sequences, reference)
    stats = out.speculative_stats
    assert stats.drafted_tokens > 0
    if kind in ("ngram", "suffix"):  # they saw the first half of the output
        assert stats.accepted_tokens > 0


def test_an_eagle_head_for_an_attention_free_target_has_attention_of_its_own():
    """Mamba2 has no attention heads to copy (its `head_dim` is its SSM's): the head's attention spans the hidden
    size, in heads of 64 (one head below that), or as many as `num_attention_heads` asks."""
    target = sweep_model("mamba2")
    hidden = target.config.hidden_size
    config = hf_specdec.EagleDrafter.from_target(target).model.config
    heads = hidden // 64 if hidden % 64 == 0 else 1
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (heads, heads, hidden // heads)
    config = hf_specdec.EagleDrafter.from_target(target, num_attention_heads=2).model.config
    assert (config.num_attention_heads, config.head_dim) == (2, hidden // 2)
