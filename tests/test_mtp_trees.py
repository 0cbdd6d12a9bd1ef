"""MtpDrafter's dynamic token trees (one or several full-attention MTP layers): greedy identity (always, partly and
never right), every expanded node computed as the chain through it would be (checked against transformers'
`MtpModel.forward_layer` run from a fresh cache along the node's path), sampling against the exactly enumerated target
with a power check, and chains for the layouts trees do not cover."""

from __future__ import annotations

import pytest
import torch
from conftest import prompt
from test_mtp import GREEDY, deepseek, make_bigram, sampled
from test_sampling_distribution import exact_distribution, goodness_of_fit
from transformers.cache_utils import MtpCache

from hf_specdec.drafters import tree_builder
from hf_specdec.drafters.mtp import MtpDrafter


@pytest.mark.parametrize("budget, layers", [(4, 1), (8, 1), (16, 1), (8, 2), (16, 3)])
@pytest.mark.parametrize("right", ["always", "partly", "never"])
def test_trees_decode_exactly(budget, layers, right):
    target, mtp = deepseek(layers, seed=budget)
    if right == "always":
        make_bigram(target, mtp)
    elif right == "partly":
        make_bigram(target, mtp, context=0.5, roughness=0.05)
    else:
        with torch.no_grad():
            for layer in mtp.layers:
                layer.post_norm.weight.zero_()  # every logit 0: the draft is always token 0
            target.get_output_embeddings().weight[0] = -100.0  # which the target never emits
    ids = prompt(6, seed=budget)
    plain = target.generate(ids, max_new_tokens=25, do_sample=False)
    out = target.generate(
        ids,
        drafter=MtpDrafter(mtp, tree_top_k=2),
        speculative_tree_budget=budget,
        speculative_gamma=layers + 3,
        return_dict_in_generate=True,
        **GREEDY,
    )
    assert torch.equal(out.sequences, plain)
    stats = out.speculative_stats
    if right == "always":  # every drafting round keeps a path of two nodes or more
        histogram = stats.accepted_length_histogram  # rounds with none: the prefill, and a last plain step at most
        assert histogram[0] <= 2 and histogram[1] == 0 and sum(histogram[2:]) >= 4
    elif right == "partly":
        assert 0 < stats.accepted_tokens < stats.drafted_tokens
    else:
        assert stats.accepted_tokens == 0 and stats.drafted_tokens > 0


@torch.no_grad()
def chain_log_q(target, mtp, sequence: torch.LongTensor, path: list[int]) -> torch.Tensor:
    """The log q after `sequence` + `path` that a chain through `path` computes, from scratch with transformers'
    `MtpModel.forward_layer` and a fresh cache: layers 0 .. min(d, L - 1) over the context's slots in turn (the
    target's last hidden state at 0..n-2 into layer 0; layer k reads tokens k+1 .. n-1+k of sequence + path, as
    `MtpModel.forward` rolls them), then, for a path deeper than the L layers, one step per further path token with
    layer d mod L (the previous output, the token, position n - 1 + d)."""
    length, layers, depth = sequence.shape[1], len(mtp.layers), len(path)
    full = torch.cat([sequence, torch.tensor([path], dtype=torch.long)], dim=1)
    hidden = target.model(sequence).last_hidden_state[:, : length - 1]
    cache = MtpCache(config=target.config.get_mtp_config())
    for index in range(min(depth, layers - 1) + 1):
        positions = torch.arange(1 + index, length + index)[None]
        hidden = mtp.forward_layer(index, hidden, positions, cache, input_ids=full[:, 1 + index : length + index])
    out = hidden[:, -1:]
    for step in range(layers, depth + 1):
        position = torch.tensor([[length - 1 + step]])
        out = mtp.forward_layer(step % layers, out, position, cache, input_ids=full[:, length - 1 + step :][:, :1])
    return mtp._project_to_logits(out[0, -1]).float().log_softmax(-1)


@pytest.mark.parametrize("layers, do_sample", [(1, False), (2, False), (3, False), (2, True), (3, True)])
def test_each_node_is_the_step_a_chain_through_it_takes(monkeypatch, layers, do_sample):
    """Random MTP weights (its drafts depend on its hidden state, attention and cache): every expanded node's
    children's log q, in every round, equals a chain's through that node's path from a fresh cache, at depths within
    the layers and past them (γ = layers + 2). A node that saw its siblings, another layer's steps, a wrong position,
    slot or predecessor output would differ, and so would a round after one that kept keys of the wrong branch.
    Sampling (no processors: the log q are the raw ones) keeps paths that do not start with the best node."""
    target, mtp = deepseek(layers, seed=3)
    make_bigram(target, mtp, context=0.5, roughness=0.6)
    log = []
    grow = tree_builder.DynamicTree.grow

    def recording(tree, log_q):
        log[-1][1].append((tree.newest_paths[tree.frontier - tree.newest_start].clone(), log_q.clone()))
        grow(tree, log_q)

    monkeypatch.setattr(tree_builder.DynamicTree, "grow", recording)

    class Recorded(MtpDrafter):
        def _propose_tree(self, input_ids, num_tokens, stages):
            log.append((input_ids.clone(), []))
            return super()._propose_tree(input_ids, num_tokens, stages)

    ids = prompt(6, seed=4)
    plain = target.generate(ids, max_new_tokens=16, do_sample=False)
    torch.manual_seed(0)
    out = target.generate(
        ids,
        drafter=Recorded(mtp, tree_top_k=2),
        speculative_tree_budget=32,  # more than the nodes: every depth is expanded
        speculative_gamma=layers + 2,
        max_new_tokens=16,
        speculative_gamma_policy="constant",
        **(dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0) if do_sample else dict(do_sample=False)),
    )
    assert do_sample or torch.equal(out, plain)
    checked, depths = 0, set()
    for sequence, grows in log:
        for paths, rows in grows:
            assert paths.shape[0] > 1 or checked  # siblings expanded together
            for path, row in zip(paths, rows):
                torch.testing.assert_close(row, chain_log_q(target, mtp, sequence, path.tolist()), atol=2e-5, rtol=0)
                checked += 1
                depths.add(path.shape[0])
    assert len(log) >= 3 and checked >= 12 and depths == set(range(1, layers + 2))


@pytest.mark.parametrize("layers", [1, 2])
def test_sampled_trees_follow_the_target(monkeypatch, layers):
    """Sampling with trees of deterministic nodes: the five tokens' joint distribution against the exactly
    enumerated target; power (one layer: the verification does not depend on how the nodes were drafted): the same
    test rejects a tree verification that accepts the first child at every depth."""
    target, mtp = deepseek(layers, seed=5)
    make_bigram(target, mtp, context=0.5, roughness=0.02)
    config = dict(temperature=0.9, top_k=2)
    ids = prompt(6, seed=11)
    table = exact_distribution(target, ids, config, length=5)
    run = dict(
        drafter=MtpDrafter(mtp, tree_top_k=2),
        speculative_tree_budget=4,
        speculative_gamma=layers + 1,
        speculative_gamma_policy="constant",
    )
    assert goodness_of_fit(table, sampled(target, ids, config, 1000, **run)) > 1e-3
    if layers > 1:
        return

    from hf_specdec import layouts, sampling

    verify_tree_sampling = sampling.verify_tree_sampling

    def first_children(tokens, parents, probs, target_probs, generator=None):
        accepted, nodes, _ = verify_tree_sampling(tokens, parents, probs, target_probs, generator)
        # the chain of first children (a node whose parent is the previous one, from the root)
        chain, current = [], -1
        for index in range(tokens.shape[1]):
            if int(parents[0, index]) == current:
                chain.append(index)
                current = index
        nodes = torch.full_like(nodes, -1)
        nodes[0, : len(chain)] = torch.tensor(chain)
        bonus = sampling.sample_tokens(target_probs[:, (chain[-1] + 1) if chain else 0])
        return torch.full_like(accepted, len(chain)), nodes, bonus

    monkeypatch.setattr(layouts, "verify_tree_sampling", first_children)
    wrong = sampled(target, ids, config, 500, **run)
    monkeypatch.undo()
    inside = [outcome for outcome in wrong if outcome in table]  # a first child outside the target's top 2: refused
    assert goodness_of_fit(table, inside) < 1e-3


def test_a_context_shorter_than_the_layers_drafts_a_chain_first():
    """A tree needs each layer to have a slot reading the context only: with 3 layers and a 1-token prompt the first
    drafting round drafts a chain, the later ones trees; the output stays the target's."""
    target, mtp = deepseek(3, seed=1)
    make_bigram(target, mtp)
    kinds = []

    class Recorded(MtpDrafter):
        def propose(self, input_ids, num_tokens, attention_mask=None):
            proposal = super().propose(input_ids, num_tokens, attention_mask)
            if proposal.tokens.shape[1]:  # not the prefill's round
                kinds.append("tree" if proposal.parents is not None else "chain")
            return proposal

    ids = prompt(1, seed=1)
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    run = dict(GREEDY, max_new_tokens=12, speculative_gamma=4)
    out = target.generate(ids, drafter=Recorded(mtp), speculative_tree_budget=8, **run)
    assert torch.equal(out, plain) and kinds[0] == "chain" and "tree" in kinds[1:]
    with pytest.raises(ValueError, match=r"`tree_top_k` must be a positive int .* got 0"):
        MtpDrafter(mtp, tree_top_k=0)


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("layout", [dict(cache_implementation="static"), dict(prefill_chunk_size=3)])
def test_trees_in_a_static_cache_and_a_chunked_prefill(layout, layers):
    target, mtp = deepseek(layers, seed=2)
    make_bigram(target, mtp, context=0.5, roughness=0.05)
    ids = prompt(6, seed=3)
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    out = target.generate(
        ids,
        drafter=MtpDrafter(mtp),
        speculative_tree_budget=6,
        speculative_gamma=3,
        return_dict_in_generate=True,
        **layout,
        **dict(GREEDY, max_new_tokens=20),
    )
    assert torch.equal(out.sequences, plain) and out.speculative_stats.accepted_tokens > 0
