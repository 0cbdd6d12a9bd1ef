"""MtpDrafter: a checkpoint's multi-token-prediction layers as the drafter. Greedy identity (always, partly and never
right), drafts equal to transformers' own `MtpModel` (from scratch, and per round against `generate(use_mtp=True)` on a
checkpoint), sampling against the exactly enumerated target with a power check, sharing the target's embeddings and
head, and the refusals. Tiny DeepSeek-V3 targets built from configs, fp32."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import VOCAB, prompt, tiny_model
from test_sampling_distribution import exact_distribution, goodness_of_fit, processors
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import MtpCache
from transformers.modeling_layers import MtpModel

import hf_specdec
from hf_specdec.drafters.mtp import MtpDrafter


def deepseek_config(num_mtp_layers: int = 1, **overrides):
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=2,  # dense decoder layers; the MTP layers are MoE (`get_mtp_config`)
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        num_mtp_layers=num_mtp_layers,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    kwargs.update(overrides)
    return AutoConfig.for_model("deepseek_v3", **kwargs)


def deepseek(num_mtp_layers: int = 1, seed: int = 0):
    """A tiny DeepSeek-V3 target and its MTP layers (random weights: `MtpModel` leaves its experts uninitialized)."""
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(deepseek_config(num_mtp_layers)).eval()
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(8.0)  # sharp argmaxes: float noise never decides a draft
        # a final norm that is not the identity: the hidden states before and after it differ even after `hnorm`
        target.model.norm.weight.copy_(torch.rand(target.config.hidden_size, generator=generator) + 0.5)
    mtp = MtpModel(target, num_mtp_layers).eval()
    with torch.no_grad():
        for name, weight in mtp.layers.named_parameters():
            if name.endswith("norm.weight"):
                weight.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                weight.zero_()
            else:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.1)
    return hf_specdec.enable(target), mtp


def make_bigram(target, mtp, context: float = 0.0, roughness: float = 0.0, seed: int = 7):
    """With `context=0` the target's next token is a function of its current token (attention and MLP outputs
    zeroed), and each MTP layer hands the embedding of the token it reads straight to the head through the target's
    final norm: it predicts exactly what the target will. `context` keeps some of the target's attention (then it
    sometimes departs from the bigram); `roughness` adds noise on the hidden-state half of each layer's projection and
    on its attention output (then the drafts depend on the hidden states and the caches)."""
    hidden = target.config.hidden_size
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(context)
            layer.mlp.down_proj.weight.zero_()
        for layer in mtp.layers:
            projection = layer.eh_proj.weight  # [hidden, 2 hidden]: the embedding half first, then the hidden state
            projection.zero_()
            projection[:, :hidden] = torch.eye(hidden)
            projection[:, hidden:] = torch.randn(hidden, hidden, generator=generator) * roughness
            block = layer.mtp_block
            block.self_attn.o_proj.weight.copy_(torch.randn(block.self_attn.o_proj.weight.shape, generator=generator))
            block.self_attn.o_proj.weight.mul_(roughness)
            block.mlp.experts.down_proj.zero_()
            block.mlp.shared_experts.down_proj.weight.zero_()
            layer.post_norm.weight.copy_(target.model.norm.weight)


@torch.no_grad()
def transformers_drafts(target, mtp, sequence: torch.LongTensor, logits_processor=None) -> list[int]:
    """The greedy drafts transformers' `MtpModel.forward` makes after `sequence` (`[1, n]`), from a fresh cache: the
    target's `last_hidden_state` at positions 0..n-2 and tokens 1..n-1 at positions 1..n-1, as
    `MTPCandidateGenerator` feeds it after a prefill (with the target's processors, if any, as it applies them)."""
    length = sequence.shape[1]
    hidden = target.model(sequence).last_hidden_state[:, : length - 1]
    drafts, _, _ = mtp(
        input_ids=sequence[:, 1:],
        last_hidden_states=hidden,
        attention_mask=None,
        position_ids=torch.arange(1, length)[None],
        mtp_cache=MtpCache(config=mtp.config),  # the MTP config (`get_mtp_config()`) the layers were built from
        do_sample=False,
        logits_processor=logits_processor,
        full_input_ids=sequence,
    )
    return drafts[0].tolist()


class Recorder(MtpDrafter):
    """Records each non-empty proposal: the sequence it followed and its tokens; with `fed` (a list the MTP layer
    calls are recorded into), also each proposal's calls, as `self.calls`."""

    fed: list | None = None

    def reset(self, context):
        super().reset(context)
        self.log, self.calls = [], []

    def propose(self, input_ids, num_tokens, attention_mask=None):
        start = len(self.fed) if self.fed is not None else 0
        proposal = super().propose(input_ids, num_tokens, attention_mask)
        if proposal.tokens.shape[1]:
            self.log.append((input_ids.clone(), proposal.tokens[0].tolist()))
            self.calls.append(
                (input_ids[0].tolist() + proposal.tokens[0].tolist(), self.fed[start:] if self.fed else [])
            )
        return proposal


def recorded_generate(target, drafter: Recorder, ids, **kwargs):
    """`generate` with `drafter`; returns the output and the per-call copy the loop used (with its log)."""
    copies = []
    original = drafter.for_call
    drafter.for_call = lambda context: copies.append(original(context)) or copies[-1]
    out = target.generate(ids, drafter=drafter, return_dict_in_generate=True, **kwargs)
    return out, copies[0]


def call_context(target, ids, logits_processor=None, do_sample=False) -> hf_specdec.DraftContext:
    """What a `generate` call hands a drafter, built by hand to drive one directly."""
    return hf_specdec.DraftContext(
        target=target,
        input_ids=ids,
        logits_processor=logits_processor if logits_processor is not None else LogitsProcessorList(),
        generation_config=GenerationConfig(do_sample=do_sample),
        vocab_size=VOCAB,
    )


GREEDY = dict(max_new_tokens=25, do_sample=False, speculative_gamma_policy="constant")


@pytest.mark.parametrize("num_mtp_layers, gamma", [(1, 1), (1, 3), (2, 2), (2, 4)])
def test_greedy_identity_always_right(num_mtp_layers, gamma):
    target, mtp = deepseek(num_mtp_layers)
    make_bigram(target, mtp)
    ids = prompt(7, seed=1)
    plain = target.generate(ids, max_new_tokens=25, do_sample=False)
    out = target.generate(ids, drafter=MtpDrafter(mtp), speculative_gamma=gamma, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(plain, out.sequences)
    stats = out.speculative_stats
    assert stats.accepted_tokens == stats.drafted_tokens >= 12
    # the first round is the prompt's prefill (no hidden states yet); every later round accepts all it drafted
    assert stats.target_calls <= 1 + -(-24 // (gamma + 1))


@pytest.mark.parametrize("num_mtp_layers", [1, 2, 3])
def test_greedy_identity_partly_right_and_drafts_are_transformers(num_mtp_layers):
    """Every proposal's first L drafts (L MTP layers) are those transformers' `MtpModel` makes from scratch: the
    incremental caches, cropped after each rejection, are exact. Past L the layers are reused (not compared)."""
    target, mtp = deepseek(num_mtp_layers, seed=num_mtp_layers)
    make_bigram(target, mtp, context=1.0, roughness=0.05)
    accepted = drafted = partial_rounds = 0
    for gamma, seed in [(1, 2), (num_mtp_layers, 3), (num_mtp_layers + 2, 4)]:
        ids = prompt(6, seed=seed)
        plain = target.generate(ids, max_new_tokens=25, do_sample=False)
        out, drafter = recorded_generate(target, Recorder(mtp), ids, speculative_gamma=gamma, **GREEDY)
        assert torch.equal(plain, out.sequences)
        for sequence, drafts in drafter.log:
            compared = min(len(drafts), num_mtp_layers)
            assert drafts[:compared] == transformers_drafts(target, mtp, sequence)[:compared], sequence.shape[1]
        stats = out.speculative_stats
        accepted, drafted = accepted + stats.accepted_tokens, drafted + stats.drafted_tokens
        partial_rounds += sum(stats.accepted_length_histogram[1:gamma])
    assert 0 < accepted < drafted
    if num_mtp_layers > 1:
        assert partial_rounds > 0  # some rounds kept only part of their drafts: the crops of the deeper layers ran


@pytest.mark.parametrize("num_mtp_layers", [1, 3])
def test_drafts_read_the_target_hidden_states_as_transformers(num_mtp_layers, monkeypatch):
    """Random MTP weights, so the drafts depend on the hidden states fed (the target's last hidden state, after its
    final norm) and on every layer's cache."""
    target, mtp = deepseek(num_mtp_layers, seed=10 + num_mtp_layers)
    ids = prompt(6, seed=5)
    fed = []  # (positions, tokens) of every MTP layer call
    forward_layer = mtp.forward_layer

    def recording(index, hidden, positions, cache, input_ids=None, **kwargs):
        fed.append((positions[0].tolist(), input_ids[0].tolist()))
        return forward_layer(index, hidden, positions, cache, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(mtp, "forward_layer", recording)
    recorder = Recorder(mtp)
    recorder.fed = fed
    out, drafter = recorded_generate(target, recorder, ids, speculative_gamma=num_mtp_layers + 1, **GREEDY)
    monkeypatch.undo()
    assert torch.equal(target.generate(ids, max_new_tokens=25, do_sample=False), out.sequences)
    assert len(drafter.log) >= 10
    for sequence, drafts in drafter.log:
        assert drafts[:num_mtp_layers] == transformers_drafts(target, mtp, sequence)[: len(drafts)]
    # every layer reads token x_p at position p, a draft past the context (RoPE alone would not notice a shift);
    # near max_length a proposal returns fewer drafts than the deeper layers read
    for sequence, calls in drafter.calls:
        assert calls
        for positions, tokens in calls:
            known = [p for p in positions if p < len(sequence)]
            assert tokens[: len(known)] == [sequence[p] for p in known]


class FavourTheNextId(LogitsProcessor):
    """A processor that reads the prefix: it favours the id after the last token's."""

    def __call__(self, input_ids, scores):
        bonus = torch.zeros_like(scores).scatter_(-1, (input_ids[:, -1:] + 1) % scores.shape[-1], 6.0)
        return scores + bonus


def test_drafts_are_standardized_with_their_own_prefix_as_transformers():
    """A processor that reads the prefix sees each draft's own, drafts included: the drafts are transformers'."""
    target, mtp = deepseek(2, seed=4)
    make_bigram(target, mtp, context=1.0, roughness=0.05)
    ids = prompt(6, seed=6)
    processor = LogitsProcessorList([FavourTheNextId()])
    run = dict(GREEDY, logits_processor=processor)
    out, drafter = recorded_generate(target, Recorder(mtp), ids, speculative_gamma=3, **run)
    plain = target.generate(ids, max_new_tokens=25, do_sample=False, logits_processor=processor)
    assert torch.equal(plain, out.sequences)
    assert len(drafter.log) >= 6 and 0 < out.speculative_stats.accepted_tokens
    for sequence, drafts in drafter.log:
        assert drafts[:2] == transformers_drafts(target, mtp, sequence, processor)[: len(drafts)]


def test_greedy_identity_never_right():
    target, mtp = deepseek(2)
    with torch.no_grad():
        for layer in mtp.layers:
            layer.post_norm.weight.zero_()  # zero logits: every draft is token 0 (the first of the ties)
        target.get_output_embeddings().weight[0].zero_()  # which the target, with other logits > 0, never emits
    ids = prompt(9, seed=4)
    plain = target.generate(ids, max_new_tokens=25, do_sample=False)
    out = target.generate(ids, drafter=MtpDrafter(mtp), speculative_gamma=3, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(plain, out.sequences) and 0 not in plain[0, ids.shape[1] :].tolist()
    assert out.speculative_stats.drafted_tokens > 20 and out.speculative_stats.accepted_tokens == 0


def test_default_policy_and_plain_steps_stay_exact():
    """The default γ policy takes plain steps and shadow drafts (a proposal that is never verified): the layers'
    caches follow, and the output is plain generate's."""
    target, mtp = deepseek(2, seed=2)
    make_bigram(target, mtp, context=1.0, roughness=0.05)
    for seed in (1, 2):
        ids = prompt(6, seed=seed)
        plain = target.generate(ids, max_new_tokens=30, do_sample=False)
        assert torch.equal(plain, target.generate(ids, drafter=MtpDrafter(mtp), max_new_tokens=30, do_sample=False))


def test_drafter_shares_the_target_embeddings_and_head():
    target, mtp = deepseek(1)
    drafter = MtpDrafter(mtp).for_call(call_context(target, prompt(5)))
    model = drafter.model
    assert model.embed_tokens.weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    assert model.shared_head.weight.data_ptr() == target.get_output_embeddings().weight.data_ptr()
    assert drafter.final_norm is target.model.norm


def sampled(target, ids, config, count, **kwargs):
    torch.manual_seed(4321)
    return [
        tuple(target.generate(ids, do_sample=True, max_new_tokens=5, **config, **kwargs)[0, ids.shape[1] :].tolist())
        for _ in range(count)
    ]


def accept_every_draft(monkeypatch) -> None:
    """A wrong sampler for power checks: both verification rules (token-wise, and block, which verifies sampled drafts
    by default) replaced, wherever the loop imported them from, by one that accepts every draft and draws the bonus
    token from the target."""
    rules = (hf_specdec.sampling.verify_sampling, hf_specdec.block_verification.verify_block)

    def accept_all(tokens, probs, target_probs, *args, **kwargs):
        accepted, _ = rules[0](tokens, probs, target_probs)
        return torch.full_like(accepted, tokens.shape[1]), hf_specdec.sampling.sample_tokens(
            target_probs[:, tokens.shape[1]]
        )

    for rule in rules:
        importers = [
            module
            for name, module in list(sys.modules.items())
            if name.startswith("hf_specdec.") and getattr(module, rule.__name__, None) is rule
        ]
        assert len(importers) > 1  # the rule's own module and the module that verifies a round
        for module in importers:
            monkeypatch.setattr(module, rule.__name__, accept_all)


def test_sampling_follows_the_target(monkeypatch):
    """Two MTP layers, γ = 3: after the prefill's first token, a round drafts tokens 2 and 3 with the two layers and
    token 4 with the first layer reused. Chi-square against the exact distribution of the five tokens; power: the
    same test rejects verification that accepts every draft."""
    target, mtp = deepseek(2, seed=3)
    make_bigram(target, mtp, context=0.5, roughness=0.02)  # about 4 in 5 drafts accepted
    config = dict(temperature=0.9, top_k=2)
    ids = prompt(6, seed=11)
    table = exact_distribution(target, ids, config, length=5)
    run = dict(drafter=MtpDrafter(mtp), speculative_gamma=3, speculative_gamma_policy="constant")
    assert goodness_of_fit(table, sampled(target, ids, config, 1000, **run)) > 1e-3

    # power: every draft accepted (the bonus token still from the target) is caught, at half the sample size
    accept_every_draft(monkeypatch)
    wrong = sampled(target, ids, config, 500, **run)
    monkeypatch.undo()
    # it emits drafts the target never samples (outside its top 2), which the test refuses; and on the samples
    # inside the target's support alone the chi-square rejects as well
    with pytest.raises(AssertionError, match="sampled outcomes the target gives probability 0"):
        goodness_of_fit(table, wrong)
    assert goodness_of_fit(table, [outcome for outcome in wrong if outcome in table]) < 1e-3


def test_sampling_proposals_carry_q_over_the_full_vocabulary():
    """q of the first draft is transformers' (softmax of its processed MTP logits); every q is a distribution giving
    its drafted token q(x) > 0."""
    target, mtp = deepseek(2, seed=3)
    ids = prompt(6, seed=3)
    config = dict(temperature=0.8, top_k=5)
    logits_processor = processors(target, ids, config)
    drafter = MtpDrafter(mtp).for_call(call_context(target, ids, logits_processor, do_sample=True))
    recorded = []  # what the round hands over: the last decoder layer's output (before the final norm)
    handle = target.model.layers[-1].register_forward_hook(lambda module, args, output: recorded.append(output))
    with torch.no_grad():
        target(ids)
    handle.remove()
    drafter.on_verified(ids, torch.tensor([0]), target_hidden_states=recorded[0][:, :-1])
    proposal = drafter.propose(ids, 3)
    assert proposal.tokens.shape == (1, 3) and proposal.probs.shape == (1, 3, VOCAB)
    assert bool((proposal.probs[0].gather(-1, proposal.tokens[0][:, None]) > 0).all())
    torch.testing.assert_close(proposal.probs.sum(-1), torch.ones(1, 3))
    with torch.no_grad():
        hidden = target.model(ids).last_hidden_state[:, :-1]
        _, logits, _ = mtp(
            input_ids=ids[:, 1:],
            last_hidden_states=hidden,
            attention_mask=None,
            position_ids=torch.arange(1, ids.shape[1])[None],
            mtp_cache=MtpCache(config=target.config.get_mtp_config()),
            do_sample=True,
            logits_processor=logits_processor,
            full_input_ids=ids,
        )
    torch.testing.assert_close(proposal.probs[:, 0], logits[:, 0].softmax(-1))


def checkpoint_with_mtp_layer(directory, context: float, roughness: float):
    """A DeepSeek-V3 checkpoint laid out as the published ones: 61 decoder layers (transformers finds DeepSeek-V3's MTP
    weights by the pattern `model.layers.61.*`), then the MTP layer under `model.layers.61.` with its `enorm`,
    `hnorm`, `eh_proj`, `shared_head.norm` (and the copies of the embeddings and head that checkpoints carry)."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    small = dict(hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_attention_heads=2)
    small.update(num_key_value_heads=2, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
    # layer 61 is the MTP layer's decoder block: an MoE layer, as the MTP config makes it
    model = AutoModelForCausalLM.from_config(
        deepseek_config(1, num_hidden_layers=62, first_k_dense_replace=61, **small)
    )
    hidden = model.config.hidden_size
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        for layer in model.model.layers[:61]:
            layer.self_attn.o_proj.weight.mul_(context)
            layer.mlp.down_proj.weight.zero_()
        block = model.model.layers[61]
        block.self_attn.o_proj.weight.mul_(roughness)
        block.mlp.experts.down_proj.zero_()
        block.mlp.shared_experts.down_proj.weight.zero_()
    model.save_pretrained(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    projection = torch.cat([torch.eye(hidden), torch.randn(hidden, hidden, generator=generator) * roughness], dim=1)
    tensors.update(
        {
            "model.layers.61.enorm.weight": torch.ones(hidden),
            "model.layers.61.hnorm.weight": torch.ones(hidden),
            "model.layers.61.eh_proj.weight": projection,
            "model.layers.61.shared_head.norm.weight": tensors["model.norm.weight"].clone(),
            "model.layers.61.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
            "model.layers.61.shared_head.head.weight": tensors["lm_head.weight"].clone(),
        }
    )
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["num_hidden_layers"] = 61
    (directory / "config.json").write_text(json.dumps(config))
    return tensors


def use_mtp_drafts(monkeypatch, model, ids, **kwargs) -> tuple[torch.LongTensor, list]:
    """transformers' own `generate(use_mtp=True)` on `model` (not enabled), recording each round's drafts: its output
    and `[(sequence length, drafts)]`."""
    from transformers.generation.candidate_generator import MTPCandidateGenerator

    log = []
    get_candidates = MTPCandidateGenerator.get_candidates

    def recording(self, input_ids, **candidate_kwargs):
        candidates, logits = get_candidates(self, input_ids, **candidate_kwargs)
        if candidates.shape[1] > input_ids.shape[1]:
            log.append((input_ids.shape[1], candidates[0, input_ids.shape[1] :].tolist()))
        return candidates, logits

    monkeypatch.setattr(MTPCandidateGenerator, "get_candidates", recording)
    try:
        return model.generate(ids, use_mtp=True, **kwargs), log
    finally:
        monkeypatch.undo()


def test_checkpoint_mtp_layers_load_and_draft_as_transformers_use_mtp(tmp_path, monkeypatch):
    """`drafter="mtp"` loads the checkpoint's MTP layer with transformers' loader (same keys, embeddings and head
    shared), and drafts per round exactly what `generate(use_mtp=True)` drafts."""
    tensors = checkpoint_with_mtp_layer(tmp_path, context=0.5, roughness=0.05)
    target = hf_specdec.enable(AutoModelForCausalLM.from_pretrained(tmp_path).eval())
    drafter = MtpDrafter.from_target(target)
    layer = drafter.mtp_model.layers[0]
    assert torch.equal(layer.eh_proj.weight, tensors["model.layers.61.eh_proj.weight"])
    assert torch.equal(layer.post_norm.weight, tensors["model.layers.61.shared_head.norm.weight"])
    assert torch.equal(layer.mtp_block.self_attn.q_proj.weight, tensors["model.layers.61.self_attn.q_proj.weight"])
    assert drafter.mtp_model.embed_tokens.weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    assert drafter.mtp_model.shared_head.weight.data_ptr() == target.get_output_embeddings().weight.data_ptr()

    ids = prompt(6, seed=2)
    plain = target.generate(ids, max_new_tokens=16, do_sample=False)
    plain_target = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # not enabled: transformers' own MTP
    theirs, theirs_log = use_mtp_drafts(monkeypatch, plain_target, ids, max_new_tokens=16, do_sample=False)
    out, ours = recorded_generate(
        target, Recorder(drafter.mtp_model), ids, speculative_gamma=1, **dict(GREEDY, max_new_tokens=16)
    )
    assert torch.equal(theirs, plain) and torch.equal(out.sequences, plain)
    ours_log = [(sequence.shape[1], drafts) for sequence, drafts in ours.log]
    assert ours_log == theirs_log[: len(ours_log)] and len(ours_log) >= 8  # ours stops drafting at max_length
    assert 0 < out.speculative_stats.accepted_tokens < out.speculative_stats.drafted_tokens
    by_name = target.generate(ids, drafter="mtp", speculative_gamma=2, **dict(GREEDY, max_new_tokens=16))
    assert torch.equal(by_name, plain)
    # on an enabled model, transformers' own request is served by this drafter
    requested = target.generate(ids, use_mtp=True, return_dict_in_generate=True, **dict(GREEDY, max_new_tokens=16))
    assert torch.equal(requested.sequences, plain) and requested.speculative_stats.drafted_tokens > 0


def test_targets_without_mtp_layers_are_refused(tmp_path):
    llama = hf_specdec.enable(tiny_model("llama"))
    with pytest.raises(
        ValueError, match=r'`drafter="mtp"` .*LlamaForCausalLM has none.*num_mtp_layers=None.*prompt_lookup'
    ):
        llama.generate(prompt(5), drafter="mtp", max_new_tokens=3)
    torch.manual_seed(0)
    no_layers = hf_specdec.enable(AutoModelForCausalLM.from_config(deepseek_config(0)).eval())
    with pytest.raises(ValueError, match=r"has none: its config declares none \(`num_mtp_layers=0`\)"):
        no_layers.generate(prompt(5), drafter="mtp", max_new_tokens=3)
    # declared, but built from a config: no checkpoint to load them from
    target, mtp = deepseek(1)
    with pytest.raises(ValueError, match=r"of DeepseekV3ForCausalLM: it was not loaded from a checkpoint .*mtp_model="):
        target.generate(prompt(5), drafter="mtp", max_new_tokens=3)
    # a checkpoint that declares MTP layers but does not hold them
    target.save_pretrained(tmp_path)
    loaded = hf_specdec.enable(AutoModelForCausalLM.from_pretrained(tmp_path).eval())
    with pytest.raises(ValueError, match=r"from its checkpoint \(`config.name_or_path=.*`\): RuntimeError: .*missing"):
        loaded.generate(prompt(5), drafter="mtp", max_new_tokens=3)
    other, _ = deepseek(1, seed=1)
    with pytest.raises(ValueError, match="`mtp_model` was not built for this DeepseekV3ForCausalLM"):
        other.generate(prompt(5), drafter=MtpDrafter(mtp), max_new_tokens=3)
    with pytest.raises(TypeError, match="`mtp_model` must be a `transformers.modeling_layers.MtpModel`, got"):
        MtpDrafter(target)
