"""DeepSeek-V4's compressed attention: its cache layers (`DeepseekV4HCACache`, `DeepseekV4CSACache`) hold, beside a
window of keys that their `update` keeps at `sliding_window - 1`, each compressor's buffer, compressed entries, count
and overlap, which a crop does not roll back. They are checkpointed whole (`recurrent.snapshot_layers`) and rejected
drafts are undone from the checkpoint, the kept tokens fed again."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import ScriptedDrafter
from test_sampling_distribution import exact_distribution, goodness_of_fit
from transformers import DynamicCache

import hf_specdec
from hf_specdec.recurrent import RecurrentCheckpoints, snapshot_layers

sys.path.insert(0, str(Path(__file__).parent / "sweep"))
from tiny import VOCAB
from tiny import tiny_model as sweep_model

# windows that close within a few tokens: a compressed-sparse-attention entry every 4 tokens, a heavily compressed
# one every 8, keys kept over a window of 8, and an indexer top-k of 20 entries (every entry of 80 tokens selected)
RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
NEW_TOKENS = 48


def deepseek_v4(seed=0, index_topk=20):
    model = sweep_model("deepseek_v4", seed=seed, compress_rates=RATES, index_topk=index_topk)
    config = model.config
    assert (config.sliding_window, config.index_topk) == (8, index_topk)
    assert set(config.layer_types) == {"compressed_sparse_attention", "heavily_compressed_attention"}
    return model


@pytest.fixture(scope="module")
def target():
    return hf_specdec.enable(deepseek_v4())


def prompt(length=9, seed=0, batch=1):
    return torch.randint(4, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def plain(model, ids, **kwargs):
    # every compressed entry is selected: within the indexer's top-k (see the last test)
    assert ids.shape[1] + NEW_TOKENS <= model.config.index_topk * RATES["compressed_sparse_attention"]
    return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


def speculative(model, ids, **kwargs):
    return model.generate(
        ids,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        speculative_gamma=5,
        speculative_gamma_policy="constant",
        return_dict_in_generate=True,
        **kwargs,
    )


def _assert_same(got, wanted, where) -> int:
    """Asserts that two values a cache layer holds are the same (tensors to float tolerance, dicts entry by entry);
    returns how many non-empty tensors it compared."""
    if isinstance(got, dict):
        assert got.keys() == wanted.keys(), where
        return sum(_assert_same(got[key], wanted[key], (*where, key)) for key in got)
    if isinstance(got, torch.Tensor):
        assert isinstance(wanted, torch.Tensor) and got.shape == wanted.shape, where
        torch.testing.assert_close(got, wanted, rtol=1e-4, atol=1e-5)
        return int(got.numel() > 0)
    assert got == wanted, (where, got, wanted)
    return 0


def _assert_same_layers(model, cache, want):
    layers, expected_layers = snapshot_layers(model, cache), snapshot_layers(model, want)
    assert len(layers) == len(expected_layers) == len(cache.layers)
    compared = 0
    for index, (layer, expected) in enumerate(zip(layers, expected_layers, strict=True)):
        assert vars(layer).keys() == vars(expected).keys()
        compared += sum(
            _assert_same(value, getattr(expected, name), (index, name)) for name, value in vars(layer).items()
        )
    assert compared > 0


@torch.no_grad()
def _fed(model, tokens_list):
    cache = DynamicCache(config=model.config)
    checkpoints = RecurrentCheckpoints(cache, model=model)
    for tokens in tokens_list:
        _forward(model, tokens, cache, checkpoints)
    return cache, checkpoints


def _forward(model, tokens, cache, checkpoints):
    start = checkpoints.length
    positions = torch.arange(start, start + tokens.shape[1])[None]
    model(tokens, cache=cache, use_cache=True, position_ids=positions)
    checkpoints.fed(tokens.shape[1])


@torch.no_grad()
@pytest.mark.parametrize("context", [7, 13])
def test_the_layers_after_a_rollback_hold_what_a_forward_over_the_kept_tokens_leaves(target, context):
    """Keys, compressor buffers, compressed entries, their counts and overlaps, after a verify forward over 6 drafts
    (a compressed-sparse and a heavily compressed window close inside it) rolled back to every kept length."""
    ids = prompt(context + 6, seed=3)
    drafts = ids[:, context:]
    for kept in range(drafts.shape[1] + 1):
        cache, checkpoints = _fed(target, [ids[:, :context]])
        checkpoints.save()
        _forward(target, drafts, cache, checkpoints)
        restored = checkpoints.rewind(context + kept)
        assert restored == (context + kept if kept == drafts.shape[1] else context)
        if restored < context + kept:
            _forward(target, drafts[:, :kept], cache, checkpoints)
        _assert_same_layers(target, cache, _fed(target, [ids[:, : context + kept]])[0])


@pytest.mark.parametrize("period", [None, 1, 3], ids=["always_right", "never_right", "partly_right"])
def test_greedy_speculation_equals_plain_generate(target, period):
    ids = prompt()
    reference = plain(target, ids)
    out = speculative(target, ids, drafter=ScriptedDrafter(reference, period))
    assert torch.equal(out.sequences, reference)
    stats = out.speculative_stats
    assert stats.target_calls < NEW_TOKENS if period != 1 else stats.target_calls == NEW_TOKENS
    if period == 3:  # rounds that rejected drafts: rolled back from checkpoints and continued exactly
        assert 0 < stats.accepted_tokens < stats.drafted_tokens


@pytest.mark.parametrize("drafter", ["prompt_lookup", "self", "other"])
def test_every_drafter_decodes_exactly_one_row_and_an_unpadded_batch(target, drafter):
    kwargs = {
        "prompt_lookup": dict(drafter="prompt_lookup"),
        "self": dict(assistant_model=target),  # a draft model with compressed attention, rolled back too
        "other": dict(assistant_model=deepseek_v4(seed=1)),
    }[drafter]
    for ids in (prompt(), prompt(batch=2, seed=5)):
        ids = torch.cat([ids, ids[:, :5], ids], dim=-1)  # repeats, for prompt lookup to copy
        reference = plain(target, ids)
        out = speculative(target, ids, **kwargs)
        assert torch.equal(out.sequences, reference)
        stats = out.speculative_stats
        # the copy is always right, the other model almost never: its rejections roll its cache back every round
        assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0 if drafter != "other" else stats.drafted_tokens


def test_sampling_follows_the_target_distribution():
    """Chi-square goodness of fit of 2 sampled tokens against the enumerated target distribution, drafted by another
    DeepSeek-V4 (both rolled back); power: the drafter's own samples fail the same test."""
    model = hf_specdec.enable(deepseek_v4())
    drafter = hf_specdec.enable(deepseek_v4(seed=9))
    config = dict(temperature=0.9, top_k=3)
    ids = prompt(6, seed=11)
    table = exact_distribution(model, ids, config, length=2)

    def samples(generating, **kwargs):
        torch.manual_seed(1234)  # rows of one batch, each sampled on its own (without padding)
        out = generating.generate(ids.repeat(300, 1), do_sample=True, max_new_tokens=2, **config, **kwargs)
        return [tuple(row) for row in out[:, 6:].tolist()]

    drawn = samples(model, assistant_model=drafter, speculative_gamma=2, speculative_gamma_policy="constant")
    assert goodness_of_fit(table, drawn) > 1e-3
    own = samples(drafter)
    assert any(s not in table for s in own) or goodness_of_fit(table, own) < 1e-3


def test_padded_rows_trees_and_beams_are_refused_with_the_reason(target):
    ids = prompt(batch=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with pytest.raises(
        ValueError,
        match=r"DeepseekV4ForCausalLM cannot be verified exactly on rows with padding: its DeepseekV4\w+Cache layers "
        r"compress their keys in windows counted in cache slots",
    ):
        target.generate(ids, attention_mask=mask, drafter="prompt_lookup", max_new_tokens=4)
    with pytest.raises(
        ValueError, match=r"Token trees .* cannot be verified on DeepseekV4ForCausalLM: its cache keeps"
    ):
        target.generate(prompt(), drafter="prompt_lookup", speculative_tree_budget=4, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"not supported on DeepseekV4ForCausalLM: its cache keeps state"):
        target.generate(prompt(), assistant_model=target, num_beams=2, max_new_tokens=4)
    # its decoder layers output hyper-connection streams, [batch, positions, streams, hidden]
    with pytest.raises(
        ValueError,
        match=r"EagleDrafter reads the target's hidden states as \[batch, positions, hidden\], but the decoder "
        r"layers of DeepseekV4ForCausalLM output tensors of shape \(1, 8, 4, 64\)",
    ):
        target.generate(prompt(), drafter=hf_specdec.EagleDrafter.from_target(target), max_new_tokens=4)


def test_padded_rows_differ_from_plain_decoding_without_the_refusal(target, monkeypatch):
    """The refusal's reason, shown: with it lifted, a padded row's speculative output is not plain generate's."""
    import hf_specdec.decoding as decoding

    monkeypatch.setattr(decoding, "snapshot_layers", lambda model, cache: [])
    ids = prompt(batch=2, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    reference = plain(target, ids, attention_mask=mask)
    out = speculative(target, ids, attention_mask=mask, assistant_model=deepseek_v4(seed=1))
    assert torch.equal(out.sequences[0], reference[0])
    assert not torch.equal(out.sequences[1], reference[1])


def test_past_the_indexer_top_k_it_is_refused_as_ties_there_break_by_place():
    """The indexer's ReLU scores are often exactly 0; tied at the top-k's boundary, `topk` orders them by their place
    in the row, which a verify forward makes longer than a one-token forward: past `index_topk` entries a verify can
    select other entries. Refused there, with the reason; the divergence shown with the limit lifted."""
    import hf_specdec.capability as capability

    model = hf_specdec.enable(deepseek_v4(index_topk=8))
    ids = torch.randint(4, VOCAB, (1, 13), generator=torch.Generator().manual_seed(1026))
    reference = model.generate(ids, max_new_tokens=60, do_sample=False)
    exact = model.generate(ids, max_new_tokens=32 - 13, do_sample=False, drafter=ScriptedDrafter(reference))
    assert torch.equal(exact, reference[:, :32])  # every entry selected: served
    run = dict(max_new_tokens=60, do_sample=False, speculative_gamma=6, speculative_gamma_policy="constant")
    with pytest.raises(
        ValueError,
        match=r"DeepseekV4ForCausalLM cannot be verified exactly by speculative decoding: its indexer selects at "
        r"most index_topk=8 compressed entries per query \(of 4 tokens or more each\) and breaks ties .* longer "
        r"than 32 tokens \(this generation may reach max_length=73\)",
    ):
        model.generate(ids, drafter=ScriptedDrafter(reference), **run)
    limit = capability._attention_limit
    try:
        capability._attention_limit = lambda model, cache: None
        lifted = model.generate(ids, drafter=ScriptedDrafter(reference), **run)
    finally:
        capability._attention_limit = limit
    assert not torch.equal(lifted, reference)
