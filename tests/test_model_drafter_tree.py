"""`ModelDrafter` token trees (EAGLE-2's dynamic tree): structure, the batched tree forward against plain causal
forwards over each node's path, the rerank, cache rollback, and chains wherever trees do not apply."""

import pytest
import torch
from conftest import VOCAB, noisy_copy, prompt, source, tiny_config, tiny_model, tiny_seq2seq
from transformers import GenerationConfig, LlamaForCausalLM, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

import hf_specdec
from hf_specdec.trees import best_subtree, check_parents, tree_depths

TREE_ARCHITECTURES = ("gpt2", "llama", "qwen2")
PROCESSORS = {
    "none": LogitsProcessorList,
    # depends on each row's own prefix: a node's path changes its q
    "repetition_penalty": lambda: LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty=3.0)]),
}


def context(target, input_ids, tree_budget, processors=None, do_sample=False, **fields):
    return hf_specdec.DraftContext(
        target=target,
        input_ids=input_ids,
        logits_processor=LogitsProcessorList() if processors is None else processors,
        generation_config=GenerationConfig(max_length=64, do_sample=do_sample),
        vocab_size=VOCAB,
        tree_budget=tree_budget,
        **fields,
    )


def tree_drafter(model, input_ids, tree_budget, tree_top_k=3, **kwargs):
    return hf_specdec.ModelDrafter(model, tree_top_k=tree_top_k).for_call(
        context(model, input_ids, tree_budget, **kwargs)
    )


@torch.no_grad()
def plain_log_q(model, ids, processors):
    """Standardized log q after `ids` (`[1, len]`) from one plain causal forward, no cache: `[vocab]`."""
    logits = model(input_ids=ids).logits[:, -1].float()
    return processors(ids, logits).log_softmax(dim=-1)[0]


def node_paths(tokens, parents):
    """Each node's path below the root, as a list of token ids (topological order makes one pass enough)."""
    paths = []
    for token, parent in zip(tokens[0].tolist(), parents[0].tolist()):
        paths.append(([] if parent < 0 else paths[parent]) + [token])
    return paths


def children_of(parents):
    children = {}
    for node, parent in enumerate(parents[0].tolist()):
        children.setdefault(parent, []).append(node)
    return children  # -1: the root's children


def check_structure(proposal, budget, num_tokens):
    tokens, parents = proposal.tokens, proposal.parents
    assert proposal.probs is None
    assert parents is not None and tokens.shape == parents.shape and tokens.shape[0] == 1
    assert 1 <= tokens.shape[1] <= budget
    assert check_parents(parents) is None
    assert int(tree_depths(parents).max()) <= num_tokens
    for siblings in children_of(parents).values():
        sibling_tokens = tokens[0, siblings].tolist()
        assert len(set(sibling_tokens)) == len(sibling_tokens)


@pytest.mark.parametrize("processors", sorted(PROCESSORS))
@pytest.mark.parametrize("arch", TREE_ARCHITECTURES)
def test_full_tree_matches_plain_forwards(arch, processors):
    """A budget that keeps every node grown: every expanded node's children are exactly the top-k of a plain forward
    over the prompt and its path, and each depth expands exactly its top-k nodes by cumulative log q."""
    model, ids, top_k, num_tokens = tiny_model(arch, seed=1), prompt(6, seed=2), 3, 3
    proposal = tree_drafter(model, ids, 64, top_k, processors=PROCESSORS[processors]()).propose(ids, num_tokens)
    check_structure(proposal, 64, num_tokens)
    assert proposal.tokens.shape[1] == top_k + (num_tokens - 1) * top_k * top_k  # nothing cut
    processors = PROCESSORS[processors]()
    paths, children = node_paths(proposal.tokens, proposal.parents), children_of(proposal.parents)
    depths = tree_depths(proposal.parents)[0].tolist()
    scores = {}  # node -> cumulative log q from plain forwards
    for node in [-1] + list(range(len(paths))):
        path = [] if node < 0 else paths[node]
        if node >= 0:
            parent_path = ids if len(path) == 1 else torch.cat([ids, torch.tensor([path[:-1]])], dim=-1)
            parent = proposal.parents[0, node].item()
            scores[node] = scores.get(parent, 0.0) + plain_log_q(model, parent_path, processors)[path[-1]].item()
        if node not in children:
            continue
        log_q = plain_log_q(model, torch.cat([ids, torch.tensor([path], dtype=torch.long)], dim=-1), processors)
        assert proposal.tokens[0, children[node]].tolist() == log_q.topk(top_k).indices.tolist()
    for depth in range(1, num_tokens):
        level = [node for node in range(len(paths)) if depths[node] == depth]
        best = sorted(level, key=lambda node: -scores[node])[:top_k]
        assert sorted(best) == sorted(node for node in level if node in children)


@pytest.mark.parametrize("budget", [2, 6, 12])
@pytest.mark.parametrize("arch", TREE_ARCHITECTURES)
def test_budgeted_tree_keeps_the_best_children(arch, budget):
    """Cut to a budget: the kept children of a node are the best of its plain forward's top-k, in that order, and the
    tree respects the budget, γ as its depth, distinct siblings and topological parents."""
    model, ids, num_tokens = tiny_model(arch, seed=1), prompt(5, seed=3), 4
    processors = PROCESSORS["repetition_penalty"]()
    proposal = tree_drafter(model, ids, budget, 4, processors=processors).propose(ids, num_tokens)
    check_structure(proposal, budget, num_tokens)
    assert proposal.tokens.shape[1] == budget  # 4 children at depth 1, 16 at depth 2: always enough nodes
    paths = node_paths(proposal.tokens, proposal.parents)
    for node, kids in children_of(proposal.parents).items():
        path = [] if node < 0 else paths[node]
        log_q = plain_log_q(model, torch.cat([ids, torch.tensor([path], dtype=torch.long)], dim=-1), processors)
        assert proposal.tokens[0, kids].tolist() == log_q.topk(4).indices[: len(kids)].tolist()


@pytest.mark.parametrize("arch", TREE_ARCHITECTURES)
def test_without_budget_chains_are_unchanged(arch):
    model, ids = tiny_model(arch, seed=1), prompt(6, seed=4)
    chain = tree_drafter(model, ids, None, tree_top_k=5).propose(ids, 4)
    assert chain.parents is None and chain.probs is None
    expected = ids
    for _ in range(4):  # greedy, one plain forward per token
        expected = torch.cat([expected, plain_log_q(model, expected, LogitsProcessorList()).argmax().view(1, 1)], -1)
    assert torch.equal(chain.tokens, expected[:, ids.shape[1] :])
    # sampled chains: the same draws and q as a drafter built without tree arguments
    sampled = []
    for drafter in (hf_specdec.ModelDrafter(model), hf_specdec.ModelDrafter(model, tree_top_k=2)):
        torch.manual_seed(0)
        sampled.append(drafter.for_call(context(model, ids, None, do_sample=True)).propose(ids, 4))
    assert torch.equal(sampled[0].tokens, sampled[1].tokens) and torch.equal(sampled[0].probs, sampled[1].probs)
    assert sampled[1].parents is None


@pytest.mark.parametrize("do_sample", [False, True])
def test_budget_one_is_the_greedy_first_token(do_sample):
    model, ids = tiny_model("llama", seed=1), prompt(6, seed=5)
    proposal = tree_drafter(model, ids, 1, do_sample=do_sample).propose(ids, 4)
    greedy = hf_specdec.ModelDrafter(model).for_call(context(model, ids, None)).propose(ids, 4)
    assert proposal.tokens.tolist() == greedy.tokens[:, :1].tolist()
    assert proposal.parents.tolist() == [[-1]] and proposal.probs is None


@pytest.mark.parametrize("arch", TREE_ARCHITECTURES)
def test_rollback_after_verification(arch):
    """Rounds that accept none, part or all of a path, then a bonus token: each next tree equals the tree a fresh
    drafter grows for the longer input (the tree's nodes left the cache, the accepted tokens were fed again)."""
    model, ids = tiny_model(arch, seed=1), prompt(6, seed=6)
    drafter = tree_drafter(model, ids, 8)
    proposal = drafter.propose(ids, 4)
    for round_, accept in enumerate(["none", "part", "all", "part"]):
        paths, parents = node_paths(proposal.tokens, proposal.parents), proposal.parents[0].tolist()
        deepest = max(range(len(paths)), key=lambda node: len(paths[node]))
        route = [deepest]
        while parents[route[0]] >= 0:
            route.insert(0, parents[route[0]])
        route = {"none": [], "part": route[:2], "all": route}[accept]
        accepted = [paths[route[-1]]] if route else [[]]
        bonus = torch.tensor([[(7 * round_ + 3) % VOCAB]])
        ids = torch.cat([ids, torch.tensor(accepted, dtype=torch.long), bonus], dim=-1)
        drafter.on_verified(ids, torch.tensor([len(route)]), accepted_nodes=torch.tensor([route], dtype=torch.long))
        assert drafter.cache.get_seq_length() == ids.shape[1] - 1 - len(route)  # the context before this tree
        proposal = drafter.propose(ids, 4)
        fresh = tree_drafter(model, ids, 8).propose(ids, 4)
        assert torch.equal(proposal.tokens, fresh.tokens) and torch.equal(proposal.parents, fresh.parents)
    drafter.on_verified(torch.cat([ids, bonus], dim=-1), torch.tensor([0]))  # `accepted_nodes` may be absent
    assert drafter.cache.get_seq_length() == ids.shape[1]


def test_padded_batch_gets_chains():
    model = tiny_model("llama", seed=1)
    ids = torch.cat([prompt(6, seed=7), prompt(6, seed=8)])
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    proposals = [
        hf_specdec.ModelDrafter(model)
        .for_call(context(model, ids, budget, model_kwargs={"attention_mask": mask}))
        .propose(ids, 3, attention_mask=mask)
        for budget in (None, 8)
    ]
    assert proposals[1].parents is None and torch.equal(proposals[0].tokens, proposals[1].tokens)


def test_encoder_decoder_target_gets_chains():
    target, draft = tiny_seq2seq("t5", seed=0), tiny_seq2seq("t5", seed=1)
    decoder_ids = torch.zeros(1, 1, dtype=torch.long)
    drafter = hf_specdec.ModelDrafter(draft).for_call(context(target, decoder_ids, 8, inputs_tensor=source()))
    proposal = drafter.propose(decoder_ids, 3)
    assert proposal.parents is None and proposal.tokens.shape == (1, 3)


class MaskIgnoringLlama(LlamaForCausalLM):
    """Builds its own causal mask whatever it is given: tree nodes would see their cousins."""

    def forward(self, *args, attention_mask=None, **kwargs):
        return super().forward(*args, **kwargs)


def test_drafter_without_tree_attention_is_refused():
    torch.manual_seed(0)
    model = MaskIgnoringLlama(tiny_config("llama")).eval()
    with pytest.raises(
        ValueError,
        match=r"`speculative_tree_budget` needs models that take a custom 4D attention .* "
        r"the drafter model \(`assistant_model`\)",
    ):
        tree_drafter(model, prompt(4), 8)
    assert tree_drafter(model, prompt(4), None).propose(prompt(4), 2).tokens.shape == (1, 2)  # chains still work


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4"])
def test_bad_tree_top_k(bad):
    with pytest.raises(ValueError, match=r"`tree_top_k` must be a positive int .*, got .*Use `tree_top_k=4`"):
        hf_specdec.ModelDrafter(tiny_model("llama"), tree_top_k=bad)


def test_best_subtree_keeps_ancestors_on_ties():
    # a child may score as much as its parent (q = 1): the parent, grown first, must win the tie
    parents = torch.tensor([[-1, 0, 1, -1, 3]])
    scores = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -2.0]])
    kept, kept_parents = best_subtree(parents, scores, 3)
    assert kept.tolist() == [[0, 1, 2]] and kept_parents.tolist() == [[-1, 0, 1]]
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):  # random trees with scores that never increase along a path, ties included
        size = 12
        parents = torch.tensor([[-1] + [int(torch.randint(-1, i, (1,), generator=generator)) for i in range(1, size)]])
        steps = torch.randint(0, 3, (size,), generator=generator).float().neg()  # log q in {0, -1, -2}
        scores = torch.zeros(1, size)
        for node in range(size):
            parent = parents[0, node].item()
            scores[0, node] = (0.0 if parent < 0 else scores[0, parent]) + steps[node]
        for budget in range(1, size + 1):
            kept, kept_parents = best_subtree(parents, scores, budget)
            chosen = set(kept[0].tolist())
            assert all(parents[0, node].item() in chosen | {-1} for node in chosen)  # closed under ancestors
            assert check_parents(kept_parents) is None
            remapped = [-1 if p < 0 else kept[0, p].item() for p in kept_parents[0].tolist()]
            assert remapped == parents[0, kept[0]].tolist()


@pytest.mark.parametrize("arch", TREE_ARCHITECTURES)
def test_left_padded_single_prompt(arch):
    """A single prompt with left padding: its nodes see none of it and sit where the unpadded prompt's would."""
    model, ids = tiny_model(arch, seed=1), prompt(6, seed=9)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=-1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=-1)
    drafter = tree_drafter(model, padded, 8, model_kwargs={"attention_mask": mask})
    proposal, unpadded = drafter.propose(padded, 4), tree_drafter(model, ids, 8).propose(ids, 4)
    assert torch.equal(proposal.tokens, unpadded.tokens) and torch.equal(proposal.parents, unpadded.parents)


@pytest.mark.parametrize("kind", ["assistant_model", "assistant_early_exit"])
def test_a_prefix_function_sees_the_call_s_prompt_numbers_in_a_tree(kind):
    """`prefix_allowed_tokens_fn` with a tree: the drafter standardizes a frontier of several paths of the one
    prompt, and the function is asked about prompt 0 only, as plain `generate` asks it (it got 1, 2, ... and a
    function indexing per-prompt constraints raised)."""
    target = hf_specdec.enable(tiny_model("llama"))
    ids = prompt(8, seed=0)
    seen = set()

    def allowed(batch_id, sent):
        seen.add(batch_id)
        return [list(range(3, 40))][batch_id]

    plain = target.generate(ids, max_new_tokens=10, prefix_allowed_tokens_fn=allowed)
    drafter = {"assistant_model": noisy_copy(target, 0.1)} if kind == "assistant_model" else {kind: 1}
    out = target.generate(
        ids,
        max_new_tokens=10,
        prefix_allowed_tokens_fn=allowed,
        speculative_tree_budget=8,
        speculative_gamma_policy="constant",
        return_dict_in_generate=True,
        **drafter,
    )
    assert torch.equal(out.sequences, plain)
    assert seen == {0}
    assert out.speculative_stats.drafted_tokens > 0
