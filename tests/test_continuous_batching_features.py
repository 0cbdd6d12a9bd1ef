"""Feature drafters inside continuous batching (EAGLE-3 heads, MTP layers, DFlash blocks: `reads_target_hidden_states`): each
request's copy hears the target's hidden states of its own kept positions, sliced from each step's packed forward.
A request's rounds are then exactly those of `generate` at batch size 1 (same drafts, same verdicts), and its
output is plain continuous batching's (greedy) or the target's distribution (sampling)."""

import pytest
import torch
from test_continuous_batching import (
    NEW_TOKENS,
    PROMPTS,
    config,
    counting_offloads,
    drafted_and_accepted,
    serve,
    small_cache,
    tokens,
)
from test_dflash import block_drafter, llama, make_bigram
from test_eagle import always_right, eagle_target, trained_head
from test_sampling_distribution import exact_distribution, goodness_of_fit
from transformers import ContinuousBatchingConfig, GenerationMixin

import hf_specdec
from hf_specdec import capture
from hf_specdec.drafters.dflash import DFlashDrafter
from hf_specdec.drafters.mtp import MtpDrafter
from hf_specdec.mtp_training import train_mtp_layers
from hf_specdec.toy import build_early_exit_pair

CONSTANT = dict(speculative_gamma=3, speculative_gamma_policy="constant")


def no_trimming(**overrides):
    """Pages of 4 (drafts cross blocks), a token budget every request's drafts fit in, and a slot for each request:
    each request's rounds are those of `generate` at batch size 1."""
    return small_cache(max_batch_tokens=256, max_requests_per_batch=8, **overrides)


def assert_rounds_are_generate_s(target, prompts, outputs, drafter):
    """Each request drafted and kept, round by round, what `generate` drafts and keeps for its prompt alone: the
    copy heard the hidden states of exactly its own positions."""
    for i, prompt in enumerate(prompts):
        alone = target.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            drafter=drafter,
            return_dict_in_generate=True,
            **CONSTANT,
        ).speculative_stats
        ours = outputs[f"req_{i}"].speculative_stats
        assert ours.drafted_history == alone.drafted_history, i
        assert ours.position_accepted == alone.position_accepted, i
        assert ours.accepted_length_histogram == alone.accepted_length_histogram, i


@pytest.fixture(scope="module")
def eagle():
    """A tiny Llama and an EAGLE-3 head trained briefly on its own text (partly right)."""
    return trained_head("llama")


@pytest.fixture(scope="module")
def mtp():
    return trained_mtp()


def trained_mtp():
    """A small Llama and two MTP layers trained briefly on its own greedy texts (partly right), with prompts."""
    target, _ = build_early_exit_pair(num_layers=4, hidden_size=128, vocab_size=256, seed=0)
    target = hf_specdec.enable(target)
    prompts = torch.randint(0, 256, (48, 8), generator=torch.Generator().manual_seed(1))
    texts = GenerationMixin.generate(target, prompts, max_new_tokens=40, min_new_tokens=40, do_sample=False).tolist()
    layers = train_mtp_layers(target, texts=texts, num_mtp_layers=2, num_steps=20, show_progress=False)
    return target, layers, [text[:8] for text in texts[:5]]


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_partly_right_feature_drafters_draft_each_request_as_generate_does(kind, request):
    """An EAGLE-3 head and MTP layers, each trained briefly on its target's own text."""
    if kind == "eagle":
        target, head = request.getfixturevalue("eagle")
        drafter, prompts = head, PROMPTS
    else:
        target, layers, prompts = request.getfixturevalue("mtp")
        drafter = MtpDrafter(layers)
    plain = tokens(target.generate_batch(prompts, config(), continuous_batching_config=no_trimming()))
    outputs = target.generate_batch(
        prompts, config(), continuous_batching_config=no_trimming(), drafter=drafter, **CONSTANT
    )
    assert tokens(outputs) == plain
    drafted, accepted = drafted_and_accepted(outputs.values())
    assert 0 < accepted < drafted
    assert_rounds_are_generate_s(target, prompts, outputs, drafter)


class HeardStates(hf_specdec.EagleDrafter):
    """An EAGLE-3 head whose copies log every `(sequence, target_hidden_states)` they are told of (the list is
    shared by the copies)."""

    def __init__(self, model):
        super().__init__(model)
        self.heard = []

    def on_verified(self, input_ids, num_accepted, *args, target_hidden_states=None, **kwargs):
        self.heard.append((input_ids[0].tolist(), target_hidden_states))
        super().on_verified(input_ids, num_accepted, *args, target_hidden_states=target_hidden_states, **kwargs)


def test_each_copy_hears_the_hidden_states_of_exactly_its_kept_positions(eagle):
    """The rows a request's copy was handed, in order, are the target's own hidden states (at the head's layers) of
    every position of the request but its last token, as one unpacked forward over them computes them: prompt
    chunks, verified queries (the last token and the accepted drafts, never a rejected one), trimmed drafts."""
    target, head = eagle
    drafter = HeardStates(head.model)
    cache = small_cache(max_batch_tokens=12, max_requests_per_batch=3)  # prompts split, drafts trimmed
    outputs = target.generate_batch(PROMPTS, config(), continuous_batching_config=cache, drafter=drafter, **CONSTANT)
    assert 0 < sum(o.speculative_stats.accepted_tokens for o in outputs.values())
    assert not any(module in capture._HOOKS for module in target.modules())  # the loop's capture was closed
    layers = head.model.config.eagle_layers
    for i, prompt in enumerate(PROMPTS):
        sequence = prompt + outputs[f"req_{i}"].generated_tokens
        heard = [states for seen, states in drafter.heard if seen[: len(prompt)] == prompt]
        heard = torch.cat(heard, dim=1)[0]
        with torch.no_grad():
            hidden = target(torch.tensor([sequence[:-1]]), output_hidden_states=True).hidden_states
        expected = torch.cat([hidden[layer][0] for layer in layers], dim=-1)
        assert heard.shape == expected.shape, i
        torch.testing.assert_close(heard, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["always_right", "never_right"])
def test_eagle_heads_always_and_never_right(kind):
    target = eagle_target("llama")
    if kind == "always_right":
        head = always_right(target)  # the target's logits all zero: token 0 every step, and the head drafts it
    else:
        emitted = {t for out in tokens(target.generate_batch(PROMPTS, config())) for t in out}
        head = hf_specdec.EagleDrafter.from_target(target, draft_token_ids=[min(set(range(96)) - emitted)])
    plain = tokens(target.generate_batch(PROMPTS, config(), continuous_batching_config=small_cache()))
    outputs = target.generate_batch(
        PROMPTS, config(), continuous_batching_config=small_cache(), drafter=head, **CONSTANT
    )
    assert tokens(outputs) == plain
    drafted, accepted = drafted_and_accepted(outputs.values())
    assert drafted > 0
    assert accepted == (drafted if kind == "always_right" else 0)


@pytest.mark.parametrize("roughness", [0.0, 0.5], ids=["always_right", "reads_the_hidden_states"])
def test_dflash_blocks_draft_each_request_as_generate_does(roughness):
    """A DFlash block drafter on a bigram target: right every time (roughness 0), or with drafts mixed with the
    target's hidden states (mostly wrong, and different for other states)."""
    target, drafter = make_bigram(hf_specdec.enable(llama()), block_drafter(), roughness=roughness)
    plain = tokens(target.generate_batch(PROMPTS, config(), continuous_batching_config=no_trimming()))
    dflash = DFlashDrafter(drafter)
    outputs = target.generate_batch(
        PROMPTS, config(), continuous_batching_config=no_trimming(), drafter=dflash, **CONSTANT
    )
    assert tokens(outputs) == plain
    drafted, accepted = drafted_and_accepted(outputs.values())
    assert (accepted == drafted > 0) if roughness == 0 else (accepted < drafted)
    assert_rounds_are_generate_s(target, PROMPTS, outputs, dflash)


def test_trimmed_drafts_and_offloaded_requests_stay_exact(eagle):
    """A small token budget (drafts trimmed), fewer slots than requests and too few blocks: offloaded requests start
    their prefill again, with a new copy that hears it from the first position, and draft again."""
    target, head = eagle
    plain = tokens(target.generate_batch(PROMPTS, config(), continuous_batching_config=small_cache()))
    offloads = []
    cache = small_cache(num_blocks=14, max_requests_per_batch=5, max_batch_tokens=24)
    outputs = serve(
        target, [(p, {}) for p in PROMPTS], cache, counting_offloads(offloads), drafter=head, speculative_gamma=4
    )
    assert offloads
    assert [output.generated_tokens for output in outputs] == plain
    assert sum(output.speculative_stats.drafted_tokens for output in outputs) > 0


def test_a_prompt_prefix_read_from_the_cache_decodes_without_drafts(eagle, caplog):
    """Prefix sharing: a request whose prompt starts with blocks another request completed never runs them through
    the model, so its copy would miss their hidden states: it decodes plainly (exactly), with one warning."""
    target, head = eagle
    prompts = [list(range(20, 40))] * 3
    cache = small_cache(allow_block_sharing=True, max_requests_per_batch=1)
    plain = tokens(target.generate_batch(prompts, config(), continuous_batching_config=cache))
    outputs = target.generate_batch(prompts, config(), continuous_batching_config=cache, drafter=head, **CONSTANT)
    assert tokens(outputs) == plain
    drafted = [outputs[f"req_{i}"].speculative_stats.drafted_tokens for i in range(3)]
    assert drafted[0] > 0 and drafted[1:] == [0, 0]


@pytest.mark.parametrize("lenience", [1.0, 0.05], ids=["exact", "lossy_power_check"])
def test_sampled_eagle_drafts_follow_the_target_distribution(eagle, lenience):
    """An EAGLE-3 head samples its drafts (q over its draft vocabulary, standardized by the target's processors);
    each request's four tokens follow the exactly enumerated target distribution, and a lossy verification with the
    same head fails."""
    target, head = eagle
    prompt = PROMPTS[1]
    table = exact_distribution(target, torch.tensor([prompt]), dict(temperature=0.9, top_k=4), length=4)
    torch.manual_seed(0)
    outputs = target.generate_batch(
        [prompt] * 1500,
        config(do_sample=True, temperature=0.9, top_k=4, max_new_tokens=4),
        continuous_batching_config=ContinuousBatchingConfig(
            num_blocks=256, max_batch_tokens=256, max_requests_per_batch=64
        ),
        drafter=head,
        speculative_gamma=2,
        speculative_gamma_policy="constant",
        speculative_lenience=lenience,
    )
    drafted, accepted = drafted_and_accepted(outputs.values())
    assert drafted >= 1500 and 0 < accepted < drafted
    p_value = goodness_of_fit(table, [tuple(output.generated_tokens) for output in outputs.values()])
    if lenience == 1.0:
        assert p_value > 1e-3
    else:
        assert p_value < 1e-6
