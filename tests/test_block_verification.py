"""Block verification (`speculative_verification="block"`, and `"auto"`, the default, for sampled drafts): the output
distribution equals the target's, exactly by enumeration on a tiny vocabulary for γ = 1..4 and by a chi-square test of
`verify_block`'s own samples and of `generate` on a real tiny model, with power checks that wrong variants fail; never
fewer accepted drafts in expectation than token-wise verification; `"auto"` picks block for sampled drafts only;
greedy unaffected; clear errors for what it cannot be combined with."""

import itertools

import pytest
import torch
from conftest import noisy_copy, prompt, tiny_model
from scipy.stats import chisquare
from test_sampling_distribution import CONFIGS, P_THRESHOLD, SAMPLES, exact_two_token_distribution, goodness_of_fit

import hf_specdec
from hf_specdec.block_verification import block_next_distribution, block_thresholds, verify_block

V = 3  # a vocabulary small enough to enumerate every draft block and continuation


class Tables:
    """A target p and a drafter q over prefixes of a `V`-token vocabulary, random and fixed per seed (peaked: a cube
    of uniforms, so that ratios far from 1 occur). `deterministic`: the drafter proposes q's most likely token (a
    point mass, as prompt lookup's)."""

    def __init__(self, seed: int, deterministic: bool = False):
        self.generator = torch.Generator().manual_seed(seed)
        self.p, self.q, self.deterministic = {}, {}, deterministic

    def _row(self, table, prefix):
        if prefix not in table:
            row = torch.rand(V, generator=self.generator, dtype=torch.float64) ** 3
            table[prefix] = row / row.sum()
        return table[prefix]

    def target(self, prefix) -> torch.Tensor:
        return self._row(self.p, prefix)

    def drafter(self, prefix) -> torch.Tensor:
        row = self._row(self.q, prefix)
        return torch.nn.functional.one_hot(row.argmax(), V).double() if self.deterministic else row

    def sequence_probability(self, sequence, start: int = 0) -> float:
        probability = 1.0
        for i in range(start, len(sequence)):
            probability *= float(self.target(sequence[:i])[sequence[i]])
        return probability


def drafted_blocks(tables: Tables, gamma: int):
    """Every draft block with its probability under the drafter, and the round's inputs."""
    for drafts in itertools.product(range(V), repeat=gamma):
        q_rows = [tables.drafter(drafts[:i]) for i in range(gamma)]
        probability = 1.0
        for i in range(gamma):
            probability *= float(q_rows[i][drafts[i]])
        if probability == 0:
            continue
        tokens = torch.tensor([drafts])
        draft_probs = None if tables.deterministic else torch.stack(q_rows)[None]
        target_probs = torch.stack([tables.target(drafts[:i]) for i in range(gamma + 1)])[None]
        yield drafts, probability, tokens, draft_probs, target_probs


def accepted_distribution(h: list[float]) -> list[float]:
    """P(τ = i), i = 0..γ, for τ the last position whose independent uniform falls below its threshold."""
    gamma = len(h)
    return [
        (h[i - 1] if i else 1.0) * float(torch.tensor([1 - x for x in h[i:]], dtype=torch.float64).prod())
        for i in range(gamma + 1)
    ]


def round_then_target(tables: Tables, gamma: int, thresholds=block_thresholds, next_distribution=None) -> dict:
    """The exact distribution of the first γ + 1 tokens when one round of block verification runs and the target
    samples the rest: every draft block, accepted count and next token enumerated."""
    next_distribution = next_distribution or block_next_distribution
    length, out = gamma + 1, {}
    for drafts, probability, tokens, draft_probs, target_probs in drafted_blocks(tables, gamma):
        h, weights = thresholds(tokens, draft_probs, target_probs)
        for tau, p_tau in enumerate(accepted_distribution(h[0].tolist())):
            if p_tau == 0:
                continue
            dist = next_distribution(torch.tensor([tau]), tokens, draft_probs, target_probs, weights)[0]
            for y in range(V):
                emitted = drafts[:tau] + (y,)
                for rest in itertools.product(range(V), repeat=length - len(emitted)):
                    sequence = emitted + rest
                    mass = probability * p_tau * float(dist[y]) * tables.sequence_probability(sequence, len(emitted))
                    out[sequence] = out.get(sequence, 0.0) + mass
    return out


def target_distribution(tables: Tables, length: int) -> dict:
    return {s: tables.sequence_probability(s) for s in itertools.product(range(V), repeat=length)}


def largest_error(tables: Tables, gamma: int, **variant) -> float:
    exact = target_distribution(tables, gamma + 1)
    got = round_then_target(tables, gamma, **variant)
    return max(abs(exact[s] - got.get(s, 0.0)) for s in exact)


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled_drafts", "point_mass_drafts"])
@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
def test_block_verification_emits_the_target_distribution_exactly(gamma, deterministic):
    for seed in range(3):
        assert largest_error(Tables(seed, deterministic), gamma) < 1e-12


def wrong_residual(accepted, tokens, draft_probs, target_probs, weights):
    """Token-wise verification's residual after block acceptance (w_τ taken as 1)."""
    return block_next_distribution(accepted, tokens, draft_probs, target_probs, torch.ones_like(weights))


def wrong_last_threshold(tokens, draft_probs, target_probs):
    """The whole block accepted whenever its last test passes the token-wise ratio, without the prefix's weight."""
    h, weights = block_thresholds(tokens, draft_probs, target_probs)
    p_x = target_probs[:, -2].gather(-1, tokens[:, -1:]).squeeze(-1)
    q_x = 1.0 if draft_probs is None else draft_probs[:, -1].gather(-1, tokens[:, -1:]).squeeze(-1)
    h[:, -1] = torch.clamp(p_x / q_x, max=1.0)
    return h, weights


@pytest.mark.parametrize(
    "variant",
    [dict(next_distribution=wrong_residual), dict(thresholds=wrong_last_threshold)],
    ids=["token_residual", "unweighted_last_test"],
)
def test_the_enumeration_rejects_wrong_variants(variant):
    # power: the same check fails for near misses of the rule
    assert max(largest_error(Tables(seed), 3, **variant) for seed in range(3)) > 1e-3


def expected_accepted(tables: Tables, gamma: int, block: bool) -> float:
    total = 0.0
    for _, probability, tokens, draft_probs, target_probs in drafted_blocks(tables, gamma):
        if block:
            h, _ = block_thresholds(tokens, draft_probs, target_probs)
            expected = sum(i * p for i, p in enumerate(accepted_distribution(h[0].tolist())))
        else:  # Algorithm 1: the i-th draft is accepted when it and every earlier one pass min(1, p / q)
            p_x = target_probs[0, :gamma].gather(-1, tokens[0, :, None]).squeeze(-1)
            q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[0].gather(-1, tokens[0, :, None])[:, 0]
            expected = float(torch.clamp(p_x / q_x, max=1.0).cumprod(0).sum())
        total += probability * expected
    return total


def test_prefix_weights_follow_their_recursion():
    """w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i)), w_0 = 1, computed in one pass, equals the recursion step by step:
    ratios above and below 1, a draft the target gives no mass (w stays 0 after it), one the drafter gave none."""
    generator = torch.Generator().manual_seed(0)
    batch, gamma, vocab = 64, 6, 5
    p = torch.rand(batch, gamma + 1, vocab, generator=generator, dtype=torch.float64) ** 4
    q = torch.rand(batch, gamma, vocab, generator=generator, dtype=torch.float64) ** 4
    p[:8, 2, 0], q[8:16, 1, 0] = 0.0, 0.0
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    drafts = torch.randint(0, vocab, (batch, gamma), generator=generator)
    drafts[:16, :3] = 0
    _, weights = block_thresholds(drafts, q, p)
    p_x = p[:, :gamma].gather(-1, drafts[..., None])[..., 0]
    q_x = q.gather(-1, drafts[..., None])[..., 0]
    w, expected = torch.ones(batch, dtype=torch.float64), []
    for i in range(gamma):
        w = torch.clamp(w * torch.where(q_x[:, i] > 0, p_x[:, i] / q_x[:, i], 1.0), max=1.0)
        expected.append(w)
    expected = torch.stack(expected, dim=1)
    assert (expected == 1).any() and (expected == 0).any() and ((expected > 0) & (expected < 1)).any()
    torch.testing.assert_close(weights, expected, rtol=1e-12, atol=0)


def test_block_verification_accepts_at_least_as_many_drafts_as_token_wise():
    gains = []
    for seed, gamma in itertools.product(range(12), [2, 3, 4]):
        tables = Tables(seed)
        block, token = expected_accepted(tables, gamma, True), expected_accepted(tables, gamma, False)
        assert block >= token - 1e-12, (seed, gamma, block, token)
        gains.append(block - token)
    assert max(gains) > 1e-3  # strictly more on some pairs


def test_with_point_mass_drafts_block_accepts_as_many_drafts_as_token_wise():
    """Deterministic drafts (prompt lookup, n-gram tables, greedy draft models): every ratio p / q is p <= 1, so no
    later position recovers mass an earlier one lost, and block verification's expected accepted drafts equal
    Algorithm 1's for every draft block (its gain needs drafts sampled from q)."""
    for seed, gamma in itertools.product(range(6), [2, 3, 4]):
        tables = Tables(seed, deterministic=True)
        for _, _, tokens, draft_probs, target_probs in drafted_blocks(tables, gamma):
            h, _ = block_thresholds(tokens, draft_probs, target_probs)
            block = sum(i * p for i, p in enumerate(accepted_distribution(h[0].tolist())))
            token = float(target_probs[0, :gamma].gather(-1, tokens[0, :, None])[:, 0].cumprod(0).sum())
            assert block == pytest.approx(token, abs=1e-12), (seed, gamma)


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled_drafts", "point_mass_drafts"])
def test_verify_block_samples_follow_the_target(deterministic):
    """`verify_block` itself, with its own randomness: 200 000 rows of one round (drafts from the drafter), continued
    by the target to γ + 1 tokens, against the exact table. Power: a drafter that claims a uniform q for its drafts
    must fail. (A point mass may be claimed for drafts chosen any way: that is exact, only less often accepted.)"""
    gamma, rows = 3, 200_000
    generator = torch.Generator().manual_seed(0)

    def sample(prefixes, rows_of):
        out = []
        for prefix in prefixes:
            out.append(torch.multinomial(rows_of(prefix).float(), 1, generator=generator).item())
        return out

    def run(tables, claimed_q) -> dict:
        """`claimed_q(prefix)`: the q row passed for the draft after `prefix`, or None for point masses."""
        counts = {}
        blocks = {}
        for drafts, probability, tokens, _, target_probs in drafted_blocks(tables, gamma):
            blocks[drafts] = (probability, tokens, target_probs)
        keys = list(blocks)
        weights = torch.tensor([blocks[k][0] for k in keys])
        chosen = torch.multinomial(weights, rows, replacement=True, generator=generator)
        for index, number in zip(*torch.unique(chosen, return_counts=True)):
            drafts = keys[int(index)]
            _, tokens, target_probs = blocks[drafts]
            n = int(number)
            q_rows = [claimed_q(drafts[:i]) for i in range(gamma)]
            draft_probs = None if q_rows[0] is None else torch.stack(q_rows)[None].float().expand(n, -1, -1)
            accepted, next_tokens = verify_block(
                tokens.expand(n, -1), draft_probs, target_probs.float().expand(n, -1, -1), generator
            )
            for tau, y in zip(accepted.tolist(), next_tokens.tolist()):
                emitted = drafts[:tau] + (y,)
                rest = []
                while len(emitted) + len(rest) < gamma + 1:
                    rest += sample([emitted + tuple(rest)], tables.target)
                sequence = emitted + tuple(rest)
                counts[sequence] = counts.get(sequence, 0) + 1
        return counts

    tables = Tables(5, deterministic=deterministic)
    exact = target_distribution(tables, gamma + 1)
    outcomes = sorted(exact)

    def p_value(counts):
        observed = [counts.get(s, 0) for s in outcomes]
        return chisquare(observed, [exact[s] * rows for s in outcomes]).pvalue

    if deterministic:
        assert p_value(run(tables, lambda prefix: None)) > P_THRESHOLD
    else:
        assert p_value(run(tables, tables.drafter)) > P_THRESHOLD
    assert p_value(run(tables, lambda prefix: torch.full((V,), 1.0 / V, dtype=torch.float64))) < P_THRESHOLD


@pytest.fixture(scope="module")
def models():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    return target, tiny_model("llama", seed=1)  # an independent drafter: far from the target


@pytest.mark.parametrize("config_name", ["temperature_top_k", "top_p_repetition_penalty"])
def test_generate_with_block_verification_follows_the_target(models, config_name):
    target, drafter = models
    config = CONFIGS[config_name]
    ids = prompt(6, seed=11)
    table = exact_two_token_distribution(target, ids, config)
    kwargs = dict(
        do_sample=True,
        max_new_tokens=2,
        assistant_model=drafter,
        speculative_gamma=2,
        speculative_gamma_policy="constant",
        speculative_verification="block",
        **config,
    )
    torch.manual_seed(1234)
    samples = [tuple(target.generate(ids, **kwargs)[0, ids.shape[1] :].tolist()) for _ in range(SAMPLES)]
    assert goodness_of_fit(table, samples) > P_THRESHOLD
    # power: the same test rejects the drafter's own samples
    torch.manual_seed(1234)
    own = [
        tuple(hf_specdec.enable(drafter).generate(ids, do_sample=True, max_new_tokens=2, **config)[0, 6:].tolist())
        for _ in range(SAMPLES)
    ]
    assert any(s not in table for s in own) or goodness_of_fit(table, own) < P_THRESHOLD


def test_padded_batches_use_block_verification(models, monkeypatch):
    from hf_specdec import verdicts

    target, drafter = models
    calls = []
    original = verdicts.verify_block

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(verdicts, "verify_block", counted)
    ids = torch.cat([prompt(8, seed=1), prompt(8, seed=2)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    torch.manual_seed(0)
    out = target.generate(
        ids,
        attention_mask=mask,
        pad_token_id=0,
        do_sample=True,
        max_new_tokens=12,
        assistant_model=noisy_copy(target, 0.3),
        speculative_gamma=3,
        speculative_gamma_policy="constant",
        speculative_verification="block",
        return_dict_in_generate=True,
    )
    assert out.sequences.shape == (2, 20) and 2 in calls
    assert out.speculative_stats.accepted_tokens > 0


@pytest.mark.parametrize(
    "kwargs,rule",
    [
        (dict(assistant_model="drafter"), "block"),  # the default: sampled drafts are verified jointly
        (dict(drafter="prompt_lookup"), "token"),  # point masses: block would accept no more in expectation
        (dict(assistant_model="drafter", speculative_lenience=0.5), "token"),  # lenience is token-wise's
        (dict(assistant_model="drafter", speculative_verification="token"), "token"),
        (dict(drafter="prompt_lookup", speculative_verification="block"), "block"),
    ],
    ids=["sampled", "deterministic", "lenience", "token", "forced-block"],
)
def test_auto_verifies_sampled_drafts_jointly_and_deterministic_ones_token_wise(models, monkeypatch, kwargs, rule):
    from hf_specdec import verdicts

    target, drafter = models
    calls = {"block": 0, "token": 0}
    for name, function in (("block", verdicts.verify_block), ("token", verdicts.verify_sampling)):

        def counted(*args, _name=name, _function=function, **kw):
            calls[_name] += 1
            return _function(*args, **kw)

        monkeypatch.setattr(verdicts, function.__name__, counted)
    kwargs = {k: drafter if v == "drafter" else v for k, v in kwargs.items()}
    ids = torch.tensor([[5, 6, 7, 8, 9] * 4])  # repeats, so that prompt lookup drafts
    torch.manual_seed(0)
    target.generate(
        ids, do_sample=True, max_new_tokens=8, speculative_gamma=3, speculative_gamma_policy="constant", **kwargs
    )
    assert calls[rule] > 0 and calls["token" if rule == "block" else "block"] == 0


def test_greedy_decoding_is_unaffected(models):
    target, drafter = models
    ids = prompt(8, seed=3)
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    for drafting in (dict(assistant_model=noisy_copy(target, 0.1)), dict(assistant_model=drafter)):
        out = target.generate(
            ids, max_new_tokens=24, do_sample=False, speculative_verification="block", speculative_gamma=4, **drafting
        )
        assert torch.equal(out, plain)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(speculative_verification="blocks"), "must be one of"),
        (dict(speculative_verification="block", speculative_lenience=0.5), "speculative_lenience=0.5"),
        (dict(speculative_verification="block", speculative_tree_budget=4), "speculative_tree_budget=4"),
        (dict(speculative_verification="block", num_beams=2), "num_beams"),
    ],
    ids=["unknown", "lenience", "tree", "beams"],
)
def test_what_block_verification_cannot_be_combined_with_is_refused(models, kwargs, match):
    target, drafter = models
    with pytest.raises(ValueError, match=match):
        target.generate(prompt(6), assistant_model=drafter, max_new_tokens=4, **kwargs)
