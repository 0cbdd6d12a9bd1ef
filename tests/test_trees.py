"""Token trees end to end: structure and mask tables, cache compaction, greedy identity with plain `generate` for
every built-in drafter on several architectures, sampling in distribution, and the clear errors."""

import pytest
import torch
from conftest import ARCHITECTURES, VOCAB, noisy_copy, prompt, tiny_model, tiny_seq2seq
from test_sampling_distribution import exact_distribution, exact_two_token_distribution, goodness_of_fit, sample_pairs
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import hf_specdec
from hf_specdec.caches import compact_cache
from hf_specdec.layouts import TreeLayout
from hf_specdec.trees import ancestor_mask, chain_parents, tree_attention_bias, tree_depths

NEW_TOKENS = 24


class TreeScript(hf_specdec.Drafter):
    """Three branches of depth γ; branch `right_branch` follows the target's greedy output for `right_depth` tokens,
    the others (and the rest of it) are wrong. Deterministic (q is a point mass)."""

    def __init__(self, reference, right_branch: int = 1, right_depth: int = 3, branches: int = 3):
        self.reference, self.branches = reference, branches
        self.right_branch, self.right_depth = right_branch, right_depth

    def propose(self, input_ids, num_tokens):
        start = input_ids.shape[1]
        reference = self.reference[0, start : start + num_tokens].tolist()
        tokens, parents = [], []
        for branch in range(self.branches):
            parent = -1
            for depth, right_token in enumerate(reference):
                token = right_token
                if branch != self.right_branch or depth >= self.right_depth:
                    token = (right_token + 1 + branch) % VOCAB
                    if depth == 0 and token == reference[0]:
                        token = (token + 1) % VOCAB
                tokens.append(token)
                parents.append(parent)
                parent = len(tokens) - 1
        return hf_specdec.DraftProposal(
            tokens=torch.tensor([tokens], dtype=torch.long),
            parents=torch.tensor([parents], dtype=torch.long).reshape(1, -1),
        )


# ----- structure tables -----------------------------------------------------------------------------------------


def test_depths_and_ancestors_of_a_hand_built_tree():
    #        root
    #       /    \
    #      0      1
    #     / \     |
    #    2   3    4
    #    |
    #    5
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2]])
    assert tree_depths(parents).tolist() == [[1, 1, 2, 2, 2, 3]]
    assert ancestor_mask(parents)[0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ]
    assert tree_depths(chain_parents(1, 4)).tolist() == [[1, 2, 3, 4]]


def test_tree_attention_bias_table():
    parents = torch.tensor([[-1, -1, 0]])
    bias = tree_attention_bias(parents, past_length=2, tail_length=2, dtype=torch.float32)
    assert bias.shape == (1, 1, 5, 7)
    allowed = (bias[0, 0] == 0).int().tolist()
    assert allowed == [
        # past  tail   nodes
        [1, 1, 1, 0, 0, 0, 0],  # tail token 1
        [1, 1, 1, 1, 0, 0, 0],  # tail token 2 (the root)
        [1, 1, 1, 1, 1, 0, 0],  # node 0
        [1, 1, 1, 1, 0, 1, 0],  # node 1: not its sibling
        [1, 1, 1, 1, 1, 0, 1],  # node 2: its parent, node 0
    ]
    assert bias[0, 0, 3, 4] == torch.finfo(torch.float32).min


def test_tree_layout_positions_and_prefixes():
    proposal = hf_specdec.DraftProposal(tokens=torch.tensor([[40, 41, 42, 43]]), parents=torch.tensor([[-1, -1, 0, 2]]))
    layout = TreeLayout(proposal, max_depth=4)
    assert int(layout.depths.max()) == 3 and not bool(layout.too_deep)
    # the depth bound is what the read-free mask climbs to: a tree deeper than it is flagged, not silently cut
    assert bool(TreeLayout(proposal, max_depth=2).too_deep) and not bool(TreeLayout(proposal, max_depth=3).too_deep)
    # 5 cached tokens, a tail of 2 (the last is the root, at position 6), then nodes at depths 1, 1, 2, 3
    overrides = layout.forward_overrides(cache_length=5, context_length=7, dtype=torch.float32)
    assert overrides["position_ids"].tolist() == [[5, 6, 7, 7, 8, 9]]
    assert overrides["attention_mask"].shape == (1, 1, 6, 11)
    candidate_ids = torch.cat([torch.arange(7)[None], proposal.tokens], dim=-1)
    assert layout.prefix(candidate_ids, 7, 0).tolist() == [list(range(7))]
    assert layout.prefix(candidate_ids, 7, 4).tolist() == [list(range(7)) + [40, 42, 43]]  # after node 3
    assert layout.prefix(candidate_ids, 7, 2).tolist() == [list(range(7)) + [41]]


def test_compact_cache_moves_the_accepted_path_into_place():
    config = AutoConfig.for_model(
        "llama", num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB
    )
    cache = DynamicCache(config=config)
    columns = torch.arange(9, dtype=torch.float32)  # 4 context columns, then 5 nodes
    for layer in range(2):
        keys = columns[None, None, :, None].expand(1, 1, 9, 4).clone()
        cache.update(keys, keys + 100, layer)
    compact_cache(cache, start=4, kept=torch.tensor([1, 3]))
    for layer in cache.layers:
        assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 5, 7]
        assert layer.values[0, 0, :, 0].tolist() == [100, 101, 102, 103, 105, 107]
    compact_cache(cache, start=4, kept=torch.tensor([0]))  # already in place: a crop
    assert cache.get_seq_length() == 5 and cache.layers[0].keys[0, 0, -1, 0] == 5


# ----- greedy identity ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_target(request):
    target = hf_specdec.enable(tiny_model(request.param))
    ids = prompt(8, seed=3)
    reference = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return request.param, target, ids, reference


def generate_tree(target, ids, budget=12, gamma=4, **kwargs):
    # constant γ: these tests count rounds and drafts; tiny drafters on a CPU are often measured not to pay, which
    # the default "auto" policy would act on
    kwargs.setdefault("speculative_gamma_policy", "constant")
    return target.generate(
        ids,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        speculative_gamma=gamma,
        speculative_tree_budget=budget,
        return_dict_in_generate=True,
        **kwargs,
    )


@pytest.mark.parametrize("right_branch, right_depth", [(0, 9), (1, 2), (2, 0), (2, 9)])
def test_scripted_tree_greedy_identity(arch_target, right_branch, right_depth):
    _, target, ids, reference = arch_target
    out = generate_tree(target, ids, drafter=TreeScript(reference, right_branch, right_depth))
    assert torch.equal(out.sequences, reference)
    stats = out.speculative_stats
    if right_depth == 0:
        assert stats.accepted_tokens == 0
    if right_depth == 9:  # always right on one branch: every round accepts the full depth (or what is left)
        assert stats.target_calls <= -(-NEW_TOKENS // 5) + 1
    assert max(stats.drafted_history) == 12  # three branches of depth 4


def repeated_ngram_prompt(reference):
    """A prompt whose suffix occurred before with different continuations, so prompt lookup builds a trie."""
    generated = reference[0, 8:].tolist()
    pieces = [generated[:2] + [t] + generated[2:6] for t in (5, 17, 29)]
    return torch.tensor([sum(pieces, []) + generated[:2]])


@pytest.mark.parametrize("drafter_kind", ["model_right", "model_partly", "model_wrong", "prompt_lookup", "ngram"])
def test_builtin_drafters_greedy_identity_with_trees(arch_target, drafter_kind):
    arch, target, ids, reference = arch_target
    kwargs = {}
    if drafter_kind == "model_right":
        kwargs["assistant_model"] = target
    elif drafter_kind == "model_partly":
        kwargs["assistant_model"] = noisy_copy(target, 0.5)
    elif drafter_kind == "model_wrong":
        kwargs["assistant_model"] = tiny_model(arch, seed=7)
    elif drafter_kind == "prompt_lookup":
        ids = repeated_ngram_prompt(reference)
        reference = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        kwargs.update(drafter="prompt_lookup", drafter_kwargs={"min_ngram_size": 1})
    else:
        # the target's own text and a corrupted copy: contexts with two continuations, so the table branches
        corrupted = reference[0].clone()
        corrupted[2::3] = (corrupted[2::3] + 1) % VOCAB
        corpus = [reference[0].tolist(), corrupted.tolist(), prompt(40, seed=9)[0].tolist()]
        kwargs["drafter"] = hf_specdec.NGramDrafter.from_corpus(corpus, n=3, vocab_size=VOCAB, top_k=4)
    out = generate_tree(target, ids, budget=10, gamma=4, **kwargs)
    assert torch.equal(out.sequences, reference), drafter_kind
    stats = out.speculative_stats
    if drafter_kind == "model_right":
        # the drafter's greedy path is the target's, but a budget of 10 may rank deep nodes of it below shallow
        # siblings, so not every round reaches the full depth
        assert stats.mean_accepted_length >= 2.5
    if drafter_kind in ("model_right", "model_partly", "prompt_lookup", "ngram"):
        assert max(stats.drafted_history) > 4, "the budget should make the tree branch"


def test_trees_keep_scores_and_logits_of_plain_generate():
    target = hf_specdec.enable(tiny_model("llama"))
    ids = prompt(8, seed=3)
    plain = target.generate(
        ids, max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True
    )
    out = target.generate(
        ids,
        max_new_tokens=12,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        drafter=TreeScript(plain.sequences, 2, 9),
        speculative_gamma=3,
        speculative_tree_budget=9,
    )
    assert torch.equal(out.sequences, plain.sequences)
    assert len(out.scores) == len(plain.scores) == 12
    for ours, theirs in zip(out.logits, plain.logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # rotary and learned absolute positions
def test_left_padded_prompt_with_trees(arch):
    """Padding is neither seen nor counted by the tree forward, as in plain generate (logits to 1e-4, not only the
    argmax, so a shifted position cannot hide behind a wide margin)."""
    target = hf_specdec.enable(tiny_model(arch))
    ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt(6, seed=4)], dim=-1)
    mask = (torch.arange(9) >= 3).long()[None]
    common = dict(
        attention_mask=mask,
        pad_token_id=0,
        max_new_tokens=12,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    plain = target.generate(ids, **common)
    for drafter in (dict(assistant_model=target), dict(drafter=TreeScript(plain.sequences, 1, 2))):
        out = target.generate(ids, speculative_gamma=3, speculative_tree_budget=9, **drafter, **common)
        assert torch.equal(out.sequences, plain.sequences)
        for ours, theirs in zip(out.logits, plain.logits):
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


# ----- sampling -------------------------------------------------------------------------------------------------

SAMPLING = dict(temperature=0.9, top_k=4)


@pytest.fixture(scope="module")
def sampling_target():
    return hf_specdec.enable(tiny_model("llama", seed=0))


def test_point_mass_tree_samples_follow_target(sampling_target):
    """Three siblings (the likeliest first tokens), each with a child (its likeliest next token): a depth-2 tree of
    deterministic nodes, verified over three-token samples (the first round drafts the whole tree)."""
    target = sampling_target
    ids = prompt(6, seed=11)
    table = exact_distribution(target, ids, SAMPLING, length=3)
    pairs = {}
    for (x1, x2, _), p in table.items():
        pairs[(x1, x2)] = pairs.get((x1, x2), 0.0) + p
    firsts = {}
    for (x1, x2), _p in sorted(pairs.items(), key=lambda item: -item[1]):
        if x1 not in firsts and len(firsts) < 3:
            firsts[x1] = x2
    asked = []

    class Siblings(hf_specdec.Drafter):
        def propose(self, input_ids, num_tokens):
            asked.append(num_tokens)
            if num_tokens < 2:
                return hf_specdec.DraftProposal.empty(1, input_ids.device)
            tokens = [t for pair in firsts.items() for t in pair]
            parents = [p for i in range(len(firsts)) for p in (-1, 2 * i)]
            return hf_specdec.DraftProposal(tokens=torch.tensor([tokens]), parents=torch.tensor([parents]))

    torch.manual_seed(1234)
    samples = [
        tuple(
            target.generate(
                ids,
                do_sample=True,
                max_new_tokens=3,
                drafter=Siblings(),
                speculative_gamma=2,
                speculative_tree_budget=6,
                speculative_gamma_policy="constant",
                **SAMPLING,
            )[0, ids.shape[1] :].tolist()
        )
        for _ in range(2000)
    ]
    assert asked.count(2) == 2000  # every first round drafted the whole tree
    assert goodness_of_fit(table, samples) > 1e-3
    # power: accepting a drafted child whenever its parent was emitted (no ratio test below the root) fails the test
    # (outcomes the target cannot produce, or a distribution it does not have)
    wrong = [(x1, firsts[x1], x3) if x1 in firsts else (x1, x2, x3) for x1, x2, x3 in samples]
    assert any(sample not in table for sample in wrong) or goodness_of_fit(table, wrong) < 1e-3


def test_model_drafter_tree_samples_follow_target(sampling_target):
    """ModelDrafter's top-k tree (deterministic nodes, probs=None) under sampling, with a drafter that is partly
    right (rounds accept 0, 1 and 2 drafts); power: an unrelated model's own samples fail the same test."""
    target = sampling_target
    ids = prompt(6, seed=11)
    table = exact_two_token_distribution(target, ids, SAMPLING)
    samples = sample_pairs(
        target,
        ids,
        SAMPLING,
        2000,
        assistant_model=noisy_copy(target, 0.2),
        speculative_gamma=2,
        speculative_tree_budget=6,
    )
    assert goodness_of_fit(table, samples) > 1e-3
    drafter_samples = sample_pairs(hf_specdec.enable(tiny_model("llama", seed=1)), ids, SAMPLING, 2000)
    assert any(sample not in table for sample in drafter_samples) or goodness_of_fit(table, drafter_samples) < 1e-3


def test_sampled_tree_samples_follow_target(sampling_target):
    """Siblings drawn i.i.d. from a drafter's q (with q passed along) are verified exactly."""
    target = sampling_target
    drafter_model = tiny_model("llama", seed=1)
    ids = prompt(6, seed=11)
    table = exact_two_token_distribution(target, ids, SAMPLING)

    class IidSiblings(hf_specdec.Drafter):
        def reset(self, context):
            self.processors = context.logits_processor

        def propose(self, input_ids, num_tokens):
            if num_tokens < 1:
                return hf_specdec.DraftProposal.empty(1, input_ids.device)
            logits = drafter_model(input_ids).logits[:, -1].float()
            q = self.processors(input_ids, logits).softmax(-1)  # [1, vocab]
            children = torch.multinomial(q, 3, replacement=True)  # [1, 3]: independent draws
            return hf_specdec.DraftProposal(
                tokens=children, probs=q[:, None].expand(1, 3, -1).clone(), parents=torch.full((1, 3), -1)
            )

    samples = sample_pairs(
        target, ids, SAMPLING, 2000, drafter=IidSiblings(), speculative_gamma=1, speculative_tree_budget=3
    )
    assert goodness_of_fit(table, samples) > 1e-3


# ----- errors -----------------------------------------------------------------------------------------------------


def test_tree_errors_are_clear():
    target = hf_specdec.enable(tiny_model("llama"))
    ids = prompt(6)
    with pytest.raises(ValueError, match=r"speculative_tree_budget.*got 0"):
        target.generate(ids, assistant_model=target, speculative_tree_budget=0)
    with pytest.raises(ValueError, match=r"speculative_lenience=0.5.*speculative_tree_budget=8"):
        target.generate(ids, assistant_model=target, speculative_tree_budget=8, speculative_lenience=0.5)
    with pytest.raises(ValueError, match=r"batch of 2.*Drop `speculative_tree_budget`"):
        target.generate(ids.repeat(2, 1), assistant_model=target, speculative_tree_budget=8)
    reference = target.generate(ids, max_new_tokens=6, do_sample=False)
    with pytest.raises(ValueError, match=r"token tree \(`parents`\), but this call verifies chains only"):
        target.generate(ids, drafter=TreeScript(reference), max_new_tokens=6)
    with pytest.raises(ValueError, match=r"tree of 9 nodes, more than speculative_tree_budget=4"):
        target.generate(
            ids, drafter=TreeScript(reference), speculative_gamma=3, speculative_tree_budget=4, max_new_tokens=6
        )

    class BadParents(hf_specdec.Drafter):
        def propose(self, input_ids, num_tokens):
            return hf_specdec.DraftProposal(tokens=torch.tensor([[1, 2]]), parents=torch.tensor([[-1, 1]]))

    with pytest.raises(ValueError, match=r"invalid parents \[\[-1, 1\]\].*parents\[b, i\] < i"):
        target.generate(ids, drafter=BadParents(), speculative_tree_budget=4, max_new_tokens=6)


def test_trees_refuse_encoder_decoder_sliding_windows_and_models_without_4d_masks():
    t5 = hf_specdec.enable(tiny_seq2seq("t5"))
    with pytest.raises(ValueError, match=r"decoder-only targets.*T5ForConditionalGeneration"):
        t5.generate(prompt(6, seed=1) + 3, assistant_model=t5, speculative_tree_budget=8, max_new_tokens=4)
    mistral = hf_specdec.enable(tiny_model("mistral", sliding_window=4))
    with pytest.raises(ValueError, match=r"MistralForCausalLM has sliding-window"):
        mistral.generate(prompt(8), drafter="prompt_lookup", speculative_tree_budget=8, max_new_tokens=4)
    # BLOOM (ALiBi) takes no `position_ids`: a tree's depth-based positions cannot reach it
    config = AutoConfig.for_model("bloom", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    bloom = hf_specdec.enable(AutoModelForCausalLM.from_config(config).eval())
    bloom.generation_config.eos_token_id = bloom.generation_config.pad_token_id = None
    with pytest.raises(ValueError, match=r"the target \(BloomForCausalLM\) does not compute a token tree"):
        bloom.generate(prompt(6), drafter="prompt_lookup", speculative_tree_budget=8, max_new_tokens=4)


def test_probe_refuses_a_model_that_takes_positions_from_cache_slots():
    """A model that ignores `position_ids` (positions from cache slots) would put every node after the last one:
    the functional check must see it even on a default-initialized model, whose logits move little with position."""
    from conftest import tiny_config
    from transformers import LlamaForCausalLM

    from hf_specdec.tree_attention import supports_tree_attention

    class SlotPositions(LlamaForCausalLM):
        def forward(self, *args, position_ids=None, **kwargs):
            return super().forward(*args, **kwargs)

    torch.manual_seed(0)
    assert supports_tree_attention(LlamaForCausalLM(tiny_config("llama")).eval())
    torch.manual_seed(0)
    assert not supports_tree_attention(SlotPositions(tiny_config("llama")).eval())


def test_a_target_that_ignores_its_context_serves_trees():
    """With attention switched off (hf_specdec.toy.copying_target) positions and masks change nothing, and the check
    must not refuse a model that computes trees exactly."""
    from hf_specdec.toy import copying_target

    target = hf_specdec.enable(copying_target(tiny_model("llama")))
    ids = prompt(8, seed=3)
    reference = target.generate(ids, max_new_tokens=12, do_sample=False)
    out = target.generate(
        ids,
        drafter=TreeScript(reference, 1, 2),
        speculative_gamma=3,
        speculative_tree_budget=9,
        max_new_tokens=12,
        do_sample=False,
    )
    assert torch.equal(out, reference)
