"""Padded batches of hybrid models in one forward per round: rows in lockstep (`hf_specdec.batching`).

Every row's recurrent state must hold exactly its own kept tokens, so after a round every row keeps as many drafts
as the row that accepted fewest, and one rollback of the checkpoints serves all rows. Checked here: greedy identity
with plain batched `generate` (drafters always, never and partly right, a different acceptance per row, rows that
leave at EOS), that each round is one forward of the whole batch, and the sampled distribution of each row."""

import sys
from pathlib import Path

import pytest
import torch
from test_sampling_distribution import exact_distribution, goodness_of_fit

import hf_specdec

sys.path.insert(0, str(Path(__file__).parent / "sweep"))
from tiny import VOCAB
from tiny import tiny_model as sweep_model

NEW_TOKENS = 20
# a gated delta rule + full attention hybrid, a layer holding attention beside its SSM (Zamba2), and Mamba2 layers
# beside attention layers (Granite-MoE-hybrid)
FAMILIES = ["qwen3_5_text", "zamba2", "granitemoehybrid"]


class RowScript(hf_specdec.Drafter):
    """Proposes each row's own continuation (found by its prefix among `references`, the rows of plain generate's
    output without their padding), corrupting every `periods[row]`-th position of row `row`: rows accept different
    numbers of drafts. `periods=None`: always right; all 1: never."""

    def __init__(self, references: list[torch.LongTensor], periods: tuple[int, ...] | None):
        self.references, self.periods = references, periods

    def propose(self, input_ids, num_tokens):
        start = input_ids.shape[1]
        row = next(i for i, ref in enumerate(self.references) if torch.equal(ref[:start], input_ids[0]))
        tokens = self.references[row][start : start + num_tokens].clone()[None]
        if self.periods is not None:
            period = self.periods[row]
            wrong = torch.arange(start, start + tokens.shape[1]) % period == period - 1
            tokens[:, wrong] = (tokens[:, wrong] + 1) % VOCAB
        return hf_specdec.DraftProposal(tokens=tokens)


def padded_batch(seed: int):
    """Three rows, left-padded by 0, 3 and 5 tokens."""
    ids = torch.randint(4, VOCAB, (3, 9), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row, padding in ((1, 3), (2, 5)):
        ids[row, :padding], mask[row, :padding] = 0, 0
    return ids, mask


def unpadded_rows(out, mask):
    return [out[row, int((mask[row] == 0).sum()) :] for row in range(out.shape[0])]


class BatchSizes:
    """The batch size of every forward of `model` (a forward hook, removed by `close`)."""

    def __init__(self, model):
        self.sizes = []
        self.handle = model.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.sizes.append(ids.shape[0])

    def close(self):
        self.handle.remove()


@pytest.fixture(scope="module", params=FAMILIES)
def target(request):
    model = hf_specdec.enable(sweep_model(request.param))
    # the first speculative call probes the model's capabilities once, one sequence at a time: done here
    model.generate(torch.tensor([[5, 6, 7, 5, 6]]), drafter="prompt_lookup", max_new_tokens=2, do_sample=False)
    return model


@pytest.mark.parametrize(
    "periods", [None, (1, 1, 1), (3, 4, 5), (5, 2, 7)], ids=["always", "never", "partly", "partly-other"]
)
def test_rows_in_lockstep_equal_plain_batched_generate_in_one_forward_per_round(target, periods):
    ids, mask = padded_batch(seed=1)
    kwargs = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=NEW_TOKENS, do_sample=False)
    reference = target.generate(ids, **kwargs)
    drafter = RowScript(unpadded_rows(reference, mask), periods)
    sizes = BatchSizes(target)
    try:
        out = target.generate(
            ids,
            drafter=drafter,
            speculative_gamma=3,
            speculative_gamma_policy="constant",
            return_dict_in_generate=True,
            **kwargs,
        )
    finally:
        sizes.close()
    assert torch.equal(out.sequences, reference)
    assert set(sizes.sizes) == {3}, sizes.sizes  # the whole batch in every forward (not one row at a time)
    stats = out.speculative_stats
    assert stats.drafted_tokens > 0
    if periods is None:
        assert stats.accepted_tokens == stats.drafted_tokens
    elif periods == (1, 1, 1):
        assert stats.accepted_tokens == 0
    else:  # rows accept different numbers of drafts: those that accepted more keep as many as the fewest
        assert 0 < stats.accepted_tokens < stats.drafted_tokens
        assert len({row.accepted_tokens for row in stats.rows}) == 1


def test_draft_models_and_prompt_lookup_in_lockstep(target):
    """A stateful draft model (a copy of the target: per-row copies, each rolled back), another one that is never
    right, and prompt lookup."""
    ids, mask = padded_batch(seed=4)
    kwargs = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=NEW_TOKENS, do_sample=False)
    reference = target.generate(ids, **kwargs)
    other = sweep_model(target.config.model_type, seed=5)
    for drafter in ({"assistant_model": target}, {"assistant_model": other}, {"drafter": "prompt_lookup"}):
        out = target.generate(ids, speculative_gamma=3, speculative_gamma_policy="constant", **drafter, **kwargs)
        assert torch.equal(out, reference), drafter


def assert_batch_and_padded_row_equal_plain(target, ids, padded_row: int, max_new_tokens: int) -> None:
    """Greedy identity with plain `generate` (pad 0) for the batch `ids` and for its row `padded_row` alone, drafted by
    the target itself and by prompt lookup."""
    mask = (ids != 0).long()
    for rows in (list(range(ids.shape[0])), [padded_row]):
        batch = dict(attention_mask=mask[rows], pad_token_id=0, max_new_tokens=max_new_tokens, do_sample=False)
        reference = target.generate(ids[rows], **batch)
        for drafter in ({"assistant_model": target}, {"drafter": "prompt_lookup"}):
            out = target.generate(
                ids[rows], speculative_gamma=3, speculative_gamma_policy="constant", **drafter, **batch
            )
            assert torch.equal(out, reference), (rows, drafter)


def test_prompts_two_columns_wide_with_a_padded_row(target):
    """The prompt but its last column goes in a forward of its own before the first round, except here: it would be
    one column, padding in one row, and transformers gives a one-token forward no padding mask (it is taken for a
    decode step), so the pad token would enter that row's recurrent state. The first round is a plain step over both
    columns instead: in a batch (lockstep) and for the padded row alone (the one-sequence loop)."""
    ids = torch.tensor([[41, 15], [0, 87], [9, 51]])
    assert_batch_and_padded_row_equal_plain(target, ids, padded_row=1, max_new_tokens=12)


@pytest.mark.parametrize("width", [2, 4])
def test_a_row_padded_up_to_its_last_column_with_biases_before_the_state(width):
    """A row that is padding in every column but the last, on a model whose in-projection has a bias and whose pad
    embedding is not zero: plain generate's masked prefill leaves the bias (not zeros) in the convolution window, so
    the padding must go through the model's own masked forward, never be emulated (two columns: a plain step over
    both; wider: the prefix in a forward of its own, masked by transformers)."""
    target = hf_specdec.enable(sweep_model("granitemoehybrid", mamba_proj_bias=True))
    generator = torch.Generator().manual_seed(width)
    with torch.no_grad():
        target.get_input_embeddings().weight[0] = torch.randn(target.config.hidden_size, generator=generator)
        for name, parameter in target.named_parameters():
            if name.endswith("in_proj.bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    ids = torch.randint(4, VOCAB, (3, width), generator=generator)
    ids[1, :-1] = 0
    assert_batch_and_padded_row_equal_plain(target, ids, padded_row=1, max_new_tokens=10)


@pytest.mark.parametrize("family", ["qwen3_5_text", "granitemoehybrid"])
def test_a_padded_first_call_probes_the_model_without_its_padding(family):
    """The capability probe runs on the first call's first row: its left padding is left out (a state that saw only
    padding is zero, which made a model that reads its state look as if it ignored it, and the refusal was kept for
    every later call)."""
    target = hf_specdec.enable(sweep_model(family))  # not probed yet
    ids, mask = torch.tensor([[0, 87]]), torch.tensor([[0, 1]])
    kwargs = dict(pad_token_id=0, max_new_tokens=8, do_sample=False)
    reference = target.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(target.generate(ids, attention_mask=mask, drafter="prompt_lookup", **kwargs), reference)
    unpadded = torch.tensor([[5, 6, 7, 5, 6]])
    reference = target.generate(unpadded, **kwargs)
    assert torch.equal(target.generate(unpadded, drafter="prompt_lookup", **kwargs), reference)


def test_rows_that_finish_leave_the_lockstep():
    """An EOS token in one row's output: the row finishes (padded after), the others go on, as plain generate."""
    target = hf_specdec.enable(sweep_model("qwen3_5_text"))
    ids, mask = padded_batch(seed=2)
    kwargs = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=NEW_TOKENS, do_sample=False)
    free = target.generate(ids, **kwargs)
    eos = int(free[0, ids.shape[1] + 6])  # row 0's 7th new token
    reference = target.generate(ids, eos_token_id=eos, **kwargs)
    assert (reference == eos).any(dim=1).sum() >= 1 and (reference[:, -1] != 0).any()  # one row ended, one went on
    for periods in (None, (3, 4, 5)):
        drafter = RowScript(unpadded_rows(free, mask), periods)
        out = target.generate(
            ids, drafter=drafter, eos_token_id=eos, speculative_gamma=3, speculative_gamma_policy="constant", **kwargs
        )
        assert torch.equal(out, reference), periods


def test_sampled_rows_in_lockstep_follow_the_target_distribution():
    """Two prompts, twenty rows each in one padded batch: each row's 3 sampled tokens against its prompt's enumerated
    distribution. Drafted by another hybrid, so that rows accept different numbers of drafts and most rounds cut
    some row back to the fewest. Power: the drafter's own samples fail the same test."""
    target = hf_specdec.enable(sweep_model("qwen3_5_text"))
    drafter = sweep_model("qwen3_5_text", seed=9)
    config = dict(temperature=0.9, top_k=3)
    short = torch.randint(4, VOCAB, (1, 4), generator=torch.Generator().manual_seed(21))
    long = torch.randint(4, VOCAB, (1, 7), generator=torch.Generator().manual_seed(22))
    tables = [exact_distribution(target, prompt, config, length=3) for prompt in (short, long)]
    ids = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1), long]).repeat(20, 1)  # [40, 7]
    mask = (torch.arange(7)[None] >= torch.tensor([3, 0]).repeat(20)[:, None]).long()

    def samples(model, **kwargs):
        torch.manual_seed(4321)
        drawn = ([], [])
        for _ in range(15):
            out = model.generate(
                ids, attention_mask=mask, pad_token_id=0, do_sample=True, max_new_tokens=3, **config, **kwargs
            )
            for row in range(ids.shape[0]):
                drawn[row % 2].append(tuple(out[row, 7:].tolist()))
        return drawn

    drawn = samples(target, assistant_model=drafter, speculative_gamma=2, speculative_gamma_policy="constant")
    for table, rows in zip(tables, drawn, strict=True):
        assert goodness_of_fit(table, rows) > 1e-3
    own = samples(drafter)
    assert any(
        any(s not in table for s in rows) or goodness_of_fit(table, rows) < 1e-3
        for table, rows in zip(tables, own, strict=True)
    )
