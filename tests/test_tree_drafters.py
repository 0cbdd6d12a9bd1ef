"""Token-tree proposals of the built-in drafters: prompt lookup (a trie of earlier copies) and n-gram tables
(best-first by path probability), as tables of hand-made inputs and expected (tokens, parents), plus validity checks
on random inputs."""

import math

import pytest
import torch
from conftest import VOCAB, tiny_model, tiny_seq2seq
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessor, LogitsProcessorList

import hf_specdec
from hf_specdec.drafters.tree_builder import TokenTree
from hf_specdec.trees import check_parents, tree_depths


def as_table(proposal):
    """(tokens, parents) of a batch-1 proposal; parents None for a chain."""
    parents = proposal.parents[0].tolist() if proposal.parents is not None else None
    return proposal.tokens[0].tolist(), parents


def tree_lookup(context, num_tokens, tree_budget, max_ngram_size=3, min_ngram_size=1, **kwargs):
    drafter = hf_specdec.PromptLookupDrafter(max_ngram_size=max_ngram_size, min_ngram_size=min_ngram_size, **kwargs)
    return as_table(drafter.propose_for(torch.tensor([context]), num_tokens, tree_budget=tree_budget))


def assert_valid_tree(proposal, num_tokens, tree_budget):
    tokens, parents = proposal.tokens, proposal.parents
    assert proposal.probs is None  # tree nodes are chosen deterministically
    assert tokens.shape[0] == 1 and tokens.shape[1] <= tree_budget
    if parents is None:  # a chain
        assert tokens.shape[1] <= num_tokens
        return
    assert parents.shape == tokens.shape and parents.dtype == torch.long
    assert check_parents(parents) is None
    assert int(tree_depths(parents).max()) <= num_tokens
    siblings = set()
    for token, parent in zip(tokens[0].tolist(), parents[0].tolist()):
        assert (parent, token) not in siblings, f"duplicate sibling {token} under node {parent}"
        siblings.add((parent, token))
    assert any(parent != node - 1 for node, parent in enumerate(parents[0].tolist()))  # chains come as chains


# ----- TokenTree -------------------------------------------------------------------------------------------------


def test_token_tree_merges_shared_prefixes_within_budget_and_depth():
    tree = TokenTree(budget=6, max_depth=3)
    assert tree.insert([7, 8, 9, 10]) == 3  # cut at the depth bound
    assert tree.insert([7, 8, 5]) == 1  # only the differing tail
    assert tree.insert([7, 8, 9]) == 0  # already there
    assert tree.insert([4, 5, 6]) == 2  # cut where the budget runs out
    assert tree.full and tree.insert([3]) == 0
    assert (tree.tokens, tree.parents, tree.depths) == ([7, 8, 9, 5, 4, 5], [-1, 0, 1, 1, -1, 4], [1, 2, 3, 3, 1, 2])
    assert tree.path(3) == [7, 8, 5] and tree.path(-1) == []
    assert as_table(tree.proposal("cpu")) == ([7, 8, 9, 5, 4, 5], [-1, 0, 1, 1, -1, 4])


def test_token_tree_proposes_a_chain_or_nothing_without_parents():
    chain = TokenTree(budget=4, max_depth=4)
    chain.insert([3, 1, 2])
    assert as_table(chain.proposal("cpu")) == ([3, 1, 2], None)
    empty = TokenTree(budget=4, max_depth=4).proposal("cpu")
    assert empty.tokens.shape == (1, 0) and empty.parents is None


# ----- prompt lookup ---------------------------------------------------------------------------------------------

THREE_MATCHES = [1, 2, 3, 7, 8, 1, 2, 3, 5, 6, 1, 2, 3, 9, 4, 1, 2, 3]  # [1, 2, 3] went on as 7 8, 5 6 and 9 4
SHARED = [1, 2, 5, 6, 7, 1, 2, 5, 6, 8, 1, 2, 5, 9, 1, 2]  # [1, 2] went on as 5 6 7, 5 6 8 and 5 9 1
SHORTER = [5, 2, 3, 8, 8, 1, 2, 3, 4, 4, 1, 2, 3]  # [1, 2, 3] went on as 4 4; only [2, 3] also as 8 8
ALIKE = [1, 2, 7, 8, 1, 2, 7, 8, 1, 2]  # every occurrence goes on alike


@pytest.mark.parametrize(
    "context, num_tokens, tree_budget, max_ngram_size, expected",
    [
        # the latest occurrence is the main branch, the earlier ones follow, most recent first
        (THREE_MATCHES, 2, 6, 3, ([9, 4, 5, 6, 7, 8], [-1, 0, -1, 2, -1, 4])),
        (THREE_MATCHES, 2, 16, 3, ([9, 4, 5, 6, 7, 8], [-1, 0, -1, 2, -1, 4])),  # no more to add
        # budget truncation: the last alternative is cut, then dropped
        (THREE_MATCHES, 2, 5, 3, ([9, 4, 5, 6, 7], [-1, 0, -1, 2, -1])),
        (THREE_MATCHES, 2, 3, 3, ([9, 4, 5], [-1, 0, -1])),
        # the budget cuts the main branch too, and budget 1 is a one-token chain
        (THREE_MATCHES, 4, 2, 3, ([9, 4], None)),
        (THREE_MATCHES, 2, 1, 3, ([9], None)),
        # depth bound: num_tokens = 1 keeps the first token of each continuation
        (THREE_MATCHES, 1, 6, 3, ([9, 5, 7], [-1, -1, -1])),
        # shared prefixes merged: 5 6 8 adds 6 8 under the main branch's 5, then 5 6 7 adds 7 under that 6
        (SHARED, 3, 10, 2, ([5, 9, 1, 6, 8, 7], [-1, 0, 1, 0, 3, 3])),
        (SHARED, 3, 5, 2, ([5, 9, 1, 6, 8], [-1, 0, 1, 0, 3])),
        # when the longest suffix's occurrences are used up, shorter suffixes add theirs
        (SHORTER, 2, 8, 3, ([4, 4, 8, 8], [-1, 0, -1, 2])),
        (SHORTER, 2, 3, 3, ([4, 4, 8], [-1, 0, -1])),
        # continuations that agree merge into one chain; no match proposes nothing
        (ALIKE, 2, 8, 2, ([7, 8], None)),
        ([1, 2, 3, 4], 3, 8, 3, ([], None)),
        # the latest match is so recent that its copy overlaps itself (periodic); of the shorter suffix [1]'s
        # occurrences, the one at 8 9 1 8 merges into it and the first adds 6 7 2 1
        ([1, 6, 7, 2, 1, 8, 9, 1, 8, 9, 1], 4, 8, 2, ([8, 9, 1, 8, 6, 7, 2, 1], [-1, 0, 1, 2, -1, 4, 5, 6])),
    ],
)
def test_prompt_lookup_tree(context, num_tokens, tree_budget, max_ngram_size, expected):
    assert tree_lookup(context, num_tokens, tree_budget, max_ngram_size=max_ngram_size) == expected


def test_prompt_lookup_tree_min_ngram_size_bounds_the_alternatives():
    # with min_ngram_size=3 only [1, 2, 3] counts: SHORTER's 8 8 (after [2, 3]) is no alternative
    assert tree_lookup(SHORTER, 2, 8, min_ngram_size=3) == ([4, 4], None)


def test_prompt_lookup_tree_remembers_the_most_recent_occurrences():
    # [1] occurred 12 times, each time followed by another token: the index keeps the 8 most recent
    context = [token for k in range(10, 22) for token in (1, k)] + [1]
    drafter = hf_specdec.PromptLookupDrafter(max_ngram_size=1, min_ngram_size=1)
    assert drafter.max_occurrences == 8
    assert tree_lookup(context, 1, 20, max_ngram_size=1) == (list(range(21, 13, -1)), [-1] * 8)


@pytest.mark.parametrize("follow_copies", [True, False])
@pytest.mark.parametrize(
    "context", [THREE_MATCHES, SHARED, SHORTER, ALIKE, [1, 2, 3, 4], [7, 7, 7], [1, 8, 9, 8, 9], [4, 5, 6, 4]]
)
def test_prompt_lookup_without_budget_is_the_chain(context, follow_copies):
    drafter = hf_specdec.PromptLookupDrafter(min_ngram_size=1, follow_copies=follow_copies)
    ids = torch.tensor([context])
    chain = drafter.propose_for(ids, 3)
    assert chain.parents is None and chain.probs is None
    assert torch.equal(drafter.propose_for(ids, 3, tree_budget=None).tokens, chain.tokens)
    # with a budget, the tree's first nodes are that chain (its main branch)
    tokens, parents = as_table(drafter.propose_for(ids, 3, tree_budget=8))
    length = chain.tokens.shape[1]
    assert tokens[:length] == chain.tokens[0].tolist()
    assert parents is None or parents[:length] == list(range(-1, length - 1))


def test_prompt_lookup_chains_index_no_occurrence_lists():
    drafter = hf_specdec.PromptLookupDrafter(min_ngram_size=1)
    model = tiny_model("llama")
    ids = torch.tensor([THREE_MATCHES])
    for tree_budget, remembered in ((None, False), (8, True)):
        context = hf_specdec.DraftContext(
            target=model,
            input_ids=ids,
            logits_processor=None,
            vocab_size=VOCAB,
            generation_config=model.generation_config,
            tree_budget=tree_budget,
        )
        call = drafter.for_call(context)
        call.propose(ids, 2)
        assert bool(call.rows[0].starts) == remembered
    assert not hasattr(drafter, "rows") and drafter.tree_budget is None  # the user's object stays untouched


def test_prompt_lookup_tree_batches_fall_back_to_chains():
    drafter = hf_specdec.PromptLookupDrafter(min_ngram_size=1)
    ids = torch.tensor([THREE_MATCHES, THREE_MATCHES[1:] + [3]])
    tree = drafter.propose_for(ids, 2, tree_budget=8)
    assert tree.parents is None and torch.equal(tree.tokens, drafter.propose_for(ids, 2).tokens)


def test_prompt_lookup_tree_index_is_incremental():
    drafter = hf_specdec.PromptLookupDrafter(max_ngram_size=2, min_ngram_size=1, follow_copies=False)
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, 4, (1, 60), generator=generator)  # many repeats: more than 8 occurrences each
    model = tiny_model("llama")
    call = drafter.for_call(
        hf_specdec.DraftContext(
            target=model,
            input_ids=context[:, :3],
            logits_processor=None,
            generation_config=model.generation_config,
            vocab_size=VOCAB,
            tree_budget=12,
        )
    )
    for length in range(3, context.shape[1] + 1):
        grown = call.propose(context[:, :length], 4)
        fresh = drafter.propose_for(context[:, :length], 4, tree_budget=12)
        assert as_table(grown) == as_table(fresh)
        assert_valid_tree(grown, 4, 12)


def test_prompt_lookup_tree_copies_from_the_source_text_after_the_output():
    target = tiny_seq2seq("bart")
    source = torch.tensor([[1, 2, 30, 31, 1, 2, 40, 41]])  # [1, 2] goes on as 40 41, and earlier as 30 31
    output = torch.tensor([[0, 1, 2, 50, 51, 1, 2]])  # the output's own [1, 2] went on as 50 51
    drafter = hf_specdec.PromptLookupDrafter(max_ngram_size=2, min_ngram_size=2).for_call(
        hf_specdec.DraftContext(
            target=target,
            input_ids=output[:, :1],
            logits_processor=None,
            generation_config=target.generation_config,
            vocab_size=VOCAB,
            tree_budget=8,
            inputs_tensor=source,
        )
    )
    # the output's occurrence is the main branch; then the source's, most recent first, cut at the source's end
    assert as_table(drafter.propose(output, 3)) == ([50, 51, 1, 40, 41, 30, 31, 1], [-1, 0, 1, -1, 3, -1, 5, 6])


@settings(max_examples=60, deadline=None)
@given(
    context=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    num_tokens=st.integers(1, 6),
    tree_budget=st.integers(1, 20),
    min_ngram_size=st.integers(1, 2),
    follow_copies=st.booleans(),
)
def test_prompt_lookup_trees_are_valid(context, num_tokens, tree_budget, min_ngram_size, follow_copies):
    drafter = hf_specdec.PromptLookupDrafter(min_ngram_size=min_ngram_size, follow_copies=follow_copies)
    ids = torch.tensor([context])
    tree = drafter.propose_for(ids, num_tokens, tree_budget=tree_budget)
    assert_valid_tree(tree, num_tokens, tree_budget)
    chain = drafter.propose_for(ids, num_tokens).tokens[0].tolist()
    assert tree.tokens[0].tolist()[: min(len(chain), tree_budget)] == chain[:tree_budget]  # the main branch


# ----- n-gram tables ---------------------------------------------------------------------------------------------

# order 3: [1, 2] -> 3 (2/3), 4 (1/3); [2, 3] -> 1; [3, 1] -> 2. Order 2: 4 -> nothing. Unigrams: 1, 2 (3/9),
# 3 (2/9), 4 (1/9)
CORPUS = [[1, 2, 3, 1, 2, 3, 1, 2, 4]]


def ngram_call(corpus=CORPUS, n=3, vocab_size=8, tree_budget=None, logits_processor=(), **kwargs):
    table = hf_specdec.NGramDrafter.from_corpus(corpus, n=n, vocab_size=vocab_size, **kwargs)
    model = tiny_model("llama")
    return table.for_call(
        hf_specdec.DraftContext(
            target=model,
            input_ids=torch.tensor([[1]]),
            logits_processor=LogitsProcessorList(logits_processor),
            generation_config=model.generation_config,
            vocab_size=vocab_size,
            tree_budget=tree_budget,
        )
    )


@pytest.mark.parametrize(
    "context, num_tokens, tree_budget, expected",
    [
        # 3 (q 2/3) and its only continuation 1 (2/3 * 1) rank before 4 (1/3)
        ([1, 2], 2, 3, ([3, 1, 4], [-1, 0, -1])),
        # best-first down to 3 1 2 3 (4/9), then 4 (3/9), 3 1 2 4 (2/9), then 4's unigram backoff 1 and 2 (1/9 each)
        ([1, 2], 4, 8, ([3, 1, 2, 3, 4, 4, 1, 2], [-1, 0, 1, 2, -1, 2, 4, 4])),
        # depth 1: the root's continuations, most probable first
        ([1, 2], 1, 8, ([3, 4], [-1, -1])),
        # budget 1 and a budget the likeliest path fills: chains
        ([1, 2], 4, 1, ([3], None)),
        ([1, 2], 3, 3, ([3, 1, 2], None)),
        # after [2, 3] only 1 follows (q = 1), then 2; the tree branches at [1, 2] again
        ([2, 3], 3, 4, ([1, 2, 3, 4], [-1, 0, 1, 1])),
        # unknown context: the unigram row; ties (1 and 2) go to the lower token id, like argmax
        ([7], 1, 3, ([1, 2, 3], [-1, -1, -1])),
    ],
)
def test_ngram_tree(context, num_tokens, tree_budget, expected):
    proposal = ngram_call(tree_budget=tree_budget).propose(torch.tensor([context]), num_tokens)
    assert as_table(proposal) == expected


class BanSeen(LogitsProcessor):
    """Rules out every token the sequence already holds, and records the prefixes it was called with."""

    def __init__(self):
        self.prefixes = []

    def __call__(self, input_ids, scores):
        self.prefixes.append(input_ids[0].tolist())
        return scores.scatter(1, input_ids, float("-inf"))


def test_ngram_tree_standardizes_each_node_with_its_own_prefix():
    ban_seen = BanSeen()
    drafter = ngram_call(tree_budget=8, logits_processor=[ban_seen])
    # root: 3 (2/3), 4 (1/3); after 3 only 1 follows, which is seen: 3 is a leaf. After 4 the unigrams back off,
    # and of them only 3 is unseen on the path [1, 2, 4] (3 lies on its sibling's path, not its own)
    assert as_table(drafter.propose(torch.tensor([[1, 2]]), 4)) == ([3, 4, 3], [-1, -1, 1])
    assert ban_seen.prefixes == [[1, 2], [1, 2, 3], [1, 2, 4], [1, 2, 4, 3]]


def test_ngram_tree_is_deterministic_in_sample_mode():
    ids = torch.tensor([[1, 2]])
    sampled = ngram_call(tree_budget=8, draft_mode="sample").propose(ids, 4)
    assert sampled.probs is None  # nodes are the top continuations: q is a point mass on each
    assert as_table(sampled) == as_table(ngram_call(tree_budget=8).propose(ids, 4))


def test_ngram_without_budget_is_the_chain():
    ids = torch.tensor([[1, 2]])
    chain = ngram_call().propose(ids, 4)
    assert as_table(chain) == ([3, 1, 2, 3], None)
    sampled = ngram_call(draft_mode="sample").propose(ids, 4)
    assert sampled.parents is None and sampled.probs.shape == (1, 4, 8)  # chains keep sampling with q
    batch = torch.tensor([[1, 2], [2, 3]])  # trees are for batch size 1: a batch gets chains
    assert torch.equal(ngram_call(tree_budget=8).propose(batch, 3).tokens, ngram_call().propose(batch, 3).tokens)
    assert ngram_call(tree_budget=8).propose(batch, 3).parents is None


def node_path(tokens, parents, node):
    """The tokens from the root's child down to `node` (empty for the root, -1)."""
    path = []
    while node >= 0:
        path.insert(0, tokens[node])
        node = parents[node]
    return path


def continuation_probabilities(table, context):
    """{token: q} after `context`, from the table's own (unprocessed) distribution."""
    continuations, probs = table.distribution(context[-(table.n - 1) :] if table.n > 1 else [])
    return dict(zip(continuations.tolist(), probs.tolist()))


@settings(max_examples=40, deadline=None)
@given(
    corpus=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=30), min_size=1, max_size=3),
    context=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    n=st.integers(1, 4),
    num_tokens=st.integers(1, 5),
    tree_budget=st.integers(1, 16),
)
def test_ngram_trees_are_valid_and_best_first(corpus, context, n, num_tokens, tree_budget):
    table = hf_specdec.NGramDrafter.from_corpus(corpus, n=n, vocab_size=6, top_k=4)
    tree = table.propose_for([context], num_tokens, tree_budget=tree_budget)
    assert_valid_tree(tree, num_tokens, tree_budget)
    if len(context) >= n - 1:  # (a chain after a shorter context backs off to fewer tokens than it has)
        assert tree.tokens[0, 0] == table.propose_for([context], num_tokens).tokens[0, 0]  # the argmax comes first
    tokens, parents = as_table(tree)
    parents = parents if parents is not None else list(range(-1, len(tokens) - 1))
    probabilities = []  # the product of q along each node's path
    for token, parent in zip(tokens, parents):
        q = continuation_probabilities(table, context + node_path(tokens, parents, parent)).get(token, 0.0)
        probabilities.append((probabilities[parent] if parent >= 0 else 1.0) * q)
    assert all(p > 0 for p in probabilities)
    # best-first: the continuations (within depth) of the root and the nodes that the tree left out are none if
    # it has room left, and none more probable than its least probable node if it is full
    depths = tree_depths(torch.tensor([parents]))[0].tolist()
    left_out = []
    for node in [-1] + list(range(len(tokens))):
        if node >= 0 and depths[node] >= num_tokens:
            continue
        children = {tokens[i] for i in range(len(tokens)) if parents[i] == node}
        base = probabilities[node] if node >= 0 else 1.0
        q = continuation_probabilities(table, context + node_path(tokens, parents, node))
        left_out += [base * q_token for token, q_token in q.items() if token not in children]
    if len(tokens) < tree_budget:
        assert not left_out
    elif left_out:
        assert max(left_out) <= min(probabilities) * (1 + 1e-5)
    assert math.isclose(max(probabilities), probabilities[0])
