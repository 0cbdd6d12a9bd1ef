"""Greedy speculative decoding returns plain `generate`'s tokens, for every architecture, drafter and γ."""

import pytest
import torch
from conftest import ARCHITECTURES, VOCAB, ScriptedDrafter, noisy_copy, prompt, tiny_model
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_specdec

GAMMAS = (1, 3, 7, 12)
PROCESSING = dict(repetition_penalty=1.2, no_repeat_ngram_size=3)
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_setup(request):
    target = hf_specdec.enable(tiny_model(request.param, seed=0))
    ids = prompt(8, seed=3)
    plain = target.generate(ids, max_new_tokens=NEW_TOKENS, **PROCESSING)
    return request.param, target, ids, plain


def run(target, ids, gamma, **drafter_args):
    # constant γ: these tests count rounds and drafts; tiny drafters on a CPU are often measured not to pay, which
    # the default "auto" policy would act on
    drafter_args.setdefault("speculative_gamma_policy", "constant")
    out = target.generate(
        ids,
        speculative_gamma=gamma,
        max_new_tokens=NEW_TOKENS,
        return_dict_in_generate=True,
        **PROCESSING,
        **drafter_args,
    )
    return out.sequences, out.speculative_stats


@pytest.mark.parametrize("gamma", GAMMAS)
def test_always_right_drafter(arch_setup, gamma):
    _, target, ids, plain = arch_setup
    sequences, stats = run(target, ids, gamma, assistant_model=target)
    assert torch.equal(sequences, plain)
    assert stats.acceptance_rate == 1.0 and stats.alpha == 1.0
    # every round but the last (capped by max_new_tokens) drafts gamma tokens and accepts them all
    assert stats.target_calls == -(-NEW_TOKENS // (gamma + 1))


@pytest.mark.parametrize("gamma", GAMMAS)
def test_never_right_drafter(arch_setup, gamma):
    _, target, ids, plain = arch_setup
    sequences, stats = run(target, ids, gamma, drafter=ScriptedDrafter(plain, period=1))
    assert torch.equal(sequences, plain)
    assert stats.accepted_tokens == 0 and stats.target_calls == NEW_TOKENS


@pytest.mark.parametrize("gamma", GAMMAS)
def test_partly_right_scripted_drafter(arch_setup, gamma):
    _, target, ids, plain = arch_setup
    sequences, stats = run(target, ids, gamma, drafter=ScriptedDrafter(plain, period=3))
    assert torch.equal(sequences, plain)
    assert 0 < stats.accepted_tokens < stats.drafted_tokens


@pytest.mark.parametrize("gamma", GAMMAS)
def test_partly_right_noisy_copy(arch_setup, gamma):
    _, target, ids, plain = arch_setup
    sequences, _ = run(target, ids, gamma, assistant_model=noisy_copy(target, scale=0.5))
    assert torch.equal(sequences, plain)


@pytest.mark.parametrize("gamma", GAMMAS)
def test_unrelated_random_drafter(arch_setup, gamma):
    arch, target, ids, plain = arch_setup
    sequences, _ = run(target, ids, gamma, assistant_model=tiny_model(arch, seed=7))
    assert torch.equal(sequences, plain)


# every logits processor that changes the greedy choice, one at a time, against the same plain call
PROCESSORS = {
    "repetition_penalty": dict(repetition_penalty=1.5),
    "no_repeat_ngram": dict(no_repeat_ngram_size=2),
    "bad_words": dict(bad_words_ids=[[5], [7, 8]]),
    "suppress_tokens": dict(suppress_tokens=[1, 2, 3]),
    "min_new_tokens": dict(min_new_tokens=10, eos_token_id=4),
    "forced_eos": dict(forced_eos_token_id=9, max_new_tokens=12),
    "sequence_bias": dict(sequence_bias={(11,): 4.0, (12, 13): -3.0}),
    "begin_suppress": dict(begin_suppress_tokens=[0, 1]),
}


@pytest.mark.parametrize("name", sorted(PROCESSORS))
@pytest.mark.parametrize("drafter_kind", ["always", "partly"])
def test_logits_processors_keep_exactness(name, drafter_kind):
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    ids = prompt(8, seed=4)
    kwargs = dict(max_new_tokens=20)
    kwargs.update(PROCESSORS[name])
    plain = target.generate(ids, **kwargs)
    drafter = target if drafter_kind == "always" else noisy_copy(target, 0.4)
    out = target.generate(ids, assistant_model=drafter, speculative_gamma=5, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, plain)
    if drafter_kind == "always":
        # q is standardized with the same processors and prefix as p, so the target itself is never rejected
        assert out.speculative_stats.acceptance_rate == 1.0


def test_sliding_window_cache_rolls_back_past_the_window():
    target = hf_specdec.enable(tiny_model("mistral", seed=0, sliding_window=6))
    ids = prompt(5, seed=1)
    plain = target.generate(ids, max_new_tokens=30)
    for drafter in (target, noisy_copy(target, 0.5)):
        out = target.generate(ids, assistant_model=drafter, speculative_gamma=4, max_new_tokens=30)
        assert torch.equal(out, plain)


def test_drafter_in_another_dtype():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    ids = prompt(8)
    plain = target.generate(ids, max_new_tokens=20)
    drafter = noisy_copy(target, 0.3).to(torch.float64)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=20)
    assert torch.equal(out, plain)


class StopAtLength(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


@pytest.mark.parametrize(
    "stop_kwargs",
    [
        "eos_single",
        "eos_several",
        "max_length",
        "custom_criterion",
        "max_time",
    ],
)
def test_stopping_inside_an_accepted_block(stop_kwargs):
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    ids = prompt(8, seed=5)
    free = target.generate(ids, max_new_tokens=30)[0, 8:].tolist()
    kwargs = {
        "eos_single": dict(eos_token_id=free[9], max_new_tokens=30),
        "eos_several": dict(eos_token_id=[VOCAB - 1, free[13], free[6]], max_new_tokens=30),
        "max_length": dict(max_length=8 + 11),
        "custom_criterion": dict(stopping_criteria=StoppingCriteriaList([StopAtLength(8 + 7)]), max_new_tokens=30),
        "max_time": dict(max_time=1e-9, max_new_tokens=30),
    }[stop_kwargs]
    plain = target.generate(ids, **kwargs)
    assert plain.shape[1] < 8 + 30 or stop_kwargs == "max_length"
    out = target.generate(ids, assistant_model=target, speculative_gamma=12, **kwargs)
    assert torch.equal(out, plain)


def test_stop_strings_with_a_local_tokenizer(local_tokenizer):
    target = hf_specdec.enable(tiny_model("llama", seed=0, vocab_size=len(local_tokenizer)))
    ids = local_tokenizer("the cat sat on the mat", return_tensors="pt").input_ids
    free = target.generate(ids, max_new_tokens=30)
    text = local_tokenizer.decode(free[0, ids.shape[1] + 6 : ids.shape[1] + 8])
    stop = text.strip()[:3] or text
    plain = target.generate(ids, max_new_tokens=30, stop_strings=stop, tokenizer=local_tokenizer)
    assert plain.shape[1] < free.shape[1]
    out = target.generate(
        ids,
        assistant_model=target,
        speculative_gamma=7,
        max_new_tokens=30,
        stop_strings=stop,
        tokenizer=local_tokenizer,
    )
    assert torch.equal(out, plain)
    # the same stop string from a config, and a call's value next to a config's: the call's wins
    config = hf_specdec.SpeculativeGenerationConfig(max_new_tokens=30, stop_strings=stop)
    out = target.generate(ids, assistant_model=target, generation_config=config, tokenizer=local_tokenizer)
    assert torch.equal(out, plain) and config.stop_strings == stop
    config.stop_strings = "never-generated-zzz"
    out = target.generate(
        ids, assistant_model=target, generation_config=config, stop_strings=stop, tokenizer=local_tokenizer
    )
    assert torch.equal(out, plain)


@pytest.mark.parametrize("tree_budget", [None, 4])
def test_prefill_chunk_size_prefills_in_chunks_and_stays_exact(tree_budget):
    """`prefill_chunk_size` bounds the prompt's forwards, as plain `generate`'s chunked `_prefill` does: the prompt
    (all but its newest token) is prefilled in chunks, then the rounds carry the newest token and the drafts. It was
    ignored (the whole prompt in the first round's forward). A batch is decoded row by row, each row chunked."""
    model = hf_specdec.enable(tiny_model("llama"))
    ids = prompt(21, seed=5)
    lengths = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    plain = model.generate(ids, max_new_tokens=NEW_TOKENS, prefill_chunk_size=8)
    assert lengths[:3] == [8, 8, 5]  # plain generate's chunks
    lengths.clear()
    model.generate(ids, drafter="prompt_lookup", max_new_tokens=2, prefill_chunk_size=8)
    assert max(lengths) <= 8, lengths  # the capability probe (the model's first speculative call) stays within it
    drafters = {
        "always right": ScriptedDrafter(plain),
        "partly right": ScriptedDrafter(plain, period=3),
        "never right": ScriptedDrafter(plain, period=1),
        "prompt lookup": "prompt_lookup",
    }
    for name, drafter in drafters.items():
        lengths.clear()
        out = model.generate(
            ids,
            drafter=drafter,
            speculative_gamma=4,
            speculative_tree_budget=tree_budget,
            max_new_tokens=NEW_TOKENS,
            prefill_chunk_size=8,
        )
        assert torch.equal(out, plain), name
        # the prompt's chunks (after a tree's once-per-model attention check, when there is one)
        assert [8, 8, 4] in [lengths[i : i + 3] for i in range(len(lengths))], (name, lengths)
        assert max(lengths) <= 8, (name, lengths)
    batch = torch.cat([ids, prompt(21, seed=6)])
    lengths.clear()
    plain_batch = model.generate(batch, max_new_tokens=8, prefill_chunk_size=8)
    lengths.clear()
    assert torch.equal(
        model.generate(batch, drafter="prompt_lookup", max_new_tokens=8, prefill_chunk_size=8), plain_batch
    )
    assert max(lengths) <= 8


def test_prefill_chunk_size_with_a_static_cache_and_a_padded_batch():
    """transformers allocates a static cache ahead for the whole batch when `prefill_chunk_size` is set; the rows,
    decoded one at a time, each get a one-row copy. It crashed (`index_copy_` in `StaticLayer.update`), and when it
    was a model's first speculative call the capability probe kept the crash as the model's verdict, refusing every
    later call on it."""
    ids = torch.cat([prompt(12, seed=7), prompt(12, seed=8)])
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # the first prompt is 8 tokens, left-padded
    kwargs = dict(
        attention_mask=mask, pad_token_id=0, max_new_tokens=10, cache_implementation="static", prefill_chunk_size=5
    )
    model = hf_specdec.enable(tiny_model("llama"))
    plain = model.generate(ids, **kwargs)
    never = tiny_model("llama", seed=3)
    for drafter in (
        {"drafter": "prompt_lookup"},
        {"assistant_model": model},
        {"assistant_model": noisy_copy(model, 0.05)},
        {"assistant_model": never},
    ):
        assert torch.equal(model.generate(ids, speculative_gamma=3, **drafter, **kwargs), plain), drafter
    dynamic = model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=10)
    assert torch.equal(
        model.generate(
            ids, attention_mask=mask, pad_token_id=0, max_new_tokens=10, assistant_model=never, speculative_gamma=3
        ),
        dynamic,
    )


def test_a_probe_that_raises_refuses_the_call_without_condemning_the_model():
    """The capability probe's verdict is kept per model, but a probe forward that raised may be the call's inputs'
    doing: that call is refused with the error, and the next call probes again."""
    model = hf_specdec.enable(tiny_model("llama"))
    ids = prompt(8, seed=2)
    plain = model.generate(ids, max_new_tokens=NEW_TOKENS)

    def fail_on_several_tokens(module, args, kwargs):
        if kwargs["input_ids"].shape[1] > 1:
            raise RuntimeError("a forward over several tokens failed")

    hook = model.register_forward_pre_hook(fail_on_several_tokens, with_kwargs=True)
    with pytest.raises(
        ValueError,
        match=r"cannot be verified exactly by speculative decoding: a cached forward over "
        r"several new tokens fails \(RuntimeError: a forward over several tokens",
    ):
        model.generate(ids, drafter="prompt_lookup", max_new_tokens=NEW_TOKENS)
    hook.remove()
    assert torch.equal(model.generate(ids, drafter="prompt_lookup", max_new_tokens=NEW_TOKENS), plain)
