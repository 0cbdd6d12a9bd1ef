"""`SuffixDrafter` (suffix decoding): exact output with drafts that are always, never and partly right (chains, trees,
a padded batch), exact sampling, and its `SuffixCache`: eviction bounds, thread safety, incremental updates,
safetensors save/load (size limit, pickles refused, links not followed) and clear errors."""

import gc
import os
import pickle
import random
import sys
import threading

import pytest
import torch
from conftest import VOCAB, prompt, tiny_model
from test_batching import PAD, padded_batch
from test_sampling_distribution import (
    CONFIGS,
    P_THRESHOLD,
    SAMPLES,
    exact_two_token_distribution,
    goodness_of_fit,
    sample_pairs,
)

import hf_specdec
from hf_specdec.drafters.suffix import SuffixCache, SuffixDrafter
from hf_specdec.drafters.suffix_tree import SuffixTrie

NEW_TOKENS = 15  # prompt(6, seed=0) and these tokens of the target's greedy output are 21 distinct tokens
CONSTANT = dict(speculative_gamma_policy="constant", speculative_gamma=6, return_dict_in_generate=True)


@pytest.fixture(scope="module")
def setup():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    ids = prompt(6, seed=0)
    plain = target.generate(ids, max_new_tokens=NEW_TOKENS)
    return target, ids, plain


class Recording(SuffixDrafter):
    """Records whether each proposal was a tree (the list is shared by the per-call copies)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shapes = []

    def propose(self, input_ids, num_tokens, attention_mask=None):
        proposal = super().propose(input_ids, num_tokens, attention_mask)
        self.shapes.append("tree" if proposal.parents is not None else proposal.tokens.shape[1])
        return proposal


def wrong(token: int) -> int:
    return (token + 1) % VOCAB


# ----- exactness with the target -----------------------------------------------------------------------------


@pytest.mark.parametrize("tree_budget", [None, 8])
def test_second_identical_call_drafts_from_the_first_and_stays_exact(setup, tree_budget):
    target, ids, plain = setup
    drafter = SuffixDrafter()  # makes its own cache and keeps it between calls
    first = target.generate(ids, max_new_tokens=NEW_TOKENS, drafter=drafter, speculative_tree_budget=tree_budget)
    assert torch.equal(first, plain)
    # the output (not the prompt) reached the user's object's cache through the per-call copy
    assert drafter.cache.requests() == [plain[0, ids.shape[1] :].tolist()]
    out = target.generate(
        ids, max_new_tokens=NEW_TOKENS, drafter=drafter, speculative_tree_budget=tree_budget, **CONSTANT
    )
    stats = out.speculative_stats
    assert torch.equal(out.sequences, plain)
    # no match at the prompt's end (the cache holds outputs), then matches of 1, 2, 3... tokens draft as many
    assert stats.acceptance_rate == 1.0 and stats.accepted_tokens >= 9
    assert stats.target_calls <= 5  # 15 tokens in few forwards
    assert len(drafter.cache) == 2


def test_drafts_that_are_never_right_change_nothing(setup):
    target, ids, plain = setup
    full = plain[0].tolist()
    assert len(set(full)) == len(full)  # the call's own text never predicts itself: every draft comes from the cache
    cache = SuffixCache()
    for j in range(ids.shape[1] - 1, len(full) - 1):  # after each token, a wrong continuation
        cache.add([full[j], wrong(full[j + 1])])
    out = target.generate(ids, max_new_tokens=NEW_TOKENS, drafter="suffix", drafter_kwargs={"cache": cache}, **CONSTANT)
    assert torch.equal(out.sequences, plain)
    assert out.speculative_stats.drafted_tokens >= NEW_TOKENS - 1 and out.speculative_stats.accepted_tokens == 0
    assert cache.requests()[-1] == full[ids.shape[1] :]  # `drafter_kwargs={"cache": ...}` is the shared cache


@pytest.mark.parametrize("tree_budget", [None, 8])
def test_drafts_that_are_partly_right_change_nothing(setup, tree_budget):
    target, ids, plain = setup
    output = plain[0, ids.shape[1] :].tolist()
    cache = SuffixCache()
    cache.add(ids[0, -1:].tolist() + [wrong(t) if i % 4 == 3 else t for i, t in enumerate(output)])
    if tree_budget:  # a second, branching earlier output: each token after a wrong guess has two continuations
        cache.add(ids[0, -1:].tolist() + [wrong(t) if i % 5 == 2 else t for i, t in enumerate(output)])
    drafter = Recording(cache=cache)
    out = target.generate(
        ids, max_new_tokens=NEW_TOKENS, drafter=drafter, speculative_tree_budget=tree_budget, **CONSTANT
    )
    stats = out.speculative_stats
    assert torch.equal(out.sequences, plain)
    assert 0 < stats.accepted_tokens < stats.drafted_tokens
    assert ("tree" in drafter.shapes) == bool(tree_budget)


def test_a_padded_batch_matches_plain_batched_generate(setup):
    target = setup[0]
    ids, mask = padded_batch(lengths=(3, 7, 5))
    kwargs = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=PAD)
    plain = target.generate(ids, **kwargs)
    drafter = SuffixDrafter()
    assert torch.equal(target.generate(ids, drafter=drafter, **kwargs), plain)
    assert len(drafter.cache) == 3  # one request per row
    out = target.generate(ids, drafter=drafter, **kwargs, **CONSTANT)  # every row drafts from its first run
    assert torch.equal(out.sequences, plain)
    # (rows whose drafts are shorter than another row's are filled with filler the target rejects)
    assert out.speculative_stats.accepted_tokens >= 18 and out.speculative_stats.target_calls <= 5


def test_concurrent_generate_calls_share_one_cache_and_stay_exact(setup):
    target = setup[0]
    prompts = [prompt(6, seed=seed) for seed in (2, 3, 4)]
    plains = [target.generate(ids, max_new_tokens=10) for ids in prompts]
    drafter = SuffixDrafter()
    outputs = {}

    def worker(seed):
        for repeat in range(2):
            outputs[(seed, repeat)] = target.generate(prompts[seed], max_new_tokens=10, drafter=drafter)

    run_threads(worker, len(prompts))
    assert all(torch.equal(out, plains[seed]) for (seed, _), out in outputs.items())
    expected = [plain[0, 6:].tolist() for plain in plains for _ in range(2)]
    assert sorted(drafter.cache.requests()) == sorted(expected)


def test_sampling_follows_the_target_distribution():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    config = CONFIGS["temperature_top_k"]
    ids = prompt(6, seed=11)
    table = exact_two_token_distribution(target, ids, config)
    assert len(table) >= 4
    likely = max(table, key=table.get)
    cache = SuffixCache()
    cache.add(ids[0].tolist() + list(likely))  # the prompt went on as the most likely pair before
    # the drafter keeps learning the sampled pairs: its drafts follow their frequencies, right or wrong
    drafter = SuffixDrafter(cache=cache, cache_prompts=True)
    out = target.generate(
        ids, do_sample=True, max_new_tokens=2, drafter=drafter, speculative_gamma=2, return_dict_in_generate=True
    )
    assert out.speculative_stats.drafted_tokens >= 1
    samples = sample_pairs(
        target, ids, config, SAMPLES, drafter=drafter, speculative_gamma=2, speculative_gamma_policy="constant"
    )
    assert goodness_of_fit(table, samples) > P_THRESHOLD
    # power: the same test rejects what the drafter proposes first (the pair it was seeded with)
    assert goodness_of_fit(table, [likely] * SAMPLES) < P_THRESHOLD


# ----- proposals ---------------------------------------------------------------------------------------------


def test_chains_follow_the_most_frequent_path_scaled_by_the_match():
    cache = SuffixCache()
    for output in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9]):
        cache.add(output)
    drafter = SuffixDrafter(cache=cache, max_spec_factor=1.0)
    # "1 2" matched (m = 2): at most 2 tokens; "2" after "0 7 2" gets m = 1
    assert drafter.propose_for(torch.tensor([[7, 1, 2]]), num_tokens=8).tokens.tolist() == [[3, 4]]
    # the default factor, 4: m = 2 may draft up to 8, the whole path seen
    default = SuffixDrafter(cache=cache)
    assert default.propose_for(torch.tensor([[7, 1, 2]]), num_tokens=8).tokens.tolist() == [[3, 4, 5, 6]]
    assert default.propose_for(torch.tensor([[0, 7, 2]]), num_tokens=8).tokens.tolist() == [[3, 4, 5, 6]]
    assert drafter.propose_for(torch.tensor([[0, 7, 2]]), num_tokens=8).tokens.tolist() == [[3]]
    assert drafter.propose_for(torch.tensor([[1, 2, 3]]), num_tokens=8).tokens.tolist() == [[4, 5, 6]]
    assert drafter.propose_for(torch.tensor([[1, 2, 3]]), num_tokens=2).tokens.tolist() == [[4, 5]]
    factor = SuffixDrafter(cache=cache, max_spec_factor=0.5)  # m = 3: int(1.5) = 1 token
    assert factor.propose_for(torch.tensor([[1, 2, 3]]), num_tokens=8).tokens.tolist() == [[4]]
    for unbounded in (float("inf"), 1e308):  # no bound but `num_tokens` (it raised `OverflowError` in `int`)
        huge = SuffixDrafter(cache=cache, max_spec_factor=unbounded)
        assert huge.propose_for(torch.tensor([[7, 1, 2]]), num_tokens=3).tokens.tolist() == [[3, 4, 5]]
    # after "3": 4 (2/3) or 9 (1/3); min_token_prob 0.7 drops both, and every path below them
    strict = SuffixDrafter(cache=cache, min_token_prob=0.7)
    assert strict.propose_for(torch.tensor([[0, 2, 3]]), num_tokens=8).tokens.shape == (1, 0)
    assert strict.propose_for(torch.tensor([[0, 2, 3]]), num_tokens=8, tree_budget=4).tokens.shape == (1, 0)


def test_trees_grow_best_first_within_the_budget():
    cache = SuffixCache()
    for output in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 8, 7]):
        cache.add(output)
    drafter = SuffixDrafter(cache=cache, max_spec_factor=2.0)  # "1 2 3" matched: up to 6 nodes, 4 in the budget
    tree = drafter.propose_for(torch.tensor([[1, 2, 3]]), num_tokens=8, tree_budget=4)
    # estimated probabilities: 4, 5, 6 each 2/3 (two of three outputs), 9 and 8 each 1/3: best first, parents first
    assert tree.tokens.tolist() == [[4, 5, 6, 9]] and tree.parents.tolist() == [[-1, 0, 1, -1]]
    assert tree.probs is None
    small = drafter.propose_for(torch.tensor([[1, 2, 3]]), num_tokens=1, tree_budget=4)  # depth 1: two siblings
    assert small.tokens.tolist() == [[4, 9]] and small.parents.tolist() == [[-1, -1]]
    likely = SuffixDrafter(cache=cache, max_spec_factor=2.0, min_token_prob=0.5)  # 9 and 8 (1/3) are dropped
    assert likely.propose_for(torch.tensor([[1, 2, 3]]), num_tokens=8, tree_budget=4).tokens.tolist() == [[4, 5, 6]]
    out_of_vocabulary = SuffixCache()
    out_of_vocabulary.add([1, 2, 500, 3])
    clipped = SuffixDrafter(cache=out_of_vocabulary)
    clipped.vocab_size = 100
    assert clipped.propose_for(torch.tensor([[1, 2]]), num_tokens=4).tokens.shape == (1, 0)


# ----- SuffixCache -------------------------------------------------------------------------------------------


def fresh(requests, depth):
    trie = SuffixTrie(depth)
    for key, tokens in enumerate(requests):
        trie.append(key, tokens)
    return trie.snapshot()


def test_eviction_keeps_the_bounds_and_drops_the_oldest_first():
    generator = random.Random(0)
    cache = SuffixCache(max_requests=3, max_tokens=20, tree_depth=4)
    added = []
    for _ in range(12):
        tokens = [generator.randrange(6) for _ in range(generator.randrange(1, 13))]
        request = cache.add(tokens[:2])
        cache.add(tokens[2:], request)
        added.append(tokens)
        assert len(cache) <= 3 and cache.num_tokens <= 20
        held = cache.requests()
        assert sum(map(len, held)) == cache.num_tokens
        # the newest requests, whole, and at most the oldest of them cut at its front
        assert held[1:] == added[len(added) - len(held) + 1 :]
        assert added[len(added) - len(held)][-len(held[0]) :] == held[0]
        assert cache.snapshot() == fresh(held, 4)
        # evicted substrings give their nodes back: the live ones are exactly the substrings held (and the root)
        trie = cache._trie
        assert len(trie.counts) - len(trie._free) == len(cache.snapshot()) + 1
    evicted = cache.add([1])  # a request that gets evicted stops taking tokens
    for _ in range(3):
        cache.add([2, 2])
    assert cache.add([5, 5], evicted) == evicted and [5, 5] not in cache.requests()


def run_threads(worker, count):
    errors = []

    def guarded(seed):
        try:
            worker(seed)
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=guarded, args=(seed,)) for seed in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors


@pytest.mark.parametrize("bounded", [False, True])
def test_concurrent_calls_lose_and_corrupt_nothing(bounded):
    # unbounded: every request must survive whole; bounded: evictions race with additions and lookups
    cache = SuffixCache(max_requests=25 if bounded else 1000, max_tokens=400 if bounded else 100_000, tree_depth=6)
    outputs = {}
    limits = dict(
        max_pattern=4, max_depth=4, max_spec_factor=1.0, max_spec_tokens=8, min_token_prob=0.1, vocab_size=None
    )

    def worker(seed):
        generator = random.Random(seed)
        for n in range(20):
            tokens = [generator.randrange(4) for _ in range(30)]
            request = None
            for start in range(0, 30, 3):  # a few tokens at a time, as rounds confirm them
                request = cache.add(tokens[start : start + 3], request)
                cache.speculate(tokens[: start + 3], tree=bool(n % 2), **limits)
            outputs[(seed, n)] = tokens

    run_threads(worker, 4)
    held = cache.requests()
    assert cache.snapshot() == fresh(held, 6) and cache.num_tokens == sum(map(len, held))
    if bounded:
        assert len(held) <= 25 and cache.num_tokens <= 400
        assert all(any(tokens[len(tokens) - len(h) :] == h for tokens in outputs.values()) for h in held)
    else:
        assert sorted(held) == sorted(outputs.values()) and cache.num_tokens == 4 * 20 * 30


def test_appending_touches_at_most_depth_nodes_and_equals_a_fresh_build():
    generator = random.Random(1)
    tokens = [generator.randrange(5) for _ in range(400)]
    trie = SuffixTrie(depth=7)
    for token in tokens:
        before = trie.touched
        trie.append(0, [token])
        assert trie.touched - before <= 7
    assert trie.snapshot() == fresh([tokens], 7)
    for _ in range(150):  # eviction from the front is incremental too
        before = trie.touched
        trie.pop_oldest(0)
        assert trie.touched - before <= 7
    trie.append(0, tokens[:50])
    assert trie.snapshot() == fresh([tokens[150:] + tokens[:50]], 7)


@pytest.mark.parametrize("seed", range(4))
def test_appending_in_pieces_builds_what_one_token_at_a_time_builds(seed):
    """A prompt is indexed in one `append`: in pieces of any size, the trie holds every substring of up to `depth`
    tokens with its occurrence count (counted here from the text itself), every parent's children in the order of
    their first occurrence (the order `speculate` breaks ties in), the same nodes visited, and appending goes on
    from where it was."""
    generator = random.Random(seed)
    depth = generator.randrange(2, 9)
    tokens = [generator.randrange(4) for _ in range(generator.randrange(1, 120))]
    single, pieces = SuffixTrie(depth), SuffixTrie(depth)
    for token in tokens:
        single.append(0, [token])
    start = 0
    while start < len(tokens):
        size = generator.choice([0, 1, 2, 3, depth - 1, depth, depth + 1, 50])
        pieces.append(0, tokens[start : start + size])
        start += size
    counts = {}
    for i in range(len(tokens)):
        for j in range(i + 1, min(i + depth, len(tokens)) + 1):
            counts[tuple(tokens[i:j])] = counts.get(tuple(tokens[i:j]), 0) + 1
    assert dict(pieces.substrings()) == counts
    assert pieces.substrings() == single.substrings() and pieces.touched == single.touched
    more = [generator.randrange(4) for _ in range(30)]
    single.append(0, more)
    for token in more:
        pieces.append(0, [token])
    assert pieces.substrings() == single.substrings() and pieces.touched == single.touched


def test_a_large_trie_adds_no_objects_for_the_garbage_collector_to_walk():
    """Tens of thousands of nodes (a long prompt, a full shared cache) would make every full collection of the
    serving process walk them all if each were a tracked object."""
    generator = random.Random(2)
    tokens = [generator.randrange(3000) for _ in range(1000)]
    gc.collect()
    before = len(gc.get_objects())
    trie = SuffixTrie(depth=24)
    trie.append(0, tokens)
    assert len(trie.snapshot()) > 20_000
    assert len(gc.get_objects()) - before < 50


def test_save_and_load_round_trip(tmp_path):
    cache = SuffixCache(max_requests=10, max_tokens=100, tree_depth=5)
    for output in ([1, 2, 3, 4], [5, 6], [1, 2, 7]):
        cache.add(output)
    cache.save(tmp_path / "cache.safetensors")
    loaded = SuffixCache.load(tmp_path / "cache.safetensors", max_requests=10, max_tokens=100)
    assert loaded.requests() == cache.requests() and loaded.tree_depth == 5
    assert loaded.snapshot() == cache.snapshot()
    drafter = SuffixDrafter(cache=loaded)
    assert drafter.propose_for(torch.tensor([[1, 2]]), num_tokens=2).tokens.tolist() == [[3, 4]]
    SuffixCache().save(tmp_path / "empty.safetensors")
    assert len(SuffixCache.load(tmp_path / "empty.safetensors")) == 0
    with pytest.raises(FileNotFoundError, match="No SuffixCache file at"):
        SuffixCache.load(tmp_path / "missing.safetensors")


def test_load_enforces_the_size_limits(tmp_path):
    cache = SuffixCache()
    cache.add(list(range(50)))
    cache.add([1, 2])
    cache.save(tmp_path / "cache.safetensors")
    with pytest.raises(ValueError, match=r"52 tokens, more than `max_tokens=40`.*max_tokens=52"):
        SuffixCache.load(tmp_path / "cache.safetensors", max_tokens=40)
    with pytest.raises(ValueError, match=r"2 requests, more than `max_requests=1`"):
        SuffixCache.load(tmp_path / "cache.safetensors", max_requests=1)


class Planted:
    """Unpickling this creates the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_planted_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "marker"
    for name, write in (
        ("cache.safetensors", lambda path: path.write_bytes(pickle.dumps(Planted(marker)))),
        ("cache.pt", lambda path: torch.save({"tokens": Planted(marker)}, path)),
    ):
        path = tmp_path / name
        write(path)
        assert not marker.exists()
        with pytest.raises(OSError, match="not a readable safetensors file.*never pickle"):
            SuffixCache.load(path)
        assert not marker.exists()


def test_save_replaces_a_link_instead_of_writing_through_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / "cache.safetensors"
    os.symlink(victim, link)
    cache = SuffixCache()
    cache.add([3, 4, 5])
    cache.save(link)
    assert victim.read_text() == "keep me"
    assert not link.is_symlink() and SuffixCache.load(link).requests() == [[3, 4, 5]]


def test_loading_another_safetensors_file_fails_clearly(tmp_path):
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="not a SuffixCache"):
        SuffixCache.load(tmp_path / "model.safetensors")


# ----- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(max_pattern=0), ValueError, r"`max_pattern` must be an int >= 1, got 0"),
        (dict(max_depth=2.5), ValueError, r"`max_depth` must be an int >= 1, got 2.5"),
        (dict(max_spec_tokens=True), ValueError, r"`max_spec_tokens` must be an int >= 1, got True"),
        (dict(max_spec_factor=0), ValueError, r"`max_spec_factor` must be > 0, got 0.*max_spec_factor=1.0"),
        (dict(min_token_prob=1.5), ValueError, r"`min_token_prob` must lie in \[0, 1\], got 1.5.*min_token_prob=0.1"),
        (dict(min_token_prob="high"), ValueError, r"`min_token_prob` must be a number, got 'high'"),
        (dict(cache={}), TypeError, r"`cache` must be a SuffixCache, got dict.*SuffixCache\(max_requests="),
        (dict(cache_prompts=1), ValueError, r"`cache_prompts` must be a bool, got 1"),
    ],
)
def test_bad_drafter_arguments_fail_clearly(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        SuffixDrafter(**kwargs)


def test_bad_cache_arguments_fail_clearly(setup):
    for kwargs, pattern in (
        (dict(max_requests=0), r"`max_requests` must be an int >= 1, got 0"),
        (dict(max_tokens=-5), r"`max_tokens` must be an int >= 1, got -5"),
        (dict(tree_depth=1), r"`tree_depth` must be an int >= 2, got 1"),
    ):
        with pytest.raises(ValueError, match=pattern):
            SuffixCache(**kwargs)
    with pytest.raises(ValueError, match=r"`tokens` must be non-negative token ids, got \[1, -1\]"):
        SuffixCache().add([1, -1])
    with pytest.raises(ValueError, match=r"`request=7` was never returned"):
        SuffixCache().add([1], 7)
    target, ids, _ = setup
    with pytest.raises(TypeError, match=r"Unknown `drafter_kwargs` key\(s\) \['max_patern'\].*max_pattern"):
        target.generate(ids, max_new_tokens=2, drafter="suffix", drafter_kwargs={"max_patern": 3})
