"""The `auto` γ policy of continuous batching (`hf_specdec.policies.batch`): drafts allocated per step by goodput."""

import itertools
import math
import random

import pytest

from hf_specdec.policies.batch import BatchDraftAllocator, StepCostFit, allocate_drafts


def goodput(gains, counts, a, b):
    expected = sum(1 + sum(row[:k]) for row, k in zip(gains, counts))
    return expected / (a + b * sum(1 + k for k in counts))


def random_gains(rng, cap):
    gains, product = [], 1.0
    for _ in range(cap):
        product *= rng.random()
        gains.append(product)
    return gains


def test_greedy_allocation_is_the_best_one():
    """Against every allocation of small batches: the greedy choice reaches the best goodput, and reports it."""
    rng = random.Random(0)
    for _ in range(300):
        gains = [random_gains(rng, rng.randint(0, 3)) for _ in range(rng.randint(1, 3))]
        a, b = rng.choice([0.0, 0.1, 1.0, 10.0]), rng.uniform(0.05, 1.0)
        counts, predicted = allocate_drafts(gains, a, b)
        assert all(0 <= k <= len(row) for k, row in zip(counts, gains))
        best = max(goodput(gains, c, a, b) for c in itertools.product(*(range(len(row) + 1) for row in gains)))
        assert goodput(gains, counts, a, b) == pytest.approx(best, rel=1e-12)
        assert predicted == pytest.approx(best, rel=1e-12)


def test_no_draft_pays_on_a_compute_bound_step():
    assert allocate_drafts([[0.99, 0.98], [0.9, 0.8]], a=0.0, b=1.0)[0] == [0, 0]


def test_drafts_follow_acceptance_when_the_step_has_a_fixed_cost():
    counts, _ = allocate_drafts([[0.95**j for j in range(1, 9)], [0.5**j for j in range(1, 9)], [0.0] * 8], 10.0, 1.0)
    assert counts[0] > counts[1] > counts[2] == 0


def test_the_cost_fit_recovers_a_line_and_waits_for_two_sizes():
    fit = StepCostFit()
    for _ in range(5):
        fit.observe(4, 0.1 + 0.01 * 4)
    assert fit.coefficients() is None  # one size only: the slope is unknown
    for tokens in (8, 16, 32):
        fit.observe(tokens, 0.1 + 0.01 * tokens)
    a, b, jump = fit.coefficients()
    assert a == pytest.approx(0.1) and b == pytest.approx(0.01) and jump == 0.0


def test_the_cost_fit_tells_the_jump_of_a_verifying_step_from_the_slope():
    """A single request's step: one token as a matrix-vector product, a verify as a matrix product (a jump), then
    a small slope per draft. A line through both kinds would price each draft at the jump's share."""
    fit = StepCostFit()
    for tokens in (1, 1, 1):
        fit.observe(tokens, 0.3, verifying=False)
    line = StepCostFit()
    for tokens in (1, 7):
        line.observe(tokens, 0.3 if tokens == 1 else 0.3 + 0.5 + 0.02 * tokens, verifying=tokens > 1)
        line.observe(tokens, 0.3 if tokens == 1 else 0.3 + 0.5 + 0.02 * tokens, verifying=tokens > 1)
    # one size per kind: the jump and the slope cannot be told apart, so the line stands
    assert line.coefficients()[2] == 0.0 and line.coefficients()[1] > 0.09
    for tokens in (3, 5, 7, 9, 11):
        fit.observe(tokens, 0.3 + 0.5 + 0.02 * tokens, verifying=True)
    a, b, jump = fit.coefficients()
    assert a + b == pytest.approx(0.3) and b == pytest.approx(0.02) and jump == pytest.approx(0.5 + 0.02)


def fit_of(samples):
    """(a, b, j) fitted from scratch (numpy's least squares) to `(tokens, verifying, seconds)` samples."""
    import numpy

    rows = numpy.array([[1.0, t, float(v)] for t, v, _ in samples])
    return numpy.linalg.lstsq(rows, numpy.array([s for *_, s in samples]), rcond=None)[0]


def test_the_cost_fit_kept_as_steps_come_and_go_equals_a_fit_of_the_window():
    """The normal equations' sums follow the window (steps leaving it are taken out, and the sums are rebuilt every
    `window` steps): at every step the fit equals one computed from scratch on the window's steps."""
    rng = random.Random(0)
    fit = StepCostFit(window=16)
    samples, compared = [], 0
    for step in range(200):
        tokens, verifying = rng.randint(1, 40), rng.random() < 0.5
        seconds = 0.2 + 0.003 * tokens + 0.05 * verifying + rng.gauss(0, 0.01)
        fit.observe(tokens, seconds, verifying)
        samples = (samples + [(tokens, verifying, seconds)])[-16:]
        if step >= 8:
            a, b, jump = fit.coefficients()
            expected = fit_of(samples)
            if jump > 0 and a > 0:  # not clamped: the least-squares solution itself
                assert (a, b, jump) == pytest.approx(tuple(expected), rel=1e-6, abs=1e-9), step
                compared += 1
    assert compared > 150


def test_a_capped_allocation_is_the_best_one_under_its_cap():
    rng = random.Random(5)
    for _ in range(300):
        rows = [random_gains(rng, rng.randint(0, 3)) for _ in range(rng.randint(1, 3))]
        a, b, limit = rng.choice([0.0, 0.5, 5.0]), rng.uniform(0.05, 1.0), rng.randint(0, 4)
        counts, _ = allocate_drafts(rows, a, b, limit)
        allowed = [c for c in itertools.product(*(range(len(r) + 1) for r in rows)) if sum(c) <= limit]
        assert sum(counts) <= limit
        assert goodput(rows, counts, a, b) == pytest.approx(max(goodput(rows, c, a, b) for c in allowed), rel=1e-12)


def test_the_fit_is_trusted_only_near_the_sizes_it_has_seen():
    """A full batch of 32 whose steps had 32 or 33 tokens, fitted (noise-free here) as nearly free per token: the
    next step holds at most twice the largest size seen (66 tokens: 34 drafts), not all 192 drafts the fit would pay
    for; each larger step seen widens what the next may verify (doubling), and a small batch may always go the blind
    margin (one request's drafts, or a quarter of the requests) beyond the largest size seen."""
    allocator = BatchDraftAllocator()
    for tokens in (32, 33, 32, 33):
        allocator.observe_step(tokens, 0.06 + 1e-6 * tokens)
    allocator.gains = lambda request, cap: [0.5**j for j in range(1, cap + 1)]
    available = {f"r{i}": 6 for i in range(32)}
    assert sum(allocator.allocate(available).values()) == 2 * 33 - 32
    allocator.observe_step(66, 0.06 + 1e-6 * 66, verifying=True)
    assert sum(allocator.allocate(available).values()) == 2 * 66 - 32
    allocator.observe_step(132, 0.06 + 1e-6 * 132, verifying=True)
    assert sum(allocator.allocate(available).values()) == 192  # every draft: the fit has seen the sizes near it
    # two requests whose steps had 2 or 3 tokens: the margin (6, one request's drafts) beyond the largest size
    small = BatchDraftAllocator()
    for tokens in (2, 3, 2, 3):
        small.observe_step(tokens, 0.06 + 1e-6 * tokens)
    small.gains = allocator.gains
    assert sum(small.allocate({"a": 6, "b": 6}).values()) == 3 + 6 - 2
    # more requests than any step the fit has seen: the margin beyond the requests' own tokens
    assert sum(small.allocate({f"r{i}": 6 for i in range(8)}).values()) == 6
    # requests that do not draft count in the step's size: 8 drafting beside 24 that do not, after steps of 32 or 33
    # tokens, verify 34 of their 48 drafts (66 tokens in all)
    mixed = BatchDraftAllocator()
    for tokens in (32, 33, 32, 33):
        mixed.observe_step(tokens, 0.06 + 1e-6 * tokens)
    mixed.gains = allocator.gains
    assert sum(mixed.allocate({f"r{i}": 6 for i in range(8)}, others=24).values()) == 2 * 33 - 32


def test_allocation_with_a_jump_is_the_best_one():
    """Against every allocation of small batches, with a step costing a + b T, plus j when any draft is verified;
    the step's requests that do not draft (`others`) count in its tokens and its seconds."""
    rng = random.Random(1)
    for _ in range(300):
        gains = {f"r{i}": random_gains(rng, rng.randint(0, 3)) for i in range(rng.randint(1, 3))}
        a, b, jump = rng.choice([0.1, 1.0, 10.0]), rng.uniform(0.05, 1.0), rng.choice([0.0, 0.5, 2.0, 20.0])
        others = rng.choice([0, 0, 2, 30])
        allocator = BatchDraftAllocator()
        allocator.cost.coefficients = lambda: (a, b, jump)
        allocator.cost.largest = lambda: 100  # the fit has seen steps of any size here: no cap
        allocator.gains = lambda request, cap: gains[request][:cap]
        counts = allocator.allocate({r: len(g) for r, g in gains.items()}, others=others)
        rows = list(gains.values())

        def value(allocation):
            expected = others + sum(1 + sum(row[:k]) for row, k in zip(rows, allocation))
            tokens = others + sum(1 + k for k in allocation)
            return expected / (a + b * tokens + (jump if any(allocation) else 0.0))

        best = max(value(c) for c in itertools.product(*(range(len(row) + 1) for row in rows)))
        assert value([counts[r] for r in gains]) == pytest.approx(best, rel=1e-12)
        assert allocator.goodput == pytest.approx(best, rel=1e-12)


def test_rates_are_per_request_first_and_batch_wide_deeper():
    allocator = BatchDraftAllocator()
    assert allocator.gains("new", 2) == pytest.approx([0.5, 0.25])
    for _ in range(10):
        allocator.observe_request("copying", [1, 2, 3], [1, 2, 3, 4])  # a run of three kept drafts
        allocator.observe_request("open", [5, 6], [7])  # the first draft is not kept: one comparison
    copying, open_, new = (allocator.gains(r, 3) for r in ("copying", "open", "new"))
    assert copying[0] > 0.8 > new[0] > open_[0]
    # deeper drafts are kept at the batch's conditional rate once the one before was (here: always)
    assert copying[2] / copying[1] == pytest.approx(open_[2] / open_[1]) and copying[2] / copying[1] > 0.8
    # no cost fit yet: the best drafts, as many as one request's
    assert allocator.allocate({"copying": 4, "open": 4}) == {"copying": 4, "open": 0}
    allocator.forget("copying")
    assert allocator.gains("copying", 1) == allocator.gains("new", 1)


def test_before_the_step_cost_is_fitted_a_full_batch_verifies_a_few_of_its_best_drafts():
    """No fit yet (slots filling with prompts: no decoding-only step): 32 requests with 6 drafts each verify 8 drafts
    in all (a quarter of the requests), the best by gain, each request's a prefix of its drafts; a lone request
    verifies all of its own."""
    allocator = BatchDraftAllocator()
    for i in range(32):
        kept = 3 if i < 2 else 0  # two requests copy well, the others' drafts are not kept
        allocator.observe_request(f"r{i}", [1, 2, 3, 4, 5, 6], [1, 2, 3, 4][:kept] + [9])
    counts = allocator.allocate({f"r{i}": 6 for i in range(32)})
    # the copiers' three kept depths come first; then first drafts of others (0.07) before a copier's 4th (0.04)
    assert sum(counts.values()) == 8 and counts["r0"] == counts["r1"] == 3 and allocator.verifies
    assert sorted(counts.values())[-4:] == [1, 1, 3, 3]
    assert allocator.allocate({"r5": 6}) == {"r5": 6}
    assert allocator.allocate({f"r{i}": 2 for i in range(3)}) == {"r0": 1, "r1": 1, "r2": 0}  # first drafts first
    assert allocator.allocate({}) == {} and not allocator.verifies


def test_a_request_whose_drafts_cannot_pay_for_their_drafting_drafts_only_now_and_then():
    allocator = BatchDraftAllocator()
    for tokens in (4, 8, 16, 32):
        allocator.observe_step(tokens, 1.0 + 0.001 * tokens)  # a step's fixed cost dominates: drafts are cheap
    allocator.observe_draft(1e-4)
    assert allocator.allocate({"r": 4}) == {"r": 4}
    assert allocator.should_draft("r", 4)
    allocator.draft_seconds = 0.5  # now drafting one request costs more than the step it saves
    drafts = [allocator.should_draft("r", 4) for _ in range(300)]
    # it rests until an exploration (drafting, and the drafts' tokens in the verify) would cost at most
    # `explore_budget` of the time rested, then twice as long each time: rarer the longer drafting does not pay
    interval = math.ceil((0.5 + 0.001 * 4) * allocator.goodput / allocator.explore_budget)
    assert interval > allocator.explore_every
    assert [step for step, drafted in enumerate(drafts, 1) if drafted] == [interval, 3 * interval, 7 * interval, 300]
    assert interval * 15 == 300


def test_a_cheap_drafter_whose_drafts_are_never_kept_explores_after_a_few_steps():
    allocator = BatchDraftAllocator()
    for tokens in (4, 8, 16, 32):
        allocator.observe_step(tokens, 1.0 + 0.001 * tokens)
    for _ in range(200):
        allocator.observe_request("r", [1], [2])  # its first draft is never kept
    allocator.observe_draft(0.01)
    allocator.allocate({"r": 4})
    every = allocator.explore_every
    drafts = [allocator.should_draft("r", 4) for _ in range(8 * every)]
    assert [step for step, drafted in enumerate(drafts, 1) if drafted] == [every, 3 * every, 7 * every]


def test_drafts_are_priced_with_the_jump_of_verifying_when_the_last_step_verified_none():
    """One request on a step where verifying at all costs a jump (a matrix-vector product becoming a matrix one):
    its drafts do not pay, so the allocation verifies none, and it then stops drafting (it would pay the drafter for
    drafts left unverified); once another request's drafts are verified, the jump is paid anyway and it drafts."""
    allocator = BatchDraftAllocator()
    for tokens, verifying in ((1, False), (2, False), (5, True), (9, True)):
        allocator.observe_step(tokens, 1.0 + 0.01 * tokens + 2.0 * verifying, verifying)
    allocator.observe_draft(0.01)
    assert allocator.allocate({"r": 4}) == {"r": 0} and not allocator.verifies
    assert not allocator.should_draft("r", 4)
    allocator.verifies = True
    assert allocator.should_draft("r", 4)


def test_before_the_step_cost_is_fitted_a_request_drafts_when_its_share_of_a_step_pays_for_it():
    """No step cost fit yet (a busy manager may run steps with prompt chunks for a while): a request drafts when its
    expected extra tokens, at the recent steps' seconds per request, are worth its drafting time."""
    allocator = BatchDraftAllocator()
    assert allocator.should_draft("r", 4)  # nothing timed yet
    allocator.observe_draft(0.05)
    allocator.observe_share(0.01)  # a request's share of a step: 10 ms
    gains = sum(allocator.gains("r", 4))  # expected extra tokens at the prior rates: worth about 10 ms
    assert 0.5 < gains < 2.0 and not allocator.should_draft("r", 4)
    allocator.observe_draft(0.001)  # cheaper drafting now pays
    for _ in range(40):
        allocator.observe_draft(0.001)
    assert allocator.should_draft("r", 4)


def test_a_batch_in_lockstep_varies_its_step_size_until_the_cost_is_fitted():
    """A full batch whose requests all have drafts verifies the same number every step (a quarter of the requests):
    steps of one size, which the fit cannot price. The next step tries twice that size, or decodes plainly when no
    larger step can be made; with two sizes seen the quarter applies again, and four steps give a fit."""
    allocator = BatchDraftAllocator()
    allocator.gains = lambda request, cap: [0.5**j for j in range(1, cap + 1)]
    full = {f"r{i}": 6 for i in range(32)}
    assert sum(allocator.allocate(full).values()) == 8  # nothing seen: the quarter
    allocator.observe_step(40, 0.05, verifying=True)
    assert sum(allocator.allocate(full).values()) == 2 * 40 - 32  # one size seen: twice it
    allocator.observe_step(80, 0.09, verifying=True)
    assert sum(allocator.allocate(full).values()) == 8  # two sizes: the quarter again
    for tokens in (40, 40):
        allocator.observe_step(tokens, 0.05, verifying=True)
    assert allocator.cost.coefficients() is not None
    # two requests with one draft each, after steps of 4 tokens: no larger step exists, so a plain one (2 tokens)
    small = BatchDraftAllocator()
    small.gains = allocator.gains
    small.observe_step(4, 0.05, verifying=True)
    assert small.allocate({"a": 1, "b": 1}) == {"a": 0, "b": 0}
    small.observe_step(2, 0.04)
    assert small.allocate({"a": 1, "b": 1}) == {"a": 1, "b": 0}  # two sizes: the margin, one request's drafts


def test_a_first_draft_counts_only_until_another_is_timed():
    """A request's first draft holds a draft model's prefill of its prompt: counted while nothing else was timed,
    replaced by the first other draft, then ignored."""
    allocator = BatchDraftAllocator()
    allocator.observe_draft(1.0, provisional=True)
    assert allocator.draft_seconds == 1.0
    allocator.observe_draft(0.01)
    assert allocator.draft_seconds == 0.01
    allocator.observe_draft(5.0, provisional=True)
    assert allocator.draft_seconds == 0.01
    allocator.observe_draft(0.02)
    assert allocator.draft_seconds == pytest.approx(0.011)
