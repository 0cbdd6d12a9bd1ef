"""Gemma4AssistantDrafter: a Gemma 4 assistant drafting from its target's shared key/value states and last hidden
state. Greedy identity (always, partly and never right; with kv-shared targets, static caches and left-padded batches),
drafts equal to transformers' own `SinglePositionMultiTokenCandidateGenerator` on the accepted context, sampling
against the exactly enumerated target with a power check (transformers' q, which it did not sample from, is caught),
and the refusals of assistants that do not fit their target. Tiny Gemma 4 models built from configs, fp32."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_model
from test_sampling_distribution import exact_distribution, goodness_of_fit
from transformers import (
    Gemma3nForCausalLM,
    Gemma3nTextConfig,
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    GenerationConfig,
)
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

import hf_specdec
from hf_specdec.drafters.gemma4_assistant import Gemma4AssistantDrafter, is_gemma4_assistant

HIDDEN = 64
# a target whose last layers read the first ones' keys (as gemma-4-E2B's): its "store" layers are not its last, and
# its layers take per-layer inputs (transformers' kv-shared Gemma 4 needs them to generate)
KV_SHARED = dict(layers=4, shared=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB)
TARGETS = {"two_layers": {}, "kv_shared": KV_SHARED}


def text_sizes(layers: int, window: int, **overrides) -> dict:
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=16,
        layer_types=(["sliding_attention", "full_attention"] * layers)[:layers],
        sliding_window=window,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,  # a padding id would get a zero embedding row: a token every model maps to flat logits
    )
    sizes.update(overrides)
    return sizes


def gemma4_target(layers: int = 2, shared: int = 0, window: int = 64, seed: int = 0, enabled: bool = True, **overrides):
    """A tiny Gemma 4 text target: untied, sharp head; a final norm that is not the identity. `enabled`: with
    hf_specdec's `generate` (otherwise transformers' own)."""
    torch.manual_seed(seed)
    config = Gemma4TextConfig(
        **text_sizes(layers, window, num_kv_shared_layers=shared, tie_word_embeddings=False, **overrides)
    )
    model = Gemma4ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharp argmaxes: float noise never decides a draft
        model.model.norm.weight.copy_(torch.rand(HIDDEN, generator=generator) + 0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0  # left padding of batches
    return hf_specdec.enable(model) if enabled else model


def gemma4_assistant(target, layers: int = 2, seed: int = 1, hidden: int = HIDDEN, backbone: int | None = None, **text):
    """A tiny Gemma 4 assistant for `target` (every layer reads the target's keys and values)."""
    torch.manual_seed(seed)
    sizes = text_sizes(layers, target.config.sliding_window, hidden_size=hidden, num_kv_shared_layers=layers, **text)
    config = Gemma4AssistantConfig(
        text_config=sizes, backbone_hidden_size=target.config.hidden_size if backbone is None else backbone
    )
    return Gemma4AssistantForCausalLM(config).eval()


def mirror(target, assistant, context: float = 0.0, roughness: float = 0.0, shift: int = 0, seed: int = 7):
    """With `context=0` the target's next token is a function of its current token (attention, MLP and per-layer
    inputs add nothing), and the assistant hands the target's embedding of the token it reads straight to the target's
    final norm and head: it predicts exactly what the target will. `context` keeps some of the target's attention;
    `roughness` mixes the assistant's attention over the target's keys and values and the hidden state it reads into
    its drafts (then they depend on both); `shift` rolls its head by that many tokens (never right)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.post_attention_layernorm.weight.mul_(context)  # normed: scaling `o_proj` would change nothing
            layer.mlp.down_proj.weight.zero_()
            if layer.hidden_size_per_layer_input:
                layer.per_layer_projection.weight.zero_()
        projection = assistant.pre_projection.weight  # [hidden, 2 * hidden]: the embedding half, then the state
        projection.zero_()
        projection[:, :HIDDEN] = torch.eye(HIDDEN)
        projection[:, HIDDEN:] = torch.randn(HIDDEN, HIDDEN, generator=generator) * roughness * 0.1
        for layer in assistant.model.layers:
            layer.post_attention_layernorm.weight.fill_(roughness)
            layer.mlp.down_proj.weight.zero_()
        assistant.model.norm.weight.copy_(target.model.norm.weight)
        assistant.lm_head.weight.copy_(target.lm_head.weight.roll(shift, dims=0))


class Recorder(Gemma4AssistantDrafter):
    """Records each non-empty proposal: the sequence it followed, its tokens and its q."""

    def reset(self, context):
        super().reset(context)
        self.log = []

    def propose(self, input_ids, num_tokens, attention_mask=None):
        proposal = super().propose(input_ids, num_tokens, attention_mask)
        if proposal.tokens.shape[1]:
            self.log.append((input_ids.clone(), proposal.tokens[0].tolist(), proposal.probs))
        return proposal


def recorded_generate(target, drafter: Recorder, ids, **kwargs):
    """`generate` with `drafter`; returns the output and the per-call (per-row) copies the loop used."""
    copies = []
    original = drafter.for_call
    drafter.for_call = lambda context: copies.append(original(context)) or copies[-1]
    inputs = ids if isinstance(ids, dict) else {"input_ids": ids}
    out = target.generate(**inputs, drafter=drafter, return_dict_in_generate=True, **kwargs)
    return out, copies


@torch.no_grad()
def transformers_drafts(target, assistant, sequence: torch.LongTensor, num_tokens: int) -> list[int]:
    """The greedy drafts transformers' `SinglePositionMultiTokenCandidateGenerator` makes after `sequence` (`[1, n]`)
    from a target forward over the accepted context (positions 0 .. n-2), its sliding keys cut to the
    `sliding_window - 1` positions the target's cache keeps."""
    generator = SinglePositionMultiTokenCandidateGenerator(
        assistant, target.get_input_embeddings(), GenerationConfig(max_length=10_000)
    )
    generator.num_assistant_tokens = num_tokens
    outputs = target(sequence[:, :-1], use_cache=True, output_hidden_states=True, return_shared_kv_states=True)
    window = target.config.sliding_window - 1
    keys, values = outputs.shared_kv_states["sliding_attention"]
    outputs.shared_kv_states["sliding_attention"] = (keys[:, :, -window:], values[:, :, -window:])
    candidates, _ = generator.get_candidates(
        sequence,
        model_kwargs={"attention_mask": torch.ones_like(sequence)},
        model_outputs=outputs,
        is_first_iteration=False,
        n_last_matches=0,
    )
    return candidates[0, sequence.shape[1] :].tolist()


def prompt(length: int = 8, seed: int = 0) -> torch.LongTensor:
    """Prompt ids without the padding id 0 (`generate` would infer padding from it)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (1, length), generator=generator)


GREEDY = dict(max_new_tokens=24, do_sample=False, speculative_gamma=4, speculative_gamma_policy="constant")


@pytest.mark.parametrize("target_kind", sorted(TARGETS))
@pytest.mark.parametrize("behaviour", ["always_right", "partly_right", "never_right"])
def test_greedy_identity(target_kind, behaviour):
    target = gemma4_target(**TARGETS[target_kind])
    assistant = gemma4_assistant(target)
    settings = {
        "always_right": dict(),
        "partly_right": dict(context=0.05, roughness=0.03),
        "never_right": dict(shift=1),
    }[behaviour]
    mirror(target, assistant, **settings)
    ids = prompt(10, seed=1)
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    out = target.generate(ids, drafter=Gemma4AssistantDrafter(assistant), return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, plain)
    stats = out.speculative_stats
    assert stats.drafted_tokens > 0
    if behaviour == "always_right":
        assert stats.accepted_tokens == stats.drafted_tokens
    elif behaviour == "never_right":
        assert stats.accepted_tokens == 0
    else:
        assert 0 < stats.accepted_tokens < stats.drafted_tokens


@pytest.mark.parametrize("window", [64, 8])
@pytest.mark.parametrize("target_kind", sorted(TARGETS))
def test_drafts_are_transformers_on_the_accepted_context(target_kind, window):
    """Every round's drafts are those of transformers' generator fed the accepted context; with a window shorter
    than the sequence, the sliding layers read the window the target's cache keeps."""
    target = gemma4_target(window=window, **TARGETS[target_kind])
    assistant = gemma4_assistant(target)
    mirror(target, assistant, context=0.05, roughness=1.0)  # drafts depend on the keys, values and hidden state
    ids = prompt(10, seed=2)
    out, (drafter,) = recorded_generate(target, Recorder(assistant), ids, **GREEDY)
    assert len(drafter.log) >= 5  # with window 8 the sequence (34 tokens) outgrows the window
    for sequence, drafts, _ in drafter.log:
        assert drafts == transformers_drafts(target, assistant, sequence, len(drafts))


def test_first_round_drafts_are_generate_assistant_models(monkeypatch):
    """transformers' own `generate(assistant_model=...)` drafts the same tokens after the prompt's prefill."""
    target = gemma4_target(enabled=False)
    assistant = gemma4_assistant(target)
    mirror(target, assistant, context=0.05, roughness=1.0)
    assistant.generation_config.num_assistant_tokens = 4
    ids = prompt(10, seed=3)
    seen = []
    original = SinglePositionMultiTokenCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        candidates, logits = original(self, input_ids, *args, **kwargs)
        if candidates.shape[1] > input_ids.shape[1]:
            seen.append(candidates[0, input_ids.shape[1] :].tolist())
        return candidates, logits

    monkeypatch.setattr(SinglePositionMultiTokenCandidateGenerator, "get_candidates", recording)
    transformers_out = target.generate(ids, assistant_model=assistant, max_new_tokens=8, do_sample=False)
    monkeypatch.undo()
    assert seen and transformers_out.shape[1] == ids.shape[1] + 8
    hf_specdec.enable(target)
    _, (drafter,) = recorded_generate(target, Recorder(assistant), ids, **GREEDY)
    assert drafter.log[0][1] == seen[0]


def test_static_cache_drafts_as_the_dynamic_cache():
    target = gemma4_target(**KV_SHARED)
    assistant = gemma4_assistant(target)
    mirror(target, assistant, context=0.05, roughness=1.0)
    ids = prompt(10, seed=4)
    plain = target.generate(ids, max_new_tokens=24, do_sample=False, cache_implementation="static")
    static, (static_drafter,) = recorded_generate(
        target, Recorder(assistant), ids, cache_implementation="static", **GREEDY
    )
    _, (dynamic_drafter,) = recorded_generate(target, Recorder(assistant), ids, **GREEDY)
    assert torch.equal(static.sequences, plain)
    assert [entry[1] for entry in static_drafter.log] == [entry[1] for entry in dynamic_drafter.log]


def test_left_padded_batch_rows_draft_as_alone():
    """Rows are decoded one at a time; a left-padded row masks its padding and drafts at its own positions, exactly
    as the same prompt alone."""
    target = gemma4_target()
    assistant = gemma4_assistant(target)
    mirror(target, assistant, context=0.05, roughness=1.0)
    ids = torch.cat([prompt(10, seed=5), prompt(10, seed=6)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    batch = dict(input_ids=ids, attention_mask=mask)
    plain = target.generate(**batch, max_new_tokens=24, do_sample=False)
    out, rows = recorded_generate(target, Recorder(assistant), batch, **GREEDY)
    assert torch.equal(out.sequences, plain)
    _, (alone,) = recorded_generate(target, Recorder(assistant), ids[1:, 3:], **GREEDY)
    assert [entry[1] for entry in rows[1].log] == [entry[1] for entry in alone.log]


def sampled(target, ids, config, count, **kwargs):
    torch.manual_seed(4321)
    return [
        tuple(target.generate(ids, do_sample=True, max_new_tokens=3, **config, **kwargs)[0, ids.shape[1] :].tolist())
        for _ in range(count)
    ]


class ArgmaxWithRawQ(Gemma4AssistantDrafter):
    """transformers' sampling with this assistant: it drafts the argmax and reports q = softmax(raw logits)."""

    def _drafted(self, logits, prefix):
        q = logits.float().softmax(dim=-1)
        return q.argmax(dim=-1, keepdim=True), q, torch.tensor(True)


def test_sampling_follows_the_target():
    """γ = 2: after the prefill's first token, one round drafts tokens 2 and 3. Chi-square against the exact
    distribution of the three tokens; power: the same test rejects transformers' q (argmax drafts verified against
    the softmax of the raw logits, a distribution they were not drawn from)."""
    target = gemma4_target(seed=3)
    assistant = gemma4_assistant(target)
    mirror(target, assistant, context=0.05, roughness=0.03)
    config = dict(temperature=0.9, top_k=3)
    ids = prompt(6, seed=11)
    table = exact_distribution(target, ids, config, length=3)
    run = dict(speculative_gamma=2, speculative_gamma_policy="constant")
    samples = sampled(target, ids, config, 600, drafter=Gemma4AssistantDrafter(assistant), **run)
    assert goodness_of_fit(table, samples) > 1e-3
    wrong = sampled(target, ids, config, 300, drafter=ArgmaxWithRawQ(assistant), **run)
    assert goodness_of_fit(table, [outcome for outcome in wrong if outcome in table]) < 1e-3


def test_sampling_proposals_carry_the_q_they_were_drawn_from():
    """Each draft's q is the softmax of the assistant's logits standardized by the target's processors (top_k=3
    leaves three tokens), a distribution giving its token q(x) > 0."""
    target = gemma4_target()
    assistant = gemma4_assistant(target)
    mirror(target, assistant, context=0.05, roughness=0.03)
    ids = prompt(8, seed=12)
    torch.manual_seed(0)
    _, (drafter,) = recorded_generate(
        target, Recorder(assistant), ids, do_sample=True, temperature=0.8, top_k=3, max_new_tokens=12
    )
    assert drafter.log
    for _, tokens, probs in drafter.log:
        assert probs.shape == (1, len(tokens), VOCAB)
        assert torch.allclose(probs.sum(-1), torch.ones(1, len(tokens)))
        assert ((probs > 0).sum(-1) == 3).all()
        assert (probs[0, torch.arange(len(tokens)), tokens] > 0).all()


def test_registered_name_and_default_gamma():
    target = gemma4_target()
    assistant = gemma4_assistant(target)
    mirror(target, assistant)
    assistant.generation_config.num_assistant_tokens = 3
    assert is_gemma4_assistant(assistant) and not is_gemma4_assistant(target)
    assert Gemma4AssistantDrafter(assistant).default_gamma == 3
    ids = prompt(8, seed=13)
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    out = target.generate(
        ids,
        drafter="gemma4_assistant",
        drafter_kwargs={"assistant_model": assistant},
        max_new_tokens=12,
        do_sample=False,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    assert out.speculative_stats.accepted_tokens == out.speculative_stats.drafted_tokens > 0


def gemma3n_target():
    torch.manual_seed(0)
    config = Gemma3nTextConfig(
        vocab_size=VOCAB,
        vocab_size_per_layer_input=VOCAB,
        hidden_size=HIDDEN,
        hidden_size_per_layer_input=8,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.0] * 4,
        num_kv_shared_layers=2,
        laurel_rank=8,
        sliding_window=64,
        eos_token_id=None,
    )
    return hf_specdec.enable(Gemma3nForCausalLM(config).eval())


MISFITS = {
    "backbone": (
        lambda target: gemma4_assistant(target, backbone=32),
        r"Gemma4AssistantForCausalLM was built for a target of hidden size 32 \(`config.backbone_hidden_size`\), but "
        r"Gemma4ForCausalLM\w* has hidden size 64",
    ),
    "head_size": (
        lambda target: gemma4_assistant(target, head_dim=8, global_head_dim=8),
        r"Gemma4AssistantForCausalLM's layer 0 \(sliding_attention\) attends with 2 key/value heads of size 8, but "
        r"Gemma4ForCausalLM\w*'s layer 0, whose keys and values it reads, has 2 heads of size 16",
    ),
    "vocabulary": (
        lambda target: gemma4_assistant(target, vocab_size=VOCAB + 32),
        r"Gemma4AssistantForCausalLM has a vocabulary of 128 tokens but Gemma4ForCausalLM\w* has 96 logits",
    ),
}


@pytest.mark.parametrize("misfit", sorted(MISFITS))
def test_an_assistant_that_does_not_fit_its_target_is_refused(misfit):
    build, message = MISFITS[misfit]
    target = gemma4_target()
    with pytest.raises(ValueError, match=message):
        target.generate(prompt(6), drafter=Gemma4AssistantDrafter(build(target)), max_new_tokens=4)


def test_a_target_without_sliding_layers_is_refused():
    target = gemma4_target(layer_types=["full_attention"] * 2)
    with pytest.raises(ValueError, match=r"stores none for \['sliding_attention'\] \(its `layer_types` are "):
        target.generate(prompt(6), drafter=Gemma4AssistantDrafter(gemma4_assistant(target)), max_new_tokens=4)


@pytest.mark.parametrize("kind", ["gemma3n", "llama"])
def test_targets_that_share_no_key_value_states_are_refused(kind):
    target = gemma3n_target() if kind == "gemma3n" else hf_specdec.enable(tiny_model("llama", hidden_size=HIDDEN))
    assistant = gemma4_assistant(gemma4_target())
    name = {"gemma3n": r"Gemma3nForCausalLM\w* \(gemma3n_text\)", "llama": r"LlamaForCausalLM\w* \(llama\)"}[kind]
    with pytest.raises(ValueError, match=rf"`shared_kv_states`.*but {name} returns none, so transformers' own"):
        target.generate(prompt(6), drafter=Gemma4AssistantDrafter(assistant), max_new_tokens=4)


def test_other_models_and_decoding_methods_are_refused():
    target = gemma4_target()
    assistant = gemma4_assistant(target)
    with pytest.raises(TypeError, match=r"`assistant_model` must be a Gemma 4 assistant .*, got Gemma4ForCausalLM"):
        Gemma4AssistantDrafter(target)
    drafter = Gemma4AssistantDrafter(assistant)
    # token trees compact the cache, which the target's sliding layers forbid; beam search needs a beam-searching
    # draft model
    with pytest.raises(ValueError, match=r"Token trees need a cache that keeps every position"):
        target.generate(prompt(6), drafter=drafter, speculative_tree_budget=8, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"needs a draft model that can run beam search of its own"):
        target.generate(prompt(6), drafter=drafter, num_beams=2, max_new_tokens=4)
