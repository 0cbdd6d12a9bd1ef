"""Drafters that read the target's hidden states (MTP layers, EAGLE-3 heads, DFlash blocks) in a left-padded batch:
one target forward verifies every row each round, and each row's copy of the drafter is handed its own row's hidden
states. Greedy identity with plain batched `generate` (always, partly and never right; a row that ends early and
leaves), the states each copy is handed equal those it is handed decoding its row alone, one target forward per
round for the whole batch, sampling against the exactly enumerated target with a power check, an MTP copy that kept
filler after its drafts, and a drafter that reads the target's own cache staying row by row. Tiny targets built from
configs, fp32."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, prompt, tiny_model
from test_dflash import block_drafter, llama
from test_dflash import make_bigram as dflash_bigram
from test_eagle import eagle_target
from test_mtp import accept_every_draft, deepseek
from test_mtp import make_bigram as mtp_bigram
from test_sampling_distribution import exact_distribution, goodness_of_fit

import hf_specdec
from hf_specdec.caches import CACHE_KWARG
from hf_specdec.drafters.dflash import DFlashDrafter
from hf_specdec.drafters.mtp import MtpDrafter

GREEDY = dict(do_sample=False, speculative_gamma_policy="constant")


def padded_batch(seed: int = 0, lengths=(8, 5, 3)) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Three prompts of different lengths, left-padded with id 0 (masked)."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = prompt(length, seed=seed + row + 1)[0]
        mask[row, width - length :] = 1
    return ids, mask


def forward_batch_sizes(target) -> tuple[list[int], object]:
    """Records the batch size of every target forward; returns the list and the hook's handle."""
    sizes = []

    def record(module, args, kwargs):
        sizes.append(kwargs["input_ids"].shape[0])

    return sizes, target.register_forward_pre_hook(record, with_kwargs=True)


def never_right(target, mtp) -> None:
    """Every MTP draft is token 0 (zero logits: the first of the ties), which the target never emits."""
    with torch.no_grad():
        for layer in mtp.layers:
            layer.post_norm.weight.zero_()
        target.get_output_embeddings().weight[0].zero_()


@pytest.mark.parametrize(
    "num_mtp_layers, case", [(1, "always"), (2, "always"), (1, "partly"), (2, "partly"), (3, "partly"), (2, "never")]
)
def test_mtp_padded_batch_is_plain_batched_generate(num_mtp_layers, case):
    target, mtp = deepseek(num_mtp_layers, seed=num_mtp_layers)
    if case == "never":
        never_right(target, mtp)
    else:
        mtp_bigram(target, mtp, context=0.0 if case == "always" else 1.0, roughness=0.0 if case == "always" else 0.05)
    ids, mask = padded_batch(seed=num_mtp_layers)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    run = dict(attention_mask=mask, speculative_gamma=3, max_new_tokens=20, return_dict_in_generate=True, **GREEDY)
    target.generate(ids, drafter=MtpDrafter(mtp), **run)  # the first call probes the model (forwards of one row)
    sizes, handle = forward_batch_sizes(target)
    out = target.generate(ids, drafter=MtpDrafter(mtp), **run)
    handle.remove()
    assert torch.equal(plain, out.sequences)
    stats = out.speculative_stats
    # one forward per round verifies every row still decoding (rows one at a time would run forwards of one row;
    # rows that reach max_length leave)
    assert len(sizes) == stats.target_calls and sizes[0] == 3 and sizes == sorted(sizes, reverse=True)
    if case == "always":
        assert stats.accepted_tokens == stats.drafted_tokens >= 30
    elif case == "partly":
        assert 0 < stats.accepted_tokens < stats.drafted_tokens
    else:
        assert stats.drafted_tokens >= 30 and stats.accepted_tokens == 0


def test_a_row_that_ends_early_leaves_and_the_others_go_on():
    target, mtp = deepseek(2, seed=5)
    mtp_bigram(target, mtp, context=1.0, roughness=0.05)
    ids, mask = padded_batch(seed=3)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    others = set(free[0, ids.shape[1] :].tolist()) | set(free[2, ids.shape[1] :].tolist())
    eos = next(token for token in free[1, ids.shape[1] + 4 :].tolist() if token not in others)  # row 1 ends early
    run = dict(attention_mask=mask, max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
    plain = target.generate(ids, do_sample=False, **run)
    out = target.generate(
        ids, drafter=MtpDrafter(mtp), speculative_gamma=3, return_dict_in_generate=True, **run, **GREEDY
    )
    assert torch.equal(plain, out.sequences)
    assert out.speculative_stats.rows[1].emitted_tokens < out.speculative_stats.rows[0].emitted_tokens


def recording(cls):
    """`cls` recording every `on_verified`: the row's ids and the hidden states it was handed."""

    class Recording(cls):
        def reset(self, context):
            super().reset(context)
            self.handed = []

        def on_verified(self, input_ids, num_accepted, attention_mask=None, accepted_nodes=None, **kwargs):
            self.handed.append((input_ids.shape[1], kwargs["target_hidden_states"].clone()))
            super().on_verified(input_ids, num_accepted, attention_mask, accepted_nodes, **kwargs)

    return Recording


def copies(drafter) -> list:
    """The per-call copies the loop makes of `drafter` (one per row in a padded batch), in order."""
    made = []
    original = drafter.for_call
    drafter.for_call = lambda context: made.append(original(context)) or made[-1]
    return made


def mtp_case():
    target, mtp = deepseek(2, seed=6)
    mtp_bigram(target, mtp, context=1.0, roughness=0.05)
    return target, lambda: recording(MtpDrafter)(mtp)


def eagle_case():
    target = eagle_target("llama", seed=3)
    return target, lambda: recording(hf_specdec.EagleDrafter).from_target(target)


def dflash_case():
    target, drafter = dflash_bigram(hf_specdec.enable(llama(seed=3)), block_drafter(4), [5, 17, 60, 33], roughness=0.3)
    return target, lambda: recording(DFlashDrafter)(drafter)


@pytest.mark.parametrize("case", [mtp_case, eagle_case, dflash_case], ids=["mtp", "eagle", "dflash"])
def test_each_row_is_handed_the_states_it_is_handed_alone(case):
    """Left padding and rejected drafts cut out of the batch's forward: every copy gets, in order, the states of its
    row's positions that it gets when the row is decoded alone (equal up to float noise: a padded forward is another
    matmul shape)."""
    target, make = case()
    ids, mask = padded_batch(seed=3)
    run = dict(max_new_tokens=18, speculative_gamma=3, **GREEDY)
    batch_drafter = make()
    made = copies(batch_drafter)
    batched = target.generate(ids, attention_mask=mask, drafter=batch_drafter, return_dict_in_generate=True, **run)
    assert torch.equal(batched.sequences, target.generate(ids, attention_mask=mask, max_new_tokens=18, do_sample=False))
    assert len(made) == 3
    rounds = 0
    for row in range(3):
        alone_drafter = make()
        alone = copies(alone_drafter)
        target.generate(ids[row : row + 1, int((mask[row] == 0).sum()) :], drafter=alone_drafter, **run)
        rounds += len(made[row].handed)
        batch_states = torch.cat([states for _, states in made[row].handed], dim=1)
        alone_states = torch.cat([states for _, states in alone[0].handed], dim=1)
        # a row leaves the batch in the round it ends (its copy is told nothing more); alone, it is told of that
        # round too
        handed = batch_states.shape[1]
        assert alone_states.shape[1] - run["speculative_gamma"] - 1 <= handed <= alone_states.shape[1]
        torch.testing.assert_close(batch_states, alone_states[:, :handed], rtol=1e-4, atol=1e-5)
        # the positions handed are every one the row's cache keeps: all but the newest token
        assert handed == made[row].handed[-1][0] - 1
    assert rounds > 3 * 4
    if case is not eagle_case:  # an untrained head is rarely right
        assert batched.speculative_stats.accepted_tokens > 0


def sampled_rows(target, ids, mask, config, count, **kwargs) -> list[list[tuple]]:
    """`count` sampled continuations of the batch: per row, its new tokens."""
    torch.manual_seed(2468)
    rows = [[] for _ in range(ids.shape[0])]
    for _ in range(count):
        out = target.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=4, **config, **kwargs)
        for row, outcomes in enumerate(rows):
            outcomes.append(tuple(out[row, ids.shape[1] :].tolist()))
    return rows


def test_mtp_sampling_in_a_padded_batch_follows_the_target(monkeypatch):
    """Two rows, the second left-padded: each row's four new tokens against the exact distribution of its prompt
    alone (chi-square). Power: verification that accepts every draft is caught on the same rows."""
    target, mtp = deepseek(2, seed=3)
    mtp_bigram(target, mtp, context=0.5, roughness=0.02)  # about 4 in 5 drafts accepted
    config = dict(temperature=0.9, top_k=2)
    ids, mask = padded_batch(seed=11, lengths=(6, 4))
    tables = [exact_distribution(target, ids[row : row + 1, 2 * row :], config, length=4) for row in range(2)]
    run = dict(drafter=MtpDrafter(mtp), speculative_gamma=3, speculative_gamma_policy="constant")
    for table, outcomes in zip(tables, sampled_rows(target, ids, mask, config, 600, **run)):
        assert goodness_of_fit(table, outcomes) > 1e-3

    accept_every_draft(monkeypatch)
    wrong = sampled_rows(target, ids, mask, config, 300, **run)
    monkeypatch.undo()
    for table, outcomes in zip(tables, wrong):
        inside = [outcome for outcome in outcomes if outcome in table]
        assert len(inside) < len(outcomes) or goodness_of_fit(table, inside) < 1e-3


def test_mtp_copy_kept_more_tokens_than_it_drafted_drafts_as_transformers():
    """In a padded batch a row whose copy drafted fewer tokens than the others has filler after its drafts, which the
    target may accept. The copy then keeps only the slots its own drafts made exact: its next drafts are those
    transformers' `MtpModel` makes from scratch. Three layers: one draft proposed (the layers ran on two of their own),
    then the draft, a filler token other than the layers' second draft, and the bonus token kept."""
    from test_mtp import call_context, transformers_drafts

    from hf_specdec.capture import HiddenStateCapture

    target, mtp = deepseek(3, seed=9)
    mtp_bigram(target, mtp, context=1.0, roughness=0.3)

    def last_layer_states(sequence):
        with HiddenStateCapture(target, drafter.target_hidden_layers) as capture, torch.no_grad():
            target(sequence)
            return capture.take()  # [1, n, hidden]: the last decoder layer's output at every position

    ids = prompt(7, seed=4)  # the prompt (6 tokens) and the first round's token
    drafter = MtpDrafter(mtp).for_call(call_context(target, ids[:, :6]))
    drafter.on_verified(ids, torch.tensor([0]), target_hidden_states=last_layer_states(ids)[:, :6])
    (draft,) = drafter.propose(ids, 1).tokens[0].tolist()
    second = transformers_drafts(target, mtp, ids)[1]  # what the second layer drafted after it
    sequence = torch.cat([ids, torch.tensor([[draft, (second + 1) % VOCAB, 3]])], dim=-1)
    states = last_layer_states(sequence)
    drafter.on_verified(sequence, torch.tensor([2]), target_hidden_states=states[:, 6:9])
    assert drafter.propose(sequence, 3).tokens[0].tolist() == transformers_drafts(target, mtp, sequence)[:3]
    # every layer's cache holds what a copy that never drafted holds after the same proposal: no key of a slot that
    # read the layers' own second draft (where the filler is now) was kept
    fresh = MtpDrafter(mtp).for_call(call_context(target, sequence[:, :9]))
    fresh.on_verified(sequence, torch.tensor([0]), target_hidden_states=states[:, :9])
    fresh.propose(sequence, 3)
    for ours, theirs in zip(drafter.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-5, atol=1e-6)


class ReadsTheTargetCache(hf_specdec.Drafter):
    """Drafts the last token again, and reads the target's cache from its context, as a Gemma 4 assistant does
    (a padded batch's context has none: its rows share one cache)."""

    reads_target_cache = True

    def reset(self, context):
        self.cache = context.model_kwargs[CACHE_KWARG]

    def propose(self, input_ids, num_tokens, attention_mask=None):
        return hf_specdec.DraftProposal(tokens=input_ids[:, -1:].repeat(1, num_tokens))


def test_a_drafter_that_reads_the_target_cache_decodes_rows_one_at_a_time():
    target = hf_specdec.enable(tiny_model("llama", seed=2))
    ids, mask = padded_batch(seed=5)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    run = dict(attention_mask=mask, max_new_tokens=12, speculative_gamma=2, **GREEDY)
    target.generate(ids, drafter=ReadsTheTargetCache(), **run)  # the first call probes the model
    sizes, handle = forward_batch_sizes(target)
    out = target.generate(ids, drafter=ReadsTheTargetCache(), **run)
    handle.remove()
    assert torch.equal(plain, out) and set(sizes) == {1}
