"""How many drafts each request verifies in one continuous-batching step, priced on the step's total query tokens.

A step's cost grows with the tokens it packs: on a GPU the verify stays memory-bound up to a few hundred tokens, then
becomes compute-bound; on a CPU it is compute-bound almost at once. So the value of a draft depends on the whole
batch, and a γ that pays at one request per step can slow a full batch down. This is the goodput criterion of
SmartSpec (Liu et al., 2024, "Optimizing Speculative Decoding for Serving Large Language Models Using Goodput"):
per step, choose each request's draft count k_i to maximize

    expected emitted tokens / predicted step seconds = sum_i E_i(k_i) / (a + b * sum_i (1 + k_i)),

over every decoding request i of the step (one with nothing drafted has k_i = 0), with E_i(k) = 1 + g_i1 + ... + g_ik,
where g_ij is the probability that request i's first j drafts are all kept, and a + b * T (+ j when any draft is
verified) the step's seconds for T query tokens, fitted online by least squares on the recent steps that held no prompt
chunk (a chunk of hundreds of tokens costs less per token than a few drafts, and would flatten the slope where drafts
are priced); the number of requests and of drafts make T vary. Until it has varied (and whenever the window holds steps
of one size only), a step verifies the drafts with the best gains, up to a quarter as many as it has requests (at least
one request's drafts), or up to twice the size of the window's steps when they all had one size (a full batch in
lockstep would otherwise verify the same number of drafts every step and never be fitted; when no larger step can be
made, it decodes plainly, a size of its own): enough for the fit to see steps of several sizes, too few to slow a full
batch down (a verify of every request's drafts can cost twice a plain step on a compute-bound device, and while slots
fill with prompts, drafts take the token budget's room from prompt chunks). The jump j is what a step pays for leaving
the one-token-per-request shape (on a CPU a single request's step is a matrix-vector product and its verify a matrix
product; on a GPU, transformers' decode-only attention path): fitted beside the slope when both kinds of step were seen,
so the slope prices one more draft, not the switch. The fit is trusted only near the sizes it has seen: a step verifies
at most as many drafts as take it to twice the window's largest size, or to that size plus the same margin as before the
fit, whichever is more (a full batch that verifies little runs steps of nearly one size, whose noise alone can make the
least-squares slope near zero and every draft look free; a larger step then tells the slope, and the sizes tried double
rather than grow by a margin, so that where drafts are nearly free, as on a GPU, a batch reaches its full drafts within
a few steps). The k_i are chosen greedily with the fixed cost a + j: request i's next draft adds g_i(k_i+1) expected
tokens and b seconds, and drafts are added, best first, while they raise the ratio (optimal, since each request's gains
shrink with depth, also under the cap); the result is kept when it beats decoding plainly at a + b * T. When no draft
pays (a compute-bound step, a ~ 0), every request decodes plainly.

g_ij = r_i1 * r_2 * ... * r_j: the request's own rate of keeping its first draft r_i1 (shrunk towards the batch's
while it has few comparisons) times the batch's rates of keeping draft j once draft j - 1 was kept. Copy drafters
are right in runs (a copied span is kept whole or breaks early), which these conditional rates capture and a single
α per request would not. Every step measures them, drafted or not: a request's drafts are compared position by
position with the tokens it then emitted (a verified draft is kept exactly when it equals the emitted token; a draft
left unverified is a shadow draft).

Drafting itself costs time (a table lookup, a search, a draft model's forwards). A step is timed from after its
drafting, so the fit prices verification alone (drafting that has already happened must not make its drafts look
dearer to verify), and drafting is priced per request by a running mean of one request's drafting seconds, leaving
out a request's first draft (a draft model's prefill of the whole prompt, paid once) once any other was timed. Until
the step cost is fitted (steps of prompt chunks do not count, and a busy manager may run few others for a while), a
request drafts when its expected extra tokens, at the recent steps' seconds per request that got a token (chunks
included: a lenient price), are worth its drafting time. With a drafter whose drafts are not free
(`Drafter.free_drafts` unset), a request whose best drafts would not pay for their own drafting at the step's
current tokens per second does not draft, but to explore after `explore_every` steps of rest (more when an
exploration would cost over `explore_budget` of the rest: a costly draft model), then after twice as many each time
it still does not pay, so that the drafter's cost is not paid for nothing and the estimates still follow the text.
When the last step verified no drafts, the request's drafts are also priced with the jump of verifying at all (which
some other request would otherwise share): drafts that the allocation would then leave unverified are not made. Free
drafts (prompt lookup, suffix decoding) are made every step: a copy can start at any token, and only its
verification is priced.
"""

from __future__ import annotations

import collections
import heapq
import math

__all__ = ["BatchDraftAllocator", "StepCostFit", "allocate_drafts"]


def allocate_drafts(
    gains: list[list[float]], a: float, b: float, limit: int | None = None, others: int = 0
) -> tuple[list[int], float]:
    """Each request's draft count (at most `len(gains[i])`, and at most `limit` in all) maximizing
    (others + sum_i E_i(k_i)) / (a + b * (others + sum_i (1 + k_i))), greedily, with `gains[i][j]` the expected tokens
    request i's draft j + 1 adds (non-increasing in j); `a` >= 0 and `b` > 0 are the step's fixed and per-token
    seconds, and `others` the step's requests that decode without drafts (one query token, one token emitted each).
    Returns the counts and the predicted tokens per second."""
    if not gains:
        return [], 0.0
    counts = [0] * len(gains)
    expected = tokens = float(len(gains) + others)  # every request emits one token from one query token
    candidates = [(-row[0], i) for i, row in enumerate(gains) if row and row[0] > 0]
    heapq.heapify(candidates)
    while candidates and (limit is None or tokens - len(gains) - others < limit):
        gain, i = -candidates[0][0], candidates[0][1]
        if gain * (a + b * tokens) <= b * expected:  # (expected + gain) / (seconds + b) <= expected / seconds
            break
        heapq.heappop(candidates)
        counts[i] += 1
        expected, tokens = expected + gain, tokens + 1
        if counts[i] < len(gains[i]) and gains[i][counts[i]] > 0:
            heapq.heappush(candidates, (-gains[i][counts[i]], i))
    return counts, expected / (a + b * tokens)


class StepCostFit:
    """A step's seconds as a + b * (query tokens) + j * (whether it verifies drafts), fitted by least squares on the
    last `window` steps. The sums of the normal equations are kept as steps come and go (a fit costs the same at
    any window, which a step of continuous batching pays for), rebuilt from the window every `window` steps so that
    rounding does not build up."""

    def __init__(self, window: int = 64, min_steps: int = 4):
        self.samples: collections.deque[tuple[int, bool, float]] = collections.deque(maxlen=window)
        self.min_steps = min_steps
        self._fit: tuple[float, float, float] | None = None
        self._fitted = True  # whether `_fit` holds the fit of the current samples
        self._rebuild()

    def _rebuild(self) -> None:
        self._sizes: collections.Counter[tuple[int, bool]] = collections.Counter()
        self._sums = [0.0] * 8  # n, Σt, Σv, Σt², Σtv, Σs, Σts, Σvs
        self._since_rebuild = 0
        for sample in self.samples:
            self._add(sample, 1)

    def _add(self, sample: tuple[int, bool, float], sign: int) -> None:
        t, v, s = sample
        self._sizes[(t, v)] += sign
        if not self._sizes[(t, v)]:
            del self._sizes[(t, v)]
        for i, term in enumerate((1.0, t, v, t * t, t * v, s, t * s, v * s)):
            self._sums[i] += sign * term

    def observe(self, tokens: int, seconds: float, verifying: bool = False) -> None:
        sample = (tokens, bool(verifying), seconds)
        if len(self.samples) == self.samples.maxlen:
            self._add(self.samples[0], -1)
        self.samples.append(sample)
        self._add(sample, 1)
        self._since_rebuild += 1
        if self._since_rebuild >= self.samples.maxlen:
            self._rebuild()
        self._fitted = False

    def sizes(self) -> set[int]:
        """The query tokens of the window's steps (each size once)."""
        return {t for t, _ in self._sizes}

    def largest(self) -> int:
        """The most query tokens of a step in the window (0 when empty)."""
        return max(self.sizes(), default=0)

    def coefficients(self) -> tuple[float, float, float] | None:
        """(a, b, j), or None until `min_steps` steps of at least two different sizes were seen. j is 0 unless steps
        with and without drafts were seen and the slope can be told apart from the jump (steps of two sizes among
        those with drafts or among those without); then a negative jump counts as none. Fitted once per new step."""
        if not self._fitted:
            self._fit, self._fitted = self._coefficients(), True
        return self._fit

    def _coefficients(self) -> tuple[float, float, float] | None:
        if len(self.samples) < self.min_steps or len({t for t, _ in self._sizes}) < 2:
            return None
        n, st, sv, stt, stv, ss, sts, svs = self._sums
        sizes = [sum(1 for _, v in self._sizes if v is kind) for kind in (False, True)]
        if all(sizes) and max(sizes) >= 2:
            fit = _solve([[n, st, sv], [st, stt, stv], [sv, stv, sv]], [ss, sts, svs])
            if fit is not None and fit[2] >= 0:
                a, b, j = fit
                return max(a, 0.0), max(b, 1e-12), j
        mean_t, mean_s = st / n, ss / n
        b = max((sts - n * mean_t * mean_s) / (stt - n * mean_t * mean_t), 1e-12)
        return max(mean_s - b * mean_t, 0.0), b, 0.0


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """The solution x of matrix @ x = vector (the normal equations of a least-squares fit), by elimination with
    partial pivoting; None when they are singular. `matrix` and `vector` are changed in place."""
    size = len(vector)
    scale = max(abs(x) for row in matrix for x in row)
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(matrix[r][col]))
        if abs(matrix[pivot][col]) <= 1e-12 * scale:
            return None
        matrix[col], matrix[pivot] = matrix[pivot], matrix[col]
        vector[col], vector[pivot] = vector[pivot], vector[col]
        for row in range(col + 1, size):
            factor = matrix[row][col] / matrix[col][col]
            for k in range(col, size):
                matrix[row][k] -= factor * matrix[col][k]
            vector[row] -= factor * vector[col]
    solution = [0.0] * size
    for row in reversed(range(size)):
        solution[row] = (vector[row] - sum(matrix[row][k] * solution[k] for k in range(row + 1, size))) / matrix[row][
            row
        ]
    return solution


class BatchDraftAllocator:
    """The `auto` γ policy of continuous batching: `should_draft` and `allocate` before each step, `observe_*` after
    it."""

    prior_weight = 4.0
    """Comparisons' worth of the batch's first-draft rate in a request's own."""

    explore_every = 8
    """A request whose drafts did not pay drafts again (explores) only after `explore_every` steps of rest, or more
    (`explore_budget`), then after twice as many each time it still does not pay (steps 8, 24, 56, ... of its rest)."""

    explore_budget = 0.05
    """The most of a resting request's time its explorations may take: it rests at least as many steps as make its
    share of them cost 1 / explore_budget times an exploration (the drafting, the jump of verifying at all, the
    drafts' tokens in the verify)."""

    blind_share = 0.25
    """Until the step cost is fitted, a step verifies at most `blind_share` x its requests drafts (at least as many as
    one request may verify), the best by gain; once it is, at most that many more than take the step to the largest
    size the fit has seen, or `trust_growth` x that size if more."""

    trust_growth = 2.0
    """Once the step cost is fitted, a step may hold up to this many times the query tokens of the largest step the
    fit has seen (or that size plus the blind margin, if more)."""

    def __init__(self) -> None:
        self.cost = StepCostFit()
        self.draft_seconds: float | None = None  # a running mean of one request's drafting time
        self.provisional = False  # whether `draft_seconds` holds only first drafts (with a draft model's prefill)
        self.share_seconds: float | None = None  # a running mean of a step's seconds per request that got a token
        self.goodput: float | None = None  # the last allocation's predicted tokens per second
        self.verifies = False  # whether the last allocation verified drafts (the step paid the jump of verifying)
        self.forget_requests()

    def forget_requests(self) -> None:
        """Forgets every request and the acceptance rates (a new generation loop); the step cost fit stays."""
        self.first: dict[str, list[int]] = {}  # request -> [first drafts kept, first drafts compared]
        self.positions: list[list[int]] = []  # depth j -> [kept, compared once draft j - 1 was kept], batch-wide
        self.resting: dict[str, int] = {}  # request -> steps since drafting stopped paying for it

    def _rate(self, kept: int, compared: int, prior: float, weight: float) -> float:
        return (kept + weight * prior) / (compared + weight)

    def gains(self, request_id: str, cap: int) -> list[float]:
        """The expected tokens each of the request's next `cap` drafts adds (see the module docstring)."""
        rates = [self._rate(kept, compared, 0.5, 2.0) for kept, compared in self.positions[:cap]]
        rates += [0.5] * (cap - len(rates))
        if cap:
            kept, compared = self.first.get(request_id, (0, 0))
            rates[0] = self._rate(kept, compared, rates[0], self.prior_weight)
        gains, product = [], 1.0
        for rate in rates:
            product *= rate
            gains.append(product)
        return gains

    def allocate(self, available: dict[str, int], others: int = 0) -> dict[str, int]:
        """Each request's draft count this step, out of the drafts `available` to it (until the cost fit has seen
        enough steps, the best by gain up to `blind_share` x the requests); `others`: the step's requests that
        decode without drafts (each one query token)."""
        if not available:
            self.verifies = False
            return {}
        requests, size = list(available), len(available) + others
        gains = [self.gains(r, available[r]) for r in requests]
        margin = self._margin(available, size)
        fit = self.cost.coefficients()
        if fit is None:
            counts = self._blind(gains, size, margin)
        else:
            a, b, jump = fit
            largest = self.cost.largest()
            limit = max(max(largest, size) + margin, math.floor(self.trust_growth * largest)) - size
            counts, self.goodput = allocate_drafts(gains, a + jump, b, limit, others)
            plain = size / (a + b * size)  # every request decoding plainly: no jump
            if plain >= self.goodput:
                counts, self.goodput = [0] * len(requests), plain
        self.verifies = any(counts)
        return dict(zip(requests, counts))

    def _blind(self, gains: list[list[float]], size: int, margin: int) -> list[int]:
        """The drafts with the best gains, at most `margin` of them: `allocate_drafts` with every draft paying. When
        the window holds steps of one size only (a full batch in lockstep verifies the same number of drafts every
        step, and the fit needs two sizes), up to `trust_growth` x that size instead, and a plain step when that
        would be the same size again (`size`: the step's requests)."""
        sizes = self.cost.sizes()
        limit = max(margin, math.floor(self.trust_growth * min(sizes)) - size) if len(sizes) == 1 else margin
        counts, _ = allocate_drafts(gains, math.inf, 1.0, limit)
        if sizes == {size + sum(counts)} and sum(counts):
            counts = [0] * len(gains)
        return counts

    def _margin(self, available: dict[str, int], size: int) -> int:
        """Drafts a step may verify beyond the sizes the cost fit has seen: `blind_share` x the step's `size`
        requests, at least one request's drafts."""
        return max(max(available.values()), math.ceil(self.blind_share * size))

    def should_draft(self, request_id: str, cap: int) -> bool:
        """Whether drafting up to `cap` tokens for `request_id` this step can pay for the drafting itself: some
        k <= cap gives more expected tokens per second of drafting and verifying, (E(k) - 1) / (c + b k), plus the
        jump j of verifying at all when the last step verified nothing, than the last step's goodput; else only to
        explore, ever more rarely (`explore_every`)."""
        fit = self.cost.coefficients()
        if self.draft_seconds is None:
            return True
        if fit is None or self.goodput is None:  # no step cost yet: drafting against a step's share per request
            return self.share_seconds is None or sum(self.gains(request_id, cap)) * self.share_seconds > (
                self.draft_seconds
            )
        _, b, jump = fit
        fixed, gains = self.draft_seconds + (0.0 if self.verifies else jump), self.gains(request_id, cap)
        added = [sum(gains[:k]) / (fixed + b * k) for k in range(1, cap + 1)]
        if added and max(added) > self.goodput:
            self.resting.pop(request_id, None)
            return True
        rest = self.resting[request_id] = self.resting.get(request_id, 0) + 1
        # a request's share of a plain step lasts 1 / goodput seconds
        exploration = (self.draft_seconds + jump + b * cap) * self.goodput / self.explore_budget
        explorations, left = divmod(rest, max(self.explore_every, math.ceil(exploration)))
        return left == 0 and explorations & (explorations + 1) == 0  # rest = interval x (1, 3, 7, 15, ...)

    def observe_draft(self, seconds: float, provisional: bool = False) -> None:
        """One request's drafting took `seconds`; `provisional`: its first draft (with a draft model's prefill of the
        prompt), counted only until another draft is timed."""
        if provisional and not (self.draft_seconds is None or self.provisional):
            return
        if self.draft_seconds is None or self.provisional != provisional:
            self.draft_seconds, self.provisional = seconds, provisional
        else:
            self.draft_seconds = 0.9 * self.draft_seconds + 0.1 * seconds

    def observe_share(self, seconds: float) -> None:
        """A step took `seconds` per request that got a token (any step, prompt chunks included)."""
        self.share_seconds = seconds if self.share_seconds is None else 0.8 * self.share_seconds + 0.2 * seconds

    def observe_step(self, query_tokens: int, seconds: float, verifying: bool = False) -> None:
        """A step without prompt chunks took `seconds` for `query_tokens`; `verifying`: some request verified drafts."""
        self.cost.observe(query_tokens, seconds, verifying)

    def observe_request(self, request_id: str, drafts: list[int], emitted: list[int]) -> None:
        """`drafts` (all the request drafted before the step, verified or not) against the tokens it `emitted`."""
        for depth, (draft, token) in enumerate(zip(drafts, emitted)):
            if depth == len(self.positions):
                self.positions.append([0, 0])
            kept = int(draft == token)
            self.positions[depth][0] += kept
            self.positions[depth][1] += 1
            if depth == 0:
                first = self.first.setdefault(request_id, [0, 0])
                first[0] += kept
                first[1] += 1
            if not kept:
                break

    def requests(self) -> set[str]:
        """The requests this allocator holds anything for."""
        return self.first.keys() | self.resting.keys()

    def forget(self, request_id: str) -> None:
        self.first.pop(request_id, None)
        self.resting.pop(request_id, None)
