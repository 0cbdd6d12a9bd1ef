"""EagleDrafter (EAGLE-3): exactness on several architectures, the hidden states the round hands over, sampling,
the published checkpoint layout both ways, refusals, and training with resume. Tiny targets built from configs."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from conftest import VOCAB, prompt, saved_target, tiny_config
from test_sampling_distribution import exact_distribution, goodness_of_fit, processors
from transformers import AutoConfig, AutoModelForCausalLM

import hf_specdec
from hf_specdec.distill import train_eagle_drafter
from hf_specdec.drafters.eagle import Eagle3DraftModel

ARCHS = ["gemma", "llama", "mistral", "qwen2", "qwen3"]


def eagle_target(arch: str = "llama", seed: int = 0, layers: int = 4):
    torch.manual_seed(seed)
    if arch == "qwen3":
        config = AutoConfig.for_model(
            "qwen3",
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            eos_token_id=None,
            bos_token_id=None,
            pad_token_id=None,
        )
    else:
        config = tiny_config(arch, num_hidden_layers=layers)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        setattr(model.generation_config, name, None)
    return hf_specdec.enable(model)


def own_samples(target, count: int = 24, length: int = 48, seed: int = 0) -> list[list[int]]:
    """The target's own sampled continuations of random prompts: what a head learns to predict."""
    torch.manual_seed(seed)
    sequences = []
    for i in range(count):
        ids = prompt(6, seed=100 + i)
        out = target.generate(ids, do_sample=True, max_new_tokens=length, temperature=0.7, top_k=0)
        sequences.append(out[0].tolist())
    return sequences


_TRAINED = {}


def trained_head(arch: str, steps: int = 40) -> hf_specdec.EagleDrafter:
    """A partly right head: trained briefly on the target's own text (cached per architecture)."""
    if arch not in _TRAINED:
        target = eagle_target(arch)
        _TRAINED[arch] = (
            target,
            train_eagle_drafter(
                target,
                texts=own_samples(target),
                num_steps=steps,
                batch_size=8,
                ttt_steps=3,
                learning_rate=3e-3,
                show_progress=False,
            ),
        )
    return _TRAINED[arch]


def always_right(target) -> hf_specdec.EagleDrafter:
    """A target whose logits are all zero (greedy: token 0, the first of the ties, every step) and a head whose draft
    vocabulary is token 0 alone."""
    with torch.no_grad():
        target.get_output_embeddings().weight.zero_()
    return hf_specdec.EagleDrafter.from_target(target, draft_token_ids=[0])


def greedy_pair(target, drafter, ids, **kwargs):
    # constant γ: a tiny target's rounds rarely pay on a CPU, and the default "auto" policy would stop drafting
    kwargs.setdefault("speculative_gamma_policy", "constant")
    plain = target.generate(ids, max_new_tokens=30, do_sample=False)
    out = target.generate(
        ids, drafter=drafter, max_new_tokens=30, do_sample=False, return_dict_in_generate=True, **kwargs
    )
    return plain, out.sequences, out.speculative_stats


@pytest.mark.parametrize("tree_budget", [None, 10])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identity_partly_right(arch, tree_budget):
    target, drafter = trained_head(arch)
    accepted = drafted = 0
    for seed in (1, 2, 3):
        plain, fast, stats = greedy_pair(target, drafter, prompt(7, seed=seed), speculative_tree_budget=tree_budget)
        assert torch.equal(plain, fast)
        accepted, drafted = accepted + stats.accepted_tokens, drafted + stats.drafted_tokens
    assert 0 < accepted < drafted


@pytest.mark.parametrize("tree_budget", [None, 10])
def test_greedy_identity_never_right(tree_budget):
    target = eagle_target("llama")
    drafter = hf_specdec.EagleDrafter.from_target(target, seed=3)
    plain, fast, stats = greedy_pair(target, drafter, prompt(9, seed=4), speculative_tree_budget=tree_budget)
    assert torch.equal(plain, fast)
    assert stats.drafted_tokens > 0


@pytest.mark.parametrize("tree_budget", [None, 10])
def test_greedy_identity_always_right(tree_budget):
    target = eagle_target("llama")
    drafter = always_right(target)
    plain, fast, stats = greedy_pair(
        target, drafter, prompt(9, seed=4), speculative_gamma=4, speculative_tree_budget=tree_budget
    )
    assert torch.equal(plain, fast)
    assert stats.accepted_tokens == stats.drafted_tokens > 20
    # the first round is the prompt's prefill (no features yet); every later round accepts all it drafted
    assert stats.target_calls <= 1 + -(-29 // 5)


class RecordingEagle(hf_specdec.EagleDrafter):
    def reset(self, context):
        super().reset(context)
        self.received = []

    def on_verified(self, input_ids, num_accepted, attention_mask=None, accepted_nodes=None, target_hidden_states=None):
        self.received.append(target_hidden_states)
        super().on_verified(input_ids, num_accepted, attention_mask, accepted_nodes, target_hidden_states)


@pytest.mark.parametrize("tree_budget", [None, 8])
def test_round_hands_over_the_hidden_states_of_the_kept_positions(tree_budget):
    target, trained = trained_head("llama")
    drafter = RecordingEagle(trained.model)
    calls = []
    original = drafter.for_call

    def for_call(context):
        copy = original(context)
        calls.append(copy)
        return copy

    drafter.for_call = for_call
    ids = prompt(7, seed=5)
    out = target.generate(ids, drafter=drafter, max_new_tokens=25, do_sample=False, speculative_tree_budget=tree_budget)
    handed = torch.cat(calls[0].received, dim=1)[0]  # [positions, 3h]
    layers = trained.model.config.eagle_layers
    with torch.no_grad():
        full = target(out, output_hidden_states=True).hidden_states
    expected = torch.cat([full[i][0] for i in layers], dim=-1)[: out.shape[1] - 1]  # every position but the last
    assert handed.shape == expected.shape
    torch.testing.assert_close(handed, expected, atol=2e-4, rtol=1e-3)


class ProposalLog(hf_specdec.EagleDrafter):
    """Records every non-empty proposal (sequence length, tokens) in the shared list `log`; with `eager`, also feeds
    the pending target features at plain steps (what the drafter did before it left them pending)."""

    log: list
    eager = False

    def propose(self, input_ids, num_tokens, attention_mask=None):
        if self.eager and num_tokens == 0:
            self._feed_context(input_ids)
        proposal = super().propose(input_ids, num_tokens, attention_mask)
        if num_tokens:
            self.log.append((input_ids.shape[1], proposal.tokens.tolist()))
        return proposal


class EveryThirdRound(hf_specdec.policies.GammaPolicy):
    """Drafts γ every third round and takes plain steps between."""

    def __init__(self, gamma, max_gamma):
        super().__init__(gamma, max_gamma)
        self.round = -1

    def next_gamma(self):
        self.round += 1
        return self.gamma if self.round % 3 == 0 else 0


@pytest.mark.parametrize("tree_budget", [None, 6])
def test_plain_steps_leave_the_features_pending_and_the_drafts_unchanged(tree_budget, monkeypatch):
    """At a plain step the head does not run: the target features wait and are fed in one forward when drafts are
    next asked for. The drafts are those of a head fed at every step, and the output is plain generate's."""
    # registered for this test only (the registry's list is part of other tests' error messages)
    monkeypatch.setitem(hf_specdec.policies._POLICIES._classes, "every_third_round", EveryThirdRound)
    target, trained = trained_head("llama")
    ids = prompt(7, seed=5)
    plain = target.generate(ids, max_new_tokens=30, do_sample=False)
    logs, forwards = {}, {}
    for eager in (False, True):
        drafter = ProposalLog(trained.model)
        drafter.log, drafter.eager = logs.setdefault(eager, []), eager
        counter = [0]
        handle = trained.model.register_forward_hook(lambda *args: counter.__setitem__(0, counter[0] + 1))
        try:
            out = target.generate(
                ids,
                drafter=drafter,
                max_new_tokens=30,
                do_sample=False,
                speculative_gamma_policy="every_third_round",
                speculative_tree_budget=tree_budget,
            )
        finally:
            handle.remove()
        assert torch.equal(out, plain)
        forwards[eager] = counter[0]
    assert logs[False] == logs[True] and len(logs[False]) >= 5
    assert forwards[False] < forwards[True]  # fewer head forwards: none at plain steps


def samples(model, ids, config, n, **kwargs):
    torch.manual_seed(4321)
    return [
        tuple(model.generate(ids, do_sample=True, max_new_tokens=3, **config, **kwargs)[0, ids.shape[1] :].tolist())
        for _ in range(n)
    ]


@pytest.mark.parametrize("tree_budget", [None, 6])
def test_sampling_follows_the_target(tree_budget):
    target, drafter = trained_head("llama")
    config = dict(temperature=0.9, top_k=3)
    ids = prompt(6, seed=11)
    table = exact_distribution(target, ids, config)
    drawn = samples(
        target,
        ids,
        config,
        1500,
        drafter=drafter,
        speculative_gamma=2,
        speculative_tree_budget=tree_budget,
        speculative_gamma_policy="constant",
    )
    assert goodness_of_fit(table, drawn) > 1e-3
    # power: at this sample size the test rejects a sampler that is slightly off (temperature 1.3 instead of 0.9)
    wrong = samples(target, ids, dict(config, temperature=1.3), 1500)
    assert goodness_of_fit(table, wrong) < 1e-3


def test_sampling_proposals_carry_q_over_the_full_vocabulary():
    target, drafter = trained_head("llama")
    ids = prompt(6, seed=3)
    context = hf_specdec.proposals.draft_context(
        target, ids, processors(target, ids, dict(temperature=0.8, top_k=5)), target.generation_config, {}, None
    )
    context.generation_config = target.generation_config.__class__(do_sample=True)
    copy = drafter.for_call(context)
    with torch.no_grad():
        full = target(ids, output_hidden_states=True).hidden_states
    features = torch.cat([full[i] for i in copy.target_hidden_layers], dim=-1)
    copy.on_verified(ids, torch.tensor([0]), target_hidden_states=features[:, :-1])
    proposal = copy.propose(ids, 3)
    assert proposal.probs.shape == (1, 3, VOCAB)
    drafted_q = proposal.probs[0].gather(-1, proposal.tokens[0][:, None])
    assert bool((drafted_q > 0).all())
    torch.testing.assert_close(proposal.probs.sum(-1), torch.ones(1, 3))


def test_save_and_load_give_the_same_drafts(tmp_path):
    target, drafter = trained_head("qwen2")
    drafter.save_pretrained(tmp_path)
    config = __import__("json").loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == drafter.model.config.draft_vocab_size
    assert "Eagle" in (tmp_path / "README.md").read_text() or "EAGLE" in (tmp_path / "README.md").read_text()
    loaded = hf_specdec.EagleDrafter.from_pretrained(tmp_path, target=target)
    ids = prompt(8, seed=6)
    run = dict(max_new_tokens=20, do_sample=False, return_dict_in_generate=True, speculative_gamma_policy="constant")
    first = target.generate(ids, drafter=drafter, **run)
    again = target.generate(ids, drafter=loaded, **run)
    by_name = target.generate(ids, drafter="eagle", drafter_kwargs={"pretrained": str(tmp_path)}, **run)
    assert torch.equal(first.sequences, again.sequences) and torch.equal(first.sequences, by_name.sequences)
    assert first.speculative_stats.accepted_length_histogram == again.speculative_stats.accepted_length_histogram
    assert first.speculative_stats.accepted_length_histogram == by_name.speculative_stats.accepted_length_histogram


def published_layout(target, draft_vocab: int = 40, seed: int = 0) -> tuple[dict, dict]:
    """A checkpoint written the way published EAGLE-3 heads are (random weights): `model.`-less names, a reduced
    vocabulary with d2t offsets, the target's embeddings included, SGLang's config keys."""
    text = target.config
    hidden, heads, kv = text.hidden_size, text.num_attention_heads, text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator) * 0.1

    hot = torch.randperm(VOCAB, generator=generator)[:draft_vocab].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[hot] = True
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(64, hidden),
        "midlayer.mlp.up_proj.weight": rand(64, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, 64),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(draft_vocab, hidden) * 30,
        "d2t": hot - torch.arange(draft_vocab),
        "t2d": t2d,
        "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 64,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": VOCAB,
        "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
    }
    return config, tensors


@pytest.mark.parametrize("file_format", ["safetensors", "bin"])
def test_published_layout_loads_and_decodes_exactly(tmp_path, file_format):
    import json

    from safetensors.torch import save_file

    target = eagle_target("llama")
    config, tensors = published_layout(target)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if file_format == "safetensors":
        save_file(tensors, str(tmp_path / "model.safetensors"))
    else:
        torch.save(tensors, tmp_path / "pytorch_model.bin")
    drafter = hf_specdec.EagleDrafter.from_pretrained(tmp_path, target=target)
    model = drafter.model
    assert model.config.eagle_layers == [1, 2, 3]
    assert torch.equal(model.hot_ids.cpu(), tensors["d2t"] + torch.arange(40))
    torch.testing.assert_close(model.fc.weight, tensors["fc.weight"])
    assert model.embed_tokens is not None
    for budget in (None, 6):
        plain, fast, stats = greedy_pair(target, drafter, prompt(8, seed=9), speculative_tree_budget=budget)
        assert torch.equal(plain, fast)
        assert stats.drafted_tokens > 0


class _Exploit:
    def __reduce__(self):
        return (exec, ("open('/tmp/hf_specdec_pwned', 'w').write('x')",))


def test_bin_heads_never_unpickle_code(tmp_path):
    import json
    import os

    target = eagle_target("llama")
    config, tensors = published_layout(target)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with open(tmp_path / "pytorch_model.bin", "wb") as file:
        pickle.dump({"fc.weight": _Exploit()}, file)
    if os.path.exists("/tmp/hf_specdec_pwned"):
        os.remove("/tmp/hf_specdec_pwned")
    with pytest.raises(OSError, match="weights_only=True"):
        hf_specdec.EagleDrafter.from_pretrained(tmp_path, target=target)
    assert not os.path.exists("/tmp/hf_specdec_pwned")


@pytest.mark.parametrize(
    "change, message",
    [
        ("hidden", r"hidden states of size 48, the target's are 32"),
        ("vocab", r"vocabulary of 100 tokens, the target has 96"),
    ],
)
def test_heads_that_do_not_fit_the_target_are_refused(tmp_path, change, message):
    import json

    from safetensors.torch import save_file

    target = eagle_target("llama")
    config, tensors = published_layout(target)
    if change == "hidden":
        config["target_hidden_size"] = 48
        tensors["fc.weight"] = torch.zeros(32, 3 * 48)
    else:
        config["vocab_size"] = 100
        tensors["t2d"] = torch.zeros(100, dtype=torch.bool)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        hf_specdec.EagleDrafter.from_pretrained(tmp_path, target=target)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="exactly one of `model`"):
        hf_specdec.EagleDrafter()
    with pytest.raises(ValueError, match="tree_top_k"):
        hf_specdec.EagleDrafter(pretrained=tmp_path, tree_top_k=0)
    with pytest.raises(TypeError, match=r"Unknown option\(s\) \['tree_topk'\] for EagleDrafter"):
        hf_specdec.EagleDrafter(pretrained=tmp_path, tree_topk=2)
    target = eagle_target("llama")
    with pytest.raises(OSError, match="no config.json"):
        hf_specdec.EagleDrafter.from_pretrained(tmp_path, target=target)
    with pytest.raises(ValueError, match="draft_token_ids"):
        hf_specdec.EagleDrafter.from_target(target, draft_token_ids=[1, 1, 2])
    for fractional in ([1.7, 2.2, 3.9], torch.tensor([1.0, 2.0])):  # were truncated to ids without a word
        with pytest.raises(ValueError, match=r"`draft_token_ids` must be integer token ids, got a torch.float"):
            hf_specdec.EagleDrafter.from_target(target, draft_token_ids=fractional)
    with pytest.raises(ValueError, match="needs a budget"):
        train_eagle_drafter(target, texts=[[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="tokenizer"):
        train_eagle_drafter(target, prompts=["hi"], num_steps=1)


def test_a_left_padded_batch_is_decoded_row_by_row_exactly():
    target, drafter = trained_head("llama")
    ids = torch.cat([prompt(6, seed=1), prompt(6, seed=2)])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = target.generate(ids, attention_mask=mask, drafter=drafter, max_new_tokens=12, do_sample=False)
    assert torch.equal(plain, out)


def test_training_lowers_the_loss_and_resumes(tmp_path):
    import json

    target = eagle_target("llama", seed=2)
    texts = own_samples(target, count=12, length=32, seed=1)
    drafter = train_eagle_drafter(
        target,
        texts=texts,
        num_steps=16,
        batch_size=4,
        ttt_steps=2,
        learning_rate=3e-3,
        output_dir=tmp_path,
        save_every=8,
        show_progress=False,
    )
    log = json.loads((tmp_path / "training_log.json").read_text())["log"]
    assert log[-1]["loss"] < log[0]["loss"]
    assert (tmp_path / "checkpoint-8" / "model.safetensors").exists()
    assert drafter.training_info["steps"] == 16
    resumed = train_eagle_drafter(
        target,
        texts=texts,
        num_steps=20,
        batch_size=4,
        ttt_steps=2,
        output_dir=tmp_path,
        resume_from_checkpoint=True,
        show_progress=False,
    )
    assert resumed.training_info["steps"] == 20  # 16 done before, 4 more
    assert isinstance(resumed.model, Eagle3DraftModel)
    plain, fast, _ = greedy_pair(target, resumed, prompt(8, seed=3))
    assert torch.equal(plain, fast)


def test_each_batch_reads_the_features_at_the_heads_layers_from_a_copy_in_feature_dtype():
    """Features and target logits come from one forward per training batch (right-padded), at the head's layers, by
    a copy of the target in `feature_dtype`; the user's model is neither converted nor left with hooks."""
    from hf_specdec.capture import HiddenStateCapture
    from hf_specdec.eagle_data import batch_reader

    target = eagle_target("llama", seed=2)
    texts = own_samples(target, count=6, length=12, seed=1)
    texts[1] = texts[1][:9]  # rows of different lengths: padding on the right
    layers = [1, 2, 3]
    hot = torch.arange(0, VOCAB, 2)
    masks = [torch.ones(len(ids), dtype=torch.bool) for ids in texts]
    sequences = [(ids, 1) for ids in texts]
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 0.1)):
        reader = copy.deepcopy(target).to(dtype)
        with HiddenStateCapture(reader, layers) as capture:
            ids, features, logits, in_draft, loss_mask = batch_reader(reader, capture, hot, masks, sequences)([0, 1, 2])
        for row, i in enumerate([0, 1, 2]):
            n = len(texts[i])
            with torch.no_grad():
                out = target(torch.tensor([texts[i]]), output_hidden_states=True)
            expected = torch.cat([out.hidden_states[layer][0] for layer in layers], dim=-1)
            assert torch.equal(ids[row, :n], torch.tensor(texts[i])) and loss_mask[row, :n].all()
            assert not loss_mask[row, n:].any()
            assert features.dtype == torch.float32 and features.shape[-1] == 3 * target.config.hidden_size
            scale = expected.abs().max()
            assert (features[row, :n] - expected).abs().max() <= tolerance * scale
            assert (logits[row, :n] - out.logits[0][:, hot]).abs().max() <= tolerance * out.logits.abs().max()
            if dtype == torch.float32:
                assert torch.equal(in_draft[row, :n], out.logits[0].argmax(-1) % 2 == 0)
    before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    hooks = [dict(module._forward_hooks) for module in target.modules()]  # transformers' own, from the forwards above
    drafter = train_eagle_drafter(
        target, texts=texts, num_steps=3, batch_size=2, ttt_steps=2, feature_dtype="bfloat16", show_progress=False
    )
    assert drafter.training_info["steps"] == 3
    assert target.dtype == torch.float32
    assert all(torch.equal(before[name], tensor) for name, tensor in target.state_dict().items())
    train_eagle_drafter(target, texts=texts, num_steps=1, batch_size=2, ttt_steps=1, show_progress=False)  # reads
    assert [dict(module._forward_hooks) for module in target.modules()] == hooks  # with the target: hooks gone
    plain, fast, _ = greedy_pair(target, drafter, prompt(8, seed=3))
    assert torch.equal(plain, fast)
    with pytest.raises(ValueError, match="`feature_dtype` 'half_float' is not a torch dtype"):
        train_eagle_drafter(target, texts=texts, num_steps=1, feature_dtype="half_float")


def test_a_text_longer_than_the_targets_positions_is_trained_on_in_pieces(tmp_path):
    """A text longer than the target's `max_position_embeddings` (here 48) would index past its positions (and a
    long one exhaust memory): it is split into consecutive pieces, each trained on as a sequence of its own."""
    from hf_specdec.eagle_data import DATA_NAME, load_sequences

    target = eagle_target("llama")
    target.config.max_position_embeddings = 48
    text = torch.randint(0, VOCAB, (110,), generator=torch.Generator().manual_seed(2)).tolist()
    train_eagle_drafter(
        target, texts=[text], num_steps=1, batch_size=2, ttt_steps=1, output_dir=tmp_path, show_progress=False
    )
    sequences, _, _ = load_sequences(tmp_path / DATA_NAME)
    assert [ids for ids, _ in sequences] == [text[:48], text[48:96], text[96:]]


def test_cli_trains_a_head_and_demos_it_on_a_local_model(tmp_path, local_tokenizer, capsys):
    from hf_specdec.cli import main

    saved_target(tmp_path, local_tokenizer)
    (tmp_path / "prompts.txt").write_text("the cat sat\na quick brown fox\n\ndef add(a, b):\n")
    (tmp_path / "text.txt").write_text("the dog sat on the log and the cat watches the fox " * 8)
    code = main(
        [
            "train-drafter",
            "--target",
            str(tmp_path / "target"),
            "--prompts",
            str(tmp_path / "prompts.txt"),
            "--texts",
            str(tmp_path / "text.txt"),
            "--output",
            str(tmp_path / "head"),
            "--steps",
            "4",
            "--ttt-steps",
            "2",
            "--max-answer-tokens",
            "12",
            "--threads",
            "1",
            "--feature-dtype",
            "bfloat16",
        ]
    )
    assert code == 0
    assert "EAGLE-3 head written to" in capsys.readouterr().out
    assert (tmp_path / "head" / "model.safetensors").exists()
    code = main(
        [
            "demo",
            "--model",
            str(tmp_path / "target"),
            "--eagle",
            str(tmp_path / "head"),
            "--max-new-tokens",
            "10",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--prompt",
            "the cat",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "EAGLE-3 head" in out and "identical: False" not in out
    assert (
        main(["train-drafter", "--target", str(tmp_path / "target"), "--output", str(tmp_path / "x"), "--steps", "1"])
        == 2
    )
    assert "needs data" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(
            [
                "train-drafter",
                "--target",
                str(tmp_path / "target"),
                "--output",
                str(tmp_path / "x"),
                "--steps",
                "1",
                "--synthetic-prompts",
                "-2",
            ]
        )
    assert "--synthetic-prompts: must be an int >= 0, got -2" in capsys.readouterr().err
    code = main(
        [
            "train-drafter",
            "--target",
            str(tmp_path / "target"),
            "--output",
            str(tmp_path / "y"),
            "--steps",
            "1",
            "--synthetic-prompts",
            "2",
            "--answer-dtype",
            "bfloat16",
        ]
    )
    assert code == 2  # the local tokenizer has no chat template to write prompts with
    assert "`num_synthetic_prompts` needs a tokenizer with a chat template" in capsys.readouterr().err


LAUNCHED = """
import sys, torch
from accelerate import Accelerator
from test_eagle import eagle_target, own_samples
from hf_specdec.distill import train_eagle_drafter
accelerator = Accelerator(cpu=True)
target = eagle_target("llama", seed=2)
texts = own_samples(target, count=8, length=16, seed=1)
drafter = train_eagle_drafter(target, texts=texts, num_steps=3, batch_size=2, ttt_steps=2, accelerator=accelerator,
                              show_progress=False)
# one file per process: the two processes' prints to one pipe can interleave within a line
with open(f"{sys.argv[1]}/rank{accelerator.process_index}.txt", "w") as out:
    out.write(f"{accelerator.num_processes} {float(drafter.model.fc.weight.detach().sum())!r}")
"""


def test_training_under_a_two_process_launch_keeps_the_processes_in_step(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED)
    tests = Path(__file__).parent
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    ranks = [(tmp_path / f"rank{rank}.txt").read_text().split() for rank in range(2)]
    assert [processes for processes, _ in ranks] == ["2", "2"]
    assert ranks[0][1] == ranks[1][1]  # gradients averaged: the same head on both processes


def test_the_target_writes_and_answers_its_own_prompts_in_another_dtype(local_tokenizer):
    """`num_synthetic_prompts` (Magpie): instructions sampled after the chat template's user-turn prefix, ended by its
    end-of-turn token, then answered like `prompts`; `answer_dtype` answers with a converted copy, never the model."""
    import copy

    from hf_specdec.eagle_data import synthetic_prompts

    tokenizer = copy.deepcopy(local_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}<eos>user {{ m['content'] }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}"
    )
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    target = AutoModelForCausalLM.from_config(config).eval()
    end = tokenizer.convert_tokens_to_ids("<eos>")
    with torch.no_grad():  # the end-of-turn token often enough that a few rows finish within 64 tokens
        target.get_output_embeddings().weight[end].mul_(4.0)
    target.generation_config.eos_token_id = None
    before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    torch.manual_seed(0)
    written = synthetic_prompts(target, tokenizer, 6, batch_size=8, show_progress=False)
    assert 1 <= len(written) <= 6 and len(set(written)) == len(written)
    assert all(len(text) >= 12 and "<eos>" not in text for text in written)
    drafter = train_eagle_drafter(
        target,
        tokenizer=tokenizer,
        num_synthetic_prompts=6,
        answer_dtype="bfloat16",
        max_answer_tokens=8,
        generation_batch_size=8,
        num_steps=2,
        batch_size=2,
        ttt_steps=2,
        show_progress=False,
    )
    assert "it wrote itself of 6 asked" in drafter.training_info["training data"]
    assert "answered in torch.bfloat16" in drafter.training_info["training data"]
    assert target.dtype == torch.float32  # answered by a copy: the model itself is untouched
    assert all(torch.equal(before[name], tensor) for name, tensor in target.state_dict().items())
    with pytest.raises(ValueError, match="`answer_dtype` 'bfloat' is not a torch dtype"):
        train_eagle_drafter(target, tokenizer=tokenizer, num_synthetic_prompts=2, answer_dtype="bfloat", num_steps=1)
    with pytest.raises(ValueError, match="`num_synthetic_prompts` must be an int >= 0, got -1"):
        train_eagle_drafter(target, tokenizer=tokenizer, num_synthetic_prompts=-1, num_steps=1)
    with pytest.raises(ValueError, match="`num_synthetic_prompts` needs a tokenizer with a chat template"):
        train_eagle_drafter(target, tokenizer=local_tokenizer, num_synthetic_prompts=2, num_steps=1)
