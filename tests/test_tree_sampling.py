"""Tree verification in the sampling core: hand-built logits for the greedy walk, exact enumeration for sampling."""

import pytest
import torch
from scipy.stats import chisquare

from hf_specdec.sampling import verify_greedy, verify_sampling, verify_tree_greedy, verify_tree_sampling
from hf_specdec.trees import chain_parents, tree_depths

TRIALS = 20000
P_THRESHOLD = 1e-3
POWER_THRESHOLD = 1e-6


def peaked(argmaxes, vocab=6, high=10.0):
    """Logits [1, len(argmaxes), vocab] with a large value on each wanted argmax."""
    logits = torch.zeros(1, len(argmaxes), vocab)
    logits[0, torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = high
    return logits


# the argmax list has k + 1 entries: after the root, then after each node
@pytest.mark.parametrize(
    "parents, tokens, argmaxes, accepted, nodes, next_token",
    [
        # node 0 wrong; node 2 right under it but cut off; node 1 and its child 3 right; 4 wrong
        ([-1, -1, 0, 1, 3], [5, 2, 1, 3, 0], [2, 1, 3, 0, 4, 1], 2, [1, 3, -1, -1, -1], 4),
        # nothing right: the next token is the target's argmax after the root
        ([-1, -1, 0, 1], [1, 2, 3, 4], [0, 3, 4, 5, 5], 0, [-1, -1, -1, -1], 0),
        # duplicate siblings, only the second one's child is right: the deeper path wins
        ([-1, -1, 0, 1], [2, 2, 3, 4], [2, 0, 4, 1, 1], 2, [1, 3, -1, -1], 1),
        # duplicate siblings with right children at equal depth: the lowest index wins
        ([-1, -1, 0, 1], [2, 2, 3, 4], [2, 3, 4, 5, 0], 2, [0, 2, -1, -1], 5),
        # an accepted leaf: the bonus token is the argmax after it
        ([-1, 0, 0], [1, 2, 3], [1, 3, 4, 5], 2, [0, 2, -1], 5),
        # nothing drafted: one plain greedy step
        ([], [], [3], 0, [], 3),
    ],
)
def test_verify_tree_greedy_table(parents, tokens, argmaxes, accepted, nodes, next_token):
    k = len(tokens)
    n, path, token = verify_tree_greedy(
        torch.tensor([tokens], dtype=torch.long).reshape(1, k),
        torch.tensor([parents], dtype=torch.long).reshape(1, k),
        peaked(argmaxes),
    )
    assert n.tolist() == [accepted] and path.tolist() == [nodes] and token.tolist() == [next_token]


def test_verify_tree_greedy_rows_have_their_own_trees():
    parents = torch.tensor([[-1, -1, 0, 1], [-1, 0, 1, 2]])  # a two-branch tree and a chain
    tokens = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    scores = torch.cat([peaked([2, 0, 4, 0, 5]), peaked([1, 2, 0, 4, 5])])
    n, path, token = verify_tree_greedy(tokens, parents, scores)
    assert n.tolist() == [2, 2]
    assert path.tolist() == [[1, 3, -1, -1], [0, 1, -1, -1]]
    assert token.tolist() == [5, 0]


def test_verify_tree_greedy_on_a_chain_is_verify_greedy():
    generator = torch.Generator().manual_seed(0)
    batch, k, vocab = 64, 5, 4  # a small vocabulary: drafts are often right, so paths of every length occur
    scores = torch.randn(batch, k + 1, vocab, generator=generator)
    drafts = torch.randint(0, vocab, (batch, k), generator=generator)
    right = torch.rand(batch, k, generator=generator) < 0.7
    drafts = torch.where(right, scores[:, :k].argmax(-1), drafts)
    n, path, token = verify_tree_greedy(drafts, chain_parents(batch, k), scores)
    expected_n, expected_token = verify_greedy(drafts, scores)
    assert torch.equal(n, expected_n) and torch.equal(token, expected_token)
    assert len(set(n.tolist())) == k + 1
    index = torch.arange(k).expand(batch, k)
    assert torch.equal(path, torch.where(index < n[:, None], index, -1))


@pytest.mark.parametrize("sampled", [False, True])
def test_verify_tree_sampling_on_a_chain_is_verify_sampling(sampled):
    generator = torch.Generator().manual_seed(1)
    batch, k, vocab = 256, 4, 5
    target = torch.rand(batch, k + 1, vocab, generator=generator).pow(3).softmax(-1)
    draft = torch.rand(batch, k, vocab, generator=generator).pow(3).softmax(-1) if sampled else None
    drafts = torch.randint(0, vocab, (batch, k), generator=generator)
    n, path, token = verify_tree_sampling(
        drafts, chain_parents(batch, k), draft, target, generator=torch.Generator().manual_seed(7)
    )
    expected_n, expected_token = verify_sampling(drafts, draft, target, generator=torch.Generator().manual_seed(7))
    # the same uniforms in the same order: not only the same law, the same tokens
    assert torch.equal(n, expected_n) and torch.equal(token, expected_token)
    assert len(set(n.tolist())) > 2
    index = torch.arange(k).expand(batch, k)
    assert torch.equal(path, torch.where(index < n[:, None], index, -1))


def test_verify_tree_sampling_zero_mass_draft_is_always_rejected():
    # the target has all its mass on token 3: both root children (1, then a duplicate 1) fail, 3 is recovered
    target = peaked([3, 0, 0], vocab=5, high=60.0).softmax(-1)
    n, path, token = verify_tree_sampling(torch.tensor([[1, 1]]), torch.tensor([[-1, -1]]), None, target)
    assert n.item() == 0 and path.tolist() == [[-1, -1]] and token.item() == 3


# ---- exact enumeration: the emitted tokens, completed from the target to a fixed length, follow its joint law ----


def random_rows(count, vocab, generator, zeros=0.25):
    """`count` random distributions over `vocab` with some exact zeros (each keeps at least one positive entry)."""
    weights = torch.rand(count, vocab, generator=generator).pow(2) + 0.02
    weights[torch.rand(count, vocab, generator=generator) < zeros] = 0.0
    weights[weights.sum(-1) == 0, 0] = 1.0
    return weights / weights.sum(-1, keepdim=True)


class Model:
    """A toy language model of `length` steps on a tiny vocabulary: a distribution for each prefix."""

    def __init__(self, vocab, length, seed):
        generator = torch.Generator().manual_seed(seed)
        self.vocab, self.length = vocab, length
        self.tables = [random_rows(vocab**t, vocab, generator) for t in range(length)]  # [vocab^t, vocab]

    def probs(self, prefix_code, depth):  # [n] codes of prefixes of `depth` tokens -> [n, vocab]
        return self.tables[depth][prefix_code]

    def joint(self):  # [vocab^length]: P(x_1 .. x_length), codes big-endian
        joint = torch.ones(1, dtype=torch.float64)
        for t in range(self.length):
            joint = (joint[:, None] * self.tables[t].double()).flatten()
        return joint


def node_codes(tokens, parents, vocab):
    """Code of each node's prefix (its ancestors' tokens and its own, big-endian) and its depth: `[n, k]` each."""
    codes, depths = torch.zeros_like(tokens), torch.ones_like(tokens)
    for i in range(tokens.shape[1]):
        parent = parents[:, i : i + 1]
        has = parent >= 0
        codes[:, i : i + 1] = torch.where(has, codes.gather(1, parent.clamp(min=0)), 0) * vocab + tokens[:, i : i + 1]
        depths[:, i : i + 1] = torch.where(has, depths.gather(1, parent.clamp(min=0)) + 1, 1)
    return codes, depths


def propose(target, parents, tokens=None, drafters=None, distinct_siblings=False, generator=None):
    """One tree per trial: `(draft_tokens, draft_probs, target_probs)`. Fixed `tokens` are point masses; else
    node i is drawn from `drafters[i]` (a `Model`: q per prefix), independently of its siblings, or, with
    `distinct_siblings`, redrawn until it differs from its elder siblings (sampling without replacement)."""
    vocab, k = target.vocab, parents.shape[1]
    trials = parents.shape[0]
    draft_probs = None
    if tokens is None:
        node_tables = [drafter.tables for drafter in drafters]
        tokens = torch.zeros(trials, k, dtype=torch.long)
        draft_probs = torch.zeros(trials, k, vocab)
        for i in range(k):
            parent = parents[:, i : i + 1]
            codes, depths = node_codes(tokens, parents, vocab)
            parent_code = torch.where(parent >= 0, codes.gather(1, parent.clamp(min=0)), 0)[:, 0]
            depth = int(torch.where(parent >= 0, depths.gather(1, parent.clamp(min=0)), 0)[0])
            q = node_tables[i][depth][parent_code]  # [trials, vocab]
            draft_probs[:, i] = q
            drawn = torch.multinomial(q, 1, generator=generator)[:, 0]
            if distinct_siblings:
                for _ in range(50):
                    elder = (parents[:, :i] == parent) & (tokens[:, :i] == drawn[:, None])
                    clash = elder.any(-1)
                    if not bool(clash.any()):
                        break
                    drawn = torch.where(clash, torch.multinomial(q, 1, generator=generator)[:, 0], drawn)
            tokens[:, i] = drawn
    else:
        tokens = torch.tensor(tokens).expand(trials, k)
    codes, depths = node_codes(tokens, parents, vocab)
    target_probs = torch.zeros(trials, k + 1, vocab)
    target_probs[:, 0] = target.probs(torch.zeros(trials, dtype=torch.long), 0)
    for i in range(k):
        target_probs[:, i + 1] = target.tables[int(depths[0, i])][codes[:, i]]
    return tokens, draft_probs, target_probs


def emitted_codes(target, tokens, accepted, accepted_nodes, next_tokens, generator):
    """The accepted path's tokens, the next token, then target samples up to `target.length`: `[n]` codes."""
    trials = tokens.shape[0]
    sequence = torch.full((trials, target.length), -1, dtype=torch.long)
    path_tokens = tokens.gather(1, accepted_nodes.clamp(min=0))
    width = min(tokens.shape[1], target.length)
    sequence[:, :width] = torch.where(accepted_nodes[:, :width] >= 0, path_tokens[:, :width], -1)
    assert int(accepted.max()) < target.length, "the tree is deeper than the enumerated length"
    sequence.scatter_(1, accepted[:, None], next_tokens[:, None])
    code = torch.zeros(trials, dtype=torch.long)
    for t in range(target.length):
        missing = sequence[:, t] < 0
        drawn = torch.multinomial(target.probs(code, t), 1, generator=generator)[:, 0]
        sequence[:, t] = torch.where(missing, drawn, sequence[:, t])
        code = code * target.vocab + sequence[:, t]
    return code


def goodness_of_fit(joint, codes):
    """Chi-square p-value of the sampled codes against the exact joint, outcomes with expected count < 5 pooled."""
    counts = torch.bincount(codes, minlength=joint.numel()).double()
    impossible = counts[joint == 0].sum()
    assert impossible == 0, f"{int(impossible)} samples of outcomes the target gives probability 0"
    expected = joint * codes.numel()
    big = expected >= 5
    observed, expected = counts[big], expected[big]
    if not bool(big[joint > 0].all()):
        observed = torch.cat([observed, counts[~big].sum()[None]])
        expected = torch.cat([expected, (joint * codes.numel())[~big].sum()[None]])
    return chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue


def run_trials(target, parents, verify, seed, **proposal):
    torch.manual_seed(seed)  # wrong_tree_sampling's multinomial
    generator = torch.Generator().manual_seed(seed)
    tree = torch.tensor(parents).expand(TRIALS, len(parents))
    tokens, draft_probs, target_probs = propose(target, tree, generator=generator, **proposal)
    accepted, accepted_nodes, next_tokens = verify(tokens, tree, draft_probs, target_probs, generator=generator)
    return accepted, emitted_codes(target, tokens, accepted, accepted_nodes, next_tokens, generator)


# root children: token 1, a duplicate 1, token 4 that the target's root row gives 0, token 2; then grandchildren
DETERMINISTIC_PARENTS = [-1, -1, -1, -1, 0, 0, 3]
DETERMINISTIC_TOKENS = [1, 1, 4, 2, 0, 3, 2]
SAMPLED_PARENTS = [-1, -1, -1, 0, 0, 2]
THREE_LEVEL_PARENTS = [-1, -1, 0, 0, 1, 2, 2, 4, 3]


def deterministic_target():
    target = Model(vocab=5, length=3, seed=3)
    root = target.tables[0]
    root[0, 4] = 0.0
    root[0, 1] = 0.5  # node 0 is accepted about half the time
    target.tables[0] = root / root.sum()
    return target


def drafters(vocab, length, seed, count):
    """A different q for every node (siblings included), e.g. several draft models or temperatures."""
    return dict(drafters=[Model(vocab, length, seed + i) for i in range(count)])


def root_rows(model, row):
    model.tables[0] = torch.tensor([row])
    return model


# q far from p: two siblings drawn without replacement from it give a first token far from p (total variation 0.6)
CONCENTRATED_P = [0.06, 0.63, 0.16, 0.15]
CONCENTRATED_Q = [0.02, 0.0, 0.01, 0.97]


def concentrated_drafters():
    drafter = root_rows(Model(vocab=4, length=2, seed=60), CONCENTRATED_Q)
    return dict(drafters=[drafter, drafter])


CASES = {
    "deterministic_siblings": (deterministic_target, DETERMINISTIC_PARENTS, lambda: dict(tokens=DETERMINISTIC_TOKENS)),
    "sampled_siblings": (lambda: Model(vocab=5, length=3, seed=4), SAMPLED_PARENTS, lambda: drafters(5, 3, 40, 6)),
    "three_levels": (lambda: Model(vocab=4, length=4, seed=5), THREE_LEVEL_PARENTS, lambda: drafters(4, 4, 50, 9)),
    "same_concentrated_q": (
        lambda: root_rows(Model(vocab=4, length=2, seed=6), CONCENTRATED_P),
        [-1, -1],
        concentrated_drafters,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_verify_tree_sampling_follows_the_target(case):
    make_target, parents, make_proposal = CASES[case]
    target = make_target()
    accepted, codes = run_trials(target, parents, verify_tree_sampling, seed=11, **make_proposal())
    assert goodness_of_fit(target.joint(), codes) > P_THRESHOLD
    depth = int(tree_depths(torch.tensor([parents])).max())
    assert set(accepted.tolist()) == set(range(depth + 1)), "every path length occurs"


def wrong_tree_sampling(variant):
    """Variants of verify_tree_sampling with one mistake, for the power checks."""

    def verify(draft_tokens, parents, draft_probs, target_probs, generator=None):
        batch, k = draft_tokens.shape
        q = draft_probs
        if q is None:
            q = torch.nn.functional.one_hot(draft_tokens, target_probs.shape[-1]).to(target_probs.dtype)
        r = torch.rand((batch, k), dtype=target_probs.dtype, generator=generator)
        node_p = target_probs[:, 0]  # the current node's own row
        p = node_p  # what the next sibling is tested against
        current = torch.full((batch,), -1)
        accepted = torch.zeros(batch, dtype=torch.long)
        nodes = torch.full((batch, k + 1), -1)
        for i in range(k):
            x = draft_tokens[:, i : i + 1]
            tested = parents[:, i] == current
            test_p = node_p if variant == "no_renormalization" else p
            passed = r[:, i] * q[:, i].gather(1, x)[:, 0] < test_p.gather(1, x)[:, 0]
            accept, reject = tested & passed, tested & ~passed
            if variant == "original_p":  # the residual of this sibling only, from the node's own row
                residual = (node_p - q[:, i]).clamp(min=0)
            else:
                residual = (p - q[:, i]).clamp(min=0)
            residual = residual / residual.sum(-1, keepdim=True).clamp(min=1e-30)
            node_p = torch.where(accept[:, None], target_probs[:, i + 1], node_p)
            p = torch.where(accept[:, None], target_probs[:, i + 1], torch.where(reject[:, None], residual, p))
            nodes[torch.arange(batch), torch.where(accept, accepted, k)] = torch.where(accept, i, -1)
            current = torch.where(accept, i, current)
            accepted = accepted + accept.long()
        return accepted, nodes[:, :k], torch.multinomial(p, 1, generator=generator)[:, 0]

    return verify


@pytest.mark.parametrize(
    "case, variant",
    [
        ("deterministic_siblings", "no_renormalization"),  # accept sibling x with p(x), not p(x) / (1 - rejected)
        ("sampled_siblings", "original_p"),  # test each sibling against the node's p, not the running residual
    ],
)
def test_tree_sampling_power_check_wrong_verifier(case, variant):
    make_target, parents, make_proposal = CASES[case]
    target = make_target()
    _, codes = run_trials(target, parents, wrong_tree_sampling(variant), seed=11, **make_proposal())
    assert goodness_of_fit(target.joint(), codes) < POWER_THRESHOLD


def test_tree_sampling_power_check_siblings_drawn_without_replacement():
    # the right verifier, but siblings redrawn until distinct: their law is not the q they report
    make_target, parents, make_proposal = CASES["same_concentrated_q"]
    target = make_target()
    _, codes = run_trials(target, parents, verify_tree_sampling, seed=11, distinct_siblings=True, **make_proposal())
    assert goodness_of_fit(target.joint(), codes) < POWER_THRESHOLD
