"""Host reads per round: on a GPU every read of a tensor's value on the host (`.item()`, `.tolist()`, `bool(t)`, ...)
waits for the device, so a round reads at most twice: its verdict (accepted counts, β, the proposal's check) and the
stopping criteria over the emitted tokens. Counted with `hf_specdec.devices.HostReads`, outside the models' own
forwards (those read what plain `generate` reads too)."""

import pytest
import torch
from conftest import VOCAB, noisy_copy, prompt, tiny_model

import hf_specdec
from hf_specdec.devices import HostReads

# reads of one `generate` call that are not per round (transformers' own input checks, the first round's checks of the
# prompt's padding and of the logits processors, a batch's padding, a row leaving the batch) are left out: the count
# is the slope of reads against rounds, between a shorter and a longer call
NEW_TOKENS = 30


@pytest.fixture(scope="module")
def pair():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    return target, noisy_copy(target, 0.3)


class DeviceTree(hf_specdec.Drafter):
    """Two branches of depth γ built with tensor ops alone (the drafter reads nothing on the host): the first follows
    `reference` for its first `right` tokens, then is wrong; the second is wrong from its root."""

    def __init__(self, reference, right: int = 2):
        self.reference, self.right = reference, right

    def propose(self, input_ids, num_tokens):
        truth = self.reference[:, input_ids.shape[1] : input_ids.shape[1] + num_tokens]  # [1, n]
        n = truth.shape[1]
        depth = torch.arange(n)
        first = torch.where(depth < self.right, truth, (truth + 1) % VOCAB)
        parents = torch.cat([depth - 1, torch.where(depth == 0, -1, n + depth - 1)])[None]  # [1, 2n]
        return hf_specdec.DraftProposal(tokens=torch.cat([first, (truth + 2) % VOCAB], dim=-1), parents=parents)


def reads_per_round(target, drafter, input_ids, eos_token_id=VOCAB - 1, new_tokens=NEW_TOKENS, **kwargs):
    common = dict(
        # an EOS criterion, read on the device (max length alone is decided on the host, without a read)
        eos_token_id=eos_token_id,
        pad_token_id=0,
        speculative_gamma=4,
        speculative_gamma_policy="constant",
        return_dict_in_generate=True,
        **kwargs,
    )
    drafting = dict(drafter=drafter) if isinstance(drafter, hf_specdec.Drafter) else dict(assistant_model=drafter)
    target.generate(input_ids, max_new_tokens=4, **drafting, **common)  # the first call probes the model once
    models = [target] + ([] if isinstance(drafter, hf_specdec.Drafter) else [drafter])
    counts = []
    for tokens in (new_tokens // 3, new_tokens):
        with HostReads(outside_of=models) as reads:
            out = target.generate(input_ids, max_new_tokens=tokens, **drafting, **common)
        stats = out.speculative_stats
        assert stats.accepted_tokens > 0 and stats.accepted_tokens < stats.drafted_tokens  # partly right: both paths
        counts.append((reads.count, stats.target_calls))
    (short_reads, short_rounds), (long_reads, long_rounds) = counts
    assert long_rounds > short_rounds + 3
    return (long_reads - short_reads) / (long_rounds - short_rounds)


@pytest.mark.parametrize(
    "do_sample,verification", [(False, "auto"), (True, "auto"), (True, "token")], ids=["greedy", "sampling", "token"]
)
def test_a_chain_reads_the_host_at_most_twice_per_round(pair, do_sample, verification):
    """Sampling: block verification (the default for sampled drafts) and token-wise verification alike."""
    target, drafter = pair
    torch.manual_seed(3)  # sampling: both calls accept and reject, under either rule
    kwargs = dict(do_sample=do_sample, speculative_verification=verification)
    assert reads_per_round(target, drafter, prompt(8), **kwargs) <= 2


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_max_length_alone_is_decided_on_the_host(pair, do_sample):
    # no criterion that reads the tokens: the verdict is the round's one read
    target, drafter = pair
    torch.manual_seed(3)  # sampling: both calls accept and reject
    assert reads_per_round(target, drafter, prompt(8), eos_token_id=None, do_sample=do_sample) <= 1


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_a_padded_batch_reads_the_host_at_most_twice_per_round(pair, do_sample):
    # the loop reads twice; the draft model realigns its own cache from the counts and padding the loop hands it
    target, drafter = pair
    ids = torch.cat([prompt(8, seed=1), prompt(8, seed=2)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    torch.manual_seed(0)
    assert reads_per_round(target, drafter, ids, attention_mask=mask, do_sample=do_sample) <= 2


def test_a_row_leaving_a_padded_batch_costs_no_read(pair, monkeypatch):
    """A row that ends (here at its EOS, mid-call) leaves the batch: the loop knows on the host which rows stay and
    hands them to the draft model, which selects its host-side state without reading the device (a read of the kept
    indices would cost one more read per row that leaves)."""
    target, drafter = pair
    ids = torch.cat([prompt(8, seed=1), prompt(8, seed=2), prompt(8, seed=4)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    new = plain[:, ids.shape[1] :].tolist()
    # a token that row 1 emits first mid-call and the other rows never emit
    eos = next(t for i, t in enumerate(new[1]) if i > 5 and t not in new[0] + new[2] + new[1][:i])
    selections = []
    original = hf_specdec.ModelDrafter.select_rows

    def select_rows(self, *args, **kwargs):
        before = reads.count
        original(self, *args, **kwargs)
        selections.append(reads.count - before)

    monkeypatch.setattr(hf_specdec.ModelDrafter, "select_rows", select_rows)
    kwargs = dict(speculative_gamma=4, speculative_gamma_policy="constant", pad_token_id=0, eos_token_id=eos)
    with HostReads(outside_of=[target, drafter]) as reads:
        out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, assistant_model=drafter, **kwargs)
    assert eos in out[1].tolist() and len(selections) >= 1  # row 1 left the batch mid-call
    assert selections == [0] * len(selections)


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_a_tree_reads_the_host_at_most_twice_per_round(pair, do_sample):
    # the loop's own reads, with a drafter that reads nothing
    target, _ = pair
    ids = prompt(8)
    reference = target.generate(ids, max_new_tokens=NEW_TOKENS + 8, do_sample=False)
    torch.manual_seed(0)
    per_round = reads_per_round(target, DeviceTree(reference), ids, speculative_tree_budget=8, do_sample=do_sample)
    assert per_round <= 2


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_a_draft_models_dynamic_tree_reads_the_host_at_most_three_times_per_round(pair, do_sample):
    # the loop's two reads, and the draft model's own count of the nodes its tree may keep (nodes the logits
    # processors rule out are left out of the proposal rather than verified for nothing); the prompt's round, which
    # drafts from a longer context, a fraction more
    target, drafter = pair
    torch.manual_seed(0)
    assert reads_per_round(target, drafter, prompt(8), speculative_tree_budget=8, do_sample=do_sample) < 3.5


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_static_caches_compiled_read_the_host_at_most_three_times_per_round(pair, do_sample):
    # a static cache keeps its length in a tensor: the target's and the drafter's lengths are counted on the host.
    # The loop reads twice; the third read is transformers' own: for a static cache, `prepare_inputs_for_generation`
    # builds the mask outside the forward, and for a query of several tokens `create_causal_mask` compares the
    # cache's offset tensor with 0 (plain decoding's one-token queries never get there)
    from test_static_cache import compile_config

    target, drafter = pair
    static_drafter = hf_specdec.ModelDrafter(drafter, cache_implementation="static")
    torch._dynamo.reset()
    try:
        torch.manual_seed(3)  # sampling: both calls accept and reject
        per_round = reads_per_round(
            target,
            static_drafter,
            prompt(8),
            cache_implementation="static",
            compile_config=compile_config(dynamic=False),
            do_sample=do_sample,
        )
    finally:
        torch._dynamo.reset()
    assert per_round <= 3


def test_host_reads_counts_reads_outside_the_given_forwards_and_restores_the_tensor_methods():
    model = tiny_model("llama", seed=0)
    methods = {name: torch.Tensor.__dict__.get(name) for name in ("item", "tolist", "__bool__", "cpu")}
    with HostReads() as everything:
        torch.ones(2).sum().item()
        bool(torch.ones(()))
        torch.ones(2).tolist()
    assert everything.count == 3
    with HostReads(outside_of=[model]) as loop:
        model(prompt(4))
        torch.ones(()).item()
    assert loop.count == 1
    assert {name: torch.Tensor.__dict__.get(name) for name in methods} == methods


def test_a_chain_round_makes_no_tensor_from_host_values(pair):
    """`torch.tensor(values, device="cuda")` copies from pageable memory, which synchronizes the stream like a read:
    a chain's rounds make no tensor from host values (`torch.tensor`, `new_tensor`) outside the models' forwards."""
    from torch.utils._python_dispatch import TorchDispatchMode

    target, drafter = pair
    inside = [0]
    handles = []
    for model in (target, drafter):
        handles.append(model.register_forward_pre_hook(lambda *args: inside.__setitem__(0, inside[0] + 1)))
        handles.append(
            model.register_forward_hook(lambda *args: inside.__setitem__(0, inside[0] - 1), always_call=True)
        )

    class HostTensors(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.lift_fresh.default and not inside[0]:
                HostTensors.count += 1
            return func(*args, **(kwargs or {}))

    kwargs = dict(
        assistant_model=drafter,
        do_sample=False,
        speculative_gamma=4,
        speculative_gamma_policy="constant",
        pad_token_id=0,
    )
    try:
        counts = []
        for new_tokens in (NEW_TOKENS // 3, NEW_TOKENS):
            HostTensors.count = 0
            with HostTensors():
                out = target.generate(prompt(8), max_new_tokens=new_tokens, return_dict_in_generate=True, **kwargs)
            counts.append((HostTensors.count, out.speculative_stats.target_calls))
    finally:
        for handle in handles:
            handle.remove()
    (short, short_rounds), (long, long_rounds) = counts
    assert long_rounds > short_rounds + 3
    assert long == short, counts  # the call's own (transformers' special tokens), none per round
