"""The built-in drafters: prompt lookup and n-gram tables (matching, exactness, Hub format, bad input)."""

import copy
import json

import pytest
import torch
from conftest import VOCAB, noisy_copy, prompt, tiny_model
from safetensors.torch import load_file, save_file
from scipy.stats import binomtest
from test_sampling_distribution import (
    CONFIGS,
    P_THRESHOLD,
    SAMPLES,
    exact_two_token_distribution,
    goodness_of_fit,
    processors,
    sample_pairs,
)
from transformers import GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper

import hf_specdec
from hf_specdec.toy import copying_target


def lookup(context, num_tokens=3, max_ngram_size=3, min_ngram_size=1):
    drafter = hf_specdec.PromptLookupDrafter(max_ngram_size=max_ngram_size, min_ngram_size=min_ngram_size)
    return drafter.propose_for(torch.tensor([context]), num_tokens).tokens[0].tolist()


@pytest.mark.parametrize(
    "context, expected",
    [
        ([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], [9, 2, 3]),  # longest: the 3-gram beats the more recent 2-gram
        ([1, 2, 5, 1, 2, 6, 1, 2], [6, 1, 2]),  # most recent occurrence of the suffix wins
        ([1, 2, 3, 4], []),  # no match: an empty proposal
        ([7, 7, 7], [7, 7, 7]),  # match at the very end: the copy overlaps itself (period 1)
        ([4, 5, 6, 4], [5, 6, 4]),  # continuation runs into the suffix itself
        ([1, 8, 9, 8, 9], [8, 9, 8]),  # most recent match one period back: periodic continuation
    ],
)
def test_prompt_lookup_matching(context, expected):
    assert lookup(context) == expected


def test_prompt_lookup_min_ngram_size():
    assert lookup([1, 2, 3, 1], min_ngram_size=2) == []
    assert lookup([1, 2, 3, 1], min_ngram_size=1) == [2, 3, 1]


def test_prompt_lookup_index_is_incremental():
    drafter = hf_specdec.PromptLookupDrafter(max_ngram_size=2, min_ngram_size=1, follow_copies=False)
    context = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]])
    model = tiny_model("llama")
    drafter.reset(
        hf_specdec.DraftContext(
            target=model,
            input_ids=context[:, :3],
            logits_processor=None,
            generation_config=model.generation_config,
            vocab_size=VOCAB,
        )
    )
    for length in range(3, context.shape[1] + 1):
        grown = drafter.propose(context[:, :length], 4).tokens
        fresh = drafter.propose_for(context[:, :length], 4).tokens
        assert torch.equal(grown, fresh)
    assert drafter.rows[0].indexed == context.shape[1] - 1  # every token indexed once


@pytest.mark.parametrize(
    "bad", [dict(max_ngram_size=0), dict(min_ngram_size=0), dict(max_ngram_size=2, min_ngram_size=3)]
)
def test_prompt_lookup_bad_sizes(bad):
    with pytest.raises(ValueError, match="ngram_size"):
        hf_specdec.PromptLookupDrafter(**bad)
    with pytest.raises(ValueError, match="`follow_copies` must be a bool, got 'yes'"):
        hf_specdec.PromptLookupDrafter(follow_copies="yes")


def copy_rounds(prompt_tokens, answer, num_tokens=64, **kwargs):
    """Drafts `answer` after `prompt_tokens` the way the decoding loop does: each round keeps the longest right
    prefix of the proposal plus the target's own next token. Returns the proposals."""
    drafter = hf_specdec.PromptLookupDrafter(**kwargs)
    model = tiny_model("llama")
    context = torch.tensor([prompt_tokens + answer])
    drafter.reset(
        hf_specdec.DraftContext(
            target=model,
            input_ids=context[:, : len(prompt_tokens)],
            logits_processor=None,
            generation_config=model.generation_config,
            vocab_size=VOCAB,
        )
    )
    proposals, written = [], 0
    while written < len(answer):
        draft = drafter.propose(context[:, : len(prompt_tokens) + written], num_tokens).tokens[0].tolist()
        proposals.append(draft)
        right = 0
        while right < len(draft) and written + right < len(answer) and draft[right] == answer[written + right]:
            right += 1
        written += right + 1
    return proposals


BLOCK = [11, 12, 13, 40, 14, 15, 16, 17, 40, 18, 19, 20, 21, 22, 40, 23, 24, 25, 26, 27]  # 40: an identifier


def test_prompt_lookup_follows_a_copy_through_a_rename():
    renamed = [41 if t == 40 else t for t in BLOCK]
    prompt_tokens = [1, 2, 3] + BLOCK + [4, 5] + [1, 2, 3]  # "here is the code ... rewrite it with 40 -> 41"
    followed = copy_rounds(prompt_tokens, renamed)
    # round 1 copies up to the first occurrence; round 2 resumes right after it (the n-gram [13, 41] never
    # occurred); round 2 confirms the substitution and drafts every later occurrence renamed
    assert followed[0][:4] == [11, 12, 13, 40]
    assert followed[1][:4] == [14, 15, 16, 17]
    assert followed[1][4] == 40  # the substitution is learned only once the copy resumed after it
    assert followed[2][: len(BLOCK) - 9] == renamed[9:]
    assert len(followed) == 3
    fresh = copy_rounds(prompt_tokens, renamed, follow_copies=False)
    assert len(fresh) > len(followed)  # looked up afresh, each rename costs extra rounds


def test_prompt_lookup_forgets_a_substitution_the_target_contradicts():
    block = BLOCK + [28, 40, 29, 30]
    answer = [41 if t == 40 and i < 10 else t for i, t in enumerate(block)]  # renamed in the first half only
    proposals = copy_rounds([1, 2, 3] + block + [4, 5] + [1, 2, 3], answer)
    assert proposals[2][:6] == [18, 19, 20, 21, 22, 41]  # learned, applied, and rejected: the target wrote 40
    assert proposals[3][:8] == [23, 24, 25, 26, 27, 28, 40, 29]  # forgotten: the next 40 is copied as it is


def test_prompt_lookup_two_mismatches_end_a_copy():
    # the answer follows the block, then leaves it for another passage: the copy survives the first mismatch
    # (it could be a rename), and after the second the lookup starts over from the new suffix
    prompt_tokens = [1, 2, 3] + BLOCK + [4, 5] + [60, 61, 62, 63] + [1, 2, 3]
    answer = BLOCK[:8] + [60, 61, 62, 63]
    proposals = copy_rounds(prompt_tokens, answer, min_ngram_size=1)
    assert proposals[0][:9] == BLOCK[:9]
    assert proposals[1][:3] == [18, 19, 20]  # the copy resumes after the mismatched token
    assert proposals[2][:3] == [62, 63, 1]  # second mismatch: the lookup of the suffix [60, 61]


def test_prompt_lookup_keeps_a_copy_over_a_more_recent_repeat_inside_it():
    # the block repeats [13, 40]; when the copy reaches the first one, the most recent occurrence of that suffix
    # is the second, but the copy under way agrees with much more of the text, so it goes on from where it is
    block = [11, 12, 13, 40, 14, 15, 16, 13, 40, 17, 18, 19]
    prompt_tokens = [1, 2, 3] + block + [4, 5] + [1, 2, 3]
    followed = copy_rounds(prompt_tokens, block, num_tokens=3, max_ngram_size=2)
    assert followed == [[11, 12, 13], [14, 15, 16], [40, 17, 18]]  # every draft right, 3 rounds for 12 tokens
    fresh = copy_rounds(prompt_tokens, block, num_tokens=3, max_ngram_size=2, follow_copies=False)
    assert fresh[1] == [17, 18, 19]  # looked up afresh, the most recent [13, 40] jumps ahead
    assert len(fresh) == 5


def test_prompt_lookup_leaves_a_copy_for_a_full_match_after_a_mismatch():
    # a loop: the copy from the prompt's passage mismatches where the text starts looping, and the new suffix then
    # fully matches the loop's previous period, so the lookup moves there instead of resuming the copy (which would
    # leave the loop): copy following proposes what looking up afresh proposes
    P = [42, 91, 89, 2, 4, 42, 91, 89, 2, 9, 57, 37, 51, 46, 91, 89, 2, 4, 42, 91]
    A = [89, 2, 4, 84, 59, 42, 91, 89, 2, 4, 42, 91, 89, 2, 4, 42, 91, 89, 2, 4, 42, 91, 89, 2, 4]
    for follow in (True, False):
        proposals = copy_rounds(P, A, num_tokens=6, follow_copies=follow)
        assert proposals[-2:] == [[91, 89, 2, 4, 42, 91], [2, 4, 42, 91, 89, 2]]


def markov_target():
    """A tiny model whose attention contributes nothing: for a prompt S + C + S, where C is its greedy continuation
    of S, it writes C again (it returns a block)."""
    return hf_specdec.enable(copying_target(tiny_model("llama", seed=0)))


@pytest.mark.parametrize("gamma", [4, 16])
def test_prompt_lookup_renamed_copy_greedy_identity(gamma):
    target = markov_target()
    seed = prompt(6, seed=3)
    block = target.generate(seed, max_new_tokens=40)[:, seed.shape[1] :]
    identifier = int(block.flatten().mode().values)
    renamed = block.masked_fill(block == identifier, (identifier + 1) % VOCAB)
    ids = torch.cat([seed, renamed, seed], dim=-1)
    plain = target.generate(ids, max_new_tokens=40)
    assert torch.equal(plain[:, ids.shape[1] :], block)  # the target writes the original block back
    calls = {}
    for follow in (True, False):
        out = target.generate(
            ids,
            drafter="prompt_lookup",
            speculative_gamma=gamma,
            speculative_gamma_policy="constant",
            max_new_tokens=40,
            drafter_kwargs={"follow_copies": follow},
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, plain)
        calls[follow] = out.speculative_stats.target_calls
    assert calls[True] < calls[False]


@pytest.fixture(scope="module")
def looping_target():
    """A target whose greedy continuation repeats its context (random tiny models fall into cycles)."""
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    warm = target.generate(prompt(8, seed=9), max_new_tokens=60)
    return target, warm[:, -20:]


@pytest.mark.parametrize("gamma", [1, 3, 7, 12])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_prompt_lookup_greedy_identity(arch, gamma):
    target = hf_specdec.enable(tiny_model(arch, seed=0))
    for ids in (prompt(8, seed=9), target.generate(prompt(8, seed=9), max_new_tokens=40)[:, -16:]):
        plain = target.generate(ids, max_new_tokens=24, repetition_penalty=1.1)
        out = target.generate(
            ids,
            drafter="prompt_lookup",
            drafter_kwargs={"min_ngram_size": 1},
            speculative_gamma=gamma,
            max_new_tokens=24,
            repetition_penalty=1.1,
        )
        assert torch.equal(out, plain)


def test_prompt_lookup_accepts_on_repetitive_text(looping_target):
    target, ids = looping_target
    plain = target.generate(ids, max_new_tokens=30)
    out = target.generate(
        ids,
        drafter="prompt_lookup",
        speculative_gamma=6,
        speculative_gamma_policy="constant",  # a mechanism test: the default policy decides by measured time
        max_new_tokens=30,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    assert out.speculative_stats.acceptance_rate > 0.5  # a repeating continuation is copied


def test_prompt_lookup_drafts_ten_when_gamma_is_left_unset():
    """`PromptLookupDrafter.default_gamma`: 10 wherever `speculative_gamma` is left unset (no argument, None, a
    `SpeculativeGenerationConfig` without it); anything set wins, and an explicit `speculative_max_gamma` caps it.
    Exact at that γ with a copy that is right (the block), then wrong (the text after it)."""
    target = markov_target()
    seed = prompt(6, seed=3)
    block = target.generate(seed, max_new_tokens=40)[:, seed.shape[1] :]
    ids = torch.cat([seed, block, seed], dim=-1)
    plain = target.generate(ids, max_new_tokens=60)
    common = dict(
        drafter="prompt_lookup", speculative_gamma_policy="constant", max_new_tokens=60, return_dict_in_generate=True
    )

    def gammas(**kwargs):
        out = target.generate(ids, **common, **kwargs)
        assert torch.equal(out.sequences, plain)
        return set(out.speculative_stats.gamma_history)

    assert gammas() == gammas(speculative_gamma=None) == {10}
    assert gammas(generation_config=hf_specdec.SpeculativeGenerationConfig(max_new_tokens=60)) == {10}
    assert gammas(speculative_gamma=5) == {5}
    assert gammas(generation_config=hf_specdec.SpeculativeGenerationConfig(speculative_gamma=4)) == {4}
    assert gammas(speculative_max_gamma=6) == {6}
    assert gammas(speculative_max_gamma=32) == {10}
    out = target.generate(ids, **common)
    assert out.speculative_stats.drafted_history[0] == 10  # the block is copied 10 tokens at a time
    # other drafters keep the library's 5
    assert set(
        target.generate(
            ids, assistant_model=target, **{k: v for k, v in common.items() if k != "drafter"}
        ).speculative_stats.gamma_history
    ) == {5}


def test_a_custom_drafter_default_gamma_is_used_and_checked():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    ids = prompt(6, seed=2)

    class Echo(hf_specdec.Drafter):
        default_gamma = 3

        def propose(self, input_ids, num_tokens):
            return hf_specdec.DraftProposal(tokens=input_ids[:, -1:].repeat(1, num_tokens))

    out = target.generate(
        ids, drafter=Echo(), speculative_gamma_policy="constant", max_new_tokens=12, return_dict_in_generate=True
    )
    assert set(out.speculative_stats.gamma_history) == {3}
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=12))
    for bad in (0, 2.5, True, 1000):
        Echo.default_gamma = bad
        with pytest.raises(
            ValueError,
            match=rf"`Echo.default_gamma` must be a positive int, got {bad!r}.*"
            r"speculative_gamma=5",
        ):
            target.generate(ids, drafter=Echo(), max_new_tokens=4)
        target.generate(ids, drafter=Echo(), max_new_tokens=4, speculative_gamma=2)  # unused when γ is given


def self_table(target, n=3, seeds=range(6), **kwargs):
    """An n-gram table built from the target's own greedy outputs: often right."""
    corpus = [target.generate(prompt(6, seed=s), max_new_tokens=40)[0] for s in seeds]
    return hf_specdec.NGramDrafter.from_corpus(corpus, n=n, vocab_size=VOCAB, **kwargs)


@pytest.mark.parametrize("processors", [{"no_repeat_ngram_size": 3}, {}], ids=["processors", "none"])
@pytest.mark.parametrize("gamma", [1, 3, 7, 12])
@pytest.mark.parametrize("table_kind", ["own_outputs", "random_corpus", "unigram"])
def test_ngram_greedy_identity(table_kind, gamma, processors):
    """Always / partly right (the target's own outputs), never right (a random corpus), a unigram table; with logits
    processors (q standardized through them) and without (drafts read from the table alone)."""
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    if table_kind == "own_outputs":
        table = self_table(target)
    elif table_kind == "random_corpus":
        table = hf_specdec.NGramDrafter.from_corpus([prompt(200, seed=5)[0]], n=3, vocab_size=VOCAB)
    else:
        table = self_table(target, n=1)
    ids = prompt(6, seed=2)
    plain = target.generate(ids, max_new_tokens=24, **processors)
    out = target.generate(
        ids,
        drafter=table,
        speculative_gamma=gamma,
        max_new_tokens=24,
        return_dict_in_generate=True,
        **processors,
    )
    assert torch.equal(out.sequences, plain)
    if table_kind == "own_outputs":
        assert out.speculative_stats.acceptance_rate > 0.3


def test_ngram_greedy_drafts_without_processors_are_the_general_paths():
    """Greedy drafts without logits processors come from the table alone (no vocabulary-sized tensor): the same
    chains as the general path, which standardizes q through the processors (here one that changes nothing), ties
    going to the lowest id as `argmax` does; rows of a batch each their own; orders 1 and 3."""

    class Unchanged:
        def __call__(self, input_ids, scores):
            return scores

    tied = [[5, 9, 4], [5, 2, 4], [7, 3, 3], [7, 1, 3]]  # after 5: 9 and 2 once each; after 7: 3 and 1
    corpus = [*tied, prompt(300, seed=5)[0].tolist()]
    for n in (3, 1):
        table = hf_specdec.NGramDrafter.from_corpus(corpus, n=n, vocab_size=VOCAB)
        general = copy.copy(table)
        general.logits_processor, general.sample, general.tree_budget = LogitsProcessorList([Unchanged()]), False, None
        for seed in range(12):
            ids = torch.cat([prompt(7, seed=seed), prompt(7, seed=seed + 50), prompt(7, seed=seed + 99)])
            for num_tokens in (1, 4, 9):
                fast = table.propose_for(ids, num_tokens)
                assert fast.probs is None
                assert torch.equal(fast.tokens, general.propose(ids, num_tokens).tokens), (n, seed, num_tokens)
    table = hf_specdec.NGramDrafter.from_corpus(tied, n=3, vocab_size=VOCAB)
    assert table.propose_for([[0, 5]], 1).tokens.tolist() == [[2]]
    assert table.propose_for([[0, 7]], 1).tokens.tolist() == [[1]]


def test_prompt_lookup_sampling_follows_target():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    config = dict(temperature=0.9, top_k=4)
    ids = prompt(6, seed=11)
    table = exact_two_token_distribution(target, ids, config)
    likely = max(table, key=table.get)
    # the prompt contains the likely pair right after its own last token, so lookup proposes it every time
    ids = torch.cat([ids, torch.tensor([[ids[0, -1].item(), *likely]]), ids], dim=-1)
    table = exact_two_token_distribution(target, ids, config)
    kwargs = dict(drafter="prompt_lookup", drafter_kwargs={"min_ngram_size": 1}, speculative_gamma=2)
    samples = sample_pairs(target, ids, config, SAMPLES, **kwargs)
    assert goodness_of_fit(table, samples) > P_THRESHOLD
    stats = target.generate(
        ids, do_sample=True, max_new_tokens=2, return_dict_in_generate=True, **config, **kwargs
    ).speculative_stats
    assert stats.drafted_tokens == 1  # it really drafts (gamma is capped by max_new_tokens - 1)


def test_ngram_sampled_drafts_follow_target():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    config = dict(temperature=0.9, top_k=4)
    ids = prompt(6, seed=11)
    drafter = self_table(target, draft_mode="sample")
    table = exact_two_token_distribution(target, ids, config)
    samples = sample_pairs(target, ids, config, SAMPLES, drafter=drafter, speculative_gamma=2)
    assert goodness_of_fit(table, samples) > P_THRESHOLD
    stats = target.generate(
        ids, do_sample=True, max_new_tokens=2, return_dict_in_generate=True, drafter=drafter, **config
    ).speculative_stats
    assert stats.drafted_tokens == 1


def sampling_call(drafter, logits_processor=()):
    """`drafter` reset as `generate` resets it for a sampling call whose target has these processors."""
    context = hf_specdec.DraftContext(
        target=None,
        input_ids=torch.empty(1, 0, dtype=torch.long),
        logits_processor=LogitsProcessorList(logits_processor),
        generation_config=GenerationConfig(do_sample=True),
        vocab_size=drafter.vocab_size,
    )
    return drafter.for_call(context)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_ngram_sample_mode_proposes_the_tables_q(temperature):
    # bigrams: after 1 come 2 (2 of 3) and 3 (1 of 3); after 2 and after 3 comes 1
    table = hf_specdec.NGramDrafter.from_corpus([[1, 2, 1, 3, 1, 2, 1]], n=2, vocab_size=8, draft_mode="sample")
    continuations = {1: {2: 2 / 3, 3: 1 / 3}, 2: {1: 1.0}, 3: {1: 1.0}}
    # q is standardized like p: temperature T turns the table's q into q^(1/T), renormalized
    warpers = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
    torch.manual_seed(0)
    first_tokens = set()
    for _ in range(20):
        proposal = sampling_call(table, warpers).propose(torch.tensor([[5, 1]]), 4)
        assert proposal.tokens.shape == (1, 4) and proposal.probs is not None
        assert proposal.probs.shape == (1, 4, 8)
        previous = 1
        for token, q in zip(proposal.tokens[0].tolist(), proposal.probs[0]):
            weights = {t: w ** (1 / temperature) for t, w in continuations[previous].items()}
            expected = torch.zeros(8)
            expected[list(weights)] = torch.tensor(list(weights.values())) / sum(weights.values())
            torch.testing.assert_close(q, expected)
            assert q[token] > 0  # drawn from q
            previous = token
        first_tokens.add(proposal.tokens[0, 0].item())
    assert first_tokens == {2, 3}  # both continuations of 1 are drawn: the tokens are sampled, not the argmax
    greedy = hf_specdec.NGramDrafter.from_corpus([[1, 2, 1, 3, 1, 2, 1]], n=2, vocab_size=8)
    assert sampling_call(greedy).propose(torch.tensor([[5, 1]]), 4).probs is None  # deterministic: a point mass


class ReplacesQ(hf_specdec.Drafter):
    """Proposes another drafter's sampled tokens with their q dropped (`probs=None`: point masses) or, with
    `uniform=True`, misreported as uniform over the vocabulary."""

    def __init__(self, inner: hf_specdec.Drafter, uniform: bool = False):
        self.inner, self.uniform = inner, uniform

    def reset(self, context):
        self.inner = self.inner.for_call(context)

    def propose(self, input_ids, num_tokens):
        tokens = self.inner.propose(input_ids, num_tokens).tokens
        probs = torch.full((*tokens.shape, VOCAB), 1 / VOCAB) if self.uniform else None  # [batch, k, vocab]
        return hf_specdec.DraftProposal(tokens=tokens, probs=probs)


def test_ngram_sample_mode_passes_q():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    config = CONFIGS["temperature_top_k"]
    ids = prompt(6, seed=11)
    # a table of the target's own samples with top_k=2: q lies on half of p's support, and differs from p there
    corpus = [torch.cat([ids[0], torch.tensor(pair)]) for pair in sample_pairs(target, ids, dict(top_k=2), 200)]
    table = hf_specdec.NGramDrafter.from_corpus(corpus, n=3, vocab_size=VOCAB, draft_mode="sample")
    # the first draft's p and q, standardized by the call's processors; beta = sum_x min(p, q) is its acceptance rate
    procs = processors(target, ids, config)
    with torch.no_grad():
        p = procs(ids, target(ids).logits[:, -1].float()).softmax(-1)[0]  # [vocab]
    tokens, token_probs = table.distribution(ids[0, -2:].tolist())
    q_logits = torch.full((1, VOCAB), float("-inf"))  # [1, vocab]
    q_logits[0, tokens] = token_probs.log()
    q = procs(ids, q_logits).softmax(-1)[0]  # [vocab]
    beta = torch.minimum(p, q).sum().item()
    assert len(q.nonzero()) == 2 and len(p.nonzero()) == 4 and beta < 0.8
    pairs_table = exact_two_token_distribution(target, ids, config)

    def sample(drafter, n):
        torch.manual_seed(1234)
        pairs, accepted, betas = [], 0, []
        for _ in range(n):
            out = target.generate(
                ids,
                do_sample=True,
                max_new_tokens=2,  # one round drafts one token (γ is capped by max_new_tokens - 1)
                drafter=drafter,
                speculative_gamma_policy="constant",
                return_dict_in_generate=True,
                **config,
            )
            stats = out.speculative_stats
            assert stats.drafted_tokens == stats.beta_count == 1
            pairs.append(tuple(out.sequences[0, ids.shape[1] :].tolist()))
            accepted += stats.accepted_tokens
            betas.append(stats.beta_sum)
        return pairs, binomtest(accepted, n, beta).pvalue, betas

    pairs, acceptance_fit, betas = sample(table, 1000)
    assert goodness_of_fit(pairs_table, pairs) > P_THRESHOLD
    # the sampler got the table's q: every round's beta is sum_x min(p, q), and drafts are accepted that often
    assert betas == pytest.approx([beta] * len(betas)) and acceptance_fit > P_THRESHOLD
    # power: with q dropped the sampler tests each draft as a point mass, accepting it with p(x) (still exact, see
    # `hf_specdec.sampling`), so the accepted drafts fall to sum_x q(x) p(x) and the acceptance test fails
    pairs, acceptance_fit, betas = sample(ReplacesQ(table), 300)
    assert goodness_of_fit(pairs_table, pairs) > P_THRESHOLD and acceptance_fit < P_THRESHOLD
    assert betas != pytest.approx([beta] * len(betas))
    # power: a q other than the one the drafts were drawn from is not exact, and the goodness of fit says so
    constant = dict(speculative_gamma_policy="constant")
    pairs = sample_pairs(target, ids, config, 300, drafter=ReplacesQ(table, uniform=True), **constant)
    assert goodness_of_fit(pairs_table, pairs) < P_THRESHOLD


def test_ngram_save_load_round_trip(tmp_path):
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    table = self_table(
        target,
        tokenizer_name="local-bpe",
        target_name="org/tiny-llama",
        corpus_description="greedy outputs of the tiny target",
        alpha=0.42,
    )
    table.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"model.safetensors", "config.json", "README.md"}
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["n"] == 3 and config["vocab_size"] == VOCAB and config["hf_specdec_version"]
    card = (tmp_path / "README.md").read_text()
    assert "library_name: hf_specdec" in card and "base_model: org/tiny-llama" in card and "0.42" in card
    assert "speculative-decoding" in card and "greedy outputs of the tiny target" in card
    loaded = hf_specdec.NGramDrafter.from_pretrained(tmp_path)
    for seed in range(10):
        context = prompt(5, seed=seed)
        assert torch.equal(loaded.propose_for(context, 6).tokens, table.propose_for(context, 6).tokens)
    ids = prompt(6, seed=3)
    assert torch.equal(
        target.generate(ids, drafter=loaded, max_new_tokens=20), target.generate(ids, drafter=table, max_new_tokens=20)
    )
    by_name = target.generate(
        ids, drafter="ngram", drafter_kwargs={"pretrained_model_name_or_path": str(tmp_path)}, max_new_tokens=20
    )
    assert torch.equal(by_name, target.generate(ids, max_new_tokens=20))


def test_ngram_push_to_hub_then_load_by_repo_id(tmp_path, monkeypatch):
    """`push_to_hub` is huggingface_hub's own `ModelHubMixin.push_to_hub`; nothing can reach the Hub here, so the two
    HTTP calls (`HfApi.create_repo`, `HfApi.upload_folder`) and the download (`hf_hub_download`) are served from a
    local folder. Everything above that boundary runs for real: the mixin's save, the card, the repo-id load path."""
    import shutil

    import huggingface_hub
    from huggingface_hub import RepoUrl

    import hf_specdec.drafters.ngram as ngram_module

    hub = tmp_path / "hub"
    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs.get("private"), kwargs.get("exist_ok")))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, *, repo_id, folder_path, revision=None, commit_message=None, **kwargs):
        calls.append(("upload_folder", repo_id, revision, commit_message))
        shutil.copytree(folder_path, hub / repo_id / (revision or "main"), dirs_exist_ok=True)
        return f"https://huggingface.co/{repo_id}/commit/0"

    def hf_hub_download(repo_id, filename, *, revision=None, **kwargs):
        path = hub / repo_id / (revision or "main") / filename
        if not path.is_file():
            raise huggingface_hub.errors.EntryNotFoundError(f"{repo_id}/{filename}")
        return str(path)

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(ngram_module, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub.hub_mixin, "hf_hub_download", hf_hub_download)  # the mixin reads config.json

    target = hf_specdec.enable(tiny_model("llama", seed=0))
    table = self_table(target, target_name="org/tiny-llama", alpha=0.42)
    url = table.push_to_hub("org/my-ngram-drafter", commit_message="Add drafter", private=True)
    assert url == "https://huggingface.co/org/my-ngram-drafter/commit/0"
    assert calls == [
        ("create_repo", "org/my-ngram-drafter", True, True),
        ("upload_folder", "org/my-ngram-drafter", None, "Add drafter"),
    ]
    pushed = hub / "org" / "my-ngram-drafter" / "main"
    assert {p.name for p in pushed.iterdir()} == {"model.safetensors", "config.json", "README.md"}
    card = (pushed / "README.md").read_text()
    assert "library_name: hf_specdec" in card and "base_model: org/tiny-llama" in card
    assert "org/my-ngram-drafter" in card  # the card's usage snippet names the repo it was pushed to

    loaded = hf_specdec.NGramDrafter.from_pretrained("org/my-ngram-drafter")  # a repo id, not a directory
    for seed in range(5):
        context = prompt(5, seed=seed)
        assert torch.equal(loaded.propose_for(context, 6).tokens, table.propose_for(context, 6).tokens)
    ids = prompt(6, seed=3)
    by_repo_id = target.generate(
        ids,
        drafter="ngram",
        max_new_tokens=20,
        drafter_kwargs={"pretrained_model_name_or_path": "org/my-ngram-drafter"},
    )
    assert torch.equal(by_repo_id, target.generate(ids, max_new_tokens=20))
    with pytest.raises(huggingface_hub.errors.EntryNotFoundError):
        hf_specdec.NGramDrafter.from_pretrained("org/not-pushed")


def test_ngram_from_texts_with_a_local_tokenizer(local_tokenizer, capsys):
    texts = ["the cat sat on the mat", "the dog sat on the log"] * 600
    table = hf_specdec.NGramDrafter.from_texts(texts, tokenizer=local_tokenizer, n=3, show_progress=True)
    assert table.vocab_size == len(local_tokenizer)
    assert "tokenizing" in capsys.readouterr().err  # the progress bar
    ids = local_tokenizer("the cat sat", return_tensors="pt").input_ids
    proposed = local_tokenizer.decode(table.propose_for(ids, 3).tokens[0])
    assert proposed.strip().startswith("on")


def corrupt(tmp_path, edit):
    table = hf_specdec.NGramDrafter.from_corpus([prompt(50)[0]], n=2, vocab_size=VOCAB)
    table.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


def test_corrupt_tables_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"missing tensors \['order_2.tokens'\]"):
        hf_specdec.NGramDrafter.from_pretrained(corrupt(tmp_path / "a", lambda t: t.pop("order_2.tokens")))
    with pytest.raises(ValueError, match="order_2.probs has shape .* expected"):
        hf_specdec.NGramDrafter.from_pretrained(
            corrupt(tmp_path / "b", lambda t: t.update({"order_2.probs": t["order_2.probs"][:, :3].contiguous()}))
        )
    with pytest.raises(ValueError, match=r"order_2.tokens holds token ids outside \[0, vocab_size=96\)"):
        hf_specdec.NGramDrafter.from_pretrained(
            corrupt(tmp_path / "c", lambda t: t["order_2.tokens"].__setitem__((0, 0), 500))
        )
    with pytest.raises(ValueError, match="holds values outside"):
        hf_specdec.NGramDrafter.from_pretrained(
            corrupt(tmp_path / "d", lambda t: t["order_2.probs"].__setitem__((0, 0), 7.0))
        )
    with pytest.raises(OSError, match="has no model.safetensors"):
        (tmp_path / "a" / "model.safetensors").unlink()
        hf_specdec.NGramDrafter.from_pretrained(tmp_path / "a")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text('{"drafter_type": "model"}')
    with pytest.raises(ValueError, match="drafter_type='model', expected 'ngram'"):
        hf_specdec.NGramDrafter.from_pretrained(tmp_path / "e")


def test_ngram_bad_input():
    with pytest.raises(ValueError, match="`n` must be a positive int, got 0"):
        hf_specdec.NGramDrafter.from_corpus([[1, 2]], n=0, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="The corpus is empty"):
        hf_specdec.NGramDrafter.from_corpus([[], []], n=2, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="The corpus is empty"):
        hf_specdec.NGramDrafter.from_texts([], tokenizer=None)
    with pytest.raises(ValueError, match=r"outside \[0, vocab_size=96\): min 0, max 200"):
        hf_specdec.NGramDrafter.from_corpus([[0, 200]], n=2, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="`draft_mode` must be one of"):
        hf_specdec.NGramDrafter.from_corpus([[1, 2]], n=2, vocab_size=VOCAB, draft_mode="beam")
    target = hf_specdec.enable(tiny_model("llama"))
    other_vocab = hf_specdec.NGramDrafter.from_corpus([[1, 2, 3]], n=2, vocab_size=50)
    with pytest.raises(ValueError, match="built for a vocabulary of 50 tokens but the target has 96"):
        target.generate(prompt(), drafter=other_vocab, max_new_tokens=5)
    with pytest.raises(ValueError, match="`drafter='ngram'` needs a table"):
        target.generate(prompt(), drafter="ngram", max_new_tokens=5)


def test_model_drafter_is_one_registered_drafter_among_others():
    assert {"model", "ngram", "prompt_lookup"} <= set(hf_specdec.list_drafters())
    target = hf_specdec.enable(tiny_model("llama"))
    ids = prompt()
    plain = target.generate(ids, max_new_tokens=12)
    by_name = target.generate(
        ids, drafter="model", drafter_kwargs={"model": noisy_copy(target, 0.3)}, max_new_tokens=12
    )
    assert torch.equal(by_name, plain)
