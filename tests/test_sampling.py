"""The pure sampling core (hf_specdec.sampling): hand-built logits and property tests."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_specdec.sampling import draft_target_overlap, sample_tokens, verify_greedy, verify_sampling

V = 6


def peaked(tokens, vocab=V, high=10.0):
    """Logits [1, len(tokens), vocab] with a large value on each wanted argmax."""
    logits = torch.zeros(1, len(tokens), vocab)
    for i, token in enumerate(tokens):
        logits[0, i, token] = high
    return logits


@pytest.mark.parametrize(
    "drafted, target, accepted, next_token",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, 4),  # all accepted, bonus token
        ([1, 2, 3], [1, 5, 3, 4], 1, 5),  # second rejected, target's token recovers
        ([1, 2, 3], [0, 2, 3, 4], 0, 0),  # first rejected
        ([], [2], 0, 2),  # nothing drafted: one plain step
    ],
)
def test_verify_greedy_table(drafted, target, accepted, next_token):
    draft = torch.tensor([drafted], dtype=torch.long).reshape(1, len(drafted))
    n, token = verify_greedy(draft, peaked(target))
    assert n.tolist() == [accepted] and token.tolist() == [next_token]


def test_verify_greedy_lenience_accepts_near_argmax():
    logits = torch.tensor([[[2.0, 1.9, -5.0, -5.0, -5.0, -5.0], [0.0, 0.0, 5.0, 0.0, 0.0, 0.0]]])
    draft = torch.tensor([[1]])
    assert verify_greedy(draft, logits)[0].item() == 0  # exact: 1 is not the argmax
    n, token = verify_greedy(draft, logits, lenience=0.5)  # p(1) = 0.475 >= 0.5 * p(0) = 0.262
    assert n.item() == 1 and token.item() == 2


def test_verify_sampling_point_mass_drafts_follow_target_exactly():
    # the target puts all mass on the drafts: always accepted, bonus from p_{γ+1}
    target = peaked([3, 1, 4], high=50.0).softmax(-1)
    n, token = verify_sampling(torch.tensor([[3, 1]]), None, target)
    assert n.item() == 2 and token.item() == 4
    # the target gives the first draft zero mass: always rejected, recovered from p with the draft removed
    n, token = verify_sampling(torch.tensor([[0, 1]]), None, target)
    assert n.item() == 0 and token.item() == 3


@settings(max_examples=25, deadline=None)
@given(
    weights=st.lists(st.floats(0.0, 1.0), min_size=V, max_size=V).filter(lambda w: sum(w) > 0.05),
    seed=st.integers(0, 2**16),
)
def test_sample_tokens_follows_the_row_distribution(weights, seed):
    # unnormalized rows, zeros included; every row of the batch is its own draw
    w = torch.tensor(weights)
    generator = torch.Generator().manual_seed(seed)
    tokens = sample_tokens(w.expand(40_000, -1), generator)
    empirical = torch.bincount(tokens, minlength=V).double() / tokens.numel()
    p = w.double() / w.double().sum()
    assert 0.5 * (empirical - p).abs().sum() < 0.025
    assert (empirical[p == 0] == 0).all()  # a zero-probability token is never drawn


def test_sample_tokens_rows_and_generator():
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
    assert sample_tokens(probs).tolist() == [2, 0, 3]
    spread = torch.full((8, 1000), 1.0)
    first = sample_tokens(spread, torch.Generator().manual_seed(3))
    assert torch.equal(first, sample_tokens(spread, torch.Generator().manual_seed(3)))
    assert first.unique().numel() > 1


@pytest.mark.parametrize("row", [[float("nan"), 1.0], [float("inf"), 1.0], [0.0, 0.0]])
def test_sample_tokens_rejects_rows_that_are_not_distributions(row):
    with pytest.raises(RuntimeError, match="probability tensor contains `inf` or `nan`, or a row with no"):
        sample_tokens(torch.tensor([[0.5, 0.5], row]))


def distributions(vocab):
    weights = st.lists(st.floats(0.0, 1.0), min_size=vocab, max_size=vocab).filter(lambda w: sum(w) > 0.05)
    return weights.map(lambda w: torch.tensor(w) / sum(w))


def empirical_first_token(p, q, lenience=1.0, samples=40_000, seed=0):
    """Distribution of the first emitted token for γ = 1 (drafts x ~ q), estimated on a batch of rows."""
    generator = torch.Generator().manual_seed(seed)
    draft_probs = q.expand(samples, 1, -1)
    draft = torch.multinomial(q.expand(samples, -1), 1, replacement=True, generator=generator)  # [samples, 1]
    target = p.expand(samples, 2, -1)
    accepted, next_token = verify_sampling(draft, draft_probs, target, lenience=lenience, generator=generator)
    first = torch.where(accepted > 0, draft[:, 0], next_token)
    return torch.bincount(first, minlength=p.numel()).double() / samples, accepted


@settings(max_examples=30, deadline=None)
@given(p=distributions(V), q=distributions(V), seed=st.integers(0, 2**16))
def test_first_token_is_distributed_as_target(p, q, seed):
    empirical, accepted = empirical_first_token(p, q, seed=seed)
    # expected total variation ~0.005 at 40k samples; a wrong sampler is off by far more (see the power test)
    assert 0.5 * (empirical - p.double()).abs().sum() < 0.025
    assert accepted.min() >= 0 and accepted.max() <= 1
    # acceptance rate estimates β = sum min(p, q) (Lemma 3.3)
    beta = torch.minimum(p, q).sum().item()
    assert abs(accepted.double().mean().item() - beta) < 0.02


def test_distribution_check_has_power():
    # the same check rejects a sampler that skips the residual (resamples from p after a rejection)
    p = torch.tensor([0.7, 0.1, 0.1, 0.1, 0.0, 0.0])
    q = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.3, 0.3])
    generator = torch.Generator().manual_seed(0)
    samples = 40_000
    draft = torch.multinomial(q.expand(samples, -1), 1, replacement=True, generator=generator)
    ratio = p[draft[:, 0]] / q[draft[:, 0]]
    accept = torch.rand(samples, generator=generator) < ratio
    wrong = torch.where(
        accept, draft[:, 0], torch.multinomial(p.expand(samples, -1), 1, True, generator=generator)[:, 0]
    )
    empirical = torch.bincount(wrong, minlength=V).double() / samples
    assert 0.5 * (empirical - p.double()).abs().sum() > 0.1


@settings(max_examples=20, deadline=None)
@given(p=distributions(V), q=distributions(V), lenience=st.floats(0.1, 1.0), seed=st.integers(0, 2**16))
def test_lenience_never_exceeds_p_over_l(p, q, lenience, seed):
    empirical, _ = empirical_first_token(p, q, lenience=lenience, seed=seed)
    assert (empirical <= p.double() / lenience + 0.02).all()


@settings(max_examples=30, deadline=None)
@given(
    gamma=st.integers(0, 6),
    batch=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_accepted_counts_are_leading_matches(gamma, batch, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, gamma + 1, V, generator=generator)
    targets = logits.argmax(-1)
    draft = torch.where(
        torch.rand(batch, gamma, generator=generator) < 0.6, targets[:, :gamma], (targets[:, :gamma] + 1) % V
    )
    accepted, next_token = verify_greedy(draft, logits)
    for row in range(batch):
        n = 0
        while n < gamma and draft[row, n] == targets[row, n]:
            n += 1
        assert accepted[row].item() == n and next_token[row].item() == targets[row, n].item()


def test_overlap_matches_definition():
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    q = torch.tensor([[[0.25, 0.25, 0.5]]])
    beta = draft_target_overlap(torch.tensor([[2]]), q, p)
    assert torch.allclose(beta, torch.tensor([[0.5]]))
    assert torch.allclose(draft_target_overlap(torch.tensor([[1]]), None, p), torch.tensor([[0.5]]))
