"""Speculation inside continuous batching (`generate_batch`, `init_continuous_batching`, `generate(...,
cache_implementation="paged")`): every request's output equals plain continuous batching's, token for token when
greedy, in distribution when sampling; what is not served is refused by name, never dropped."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, tiny_model
from test_sampling_distribution import exact_distribution, goodness_of_fit
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.requests import RequestStatus

import hf_specdec
from hf_specdec import continuous_batching

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 8, 9, 10, 7, 8, 9], [3] * 10, list(range(20, 40)), [11, 12]]
NEW_TOKENS = 20


def config(**overrides):
    values = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    values.update(overrides)
    return GenerationConfig(**values)


def small_cache(**overrides):
    """Pages of 4 tokens (drafts cross blocks), a small token budget (drafts get trimmed) and fewer slots than
    requests."""
    values = dict(page_size=4, num_blocks=64, max_batch_tokens=12, max_requests_per_batch=3, allow_block_sharing=False)
    values.update(overrides)
    return ContinuousBatchingConfig(**values)


class ScriptedRequests(hf_specdec.Drafter):
    """Proposes each request's known continuation (found by its prefix), corrupting every `period`-th absolute
    position: `period=None` always right, 1 never right."""

    def __init__(self, references: list[list[int]], period: int | None = None, vocab: int = VOCAB):
        self.references, self.period, self.vocab = references, period, vocab

    def propose(self, input_ids, num_tokens):
        sequence = input_ids[0].tolist()
        reference = next((r for r in self.references if r[: len(sequence)] == sequence), sequence)  # else: none
        start = len(sequence)
        tokens = reference[start : start + num_tokens]
        if self.period is not None:
            tokens = [
                (t + 1) % self.vocab if (start + i) % self.period == self.period - 1 else t
                for i, t in enumerate(tokens)
            ]
        return hf_specdec.DraftProposal(tokens=torch.tensor([tokens], dtype=torch.long))


class Unlikely(hf_specdec.Drafter):
    """Drafts the target's fourth most likely next token, again and again: in the support of top-k 4 sampling,
    far from the target's distribution."""

    def __init__(self, target):
        self.target = target

    @torch.no_grad()
    def propose(self, input_ids, num_tokens):
        token = self.target(input_ids).logits[0, -1].topk(4).indices[-1]
        return hf_specdec.DraftProposal(tokens=token.repeat(1, num_tokens))


@pytest.fixture(scope="module")
def model():
    return hf_specdec.enable(tiny_model("llama"))


@pytest.fixture(scope="module")
def plain(model):
    outputs = model.generate_batch(PROMPTS, config(), continuous_batching_config=small_cache())
    return [outputs[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]


def tokens(outputs):
    return [outputs[f"req_{i}"].generated_tokens for i in range(len(outputs))]


def drafted_and_accepted(outputs) -> tuple[int, int]:
    """The drafts verified and kept over `outputs` (finished `GenerationOutput`s)."""
    stats = [output.speculative_stats for output in outputs]
    return sum(s.drafted_tokens for s in stats), sum(s.accepted_tokens for s in stats)


def counting_offloads(offloads: list):
    """A `serve` watch that appends to `offloads` each time transformers offloads requests."""

    def watch(processor):
        offload = processor.offloading_manager.offload_requests

        def counted(*args, **kwargs):
            offloads.append(1)
            return offload(*args, **kwargs)

        processor.offloading_manager.offload_requests = counted

    return watch


@pytest.mark.parametrize("period", [None, 1, 3], ids=["always_right", "never_right", "partly_right"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_identity_with_plain_continuous_batching(model, plain, period, gamma):
    drafter = ScriptedRequests([p + out for p, out in zip(PROMPTS, plain)], period)
    outputs = model.generate_batch(
        PROMPTS,
        config(),
        continuous_batching_config=small_cache(),
        drafter=drafter,
        speculative_gamma=gamma,
        speculative_gamma_policy="constant",
    )
    assert tokens(outputs) == plain
    stats = [output.speculative_stats for output in outputs.values()]
    assert all(s.emitted_tokens == NEW_TOKENS for s in stats)
    drafted, accepted = sum(s.drafted_tokens for s in stats), sum(s.accepted_tokens for s in stats)
    assert drafted > 0
    if period is None:
        assert accepted == drafted  # every draft kept, even those trimmed by the token budget
        assert max(s.mean_accepted_length for s in stats) > 1.5
    elif period == 1:
        assert accepted == 0
    else:
        assert 0 < accepted < drafted


@pytest.mark.parametrize("drafter", ["prompt_lookup", "suffix"])
def test_registered_copy_drafters(model, plain, drafter):
    outputs = model.generate_batch(
        PROMPTS,
        config(),
        continuous_batching_config=small_cache(),
        drafter=drafter,
        speculative_gamma=3,
        speculative_gamma_policy="constant",
    )
    assert tokens(outputs) == plain
    assert sum(o.speculative_stats.accepted_tokens for o in outputs.values()) > 0


@pytest.mark.parametrize("period", [None, 3], ids=["always_right", "partly_right"])
def test_log_probabilities_equal_plain_continuous_batching(model, plain, period):
    """`return_logprobs=True`: each emitted token's log-probability, read off the verify forward for accepted drafts
    and the token after them, equals plain continuous batching's (to float tolerance: a verify is one forward over
    several positions)."""
    cache = small_cache(return_logprobs=True)
    reference = model.generate_batch(PROMPTS, config(), continuous_batching_config=cache)
    drafter = ScriptedRequests([p + out for p, out in zip(PROMPTS, plain)], period)
    outputs = model.generate_batch(
        PROMPTS,
        config(),
        continuous_batching_config=cache,
        drafter=drafter,
        speculative_gamma=4,
        speculative_gamma_policy="constant",
    )
    assert tokens(outputs) == plain
    for request, expected in reference.items():
        output = outputs[request]
        assert len(output.logprobs) == len(output.generated_tokens) == NEW_TOKENS
        torch.testing.assert_close(output.logprobs, expected.logprobs, rtol=0, atol=1e-5)
        assert output.speculative_stats.accepted_tokens > 0
        if period is not None:
            assert output.speculative_stats.accepted_tokens < output.speculative_stats.drafted_tokens


class TargetArgmax(hf_specdec.Drafter):
    """Drafts the target's own greedy continuation: often accepted when sampling at a low temperature, not always."""

    def __init__(self, target):
        self.target = target

    @torch.no_grad()
    def propose(self, input_ids, num_tokens):
        ids = input_ids
        for _ in range(num_tokens):
            ids = torch.cat([ids, self.target(ids).logits[:, -1:].argmax(-1)], 1)
        return hf_specdec.DraftProposal(tokens=ids[:, input_ids.shape[1] :])


def test_sampled_log_probabilities_are_the_target_s(model):
    """Sampling (temperature 0.7) with drafts accepted or not: every emitted token's log-probability is the target's
    processed log-probability of that token at its position, recomputed from one forward over the output."""
    drafter = TargetArgmax(model)
    torch.manual_seed(0)
    outputs = model.generate_batch(
        PROMPTS,
        config(do_sample=True, temperature=0.7, top_k=None, top_p=None),
        continuous_batching_config=small_cache(return_logprobs=True),
        drafter=drafter,
        speculative_gamma=4,
        speculative_gamma_policy="constant",
    )
    accepted = rejected = 0
    for i, prompt in enumerate(PROMPTS):
        output = outputs[f"req_{i}"]
        assert_logprobs_are_the_target_s(model, prompt, output, temperature=0.7)
        accepted += output.speculative_stats.accepted_tokens
        rejected += output.speculative_stats.drafted_tokens - output.speculative_stats.accepted_tokens
    assert accepted > 0 and rejected > 0


def assert_logprobs_are_the_target_s(model, prompt, output, temperature):
    """Each generated token's log-probability in `output` is log_softmax(logits / temperature) of that token, the
    logits recomputed by one forward over prompt + output: the request's cache held exactly its own tokens."""
    sequence = torch.tensor([prompt + output.generated_tokens])
    with torch.no_grad():
        logits = model(sequence).logits[0, len(prompt) - 1 : -1].float() / temperature
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(output.generated_tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(output.logprobs), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("sharing", [False, True], ids=["copied_blocks", "shared_blocks"])
def test_forked_requests_each_decode_exactly(model, sharing):
    """`num_return_sequences=3`: each request is forked after its prompt (children share its complete blocks or get
    copies, and copy the partial one), and every sequence drafts and verifies on its own: greedy (top-k 1), all
    three equal plain continuous batching's; sampling, every token's log-probability is the target's at its place in
    that sequence, and the children differ."""
    cache = small_cache(return_logprobs=True, allow_block_sharing=sharing, max_requests_per_batch=4)
    drafting = dict(drafter=TargetArgmax(model), speculative_gamma=4, speculative_gamma_policy="constant")
    greedy = config(num_return_sequences=3, do_sample=True, top_k=1)  # transformers forks sampled requests only
    reference = model.generate_batch(PROMPTS, greedy, continuous_batching_config=cache)
    outputs = model.generate_batch(PROMPTS, greedy, continuous_batching_config=cache, **drafting)
    assert sorted(outputs) == sorted(reference) and len(outputs) == 3 * len(PROMPTS)
    for request, output in outputs.items():
        assert output.generated_tokens == reference[request].generated_tokens, request
    sampled = config(num_return_sequences=3, do_sample=True, temperature=0.7, top_k=None, top_p=None)
    torch.manual_seed(0)
    outputs = model.generate_batch(PROMPTS, sampled, continuous_batching_config=cache, **drafting)
    assert len(outputs) == 3 * len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        family = [output for request, output in outputs.items() if request.split("__")[0] == f"req_{i}"]
        assert len(family) == 3
        for output in family:
            assert len(output.generated_tokens) == NEW_TOKENS
            assert_logprobs_are_the_target_s(model, prompt, output, temperature=0.7)
    assert len({tuple(output.generated_tokens) for output in outputs.values()}) > len(PROMPTS)
    stats = [output.speculative_stats for output in outputs.values()]
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.drafted_tokens for s in stats)


def test_prefix_sharing_and_large_pages(model, plain):
    """Default page size and block sharing on: identical, and the drafts of a rejected round are never hashed."""
    drafter = ScriptedRequests([p + out for p, out in zip(PROMPTS, plain)], 3)
    cache = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64, page_size=16)
    outputs = model.generate_batch(PROMPTS + PROMPTS[:2], config(), continuous_batching_config=cache, drafter=drafter)
    assert tokens(outputs) == plain + plain[:2]


def test_a_prompt_s_blocks_are_shared_as_plain_continuous_batching_shares_them(model):
    """A prompt of four pages, sent twice one after the other: the second request reads as many of its tokens from
    the first's cached blocks with a drafter as without (the step that finishes a prompt hashed only the blocks of
    its first position, so 4 tokens were reused instead of 12)."""
    prompt = list(range(10, 26))

    def reused(**drafting):
        cache = small_cache(allow_block_sharing=True, max_requests_per_batch=1, max_batch_tokens=32)
        manager = model.init_continuous_batching(config(max_new_tokens=3), cache, **drafting)
        manager.warmup()
        search = manager.batch_processor.cache.search_prefix_match
        matched = []

        def recorded(request_id, tokens):  # the cache's own search, its result noted
            matched.append(search(request_id, tokens))
            return matched[-1]

        manager.batch_processor.cache.search_prefix_match = recorded
        manager.start()
        try:
            outputs = []
            for i in range(2):
                request = manager.add_request(prompt, request_id=f"r{i}")
                outputs.append(next(o for o in manager.request_id_iter(request) if o.is_finished()).generated_tokens)
        finally:
            manager.stop(block=True, timeout=30)
        return matched, outputs

    plain_matched, plain_outputs = reused()
    matched, outputs = reused(drafter="prompt_lookup")
    assert outputs == plain_outputs
    assert matched == plain_matched == [0, 12]


def test_eos_inside_a_block_stops_there(model, plain):
    stop = next(i for i in range(4, NEW_TOKENS) if plain[0][i] not in plain[0][:i])  # its first occurrence
    eos = plain[0][stop]
    expected = [out[: out.index(eos) + 1] if eos in out else out for out in plain]
    drafter = ScriptedRequests([p + out for p, out in zip(PROMPTS, plain)])  # drafts past the EOS
    outputs = model.generate_batch(
        PROMPTS,
        config(eos_token_id=eos),
        continuous_batching_config=small_cache(),
        drafter=drafter,
        speculative_gamma=6,
        speculative_gamma_policy="constant",
    )
    assert tokens(outputs) == expected
    assert len(expected[0]) == stop + 1


def test_max_new_tokens_inside_a_block(model, plain):
    drafter = ScriptedRequests([p + out for p, out in zip(PROMPTS, plain)])
    outputs = model.generate_batch(
        PROMPTS,
        config(max_new_tokens=7),
        continuous_batching_config=small_cache(),
        drafter=drafter,
        speculative_gamma=5,
        speculative_gamma_policy="constant",
    )
    assert tokens(outputs) == [out[:7] for out in plain]


def test_a_request_longer_than_its_token_buffer_grows_it(model):
    """Each request keeps its tokens in a host buffer the drafter reads: sized to what the request holds (at least 256
    more), and grown as it goes (it was sized to `max_new_tokens` at once, 16 GiB for a request without one)."""
    prompts = PROMPTS[:2]
    long = config(max_new_tokens=600)
    plain = tokens(model.generate_batch(prompts, long, continuous_batching_config=small_cache(num_blocks=512)))
    outputs = model.generate_batch(
        prompts,
        long,
        continuous_batching_config=small_cache(num_blocks=512),
        drafter=ScriptedRequests([p + out for p, out in zip(prompts, plain)], period=5),
        speculative_gamma=4,
        speculative_gamma_policy="constant",
    )
    assert tokens(outputs) == plain and all(len(out) == 600 for out in plain)


def test_a_request_without_max_new_tokens_drafts_within_a_memory_limit(tmp_path):
    """transformers lets a request without `max_new_tokens` run to 2**31 - 1 tokens (until its EOS); under an
    address-space limit of 8 GiB plain continuous batching serves it, and so must speculation (its request failed
    with an allocation of 16 GiB)."""
    script = tmp_path / "limited.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import resource, sys
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            import torch
            from conftest import tiny_model
            from transformers import ContinuousBatchingConfig, GenerationConfig
            import hf_specdec

            torch.set_num_threads(1)
            model = hf_specdec.enable(tiny_model("llama"))
            prompt = [[1, 2, 3, 1, 2, 3]]
            cache = ContinuousBatchingConfig(page_size=4, num_blocks=64, max_batch_tokens=12, allow_block_sharing=False)
            probe = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
            eos = model.generate_batch(prompt, probe, continuous_batching_config=cache)["req_0"].generated_tokens[5]
            until_eos = GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=0)
            resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, resource.RLIM_INFINITY))
            plain = model.generate_batch(prompt, until_eos, continuous_batching_config=cache)["req_0"]
            ours = model.generate_batch(prompt, until_eos, continuous_batching_config=cache, drafter="prompt_lookup")
            ours = ours["req_0"]
            assert plain.error is None and ours.error is None, (plain.error, ours.error)
            assert ours.generated_tokens == plain.generated_tokens and plain.generated_tokens[-1] == eos
            print("served", len(ours.generated_tokens))
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "served" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("sharing", [False, True], ids=["no_sharing", "prefix_sharing"])
def test_manager_cache_invariants_streaming_cancellation_and_no_leaked_blocks(model, plain, sharing):
    """After every step each decoding request has cached prompt + generated - 1 positions, and each block hashed
    for prefix sharing lies within them (a block whose slots hold a rejected draft is never hashed); streamed
    outputs grow as prefixes of the final one; a cancelled request's blocks come back; without sharing every block
    is free at the end."""
    drafter = ScriptedRequests([p + out for p, out in zip(PROMPTS, plain)], 4)
    manager = model.init_continuous_batching(
        generation_config=config(),
        continuous_batching_config=small_cache(allow_block_sharing=sharing),
        drafter=drafter,
        speculative_gamma=4,
        speculative_gamma_policy="constant",
    )
    assert isinstance(manager, continuous_batching.SpeculativeContinuousBatchingManager)
    manager.warmup()
    processor = manager.batch_processor
    free_at_start = processor.cache.pool.num_free_sectors
    update, violations, steps, hashes = processor.update_batch, [], [], set()

    def checked_update():
        update()
        steps.append(1)
        for state in processor.scheduler.active_requests.values():
            if state.status == RequestStatus.DECODING and state.generated_tokens:
                expected = len(state.initial_tokens) + len(state.generated_tokens) - 1
                if state.position_offset != expected:
                    violations.append((state.request_id, state.position_offset, expected))
                for allocator in processor.cache.cache_allocators.values():
                    blocks = allocator.block_table.get(state.request_id, [])
                    hashed = [i for i, block in enumerate(blocks) if block in allocator.ledger.block_to_hash]
                    if hashed and (max(hashed) + 1) * allocator.tokens_per_page > state.position_offset:
                        violations.append((state.request_id, "hashed", max(hashed), state.position_offset))
                    hashes.update(hashed)

    processor.update_batch = checked_update
    manager.start()
    try:
        streamed = manager.add_request(PROMPTS[0], request_id="streamed", streaming=True)
        others = [manager.add_request(p, request_id=f"r{i}") for i, p in enumerate(PROMPTS[1:], 1)]
        cancelled = manager.add_request(list(range(40, 60)), request_id="cancelled", max_new_tokens=200)
        manager.cancel_request(cancelled)
        growing = [output.generated_tokens for output in manager.request_id_iter(streamed)]
        results = {}
        while len(results) < len(others):
            result = manager.get_result(timeout=5)
            assert result is not None
            if result.request_id in others and result.is_finished():
                results[result.request_id] = result.generated_tokens
    finally:
        manager.stop(block=True, timeout=10)
    assert growing[-1] == plain[0] and len(growing) > 1
    assert all(a == b[: len(a)] and len(a) < len(b) for a, b in zip(growing, growing[1:]))
    assert [results[r] for r in others] == plain[1:]
    assert steps and not violations
    assert bool(hashes) == sharing == processor.cache.use_prefix_sharing
    if sharing:  # finished requests' hashed blocks stay cached for later prompts
        return
    processor.cache.pool.try_to_free_sectors()  # blocks go back to their sector first, sectors to the pool lazily
    assert processor.cache.pool.num_free_sectors == free_at_start
    assert all(
        not table for allocator in processor.cache.cache_allocators.values() for table in allocator.block_table.values()
    )


def serve(model, requests, cache, watch=None, generation_config=None, **drafting):
    """Runs `requests` (`(prompt, add_request kwargs)`) on a started manager; `watch(processor)` before it starts.
    Returns each request's final output, in order."""
    manager = model.init_continuous_batching(generation_config or config(), cache, **drafting)
    manager.warmup()
    if watch is not None:
        watch(manager.batch_processor)
    manager.start()
    try:
        ids = [manager.add_request(prompt, **kwargs) for prompt, kwargs in requests]
        finished = {r: next(o for o in manager.request_id_iter(r) if o.is_finished()) for r in ids}
    finally:
        manager.stop(block=True, timeout=10)
    assert all(finished[r].error is None for r in ids)
    return [finished[r] for r in ids]


def test_requests_offloaded_under_memory_pressure_come_back_exact(model, plain):
    """Too few blocks for every request at once: transformers offloads requests (their cache is dropped and their
    output so far becomes prompt) and brings them back; they go on drafting and end as plain's."""
    drafter = ScriptedRequests([p + out for p, out in zip(PROMPTS, plain)], 3)
    offloads = []
    cache = small_cache(num_blocks=14, max_requests_per_batch=5, max_batch_tokens=24)
    outputs = serve(
        model,
        [(p, {}) for p in PROMPTS],
        cache,
        counting_offloads(offloads),
        drafter=drafter,
        speculative_gamma=4,
        speculative_gamma_policy="constant",
    )
    assert offloads
    assert [output.generated_tokens for output in outputs] == plain


def test_per_request_processor_arguments_reach_every_verified_position(model, plain):
    """With per-request processors, a request sampled at `top_k=1` decodes greedily while its neighbours sample:
    its arguments must apply to each of its verified positions, not to a neighbour's."""
    drafter = ScriptedRequests([p + out for p, out in zip(PROMPTS, plain)], 3)
    sampled = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=True, top_k=50, eos_token_id=None, pad_token_id=0)
    cache = small_cache(per_request_processors=True, max_batch_tokens=32, max_requests_per_batch=5)
    requests = [(p, {"top_k": 1} if i % 2 == 0 else {}) for i, p in enumerate(PROMPTS)]
    outputs = serve(
        model, requests, cache, None, sampled, drafter=drafter, speculative_gamma=4, speculative_gamma_policy="constant"
    )
    outputs = [output.generated_tokens for output in outputs]
    assert [outputs[i] for i in range(0, len(PROMPTS), 2)] == plain[::2]
    assert any(outputs[i] != plain[i] for i in range(1, len(PROMPTS), 2))  # the others did sample


def test_generate_with_the_paged_cache_drafts(model):
    ids = torch.tensor([PROMPTS[0]])
    plain = model.generate(ids, cache_implementation="paged", max_new_tokens=12, do_sample=False)
    ours = model.generate(
        ids, cache_implementation="paged", max_new_tokens=12, do_sample=False, drafter="prompt_lookup"
    )
    assert torch.equal(plain, ours)
    assert continuous_batching.pending_drafting.get() is None


class FreeScriptedRequests(ScriptedRequests):
    free_drafts = True  # like prompt lookup: drafted every step, only their verification priced


@pytest.mark.parametrize("free", [False, True], ids=["costly_drafts", "free_drafts"])
@pytest.mark.parametrize("cost, drafts", [((0.0, 1e-3), "none"), ((1.0, 1e-6), "all")])
def test_the_auto_policy_prices_drafts_on_the_step(model, plain, cost, drafts, free):
    """The default policy verifies no draft when the step is compute-bound (a = 0: no draft can pay) and every draft
    when a step's fixed cost dwarfs its per-token cost; outputs are identical either way, and the drafts it does not
    verify still measure each request's acceptance: every step for free drafts; costly ones whose drafting does not
    pay draft only until their drafting is timed, then rest (here an exploration, whose drafts' tokens cost the
    verify as much as that many plain steps, would be due only after more steps of rest than a request lasts)."""
    drafter = (FreeScriptedRequests if free else ScriptedRequests)([p + out for p, out in zip(PROMPTS, plain)], 3)
    watched = []

    def watch(processor):
        processor.allocator.cost.coefficients = lambda: (*cost, 0.0)
        watched.append(processor)

    outputs = serve(model, [(p, {}) for p in PROMPTS], small_cache(max_batch_tokens=64), watch, drafter=drafter)
    assert [output.generated_tokens for output in outputs] == plain
    drafted = sum(output.speculative_stats.drafted_tokens for output in outputs)
    assert (drafted == 0) if drafts == "none" else (drafted >= 3 * NEW_TOKENS)
    first_drafts_compared = watched[0].allocator.positions[0][1]
    if drafts == "none" and free:
        assert first_drafts_compared >= len(PROMPTS) * (NEW_TOKENS - 2)  # every step
    elif drafts == "none":
        assert 1 <= first_drafts_compared <= 2 * len(PROMPTS)  # rarely
    else:
        assert first_drafts_compared >= len(PROMPTS) * (NEW_TOKENS // 4)


class SlowScriptedRequests(ScriptedRequests):
    """Scripted drafts that take `first` seconds at a request's first draft (as a draft model prefills the prompt)
    and `each` seconds after: slept, or with `clock` (a `FakeClock`) added to it."""

    first, each = 0.3, 0.05
    clock = None

    def reset(self, context):
        self.started = False

    def propose(self, input_ids, num_tokens):
        seconds = self.each if self.started else self.first
        if self.clock is None:
            time.sleep(seconds)
        else:
            self.clock.now += seconds
        self.started = True
        return super().propose(input_ids, num_tokens)


class FakeClock:
    """A `time` stand-in whose `perf_counter` moves only when a drafter says so."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_the_auto_policy_times_verification_apart_from_drafting(model, plain, monkeypatch):
    """A step's seconds, which the policy fits to price verification, start after drafting (drafts already made
    must not look dearer to verify); drafting is priced per request by its own time, a request's first draft (a draft
    model's one-off prefill) only until another draft is timed. Steps are priced so that every draft pays; the loop's
    clock moves only while drafting, so the times it books are exact."""
    from hf_specdec import continuous_steps

    clock = FakeClock()
    monkeypatch.setattr(continuous_steps, "time", clock)
    steps, drafts, allocators = [], [], []

    def watch(processor):
        allocator = processor.allocator
        allocator.cost.coefficients = lambda: (1.0, 1e-6, 0.0)
        observe_step, observe_draft = allocator.observe_step, allocator.observe_draft
        allocator.observe_step = lambda tokens, seconds, verifying=False: (
            steps.append(seconds),
            observe_step(tokens, seconds, verifying),
        )
        allocator.observe_draft = lambda seconds, provisional=False: (
            drafts.append((seconds, provisional)),
            observe_draft(seconds, provisional),
        )
        allocators.append(allocator)

    drafter = SlowScriptedRequests([p + out for p, out in zip(PROMPTS, plain)], 3)
    drafter.clock = clock
    outputs = serve(model, [(p, {}) for p in PROMPTS], small_cache(max_batch_tokens=64), watch, drafter=drafter)
    assert [output.generated_tokens for output in outputs] == plain
    first, each = SlowScriptedRequests.first, SlowScriptedRequests.each
    assert steps and set(steps) == {0.0}  # no drafting inside a step's time
    assert sorted(provisional for _, provisional in drafts).count(True) == len(PROMPTS)  # each request's first
    assert all(s == pytest.approx(first if provisional else each) for s, provisional in drafts)
    assert allocators[0].draft_seconds == pytest.approx(each)


def test_a_drafter_slower_than_a_step_stops_before_the_step_cost_is_fitted(model, plain):
    """A fresh manager has no step cost fit yet: once one request's drafting is timed, the other requests weigh it
    against their share of the recent steps and do not draft (a slow draft model must not draft for every request
    of a busy manager until the fit exists)."""
    drafted = []

    def watch(processor):
        observe_draft = processor.allocator.observe_draft
        processor.allocator.observe_draft = lambda seconds, provisional=False: (
            drafted.append(seconds),
            observe_draft(seconds, provisional),
        )

    drafter = SlowScriptedRequests([p + out for p, out in zip(PROMPTS, plain)], 3)
    outputs = serve(model, [(p, {}) for p in PROMPTS], small_cache(max_batch_tokens=64), watch, drafter=drafter)
    assert [output.generated_tokens for output in outputs] == plain
    assert len(drafted) == 1
    assert sum(output.speculative_stats.drafted_tokens > 0 for output in outputs) == 1


def test_the_auto_policy_is_exact_with_its_own_fit(model, plain):
    outputs = model.generate_batch(PROMPTS, config(), continuous_batching_config=small_cache(), drafter="suffix")
    assert tokens(outputs) == plain


SAMPLING = dict(do_sample=True, temperature=0.9, top_k=4, max_new_tokens=3)


@pytest.mark.parametrize("lenience", [1.0, 0.05], ids=["exact", "lossy_power_check"])
def test_sampling_matches_the_target_distribution(model, lenience):
    """Each request's three tokens (the second verified against a draft far from the target) follow the exactly
    enumerated target distribution; a lossy verification (lenience 0.05) with the same drafter must fail."""
    prompt = PROMPTS[1]
    table = exact_distribution(model, torch.tensor([prompt]), dict(temperature=0.9, top_k=4), length=3)
    torch.manual_seed(0)
    outputs = model.generate_batch(
        [prompt] * 1500,
        config(**SAMPLING),
        continuous_batching_config=ContinuousBatchingConfig(
            num_blocks=256, max_batch_tokens=256, max_requests_per_batch=64
        ),
        drafter=Unlikely(model),
        speculative_gamma=2,
        speculative_gamma_policy="constant",
        speculative_lenience=lenience,
    )
    samples = [tuple(output.generated_tokens) for output in outputs.values()]
    assert len(samples) == 1500 and sum(o.speculative_stats.drafted_tokens for o in outputs.values()) >= 1500
    p_value = goodness_of_fit(table, samples)
    if lenience == 1.0:
        assert p_value > 1e-3
    else:
        assert p_value < 1e-6


def test_block_verification_matches_the_target_distribution(model):
    """`speculative_verification="block"`: two drafts (far from the target) verified jointly at the second token;
    the four tokens follow the exactly enumerated target distribution."""
    prompt = PROMPTS[1]
    table = exact_distribution(model, torch.tensor([prompt]), dict(temperature=0.9, top_k=4), length=4)
    torch.manual_seed(0)
    outputs = model.generate_batch(
        [prompt] * 1500,
        config(**{**SAMPLING, "max_new_tokens": 4}),
        continuous_batching_config=ContinuousBatchingConfig(
            num_blocks=256, max_batch_tokens=256, max_requests_per_batch=64
        ),
        drafter=Unlikely(model),
        speculative_gamma=2,
        speculative_gamma_policy="constant",
        speculative_verification="block",
    )
    stats = [output.speculative_stats for output in outputs.values()]
    assert max(max(s.drafted_history) for s in stats) == 2
    assert goodness_of_fit(table, [tuple(output.generated_tokens) for output in outputs.values()]) > 1e-3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(drafter="prompt_lookup", speculative_tree_budget=8), "speculative_tree_budget=8"),
        (dict(drafter="prompt_lookup", speculative_gamma_policy="optimal"), 'speculative_gamma_policy="optimal"'),
        (
            dict(speculative_gamma=4, speculative_gamma_policy="constant"),
            "`speculative_gamma` was given without a drafter",
        ),
        (dict(drafter_kwargs={"max_ngram_size": 2}), "`drafter_kwargs` was given without a drafter"),
        (dict(prompt_lookup_num_tokens=3), "`prompt_lookup_num_tokens=3` is not served inside continuous batching"),
        (dict(assistant_early_exit=1), "`assistant_early_exit=1` is not served"),
        (dict(use_mtp=True), "`use_mtp=True` is not served"),
        (
            dict(drafter=type("ReadsStates", (hf_specdec.Drafter,), {"reads_target_hidden_states": True})()),
            "set no `target_hidden_layers`",
        ),
        (
            dict(drafter=type("ReadsCache", (hf_specdec.Drafter,), {"reads_target_cache": True})()),
            "reads the target's key/value cache",
        ),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else None,
)
def test_refusals_name_the_argument(model, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        model.generate_batch(PROMPTS, config(), continuous_batching_config=small_cache(), **kwargs)


def test_bad_drafting_values_name_the_call_they_came_from(model):
    with pytest.raises(ValueError, match=r"got 0\..*\(Value read from the `generate_batch` call's keyword arguments"):
        model.generate_batch(PROMPTS, config(), drafter="prompt_lookup", speculative_gamma=0)
    with pytest.raises(TypeError, match=r"\['speculative_bogus'\] passed to `init_continuous_batching`"):
        model.init_continuous_batching(config(), small_cache(), drafter="prompt_lookup", speculative_bogus=1)
    with pytest.raises(ValueError, match=r"\(Value read from the `generation_config` passed to `generate_batch`"):
        model.generate_batch(PROMPTS, config(speculative_lenience=2.0), drafter="prompt_lookup")


@pytest.mark.parametrize(
    "setting",
    [
        dict(forced_bos_token_id=7),
        dict(forced_eos_token_id=9, max_length=14),
        dict(no_repeat_ngram_size=2),
        dict(sequence_bias={(3, 4): -5.0}),
    ],
    ids=lambda setting: next(iter(setting)),
)
def test_processors_that_read_the_step_s_tokens_are_refused(model, setting):
    """Continuous batching calls processors with one token per scored position; a verify step scores several per
    request, so a processor reading the tokens or their number fires elsewhere than in a plain step (forced BOS gave
    `[7, 7, 7, 93, ...]` where plain continuous batching gives `[7, 7, 7, 7, ...]`)."""
    name = {
        "forced_bos_token_id": "ForcedBOSTokenLogitsProcessor",
        "forced_eos_token_id": "ForcedEOSTokenLogitsProcessor",
        "no_repeat_ngram_size": "NoRepeatNGramLogitsProcessor",
        "sequence_bias": "SequenceBiasLogitsProcessor",
    }[next(iter(setting))]
    with pytest.raises(ValueError, match=f"The generation config adds `{name}`, which continuous batching calls"):
        model.generate_batch(
            PROMPTS, config(**setting), continuous_batching_config=small_cache(), drafter="prompt_lookup"
        )
    assert len(model.generate_batch(PROMPTS[:1], config(**setting), continuous_batching_config=small_cache())) == 1


def test_processors_that_act_on_each_position_s_scores_are_served(model):
    settings = dict(suppress_tokens=[3, 5], sequence_bias={(4,): -1e9}, renormalize_logits=True)
    plain = tokens(model.generate_batch(PROMPTS, config(**settings), continuous_batching_config=small_cache()))
    outputs = model.generate_batch(
        PROMPTS,
        config(**settings),
        continuous_batching_config=small_cache(),
        drafter=ScriptedRequests([p + out for p, out in zip(PROMPTS, plain)], period=3),
        speculative_gamma=4,
        speculative_gamma_policy="constant",
    )
    assert tokens(outputs) == plain
    assert not {3, 5, 4} & {token for out in plain for token in out}


@pytest.mark.parametrize(
    "setting, match",
    [
        (dict(use_async_batching=True), "use_async_batching"),
        (dict(cpu_offload_space=1.0), "cpu_offload_space"),
    ],
)
def test_continuous_batching_settings_not_served_are_refused(model, setting, match):
    cache = small_cache(**setting)
    attention = model.config._attn_implementation
    with pytest.raises(ValueError, match=f"`ContinuousBatchingConfig\\({match}=...\\)`"):
        model.generate_batch(PROMPTS, config(), continuous_batching_config=cache, drafter="prompt_lookup")
    assert model.config._attn_implementation == attention


def test_sliding_windows_are_refused(model):
    sliding = hf_specdec.enable(tiny_model("mistral", sliding_window=8))
    with pytest.raises(ValueError, match="mistral has sliding-window attention"):
        sliding.generate_batch(PROMPTS, config(), drafter="prompt_lookup")


def test_an_untested_transformers_release_is_refused(model, monkeypatch):
    monkeypatch.setattr(continuous_batching.transformers, "__version__", "5.30.0")
    with pytest.raises(RuntimeError, match="only with transformers 5.24.x.*this is transformers 5.30.0"):
        model.generate_batch(PROMPTS, config(), drafter="prompt_lookup")


def test_a_cached_manager_serves_only_its_own_drafting(model):
    manager = model.init_continuous_batching(config(), small_cache(), drafter="prompt_lookup")
    manager.start()
    manager.stop(block=True, keep_for_next_session=True)
    try:
        assert model.init_continuous_batching(config(), small_cache(), drafter="prompt_lookup") is manager
        with pytest.raises(ValueError, match="other drafting settings.*destroy_cached_continuous_batching_manager"):
            model.init_continuous_batching(config(), small_cache(), drafter="suffix")
        with pytest.raises(ValueError, match="other drafting settings"):
            model.init_continuous_batching(config(), small_cache())
    finally:
        model.destroy_cached_continuous_batching_manager()


def test_plain_continuous_batching_is_unchanged():
    plain = tiny_model("llama").generate_batch(PROMPTS[:2], config(max_new_tokens=5), warmup=False)
    enabled = hf_specdec.enable(tiny_model("llama")).generate_batch(
        PROMPTS[:2], config(max_new_tokens=5), warmup=False, max_new_tokens=5
    )
    assert tokens(enabled) == tokens(plain)
    assert all(len(output.generated_tokens) == 5 for output in plain.values())
    assert not any(hasattr(output, "speculative_stats") for output in enabled.values())
