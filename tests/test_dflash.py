"""DFlashDrafter: a DFlash block drafter (transformers' `muse_glimmer_assistant`) proposing a block per forward from
the target's hidden states. Greedy identity (always, partly and never right) in chains, trees, a padded batch and a
static cache; drafts equal to transformers' own `DFlashTokenCandidateGenerator` per round; sampling against the
exactly enumerated target with a power check; a checkpoint saved in transformers' layout; the refusals. Tiny Llama
targets and tiny block drafters built from configs, fp32."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, prompt, tiny_model
from test_sampling_distribution import exact_distribution, goodness_of_fit, processors
from transformers import (
    AutoModel,
    AutoModelForImageTextToText,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MuseGlimmerAssistantConfig,
    MuseGlimmerAssistantModel,
    MuseGlimmerConfig,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator
from transformers.generation.utils import GenerationMixin

import hf_specdec
from hf_specdec.capture import HiddenStateCapture
from hf_specdec.drafters.dflash import DFlashDrafter

HIDDEN = 32
MASK = VOCAB - 1  # the block's mask token: a token of the target's vocabulary


def block_drafter(block_size: int = 4, target_layer_ids=(0, 3), seed: int = 0, num_hidden_layers: int = 2, **overrides):
    """A tiny DFlash block drafter with random weights (std 0.3: drafts that depend on everything fed)."""
    kwargs = dict(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        block_size=block_size,
        mask_token_id=MASK,
        target_layer_ids=list(target_layer_ids),
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        sliding_window=64,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(**kwargs)).eval()
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if not name.endswith("norm.weight"):
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.3)
    return model


def llama(seed: int = 0, num_hidden_layers: int = 4):
    return tiny_model("llama", seed=seed, num_hidden_layers=num_hidden_layers)


def muse_glimmer(seed: int = 0):
    """A tiny Muse Glimmer target, the family transformers' DFlash drafters are published for: its embeddings apply
    an `embed_norm` that DFlash embeds the block without; its logits are soft-capped (the drafts, read through the
    head alone as transformers reads them, are not)."""
    text = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4)
    text.update(num_key_value_heads=2, head_dim=8, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = MuseGlimmerConfig(
        text_config=dict(text, sliding_window=16),
        vision_config=dict(vision, pos_emb_height=4, pos_emb_width=4),
        out_hidden_size=HIDDEN,
        projector_hidden_size=HIDDEN,
        image_token_id=VOCAB - 2,
        video_token_id=VOCAB - 3,
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).eval()
    model.generation_config.eos_token_id = model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def make_bigram(target, drafter, cycle: list[int] | None = None, roughness: float = 0.0, seed: int = 7):
    """Makes the target a bigram model, x -> π(x) (attention and MLP outputs zeroed, head row π(x) = embedding of x;
    π is the identity but for the `cycle` it rotates), and makes the block drafter copy the anchor's embedding to
    every masked position (queries zero: each position averages the values, of which only the anchor's is not zero,
    since the mask token's embedding is zero and the projected context is scaled by `roughness`), so every draft is
    π(anchor). With `cycle=None` and `roughness=0` every draft is right; in a run through the cycle the drafts are
    wrong from the second on; `roughness` mixes the target's hidden states into the drafts."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        embeddings = target.get_input_embeddings().weight
        embeddings[MASK].zero_()
        image = list(range(VOCAB))
        for source, destination in zip(cycle or [], (cycle or [])[1:] + (cycle or [])[:1]):
            image[source] = destination
        head = target.get_output_embeddings().weight
        for source, destination in enumerate(image):
            head[destination] = embeddings[source] * 3.0
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        target.model.norm.weight.fill_(1.0)
        for layer in drafter.layers:
            attention = layer.self_attn
            attention.q_proj.weight.zero_()
            attention.v_proj.weight.copy_(torch.eye(HIDDEN))
            attention.o_proj.weight.copy_(torch.eye(HIDDEN))
            layer.mlp.down_proj.weight.zero_()
            for norm in (layer.input_layernorm, layer.post_attention_layernorm, attention.q_norm, attention.k_norm):
                norm.weight.fill_(1.0)
        drafter.norm.weight.fill_(1.0)
        drafter.encoder.output_norm_enc.weight.fill_(roughness)
        drafter.encoder.fc.weight.copy_(torch.randn(drafter.encoder.fc.weight.shape, generator=generator))
    return target, drafter


class Recorder(DFlashDrafter):
    """Records each non-empty proposal: the sequence length it followed, its tokens and its parents (or None)."""

    def reset(self, context):
        super().reset(context)
        self.log = []

    def propose(self, input_ids, num_tokens, attention_mask=None):
        proposal = super().propose(input_ids, num_tokens, attention_mask)
        if proposal.tokens.shape[1]:
            parents = None if proposal.parents is None else proposal.parents[0].tolist()
            self.log.append((input_ids.shape[1], proposal.tokens[0].tolist(), parents))
        return proposal


def recorded_generate(target, drafter: Recorder, ids, **kwargs):
    """`generate` with `drafter`; returns the output and the per-call copy the loop used (with its log)."""
    copies = []
    original = drafter.for_call
    drafter.for_call = lambda context: copies.append(original(context)) or copies[-1]
    out = target.generate(ids, drafter=drafter, return_dict_in_generate=True, **kwargs)
    return out, copies[0]


def transformers_drafts(target, drafter, ids, monkeypatch, **kwargs):
    """transformers' own DFlash run (`speculation_type="dflash"`, through transformers' `generate`, not
    hf_specdec's): its output and, per round, the sequence length and the block it drafted."""
    log = []
    get_candidates = DFlashTokenCandidateGenerator.get_candidates

    def recording(self, input_ids, **candidate_kwargs):
        candidates, logits = get_candidates(self, input_ids, **candidate_kwargs)
        if candidates.shape[1] > input_ids.shape[1]:
            log.append((input_ids.shape[1], candidates[0, input_ids.shape[1] :].tolist()))
        return candidates, logits

    monkeypatch.setattr(DFlashTokenCandidateGenerator, "get_candidates", recording)
    out = GenerationMixin.generate(target, ids, assistant_model=drafter, speculation_type="dflash", **kwargs)
    monkeypatch.undo()
    return out, log


GREEDY = dict(max_new_tokens=24, do_sample=False, speculative_gamma_policy="constant")


@pytest.mark.parametrize("block_size, gamma", [(2, 1), (4, 3), (4, 6)])
def test_greedy_identity_always_right(block_size, gamma):
    target, drafter = make_bigram(hf_specdec.enable(llama()), block_drafter(block_size))
    ids = prompt(7, seed=1)
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    out = target.generate(
        ids, drafter=DFlashDrafter(drafter), speculative_gamma=gamma, return_dict_in_generate=True, **GREEDY
    )
    assert torch.equal(plain, out.sequences)
    stats = out.speculative_stats
    # a block drafts block_size - 1 tokens, whatever γ asks; the prefill round drafts nothing
    assert stats.accepted_tokens == stats.drafted_tokens >= 10
    assert stats.target_calls <= 1 + -(-23 // block_size)


def test_greedy_identity_partly_right_in_chains_and_trees():
    """π rotates a cycle through the tokens the prompt starts from: inside it the drafts go wrong from the second on,
    and `roughness` mixes the target's hidden states in. Trees: one forward's block, branched from its top-k."""
    cycle = [5, 17, 60, 33, 81, 12]
    target, drafter = make_bigram(hf_specdec.enable(llama(seed=1)), block_drafter(5), cycle, roughness=0.1)
    totals = {"chain": [0, 0, 0], "tree": [0, 0, 0]}
    for seed, start in enumerate([cycle[0], 40, cycle[3]]):
        ids = torch.cat([prompt(5, seed=seed + 2), torch.tensor([[start]])], dim=-1)
        plain = target.generate(ids, max_new_tokens=24, do_sample=False)
        for layout, extra in (("chain", {}), ("tree", dict(speculative_tree_budget=8))):
            out, used = recorded_generate(target, Recorder(drafter), ids, speculative_gamma=4, **GREEDY, **extra)
            assert torch.equal(plain, out.sequences), (layout, seed)
            stats = out.speculative_stats
            totals[layout][0] += stats.accepted_tokens
            totals[layout][1] += stats.drafted_tokens
            totals[layout][2] += sum(parents is not None for _, _, parents in used.log)
    for layout, (accepted, drafted, _) in totals.items():
        assert 0 < accepted < drafted, layout
    assert totals["chain"][2] == 0 and totals["tree"][2] > 0  # trees were proposed (and verified) as trees


def test_greedy_identity_never_right():
    target, drafter = hf_specdec.enable(llama()), block_drafter(4)
    with torch.no_grad():
        drafter.norm.weight.zero_()  # zero logits: every draft is token 0 (the first of the ties)
        target.get_output_embeddings().weight[0].zero_()  # which the target, with other logits > 0, never emits
    ids = prompt(9, seed=4)
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    for extra in ({}, dict(speculative_tree_budget=6)):
        out = target.generate(
            ids, drafter=DFlashDrafter(drafter), speculative_gamma=3, return_dict_in_generate=True, **GREEDY, **extra
        )
        assert torch.equal(plain, out.sequences) and 0 not in plain[0, ids.shape[1] :].tolist()
        assert out.speculative_stats.drafted_tokens > 20 and out.speculative_stats.accepted_tokens == 0


class FavourTheNextId(LogitsProcessor):
    """A processor that reads the prefix: it favours the id after the last token's."""

    def __call__(self, input_ids, scores):
        bonus = torch.zeros_like(scores).scatter_(-1, (input_ids[:, -1:] + 1) % scores.shape[-1], 6.0)
        return scores + bonus


@pytest.mark.parametrize("case", ["last layer read", "prefix processor", "sliding window", "muse glimmer target"])
def test_drafts_are_transformers(case, monkeypatch):
    """Random drafter weights, so the drafts depend on everything fed: the target's layers (the last one after its
    final norm, as transformers hands it over), the positions, the cache cropped after every rejection, the
    processors applied with each draft's own prefix, the drafter's sliding window, a target whose embeddings carry
    an `embed_norm`. Every block is the one `generate(assistant_model=drafter, speculation_type="dflash")` drafts at
    that length (ours stops short of max_length)."""
    target = hf_specdec.enable(llama(seed=2))
    kwargs = dict(max_new_tokens=30, do_sample=False)
    drafter = block_drafter(4, target_layer_ids=(0, 3), seed=5)
    if case == "prefix processor":
        drafter = block_drafter(3, target_layer_ids=(2, 1), seed=6)
        kwargs["logits_processor"] = LogitsProcessorList([FavourTheNextId()])
    elif case == "sliding window":
        drafter = block_drafter(4, target_layer_ids=(1,), seed=7, sliding_window=5, num_hidden_layers=1)
    ids = prompt(6, seed=3)
    if case == "muse glimmer target":
        target = hf_specdec.enable(muse_glimmer(seed=1))
        drafter = block_drafter(4, target_layer_ids=(0, 2), seed=5)
        ids = ids % (VOCAB - 3)  # no image or video tokens
    plain = target.generate(ids, **kwargs)
    theirs, theirs_log = transformers_drafts(target, drafter, ids, monkeypatch, **kwargs)
    gamma = drafter.config.block_size - 1
    run = dict(kwargs, speculative_gamma=gamma, speculative_gamma_policy="constant")
    out, used = recorded_generate(target, Recorder(drafter), ids, **run)
    assert torch.equal(theirs, plain) and torch.equal(out.sequences, plain)
    ours_log = [(length, tokens) for length, tokens, _ in used.log]
    assert len(ours_log) >= 8 and len(theirs_log) == len(ours_log)
    for (length, tokens), (their_length, their_tokens) in zip(ours_log, theirs_log):
        assert length == their_length and tokens == their_tokens[: len(tokens)]
    assert len(set(tuple(tokens) for _, tokens in ours_log)) > 3  # the drafts vary


class SixOf44(StoppingCriteria):
    """Stops a row once it holds token 44 six times (row by row: a function of the row alone)."""

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids == 44).sum(-1) >= 6


def test_padded_batch_static_cache_and_default_policy_stay_exact():
    """A left-padded batch (decoded row by row), a row that stops early and goes on growing, a static target cache
    (chain and tree), and the default γ policy (plain steps and shadow drafts, whose context the drafter feeds later
    in one forward)."""
    cycle = [5, 17, 60, 33]
    target, drafter = make_bigram(hf_specdec.enable(llama(seed=3)), block_drafter(4), cycle, roughness=0.3)
    batch = torch.tensor([[0, 0, 9, 5, 44], [3, 17, 8, 60, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    plain = target.generate(batch, attention_mask=mask, max_new_tokens=20, do_sample=False)
    fast = target.generate(
        batch,
        attention_mask=mask,
        drafter=DFlashDrafter(drafter),
        speculative_gamma=3,
        **dict(GREEDY, max_new_tokens=20),
    )
    assert torch.equal(plain, fast)
    # a row that stops early (no pad token) keeps growing once the others are done: the drafter goes on with it
    stop = StoppingCriteriaList([SixOf44()])
    batch = torch.tensor([[3, 9, 5, 44], [3, 17, 8, 60]])
    plain = target.generate(batch, max_new_tokens=20, do_sample=False, stopping_criteria=stop)
    fast = target.generate(
        batch,
        drafter=DFlashDrafter(drafter),
        stopping_criteria=stop,
        return_dict_in_generate=True,
        **dict(GREEDY, max_new_tokens=20),
    )
    assert torch.equal(plain, fast.sequences) and fast.speculative_stats.accepted_tokens > 0
    ids = prompt(6, seed=8)
    plain = target.generate(ids, max_new_tokens=20, do_sample=False, cache_implementation="static")
    for tree in ({}, dict(speculative_tree_budget=6)):
        static = target.generate(
            ids,
            drafter=DFlashDrafter(drafter),
            cache_implementation="static",
            return_dict_in_generate=True,
            **dict(GREEDY, max_new_tokens=20),
            **tree,
        )
        assert torch.equal(plain, static.sequences) and static.speculative_stats.accepted_tokens > 0
    for tree in ({}, dict(speculative_tree_budget=6)):
        default = target.generate(ids, drafter=DFlashDrafter(drafter), max_new_tokens=30, do_sample=False, **tree)
        assert torch.equal(target.generate(ids, max_new_tokens=30, do_sample=False), default)


def sampled(target, ids, config, count, **kwargs):
    torch.manual_seed(4321)
    return [
        tuple(target.generate(ids, do_sample=True, max_new_tokens=4, **config, **kwargs)[0, ids.shape[1] :].tolist())
        for _ in range(count)
    ]


@pytest.mark.parametrize("layout", ["chain", "tree"])
def test_sampling_follows_the_target(layout):
    """Chi-square against the exact distribution of four tokens (block of 4: after the prefill's first token, one
    round drafts the other three; a tree: up to 6 nodes from the block's top 2 per position). The drafter is sharper
    than the target (q piles onto π(anchor), p does not). Power: the same test rejects `speculative_lenience=0.02`
    (accept x with min(1, p(x) / (0.02 q(x))): nearly every draft the target supports), so it sees where the emitted
    tokens follow q instead of p."""
    target, drafter = make_bigram(hf_specdec.enable(llama(seed=4)), block_drafter(4), [5, 17, 60], roughness=0.05)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.4)  # flatter: the top 2 both likely
        drafter.norm.weight.fill_(3.0)
    config = dict(temperature=0.9, top_k=2)
    ids = torch.cat([prompt(5, seed=11), torch.tensor([[40]])], dim=-1)
    table = exact_distribution(target, ids, config, length=4)
    run = dict(drafter=DFlashDrafter(drafter, tree_top_k=2), speculative_gamma=3, speculative_gamma_policy="constant")
    if layout == "tree":
        run["speculative_tree_budget"] = 6
    samples = sampled(target, ids, config, 800 if layout == "chain" else 500, **run)
    assert goodness_of_fit(table, samples) > 1e-3
    if layout == "chain":  # lenience is refused for trees
        wrong = sampled(target, ids, config, 400, **dict(run, speculative_lenience=0.02))
        assert goodness_of_fit(table, wrong) < 1e-3


def test_sampling_proposals_carry_the_q_they_sampled_from():
    """Each drafted position's q is the softmax of its logits (the target's head over the block's output) after the
    target's processors with that draft's own prefix; every q is a distribution giving its drafted token q(x) > 0."""
    target = hf_specdec.enable(llama(seed=5))
    drafter = block_drafter(4, seed=3)
    ids = prompt(6, seed=3)
    config = dict(temperature=0.8, top_k=5, repetition_penalty=1.5)
    logits_processor = processors(target, ids, config)
    context = hf_specdec.DraftContext(
        target=target,
        input_ids=ids,
        logits_processor=logits_processor,
        generation_config=GenerationConfig(do_sample=True),
        vocab_size=VOCAB,
    )
    ours = DFlashDrafter(drafter).for_call(context)
    with HiddenStateCapture(target, ours.target_hidden_layers) as capture, torch.no_grad():
        target(ids)
        ours.on_verified(ids, torch.tensor([0]), target_hidden_states=capture.take()[:, :-1])
    torch.manual_seed(0)
    proposal = ours.propose(ids, 3)
    assert proposal.tokens.shape == (1, 3) and proposal.probs.shape == (1, 3, VOCAB)
    assert bool((proposal.probs[0].gather(-1, proposal.tokens[0][:, None]) > 0).all())
    torch.testing.assert_close(proposal.probs.sum(-1), torch.ones(1, 3))
    with torch.no_grad():  # the block from scratch, as transformers runs it after a prefill
        states = target(ids, output_hidden_states=[1, 4])
        context_states = torch.cat([states.hidden_states[1], states.hidden_states[4]], dim=-1)[:, :-1]
        block = torch.tensor([[ids[0, -1]] + [MASK] * 3])
        hidden = drafter(
            noise_embeds=target.get_input_embeddings()(block),
            context_hidden_states=context_states,
            position_ids=torch.arange(ids.shape[1] + 3)[None],
        ).last_hidden_state
        logits = target.get_output_embeddings()(hidden[:, 1:])
    prefix = ids
    for position in range(3):
        q = logits_processor(prefix, logits[:, position].clone()).softmax(-1)
        torch.testing.assert_close(proposal.probs[:, position], q)
        prefix = torch.cat([prefix, proposal.tokens[:, position : position + 1]], dim=-1)


def driven(drafter_model, target, ids, tree_budget=None, logits_processor=None):
    """A per-call drafter driven by hand: reset for `ids` and handed the target's hidden states of its prompt, as
    after the prefill round."""
    context = hf_specdec.DraftContext(
        target=target,
        input_ids=ids,
        logits_processor=logits_processor if logits_processor is not None else LogitsProcessorList(),
        generation_config=GenerationConfig(do_sample=False),
        vocab_size=VOCAB,
        tree_budget=tree_budget,
    )
    drafter = DFlashDrafter(drafter_model, tree_top_k=3).for_call(context)
    with HiddenStateCapture(target, drafter.target_hidden_layers) as capture, torch.no_grad():
        target(ids)
        recorded = capture.take()[:, :-1]  # the prompt's positions but the last: their next token is known
    drafter.on_verified(ids, torch.tensor([0]), target_hidden_states=recorded)
    return drafter


def test_tree_is_grown_from_each_position_top_k():
    """One block forward; the tree's nodes at depth d are tokens among position d's top `tree_top_k`, best-first by
    cumulative log q: its best root path is the chain's block, and the budget is spent."""
    target = hf_specdec.enable(llama(seed=7))
    drafter_model = block_drafter(5, target_layer_ids=(1, 2), seed=11)
    for seed in range(3):
        ids = prompt(6, seed=20 + seed)
        chain = driven(drafter_model, target, ids).propose(ids, 4)
        tree_drafter = driven(drafter_model, target, ids, tree_budget=9)
        tree = tree_drafter.propose(ids, 4)
        tokens, parents = tree.tokens[0].tolist(), tree.parents[0].tolist()
        assert len(tokens) == 9 and tree.probs is None
        depths = []
        for parent in parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        block = driven(drafter_model, target, ids)._block_logits(ids)[0]  # [4, vocab]
        for token, depth in zip(tokens, depths):
            assert token in block[depth - 1].topk(3).indices.tolist()
        # the chain of argmaxes is a root path of the tree (as deep as the tree goes)
        node, path = -1, []
        for token in chain.tokens[0].tolist()[: max(depths)]:
            children = [i for i, parent in enumerate(parents) if parent == node and tokens[i] == token]
            assert len(children) == 1, (seed, path, token)
            node = children[0]
            path.append(token)
        assert len(set(depths)) > 1 and max(depths) >= 2


def test_checkpoint_saved_in_transformers_layout_loads_and_decodes_exactly(tmp_path):
    """`save_pretrained` writes transformers' layout (`config.json` of model type `muse_glimmer_assistant`,
    `model.safetensors`); `DFlashDrafter(path)` (also as `drafter="dflash"`, `drafter_kwargs={"model": path}`) loads
    it with `AutoModel` and decodes exactly as the model it was saved from."""
    from safetensors.torch import load_file

    target = hf_specdec.enable(llama(seed=6))
    drafter = block_drafter(4, target_layer_ids=(1, 3), seed=8)
    drafter.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert "encoder.fc.weight" in tensors and "layers.0.self_attn.q_proj.weight" in tensors
    assert not any("embed" in key or "lm_head" in key for key in tensors)  # the target's are used, none shipped
    loaded = DFlashDrafter(tmp_path)
    assert type(loaded.model) is MuseGlimmerAssistantModel and loaded.model.config.target_layer_ids == [1, 3]
    for key, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, drafter.state_dict()[key]), key
    ids = prompt(6, seed=4)
    run = dict(GREEDY, speculative_gamma=3, return_dict_in_generate=True)
    original = target.generate(ids, drafter=DFlashDrafter(drafter), **run)
    by_path = target.generate(ids, drafter=loaded, **run)
    by_name = target.generate(ids, drafter="dflash", drafter_kwargs={"model": str(tmp_path)}, **run)
    assert torch.equal(original.sequences, target.generate(ids, max_new_tokens=24, do_sample=False))
    for out in (by_path, by_name):
        assert torch.equal(out.sequences, original.sequences)
        assert out.speculative_stats.accepted_length_histogram == original.speculative_stats.accepted_length_histogram
    assert "dflash" in hf_specdec.list_drafters() and isinstance(AutoModel.from_pretrained(tmp_path), type(drafter))


def test_refusals():
    target = hf_specdec.enable(llama(seed=0))
    ids = prompt(5)

    def run(drafter, **kwargs):
        return target.generate(ids, drafter=drafter, max_new_tokens=3, **kwargs)

    with pytest.raises(
        ValueError,
        match=r"`config.target_layer_ids=\[1, 4, 7\]`, but LlamaForCausalLM has 4 decoder layers "
        r"\(ids 0 to 3\): \[4, 7\] do not exist",
    ):
        run(DFlashDrafter(block_drafter(target_layer_ids=(1, 4, 7))))
    with pytest.raises(ValueError, match=r"`hidden_size=16` but LlamaForCausalLM has hidden size 32"):
        run(DFlashDrafter(block_drafter(hidden_size=16, num_attention_heads=2, num_key_value_heads=2)))
    with pytest.raises(
        ValueError,
        match=rf"`config.mask_token_id={VOCAB + 3}` is not a token of LlamaForCausalLM, "
        rf"whose embeddings hold {VOCAB} tokens",
    ):
        run(DFlashDrafter(block_drafter(mask_token_id=VOCAB + 3)))
    with pytest.raises(ValueError, match=rf"`vocab_size=1000` tokens, but LlamaForCausalLM has {VOCAB} logits"):
        run(DFlashDrafter(block_drafter(vocab_size=1000)))
    with pytest.raises(
        TypeError,
        match=r"must be a DFlash block drafter, but LlamaForCausalLM \(model type 'llama'\) "
        r"has no `block_size`, `mask_token_id`, `target_layer_ids`",
    ):
        DFlashDrafter(llama())
    with pytest.raises(TypeError, match=r"must be a DFlash block drafter model, got Tensor"):
        DFlashDrafter(torch.zeros(1))
    with pytest.raises(ValueError, match=r"`config.block_size` must be an int >= 2 .* got 1"):
        DFlashDrafter(block_drafter(block_size=1))
    with pytest.raises(ValueError, match=r"`tree_top_k` must be a positive int .* got 0"):
        DFlashDrafter(block_drafter(), tree_top_k=0)
    with pytest.raises(TypeError, match=r"Unknown `drafter_kwargs` key\(s\) \['block'\] for DFlashDrafter"):
        run("dflash", drafter_kwargs={"model": block_drafter(), "block": 3})
    with pytest.raises(TypeError, match=r"DFlashDrafter needs \['model'\] in `drafter_kwargs`"):
        run("dflash")


def test_speculation_type_dflash_reaches_the_drafter():
    """transformers' `speculation_type="dflash"` with `assistant_model=` is `drafter="dflash"`; other values, a second
    drafter, or no drafter model are refused; a config's value is left as it was; the model's own config naming it
    leaves plain `generate` plain."""
    target = hf_specdec.enable(llama(seed=2))
    model = block_drafter(4, seed=5)
    ids = prompt(6, seed=3)
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    run = dict(max_new_tokens=20, do_sample=False, return_dict_in_generate=True)
    config = GenerationConfig(speculation_type="dflash", **run)
    outs = [
        target.generate(ids, assistant_model=model, speculation_type="dflash", **run),
        target.generate(ids, drafter="dflash", drafter_kwargs={"model": model}, **run),
        target.generate(ids, assistant_model=model, generation_config=config),
        target.generate(ids, drafter=DFlashDrafter(model), speculation_type="dflash", **run),
    ]
    assert config.speculation_type == "dflash"
    for out in outs:
        assert torch.equal(out.sequences, plain) and out.speculative_stats.drafted_tokens > 0
    for kwargs, message in [
        (
            dict(assistant_model=model, speculation_type="eagle"),
            r"`speculation_type='eagle'` is not a speculation type",
        ),
        (dict(drafter="prompt_lookup", speculation_type="dflash"), r"but the call passes `drafter='prompt_lookup'`"),
        (dict(speculation_type="dflash"), r"`speculation_type='dflash'` needs its drafter model"),
        (dict(assistant_model=model, speculation_type="dflash", drafter_kwargs={"model": model}), r"passes both"),
        (
            dict(assistant_model=llama(), speculation_type="dflash"),
            r"must be a DFlash block drafter, but LlamaForCausalLM",
        ),
    ]:
        with pytest.raises((ValueError, TypeError), match=message):
            target.generate(ids, max_new_tokens=3, **kwargs)
    target.generation_config.speculation_type = "dflash"
    try:
        assert torch.equal(target.generate(ids, max_new_tokens=20, do_sample=False), plain)
        by_default = target.generate(ids, assistant_model=model, **run)
        assert torch.equal(by_default.sequences, plain) and by_default.speculative_stats.drafted_tokens > 0
    finally:
        target.generation_config.speculation_type = None
