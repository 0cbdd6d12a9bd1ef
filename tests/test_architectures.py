"""Architectures beyond the common ones: classes with their own `generate`, caches with extra per-column state,
models that never fill their cache, stateful models, and the capability check on cached multi-token forwards."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import ScriptedDrafter, noisy_copy, prompt, tiny_model, tiny_seq2seq
from transformers import DynamicCache
from transformers.cache_utils import DynamicIndexedLayer

import hf_specdec
from hf_specdec.caches import CACHE_KWARG, realign_cache, slice_cache

sys.path.insert(0, str(Path(__file__).parent / "sweep"))
from tiny import VOCAB as SWEEP_VOCAB
from tiny import tiny_model as sweep_model

NEW_TOKENS = 20


def sweep_prompt(length=8, seed=0):
    return torch.randint(4, SWEEP_VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def test_enabling_keeps_plain_generate_of_classes_that_override_it():
    # Whisper's `generate` takes `input_features` first; SeamlessM4T's, `input_ids` then `tgt_lang`: the mixin
    # passes every argument on as given, by position or by name
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(1)
    config = WhisperConfig(
        vocab_size=96,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=8,
        max_source_positions=16,
        max_target_positions=64,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=None,
        decoder_start_token_id=1,
        begin_suppress_tokens=None,
        suppress_tokens=None,
        init_std=1.0,
    )
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None
    features = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1))
    plain = model.generate(features, max_new_tokens=6)
    plain_dict = model.generate(features, max_new_tokens=6, return_dict_in_generate=True).sequences
    assert len(set(plain[0].tolist())) > 2
    hf_specdec.enable(model)
    assert torch.equal(model.generate(features, max_new_tokens=6), plain)
    assert torch.equal(model.generate(input_features=features, max_new_tokens=6), plain)
    spec = model.generate(
        features, assistant_model=model, speculative_gamma=3, max_new_tokens=6, return_dict_in_generate=True
    )
    assert torch.equal(spec.sequences, plain_dict) and spec.speculative_stats.acceptance_rate == 1.0


def test_realignment_moves_indexer_keys_with_their_rows():
    # a sparse-attention layer (deepseek_v32, glm_moe_dsa) caches indexer keys per column next to keys and values
    cache = DynamicCache()
    layer = DynamicIndexedLayer()
    cache.layers = [layer]
    keys = torch.arange(2 * 5, dtype=torch.float32).reshape(2, 1, 5, 1).expand(2, 3, 5, 4).contiguous()
    layer.update(keys, keys.clone())
    layer.update_indexer(keys[:, 0, :, :2].clone())  # [batch, seq, index_dim]
    columns = torch.tensor([[-1, 0, 1, 2], [1, 2, 3, 4]])  # row 0 moves right by one (new padding), row 1 left
    realign_cache(cache, columns)
    for row, source in enumerate(columns.clamp(min=0)):
        assert torch.equal(layer.keys[row, 0, :, 0], keys[row, 0, source, 0])
        assert torch.equal(layer.indexer_keys[row, :, 0], keys[row, 0, source, 0])
    slice_cache(cache, 1, 2)
    assert layer.keys.shape[2] == layer.indexer_keys.shape[1] == 2


def test_a_class_with_its_own_sample_is_refused_before_any_forward():
    """VibeVoice, CSM, Higgs Audio V2 and PocketTTS decode with their own `_sample` (audio made between tokens):
    hf_specdec's loop would replace it and differ from plain `generate`, so they are refused by name, before any
    forward; plain `generate` keeps running theirs. Here a Llama whose `_sample` counts its calls."""
    from transformers import LlamaForCausalLM

    class OwnSampleLlama(LlamaForCausalLM):
        def _sample(self, *args, **kwargs):
            self.own_sample_calls = getattr(self, "own_sample_calls", 0) + 1
            return super()._sample(*args, **kwargs)

    base = tiny_model("llama")
    model = OwnSampleLlama(base.config).eval()
    model.load_state_dict(base.state_dict())
    plain = model.generate(prompt(), max_new_tokens=4, do_sample=False)
    assert model.own_sample_calls == 1
    hf_specdec.enable(model)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    for drafter in (dict(drafter="prompt_lookup"), dict(assistant_model=base)):
        with pytest.raises(
            ValueError,
            match=r"^OwnSampleLlama cannot run speculative decoding: it decodes with its own "
            r"`_sample` \(defined by OwnSampleLlama: .*Drop `assistant_model`/`drafter`",
        ):
            model.generate(prompt(), max_new_tokens=4, do_sample=False, **drafter)
    assert not calls
    assert torch.equal(model.generate(prompt(), max_new_tokens=4, do_sample=False), plain)
    assert model.own_sample_calls == 2


def test_model_that_never_fills_its_cache_is_refused_before_any_forward():
    model = hf_specdec.enable(sweep_model("openai-gpt"))
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    with pytest.raises(
        ValueError,
        match=r"OpenAIGPTLMHeadModel generates without a `Cache` object .* drop "
        r"`assistant_model`/`drafter`",
    ):
        model.generate(sweep_prompt(), drafter="prompt_lookup", max_new_tokens=NEW_TOKENS)
    assert not calls


@pytest.mark.parametrize(
    "model_type, reason",
    [
        # cpmant prepends prompt positions to its cache: multi-token forwards and rollbacks misalign it (it used to
        # return silently wrong output with prompt lookup)
        (
            "cpmant",
            r"CpmAntForCausalLM cannot be verified exactly by speculative decoding: its cache holds 40 positions "
            r"after a forward over 8 tokens",
        ),
        # prophetnet asserts that cached decoder inputs are one token long
        (
            "prophetnet",
            r"ProphetNetForConditionalGeneration cannot be verified exactly by speculative decoding: a cached "
            r"forward over several new tokens fails \(AssertionError",
        ),
    ],
)
@pytest.mark.parametrize("drafter", ["prompt_lookup", "self"])
def test_broken_multi_token_forward_is_refused(model_type, reason, drafter):
    model = hf_specdec.enable(sweep_model(model_type))
    arguments = dict(assistant_model=model) if drafter == "self" else dict(drafter=drafter)
    with pytest.raises(ValueError, match=reason + r".*Drop `assistant_model`/`drafter`"):
        model.generate(sweep_prompt(), max_new_tokens=NEW_TOKENS, speculative_gamma=4, **arguments)


def test_capability_check_catches_a_silently_wrong_multi_token_forward_and_runs_once():
    # a llama whose forward over several new tokens sees one token too few: exact step by step, wrong in chunks
    model = tiny_model("llama", seed=0)

    class ChunkBroken(type(model)):
        # the cache comes as `cache` (transformers >= 5.24) or as `past_key_values`
        def forward(self, input_ids=None, cache=None, past_key_values=None, **kwargs):
            cache = past_key_values if cache is None else cache
            output = super().forward(input_ids=input_ids, **{CACHE_KWARG: cache}, **kwargs)
            if (
                input_ids is not None
                and input_ids.shape[1] > 1
                and cache is not None
                and cache.get_seq_length() > input_ids.shape[1]
            ):
                output.logits = output.logits + torch.arange(output.logits.shape[1])[None, :, None] * 0.5
            return output

    model.__class__ = ChunkBroken
    hf_specdec.enable(model)
    ids = prompt(8)
    plain = model.generate(ids, max_new_tokens=NEW_TOKENS)
    with pytest.raises(
        ValueError,
        match=r"ChunkBroken cannot be verified exactly by speculative decoding: a cached "
        r"forward over several new tokens disagrees with step-by-step decoding",
    ):
        model.generate(ids, drafter=ScriptedDrafter(plain), max_new_tokens=NEW_TOKENS)
    # the verdict is kept per model object: a second call refuses without probing again
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match="ChunkBroken cannot be verified exactly"):
        model.generate(ids, drafter=ScriptedDrafter(plain), max_new_tokens=NEW_TOKENS)
    assert not calls


@pytest.mark.parametrize("old_name", ["past_key_values", "cache"])
def test_a_drafter_model_gets_its_cache_under_the_name_its_forward_takes(old_name):
    # transformers 5.24 renamed the forward's `past_key_values` to `cache`; a drafter model whose forward names only
    # one of them (remote code written for another release) must get its cache under that name, or it would draft
    # without one (slower) or fail
    from hf_specdec.caches import cache_argument

    target = hf_specdec.enable(tiny_model("llama", seed=0))
    ids = prompt(8)
    plain = target.generate(ids, max_new_tokens=NEW_TOKENS)
    draft = noisy_copy(target, 0.05)
    received = []

    class OneName(type(draft)):
        if old_name == "past_key_values":

            def forward(self, input_ids=None, past_key_values=None, **kwargs):
                assert "cache" not in kwargs
                received.append(past_key_values is not None)
                return super().forward(input_ids=input_ids, **{CACHE_KWARG: past_key_values}, **kwargs)
        else:

            def forward(self, input_ids=None, cache=None, **kwargs):
                assert "past_key_values" not in kwargs
                received.append(cache is not None)
                return super().forward(input_ids=input_ids, **{CACHE_KWARG: cache}, **kwargs)

    draft.__class__ = OneName
    assert cache_argument(draft) == old_name
    out = target.generate(
        ids, assistant_model=draft, speculative_gamma=4, max_new_tokens=NEW_TOKENS, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, plain)
    assert received and all(received)
    assert out.speculative_stats.accepted_tokens > 0


def test_target_forwards_run_in_plain_decodings_kernel_switch_as_transformers_does():
    """On an accelerator, plain `generate` decodes a mixture-of-experts model with `batched_mm` experts instead of
    `grouped_mm` (`_optimize_model_for_decode`; the prefill is exempt, and so is beam search): every target forward
    but the first round's runs in that switch here too, so it computes what plain decoding computes. On the CPU the
    switch is off; this Qwen3-MoE makes it as it does on an accelerator, and records the implementation each forward
    ran with."""
    import transformers

    if not hasattr(transformers.GenerationMixin, "_optimize_model_for_decode"):
        pytest.skip("this transformers release decodes without a kernel switch")
    base = sweep_model("qwen3_moe")
    assert base.get_experts_implementation() == {"": "grouped_mm"}

    class SwitchesLikeAnAccelerator(type(base)):
        def _optimize_model_for_decode(self):
            import contextlib

            @contextlib.contextmanager
            def switch():
                self.set_experts_implementation("batched_mm")
                try:
                    yield
                finally:
                    self.set_experts_implementation("grouped_mm")

            return switch()

    model = SwitchesLikeAnAccelerator(base.config).eval()
    model.load_state_dict(base.state_dict())
    model.generation_config = base.generation_config
    seen = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["input_ids"].shape[1], module.config._experts_implementation)),
        with_kwargs=True,
    )
    ids = sweep_prompt(10)
    plain = model.generate(ids, max_new_tokens=NEW_TOKENS)
    assert seen[0] == (10, "grouped_mm") and {kind for _, kind in seen[1:]} == {"batched_mm"}  # the switch is real
    hf_specdec.enable(model)
    drafters = {
        "always right": ScriptedDrafter(plain, vocab=SWEEP_VOCAB),
        "never right": ScriptedDrafter(plain, period=1, vocab=SWEEP_VOCAB),
        "partly right": ScriptedDrafter(plain, period=3, vocab=SWEEP_VOCAB),
        "prompt lookup": "prompt_lookup",
    }
    for name, drafter in drafters.items():
        seen.clear()
        out = model.generate(
            ids,
            drafter=drafter,
            speculative_gamma=3,
            speculative_gamma_policy="constant",
            max_new_tokens=NEW_TOKENS,
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, plain), name
        assert seen[0][1] == "grouped_mm", name  # the probe's and the first round's forwards carry the prompt
        assert out.speculative_stats.target_calls > 3, name
        later = seen[-(out.speculative_stats.target_calls - 1) :]
        assert {kind for _, kind in later} == {"batched_mm"}, (name, seen)
        assert model.get_experts_implementation() == {"": "grouped_mm"}, name  # switched back
    # a batch decoded row by row (`prefill_chunk_size` asks for it) without an EOS criterion: a row that a criterion
    # stopped goes on growing until every row is done, and its continuation is decode steps too
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopsAtToken(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == stop_token

    batch = torch.cat([ids, sweep_prompt(10, seed=1)])
    stop_token = int(plain[0, 14])  # row 0 stops early, row 1 (most likely) later
    kwargs = dict(
        max_new_tokens=NEW_TOKENS, prefill_chunk_size=64, stopping_criteria=StoppingCriteriaList([StopsAtToken()])
    )
    plain_batch = model.generate(batch, **kwargs)
    seen.clear()
    out = model.generate(batch, drafter="prompt_lookup", return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, plain_batch)
    assert {kind for length, kind in seen if length == 9} == {"grouped_mm"}  # each row's prompt, prefilled
    assert {kind for length, kind in seen if length < 9} == {"batched_mm"}, seen
    assert bool((plain_batch[0, 10:-1] == stop_token).any())  # row 0 stopped, then went on growing
    seen.clear()
    beam = model.generate(ids, num_beams=2, max_new_tokens=8)
    assert {kind for _, kind in seen} == {"grouped_mm"}  # transformers' beam search decodes without the switch
    seen.clear()
    assert torch.equal(
        model.generate(ids, num_beams=2, max_new_tokens=8, assistant_model=model, speculative_gamma=3), beam
    )
    assert {kind for _, kind in seen} == {"grouped_mm"}


def test_capability_check_passes_exact_models_once():
    model = hf_specdec.enable(tiny_model("llama", seed=0))
    ids = prompt(8)
    plain = model.generate(ids, max_new_tokens=NEW_TOKENS)
    assert torch.equal(model.generate(ids, drafter=ScriptedDrafter(plain, period=3), max_new_tokens=NEW_TOKENS), plain)
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    spec = model.generate(
        ids,
        drafter=ScriptedDrafter(plain),
        speculative_gamma=4,
        max_new_tokens=NEW_TOKENS,
        return_dict_in_generate=True,
    )
    assert torch.equal(spec.sequences, plain)
    assert len(calls) == spec.speculative_stats.target_calls  # no probe forwards on the second call


def test_sparse_attention_top_k_smaller_than_the_generation_is_refused():
    model = hf_specdec.enable(sweep_model("hy_v4"))
    limit = model.config.get_text_config(decoder=True).index_topk
    with pytest.raises(
        ValueError,
        match=rf"HYV4ForCausalLM cannot be verified exactly by speculative decoding: its "
        rf"attention selects at most index_topk={limit} keys per query",
    ):
        model.generate(sweep_prompt(), drafter="prompt_lookup", max_new_tokens=NEW_TOKENS)


@pytest.mark.parametrize("model_type", ["lfm2", "lfm2_moe", "inkling_text", "inkling2_text"])
def test_convolution_caches_roll_back_exactly(model_type):
    # short-convolution layers report `is_croppable=False` until a forward shows they hold no recurrent state; they
    # used to be refused up front, though transformers' assisted generation runs them exactly
    model = hf_specdec.enable(sweep_model(model_type))
    ids = sweep_prompt()
    plain = model.generate(ids, max_new_tokens=NEW_TOKENS)

    def speculative_stats(drafter):
        out = model.generate(
            ids,
            drafter=drafter,
            speculative_gamma=4,
            speculative_gamma_policy="constant",
            max_new_tokens=NEW_TOKENS,
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, plain)
        return out.speculative_stats

    # every third position of the script is wrong: rounds accept drafts, then roll the caches back past a rejection
    stats = speculative_stats(ScriptedDrafter(plain, period=3, vocab=SWEEP_VOCAB))
    assert 0 < stats.accepted_tokens < stats.drafted_tokens and stats.target_calls < NEW_TOKENS, stats
    # the greedy outputs repeat themselves, so prompt lookup drafts from them too, and some of its drafts are accepted
    stats = speculative_stats("prompt_lookup")
    assert stats.accepted_tokens > 0 and stats.target_calls < NEW_TOKENS, stats


def test_convolution_cache_model_drafts_for_itself():
    model = hf_specdec.enable(sweep_model("lfm2_moe"))
    ids = sweep_prompt()
    plain = model.generate(ids, max_new_tokens=NEW_TOKENS)
    assert torch.equal(model.generate(ids, assistant_model=model, max_new_tokens=NEW_TOKENS), plain)


def test_inputs_embeds_of_a_decoder_only_target_are_refused_up_front():
    model = hf_specdec.enable(tiny_model("llama", seed=0))
    ids = prompt(8)
    embeds = model.get_input_embeddings()(ids)
    for arguments in (dict(drafter="prompt_lookup"), dict(assistant_model=tiny_model("llama", seed=1))):
        for inputs in (dict(inputs_embeds=embeds), dict(input_ids=ids, inputs_embeds=embeds)):
            with pytest.raises(
                ValueError,
                match=r"`inputs_embeds` \(a tensor of shape \(1, 8, 32\)\) cannot be "
                r"combined with a drafter for the decoder-only LlamaForCausalLM.*"
                r"Pass the prompt as `input_ids` instead",
            ):
                model.generate(**inputs, max_new_tokens=NEW_TOKENS, **arguments)


def test_inputs_embeds_of_an_encoder_decoder_source_are_exact():
    # for an encoder-decoder target the embeddings are the encoder's input; the decoder drafts and verifies ids
    model = hf_specdec.enable(tiny_seq2seq("bart", seed=0))
    source = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(3))
    embeds = model.get_encoder().embed_tokens(source)  # BartScaledWordEmbedding applies its scale
    plain = model.generate(inputs_embeds=embeds, max_new_tokens=NEW_TOKENS)
    assert torch.equal(plain, model.generate(source, max_new_tokens=NEW_TOKENS))
    out = model.generate(inputs_embeds=embeds, drafter=ScriptedDrafter(plain, period=3), max_new_tokens=NEW_TOKENS)
    assert torch.equal(out, plain)
