"""Batches: left-padded ragged prompts, rows that accept different amounts and end early, num_return_sequences."""

import pytest
import torch
from conftest import (
    TINY,
    VOCAB,
    ScriptedDrafter,
    noisy_copy,
    prompt,
    source,
    tiny_model,
    tiny_seq2seq,
)
from test_sampling_distribution import P_THRESHOLD, exact_two_token_distribution, goodness_of_fit
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_specdec

PAD = 0
PROCESSING = dict(repetition_penalty=1.2, no_repeat_ngram_size=3)
NEW_TOKENS = 16
BATCH_ARCHITECTURES = ("gemma", "gpt2", "gpt_neox", "llama", "qwen2")


def padded_batch(lengths=(3, 7, 5, 1), seed=0):
    """Left-padded prompts of different lengths (ids >= 3), with their attention mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, VOCAB, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


class RowScriptedDrafter(hf_specdec.Drafter):
    """Per-row copies (no `supports_padded_batches`): proposes each row's known continuation, corrupting every
    `period`-th position of it (`period=1` never right, `None` always right)."""

    def __init__(self, prompts, references, period=None):
        self.prompts = [p.tolist() for p in prompts]  # unpadded prompts, to find each row's reference
        self.references = references  # one unpadded full row (prompt + plain output) per row
        self.period = period

    def reset(self, context):
        self.row = self.prompts.index(context.input_ids[0].tolist())
        self.reference = self.references[self.row]

    def propose(self, input_ids, num_tokens, attention_mask=None):
        start = input_ids.shape[1]
        tokens = self.reference[start : start + num_tokens].clone()
        if self.period is not None:
            wrong = (torch.arange(start, start + len(tokens)) % self.period) == self.period - 1
            tokens[wrong] = (tokens[wrong] + 1) % VOCAB
        return hf_specdec.DraftProposal(tokens=tokens[None])


def unpadded_rows(sequences, mask):
    return [row[int((m == 0).sum()) :] for row, m in zip(sequences, mask)]


@pytest.fixture(scope="module", params=BATCH_ARCHITECTURES)
def batch_setup(request):
    target = hf_specdec.enable(tiny_model(request.param, seed=0))
    ids, mask = padded_batch()
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, **PROCESSING)
    return target, ids, mask, plain


def run(target, ids, mask, gamma=4, **kwargs):
    # constant γ: these tests count drafts and calls; tiny drafters on a CPU are often measured not to pay, which
    # the default "auto" policy would act on
    kwargs.setdefault("speculative_gamma_policy", "constant")
    out = target.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        pad_token_id=PAD,
        speculative_gamma=gamma,
        return_dict_in_generate=True,
        **PROCESSING,
        **kwargs,
    )
    return out.sequences, out.speculative_stats


def test_model_drafters_match_plain_batched_generate(batch_setup):
    target, ids, mask, plain = batch_setup
    sequences, stats = run(target, ids, mask, assistant_model=target)
    assert torch.equal(sequences, plain) and stats.acceptance_rate == 1.0
    assert stats.target_calls == -(-NEW_TOKENS // 5)  # every row accepts all 4 drafts: one forward per 5 tokens
    sequences, stats = run(target, ids, mask, assistant_model=noisy_copy(target, scale=0.5))
    assert torch.equal(sequences, plain) and 0 < stats.accepted_tokens < stats.drafted_tokens


class HostRealigned(hf_specdec.ModelDrafter):
    """A draft model that records what its cache holds (the ids fed, per row) after each round."""

    def __init__(self, model, held: list):
        super().__init__(model)
        self.held = held  # per round: the ids the cache holds, `[rows, cached]` (shared with the per-call copy)

    def on_verified(self, input_ids, num_accepted, attention_mask=None, accepted_nodes=None, **hints):
        super().on_verified(input_ids, num_accepted, attention_mask, accepted_nodes, **hints)
        self.held.append(self.fed_ids.clone())


class DeviceRealigned(HostRealigned):
    """The same without the loop's host-side padding: it realigns its cache from the device (one read per round), as
    any padded-batch drafter without it does."""

    def on_verified(self, input_ids, num_accepted, attention_mask=None, accepted_nodes=None):
        super().on_verified(input_ids, num_accepted, attention_mask, accepted_nodes)


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_draft_cache_realigned_from_host_padding_holds_what_the_device_realignment_keeps(batch_setup, do_sample):
    """The draft model's cache, realigned from the padding the loop hands it, holds after every round
    exactly what the device-side realignment keeps: the same ids, the same drafts, the same output."""
    target, ids, mask, plain = batch_setup
    draft = noisy_copy(target, scale=0.5)
    runs = []
    for drafter_class in (HostRealigned, DeviceRealigned):
        torch.manual_seed(3)
        held = []
        sequences, stats = run(target, ids, mask, gamma=2, drafter=drafter_class(draft, held), do_sample=do_sample)
        runs.append((sequences, held, [(row.accepted_tokens, row.drafted_tokens) for row in stats.rows]))
        # rounds where a row takes every draft (its cache then lacks the last one)
        histogram = stats.accepted_length_histogram
        assert histogram[-1] > 0
    (host, host_held, host_rows), (device, device_held, device_rows) = runs
    assert torch.equal(host, device) and host_rows == device_rows
    assert len(host_held) == len(device_held) > 0
    assert all(torch.equal(a, b) for a, b in zip(host_held, device_held))
    if not do_sample:
        assert torch.equal(host, plain)
    assert 0 < sum(a for a, _ in host_rows) < sum(d for _, d in host_rows)  # partly right: the caches matter


@pytest.mark.parametrize("period", (None, 1, 2, 3))
def test_per_row_drafters_match_plain_batched_generate(batch_setup, period):
    target, ids, mask, plain = batch_setup
    drafter = RowScriptedDrafter(unpadded_rows(ids, mask), unpadded_rows(plain, mask), period)
    sequences, stats = run(target, ids, mask, gamma=3, drafter=drafter)
    assert torch.equal(sequences, plain)
    if period == 1:
        assert stats.accepted_tokens == 0 and stats.target_calls == NEW_TOKENS
    if period is None:
        assert stats.acceptance_rate == 1.0


def test_rows_accept_different_amounts(batch_setup):
    target, ids, mask, plain = batch_setup
    # row 0 never right, row 1 always right, rows 2 and 3 partly: the rows drift apart and are realigned
    references = unpadded_rows(plain, mask)

    class Mixed(RowScriptedDrafter):
        def reset(self, context):
            super().reset(context)
            self.period = (1, None, 2, 3)[self.row]

    sequences, stats = run(target, ids, mask, gamma=5, drafter=Mixed(unpadded_rows(ids, mask), references))
    assert torch.equal(sequences, plain)
    histogram = stats.accepted_length_histogram
    assert histogram[0] > 0 and histogram[-1] > 0  # some rows rejected at once while others took all 5


def test_prompt_lookup_batch(batch_setup):
    target, ids, mask, plain = batch_setup
    sequences, _ = run(target, ids, mask, drafter="prompt_lookup", drafter_kwargs={"min_ngram_size": 1})
    assert torch.equal(sequences, plain)


def test_each_row_equals_its_own_single_run():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    ids, mask = padded_batch()
    drafter = noisy_copy(target, scale=0.5)
    sequences, _ = run(target, ids, mask, assistant_model=drafter)
    for row, row_prompt in enumerate(unpadded_rows(ids, mask)):
        single = target.generate(
            row_prompt[None], assistant_model=drafter, speculative_gamma=4, max_new_tokens=NEW_TOKENS, **PROCESSING
        )
        plain_single = target.generate(row_prompt[None], max_new_tokens=NEW_TOKENS, **PROCESSING)
        assert torch.equal(single, plain_single)
        assert torch.equal(sequences[row, ids.shape[1] - len(row_prompt) :], single[0])


def test_rows_that_end_early_are_padded_like_plain():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    ids, mask = padded_batch()
    free = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, **PROCESSING)
    # an EOS token that one row emits early and the others later or never
    eos = int(free[1, ids.shape[1] + 3])
    plain = target.generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, eos_token_id=eos, **PROCESSING
    )
    assert (plain[:, ids.shape[1] :] == PAD).any()  # at least one row finished early and was padded
    for drafter_args in (
        {"assistant_model": target},
        {"assistant_model": noisy_copy(target, scale=0.5)},
        {"drafter": RowScriptedDrafter(unpadded_rows(ids, mask), unpadded_rows(free, mask), period=3)},
    ):
        sequences, _ = run(target, ids, mask, eos_token_id=eos, **drafter_args)
        assert torch.equal(sequences, plain)


class StopAfterToken(StoppingCriteria):
    """Per-row criterion (no EOS): plain generate keeps rows that fired growing until every row has fired."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_rows_without_pad_token_run_until_all_are_done():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    ids, mask = padded_batch()
    free = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, **PROCESSING)
    token = int(free[0, ids.shape[1] + 2])
    criteria = StoppingCriteriaList([StopAfterToken(token)])
    plain = target.generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, stopping_criteria=criteria, **PROCESSING
    )
    for drafter_args in (
        {"assistant_model": target},
        {"drafter": RowScriptedDrafter(unpadded_rows(ids, mask), unpadded_rows(free, mask), 2)},
    ):
        out = target.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            stopping_criteria=criteria,
            speculative_gamma=4,
            **PROCESSING,
            **drafter_args,
        )
        assert torch.equal(out, plain)


class StopAtLength(StoppingCriteria):
    """Per-row criterion (no EOS): row r is done once its row of the padded batch holds `lengths[r]` tokens."""

    def __init__(self, prompts, lengths):
        self.prompts, self.lengths = prompts, lengths

    def __call__(self, input_ids, scores, **kwargs):
        # rows decoded apart are called one at a time: identify each row by its prompt
        rows = [next(r for r, p in enumerate(self.prompts) if torch.equal(row[: len(p)], p)) for row in input_ids]
        return torch.tensor([input_ids.shape[1] >= self.lengths[r] for r in rows])


def test_a_row_at_max_length_before_the_others_are_done_is_cut_back_like_plain():
    """No EOS criterion: a row done early keeps growing with the batch, as in plain generate. A row that reaches
    max_length (an always-right drafter, long drafts) before the last row is done leaves the batch, and is cut back
    like every other row to the length at which the last row was done (it kept its 20 new tokens)."""
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    ids = torch.cat([prompt(8, seed=3), prompt(8, seed=4)])
    free = target.generate(ids, max_new_tokens=20)
    criteria = StoppingCriteriaList([StopAtLength(list(ids), [10, 16])])
    plain = target.generate(ids, max_new_tokens=20, stopping_criteria=criteria)
    assert plain.shape[1] == 16

    class RightForRowZero(RowScriptedDrafter):  # row 0 always right, row 1 never
        def reset(self, context):
            super().reset(context)
            self.period = None if self.row == 0 else 1

    drafter = RightForRowZero(list(ids), list(free))
    out = target.generate(
        ids,
        max_new_tokens=20,
        stopping_criteria=criteria,
        drafter=drafter,
        speculative_gamma=10,
        speculative_gamma_policy="constant",
    )
    assert torch.equal(out, plain)


@pytest.mark.parametrize("arch", ("t5", "bart"))
def test_encoder_decoder_batch_matches_plain(arch):
    target = hf_specdec.enable(tiny_seq2seq(arch, seed=0))
    sources = torch.cat([source(10, seed=3), source(10, seed=4)])
    mask = torch.ones_like(sources)
    mask[1, 7:] = 0  # the second source is shorter (encoders pad on the right)
    sources[1, 7:] = PAD
    processing = dict(repetition_penalty=1.3, no_repeat_ngram_size=2)
    plain = target.generate(sources, attention_mask=mask, max_new_tokens=NEW_TOKENS, **processing)
    for drafter_args in (
        {"assistant_model": target},
        {"assistant_model": noisy_copy(target, scale=0.05)},
        {"drafter": "prompt_lookup"},
    ):
        out = target.generate(
            sources, attention_mask=mask, max_new_tokens=NEW_TOKENS, speculative_gamma=4, **processing, **drafter_args
        )
        assert torch.equal(out, plain)


def test_sampling_with_thousands_of_return_sequences():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    drafter = tiny_model("llama", seed=1)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(11))
    config = dict(temperature=0.9, top_k=4, repetition_penalty=1.3)
    table = exact_two_token_distribution(target, ids, config)
    assert len(table) >= 4

    def samples(model, **kwargs):
        torch.manual_seed(1234)
        out = model.generate(ids, do_sample=True, max_new_tokens=2, num_return_sequences=3000, **config, **kwargs)
        return [tuple(row) for row in out[:, ids.shape[1] :].tolist()]

    for drafter_args in ({"assistant_model": drafter}, {"drafter": "prompt_lookup"}):
        assert goodness_of_fit(table, samples(target, speculative_gamma=2, **drafter_args)) > P_THRESHOLD
    # power: the same test rejects the drafter's own samples
    drafter_samples = samples(hf_specdec.enable(drafter))
    assert any(s not in table for s in drafter_samples) or goodness_of_fit(table, drafter_samples) < P_THRESHOLD


def test_right_padding_is_refused():
    target = hf_specdec.enable(tiny_model("llama"))
    ids, mask = padded_batch()
    with pytest.raises(ValueError, match="needs left padding"):
        target.generate(ids, attention_mask=mask.flip(-1), assistant_model=target, max_new_tokens=3, pad_token_id=PAD)


def test_batch_with_streamer_or_scores_is_refused():
    from transformers.generation.streamers import BaseStreamer

    class Silent(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            pass

    target = hf_specdec.enable(tiny_model("llama"))
    ids, mask = padded_batch()
    with pytest.raises(ValueError, match="`streamer` needs a batch of one sequence, got 4"):
        target.generate(ids, attention_mask=mask, assistant_model=target, streamer=Silent(), max_new_tokens=3)
    with pytest.raises(ValueError, match="`output_scores` / `output_logits` are supported with a drafter for one"):
        target.generate(
            ids,
            attention_mask=mask,
            assistant_model=target,
            max_new_tokens=3,
            return_dict_in_generate=True,
            output_scores=True,
        )


def test_encoder_decoder_rows_without_eos_run_until_all_are_done():
    target = hf_specdec.enable(tiny_seq2seq("t5", seed=0))
    sources = torch.cat([source(10, seed=0), source(10, seed=1)])
    free = target.generate(sources, max_new_tokens=12)
    criteria = StoppingCriteriaList([StopAfterToken(int(free[0, 4]))])  # row 0 fires early, row 1 later or never
    plain = target.generate(sources, max_new_tokens=12, stopping_criteria=criteria)
    for drafter_args in ({"drafter": "prompt_lookup"}, {"assistant_model": target}):
        out = target.generate(
            sources, max_new_tokens=12, stopping_criteria=criteria, speculative_gamma=4, **drafter_args
        )
        assert torch.equal(out, plain)


@pytest.mark.parametrize("eos_token_id", (None, VOCAB - 1))
def test_drafts_past_max_length_stay_in_learned_position_range(eos_token_id):
    # GPT-2's learned positions end at n_positions: drafts of a row that is ahead must not index past them
    target = hf_specdec.enable(tiny_model("gpt2", n_positions=20))
    ids, mask = padded_batch((6, 6))
    kwargs = dict(attention_mask=mask, max_length=20, pad_token_id=PAD, eos_token_id=eos_token_id)
    plain = target.generate(ids, **kwargs)
    drafter = tiny_model("gpt2", seed=3, n_positions=20)
    for drafter_args in ({"assistant_model": drafter}, {"drafter": "prompt_lookup"}):
        assert torch.equal(target.generate(ids, speculative_gamma=5, **kwargs, **drafter_args), plain)


@pytest.mark.parametrize("policy", ("optimal", "heuristic"))
def test_gamma_policies_in_a_batch(policy):
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    ids, mask = padded_batch()
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, **PROCESSING)
    sequences, stats = run(
        target, ids, mask, assistant_model=noisy_copy(target, scale=0.5), speculative_gamma_policy=policy
    )
    assert torch.equal(sequences, plain)
    assert len(stats.gamma_history) == stats.target_calls  # one decision per batch round


def test_realign_cache_moves_each_row_and_slice_cache_matches_it_when_rows_move_alike():
    from transformers import DynamicCache

    from hf_specdec.caches import realign_cache, slice_cache

    def filled(batch=3, heads=2, length=6, dim=4, layers=2):
        cache = DynamicCache()
        for layer in range(layers):
            keys = torch.arange(batch * heads * length * dim, dtype=torch.float32).view(batch, heads, length, dim)
            cache.update(keys + 1000 * layer, -keys - 1000 * layer, layer)
        return cache

    def expected(cache, columns):  # the definition: column j of row r holds what column columns[r, j] held
        return [
            torch.stack(
                [layer.keys[r][:, columns[r].clamp(0, layer.keys.shape[-2] - 1)] for r in range(columns.shape[0])]
            )
            for layer in cache.layers
        ]

    uneven = torch.tensor([[0, 1, 2, 3, 4], [-1, 0, 1, 2, 3], [-2, -1, 0, 1, 2]])  # rows shifted by 0, 1, 2
    alike = torch.arange(1, 5).expand(3, -1)  # every row: drop column 0 and column 5
    for columns in (uneven, alike):
        cache = filled()
        want = expected(cache, columns)
        realign_cache(cache, columns)
        for layer, keys in zip(cache.layers, want):
            assert torch.equal(layer.keys, keys) and torch.equal(layer.values, -keys)
        assert cache.get_seq_length() == columns.shape[1]

    cache = filled()
    want = expected(cache, alike)
    storage = [layer.keys.untyped_storage().data_ptr() for layer in cache.layers]
    slice_cache(cache, 1, 4)
    for layer, keys, pointer in zip(cache.layers, want, storage):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, -keys)
        assert layer.keys.untyped_storage().data_ptr() == pointer  # a view of the old cache, nothing copied
    assert cache.get_seq_length() == 4


def test_realign_and_slice_keep_a_sliding_window_layer_s_window():
    """A sliding-window layer stores the last columns of the rectangle it has seen (here columns 2 ... 8 of 9: its
    window of 3 after a crop, then a forward of 4 it recorded): realigned or sliced, it holds the last 3 of the new
    columns, read from the stored ones, and counts the new rectangle's width; a column it no longer holds is refused."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from hf_specdec.caches import realign_cache, slice_cache

    def filled():
        layer = DynamicSlidingWindowLayer(sliding_window=4)
        layer.activate_past_recording()
        columns = torch.arange(9, dtype=torch.float32)  # every stored value is its column in the rectangle
        grid = columns.view(1, 1, 9, 1).expand(3, 2, 9, 4) + 100 * torch.arange(3).view(3, 1, 1, 1)  # + 100 x row
        layer.update(grid[:, :, :5], -grid[:, :, :5])
        layer.crop(0)  # the window: columns 2, 3, 4
        layer.update(grid[:, :, 5:], -grid[:, :, 5:])  # recorded: columns 2 ... 8
        cache = DynamicCache()
        cache.layers = [layer]
        return cache, layer

    cache, layer = filled()
    assert layer.keys.shape[2] == 7 and layer.cumulative_length == 9
    shifts = torch.tensor([0, 1, 2])
    realign_cache(cache, torch.arange(9)[None, :] - shifts[:, None])  # rows moved right by 0, 1, 2
    want = torch.stack([torch.arange(6, 9) - shift + 100 * row for row, shift in enumerate(shifts.tolist())])
    assert torch.equal(layer.keys[:, 0, :, 0], want.float()) and torch.equal(layer.values, -layer.keys)
    assert layer.cumulative_length == 9 and layer.keys.shape[2] == 3

    cache, layer = filled()
    slice_cache(cache, 1, 7)  # columns 1 ... 7: the window is 5, 6, 7
    assert torch.equal(layer.keys[0, 0, :, 0], torch.tensor([5.0, 6.0, 7.0])) and layer.cumulative_length == 7
    cache, _ = filled()
    with pytest.raises(RuntimeError, match="no longer holds column 1"):
        slice_cache(cache, 0, 4)  # its window would be columns 1, 2, 3


def test_each_row_of_a_batch_has_its_own_stats():
    """`speculative_stats.rows`: one entry per output row, in order, whose tokens and rounds add up to the call's,
    for the padded batch and for rows decoded one at a time (an encoder-decoder target)."""
    target = hf_specdec.enable(tiny_model("llama"))
    ids = torch.cat([prompt(seed=1), prompt(seed=2), prompt(seed=3)])
    reference = target.generate(ids, max_new_tokens=12)
    drafter = ScriptedDrafter(reference[1:2], period=3)  # right for row 1 (often), wrong for the others
    out = target.generate(
        ids,
        max_new_tokens=12,
        drafter=drafter,
        speculative_gamma=3,
        return_dict_in_generate=True,
        speculative_gamma_policy="constant",
    )
    stats = out.speculative_stats
    assert torch.equal(out.sequences, reference) and len(stats.rows) == 3
    assert [row.emitted_tokens for row in stats.rows] == [12, 12, 12]
    assert sum(row.accepted_tokens for row in stats.rows) == stats.accepted_tokens
    assert stats.rows[1].accepted_tokens > stats.rows[0].accepted_tokens
    # a round's forward is shared by the rows in the batch; a row that reached its end leaves it
    assert max(row.target_calls for row in stats.rows) == stats.target_calls
    assert stats.to_dict()["rows"][1]["accepted_tokens"] == stats.rows[1].accepted_tokens

    seq2seq = hf_specdec.enable(tiny_seq2seq("t5"))
    sources = torch.cat([source(seed=1), source(seed=2)])
    out = seq2seq.generate(sources, max_new_tokens=8, assistant_model=seq2seq, return_dict_in_generate=True)
    stats = out.speculative_stats
    assert len(stats.rows) == 2 and sum(row.target_calls for row in stats.rows) == stats.target_calls
    assert sum(row.emitted_tokens for row in stats.rows) == stats.emitted_tokens


class ScheduledPolicy(hf_specdec.policies.GammaPolicy):
    """γ from a fixed cycle that starts and goes on with plain steps (γ = 0): a user policy may do both."""

    schedule = (0, 0, 3, 0, 2, 4, 0, 1)

    def __init__(self, gamma, max_gamma):
        super().__init__(gamma, max_gamma)
        self.rounds = 0

    def next_gamma(self):
        self.rounds += 1
        return self.schedule[(self.rounds - 1) % len(self.schedule)]


hf_specdec.policies.register_gamma_policy("scheduled_batch_test", ScheduledPolicy)


@pytest.mark.parametrize("drafter_kind", ("always_right", "partly_right", "never_right"))
def test_plain_steps_before_and_between_drafting_rounds_in_a_batch(drafter_kind):
    # a padded batch whose first rounds draft nothing: the model drafter's cache is empty when the batch is first
    # realigned (this crashed: AttributeError on the rows it had never fed)
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    ids, mask = padded_batch()
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, **PROCESSING)
    drafters = {
        "always_right": dict(assistant_model=target),
        "partly_right": dict(assistant_model=noisy_copy(target, scale=0.5)),
        "never_right": dict(assistant_model=tiny_model("llama", seed=7)),
    }
    sequences, stats = run(target, ids, mask, speculative_gamma_policy="scheduled_batch_test", **drafters[drafter_kind])
    assert torch.equal(sequences, plain)
    assert stats.gamma_history[:6] == [0, 0, 3, 0, 2, 4]
    assert stats.drafted_tokens > 0
    if drafter_kind == "always_right":
        assert stats.acceptance_rate == 1.0
    if drafter_kind == "partly_right":
        assert 0 < stats.accepted_tokens < stats.drafted_tokens
    if drafter_kind == "never_right":
        assert stats.accepted_tokens == 0


def sliding_target(arch, seed=0, window=4):
    """A tiny sliding-window target: Mistral (every layer sliding) or Gemma 3 (a sliding and a full layer), with a
    window much shorter than the rows (prompts up to 7 tokens, 24 new ones)."""
    if arch == "mistral":
        return tiny_model("mistral", seed=seed, sliding_window=window)
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    sizes = dict(TINY["gemma"], vocab_size=VOCAB, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    layer_types = ["sliding_attention", "full_attention"]
    config = AutoConfig.for_model("gemma3_text", **sizes, sliding_window=window, layer_types=layer_types)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text"])
def test_sliding_window_targets_run_as_one_padded_batch(arch):
    """A sliding-window cache is realigned like a full one (each row's window moved to its new columns, from the
    columns its forward kept: `activate_past_recording`), so such targets verify every row in one forward, and every
    row equals plain batched generate: draft models with a sliding-window cache of their own that are always right,
    partly right (rows move apart every round) and never right; per-row drafters partly right; rows that end early."""
    from transformers import DynamicCache

    target = hf_specdec.enable(sliding_target(arch))
    assert any(getattr(layer, "is_sliding", False) for layer in DynamicCache(config=target.config).layers)
    ids, mask = padded_batch()
    new_tokens = 24
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=PAD)
    plain = target.generate(ids, **kwargs)
    references = unpadded_rows(plain, mask)
    drafters = {
        "always right": dict(assistant_model=target),
        "partly right": dict(assistant_model=noisy_copy(target, scale=0.3)),
        "never right": dict(assistant_model=sliding_target(arch, seed=1)),
        "per row": dict(drafter=RowScriptedDrafter(unpadded_rows(ids, mask), references, period=3)),
    }
    for name, drafter in drafters.items():
        rows = []  # the rows of each target forward: all of them in one (row by row: forwards of one row)
        handle = target.register_forward_pre_hook(
            lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
        )
        try:
            out = target.generate(
                ids,
                speculative_gamma=3,
                speculative_gamma_policy="constant",
                return_dict_in_generate=True,
                **kwargs,
                **drafter,
            )
        finally:
            handle.remove()
        assert torch.equal(out.sequences, plain), name
        stats = out.speculative_stats
        target_rows = rows[-stats.target_calls :]  # a draft model that is the target itself adds its own forwards
        assert target_rows[0] == len(ids) and target_rows == sorted(target_rows, reverse=True), name
        assert stats.target_calls < new_tokens if name != "never right" else stats.target_calls == new_tokens
        if name in ("partly right", "per row"):
            histogram = stats.accepted_length_histogram
            assert 0 < stats.accepted_tokens < stats.drafted_tokens and histogram[0] and sum(histogram[1:]), name
    # rows that end early (an EOS the first row emits halfway) leave the batch
    eos = int(plain[0, ids.shape[1] + new_tokens // 2])
    plain_eos = target.generate(ids, eos_token_id=eos, **kwargs)
    out = target.generate(ids, eos_token_id=eos, speculative_gamma=3, assistant_model=noisy_copy(target, 0.3), **kwargs)
    assert torch.equal(out, plain_eos) and (plain_eos[:, -1] == PAD).any()  # a row ended early, padded


def test_a_batch_returns_no_cache_and_a_sequence_returns_one_as_plain_generate_leaves_it():
    """A batch's cache holds its rows realigned, or none left (rows leave as they finish), or each row had its own:
    no cache is returned (`past_key_values` None), and continuing from the returned sequences equals plain. One
    sequence returns its cache as plain generate leaves it: a sliding-window layer trimmed to its window, not
    recording its past (it would keep every position, and go on growing in later calls)."""
    from hf_specdec.caches import CACHE_KWARG

    target = hf_specdec.enable(sliding_target("mistral"))
    ids, mask = padded_batch((3, 7))
    common = dict(max_new_tokens=12, pad_token_id=PAD, return_dict_in_generate=True)
    for extra in ({}, {"prefill_chunk_size": 4}):  # one padded batch; rows one at a time
        out = target.generate(ids, attention_mask=mask, assistant_model=target, **common, **extra)
        assert getattr(out, CACHE_KWARG) is None
        more = torch.cat([mask, torch.ones_like(out.sequences[:, mask.shape[1] :])], dim=-1)
        again = target.generate(out.sequences, attention_mask=more, assistant_model=target, **common)
        assert torch.equal(again.sequences, target.generate(out.sequences, attention_mask=more, **common).sequences)
    single = ids[:1, -3:]
    plain = target.generate(single, max_new_tokens=24, return_dict_in_generate=True)
    out = target.generate(single, max_new_tokens=24, assistant_model=target, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain.sequences)
    for got, want in zip(getattr(out, CACHE_KWARG).layers, getattr(plain, CACHE_KWARG).layers, strict=True):
        assert not got.record_past and got.keys.shape == want.keys.shape == (1, 2, 3, 8)
        torch.testing.assert_close(got.keys, want.keys)
