"""The user-facing API: enable, the config, per-call arguments, outputs, streaming, and clear errors."""

import copy
import pickle
import re

import pytest
import torch
from conftest import ScriptedDrafter, noisy_copy, prompt, tiny_config, tiny_model
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.generation.streamers import BaseStreamer

import hf_specdec
from hf_specdec.configuration import resolve_speculative_options
from hf_specdec.drafters.base import _REGISTRY as _DRAFTERS


def test_enable_is_per_instance_and_idempotent():
    model, other = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    enabled = hf_specdec.enable(model)
    assert enabled is model and hf_specdec.enable(model) is model
    assert isinstance(model, hf_specdec.SpeculativeGenerationMixin) and isinstance(model, LlamaForCausalLM)
    assert not isinstance(other, hf_specdec.SpeculativeGenerationMixin)
    with pytest.raises(TypeError, match="needs a transformers model"):
        hf_specdec.enable(torch.nn.Linear(2, 2))


def test_enable_keeps_the_saved_architecture(tmp_path):
    model = hf_specdec.enable(tiny_model("llama"))
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(reloaded) is LlamaForCausalLM
    assert reloaded.config.architectures == ["LlamaForCausalLM"]


def test_an_enabled_model_pickles_and_copies_as_an_enabled_model(tmp_path):
    """pickle, `torch.save` and `copy.deepcopy` of an enabled model (pickling raised `PicklingError`: the enabled class
    carries the model class's name, which pickle resolves to the model class itself): the copy is enabled too, with
    the same weights, and speculates as the original does."""
    model = hf_specdec.enable(tiny_model("llama"))
    ids = prompt()
    expected = model.generate(ids, max_new_tokens=10)
    torch.save(model, tmp_path / "model.pt")
    for copied in (
        pickle.loads(pickle.dumps(model)),
        torch.load(tmp_path / "model.pt", weights_only=False),  # a file this test wrote
        copy.deepcopy(model),
    ):
        assert type(copied) is type(model) and isinstance(copied, LlamaForCausalLM)
        assert copied is not model and torch.equal(copied.lm_head.weight, model.lm_head.weight)
        assert torch.equal(copied.generate(ids, max_new_tokens=10, drafter="prompt_lookup"), expected)
    assert type(pickle.loads(pickle.dumps(tiny_model("llama")))) is LlamaForCausalLM  # a model not enabled: as is


def test_mixin_as_base_class():
    class SpeculativeLlama(hf_specdec.SpeculativeGenerationMixin, LlamaForCausalLM):
        pass

    torch.manual_seed(0)
    model = SpeculativeLlama(tiny_config("llama")).eval()
    ids = prompt()
    plain = model.generate(ids, max_new_tokens=10)
    assert torch.equal(model.generate(ids, assistant_model=model, max_new_tokens=10), plain)


def test_without_drafter_is_plain_generate():
    model = tiny_model("llama")
    ids = prompt()
    plain = model.generate(ids, max_new_tokens=12, repetition_penalty=1.3)
    enabled = hf_specdec.enable(copy.deepcopy(model))
    assert torch.equal(enabled.generate(ids, max_new_tokens=12, repetition_penalty=1.3), plain)
    out = enabled.generate(ids, max_new_tokens=12, repetition_penalty=1.3, return_dict_in_generate=True)
    assert not hasattr(out, "speculative_stats")
    # a `speculative_*` argument without a drafter would be unused (plain decoding): refused, as transformers refuses
    # unused arguments; None sets nothing, and a config may hold them for the calls that pass a drafter
    for name, value in (
        ("speculative_gamma", 7),
        ("speculative_tree_budget", 8),
        ("speculative_gamma_policy", "optimal"),
    ):
        with pytest.raises(ValueError, match=rf"`{name}={value!r}` was given without a drafter.*`drafter=\.\.\.`"):
            enabled.generate(ids, max_new_tokens=12, **{name: value})
    assert torch.equal(enabled.generate(ids, max_new_tokens=12, repetition_penalty=1.3, speculative_gamma=None), plain)
    # an assistant tokenizer without an assistant (transformers drops it without a word)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")))
    with pytest.raises(ValueError, match=r"`assistant_tokenizer=<\w+>` was given without a drafter"):
        enabled.generate(ids, max_new_tokens=12, tokenizer=tokenizer, assistant_tokenizer=tokenizer)
    config = hf_specdec.SpeculativeGenerationConfig(speculative_gamma=7, max_new_tokens=12, repetition_penalty=1.3)
    assert torch.equal(enabled.generate(ids, generation_config=config), plain)


def test_config_round_trip(tmp_path):
    config = hf_specdec.SpeculativeGenerationConfig(speculative_gamma=4, speculative_lenience=0.5, max_new_tokens=64)
    config.save_pretrained(tmp_path)
    text = (tmp_path / "generation_config.json").read_text()
    assert '"speculative_gamma": 4' in text and '"hf_specdec_version"' in text
    loaded = hf_specdec.SpeculativeGenerationConfig.from_pretrained(tmp_path)
    assert (loaded.speculative_gamma, loaded.speculative_lenience, loaded.max_new_tokens) == (4, 0.5, 64)
    # a plain GenerationConfig keeps the fields as custom entries, and generate reads them from there
    plain_loaded = GenerationConfig.from_pretrained(tmp_path)
    assert plain_loaded.speculative_gamma == 4


def gammas_used(model, ids, **kwargs):
    # under the default "auto" policy a self-drafting tiny model (slower than plain steps on a CPU) stops drafting
    out = model.generate(
        ids, assistant_model=model, return_dict_in_generate=True, speculative_gamma_policy="constant", **kwargs
    )
    return set(out.speculative_stats.gamma_history[:-1])


def test_gamma_priority_call_then_config_then_model():
    model = hf_specdec.enable(tiny_model("llama"))
    ids = prompt()
    assert gammas_used(model, ids, max_new_tokens=30) == {5}  # default
    model.generation_config.speculative_gamma = 3  # the model's own config
    assert gammas_used(model, ids, max_new_tokens=30) == {3}
    config = hf_specdec.SpeculativeGenerationConfig(speculative_gamma=4, max_new_tokens=30)
    assert gammas_used(model, ids, generation_config=config) == {4}
    assert gammas_used(model, ids, generation_config=config, speculative_gamma=2) == {2}  # the call wins
    assert config.speculative_gamma == 4  # and the config is untouched
    # a config (or a call) that leaves γ None sets nothing: the next source decides
    unset = hf_specdec.SpeculativeGenerationConfig(max_new_tokens=30)
    assert unset.speculative_gamma is None
    assert gammas_used(model, ids, generation_config=unset) == {3}
    assert gammas_used(model, ids, max_new_tokens=30, speculative_gamma=None) == {3}
    model.generation_config.speculative_gamma = None
    assert gammas_used(model, ids, generation_config=unset) == {5}
    # an explicit speculative_max_gamma caps a γ left unset, and refuses one set above it
    assert gammas_used(model, ids, max_new_tokens=30, speculative_max_gamma=3) == {3}
    with pytest.raises(ValueError, match=r"`speculative_gamma=4` is larger than `speculative_max_gamma=3`"):
        model.generate(ids, assistant_model=model, max_new_tokens=4, speculative_gamma=4, speculative_max_gamma=3)
    with pytest.raises(ValueError, match=r"`speculative_gamma=4` is larger than `speculative_max_gamma=3`"):
        hf_specdec.SpeculativeGenerationConfig(speculative_gamma=4, speculative_max_gamma=3).validate()


def test_config_leaves_gamma_unset_through_a_round_trip(tmp_path):
    config = hf_specdec.SpeculativeGenerationConfig(max_new_tokens=8)
    config.validate()
    config.save_pretrained(tmp_path)
    assert '"speculative_gamma": null' in (tmp_path / "generation_config.json").read_text()
    loaded = hf_specdec.SpeculativeGenerationConfig.from_pretrained(tmp_path)
    assert loaded.speculative_gamma is None
    options = resolve_speculative_options({}, loaded)
    assert options.speculative_gamma == 5 and "speculative_gamma" not in options.given


def test_nothing_is_written_into_user_objects():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    assistant = noisy_copy(target, 0.5)
    config = hf_specdec.SpeculativeGenerationConfig(speculative_gamma=3, max_new_tokens=20, stop_strings=None)
    before = [m.generation_config.to_json_string() for m in (target, assistant)] + [config.to_json_string()]
    weights = {k: v.clone() for k, v in assistant.state_dict().items()}
    drafter = ScriptedDrafter(prompt(40), period=2)
    drafter_state = dict(vars(drafter))
    for _ in range(2):
        target.generate(prompt(), assistant_model=assistant, generation_config=config, speculative_gamma=6)
        target.generate(prompt(), drafter=drafter, max_new_tokens=10)
    after = [m.generation_config.to_json_string() for m in (target, assistant)] + [config.to_json_string()]
    assert after == before
    assert all(torch.equal(weights[k], v) for k, v in assistant.state_dict().items())
    assert vars(drafter).keys() == drafter_state.keys()


def test_stats_are_consistent():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    ids = prompt()
    plain = target.generate(ids, max_new_tokens=30)
    out = target.generate(
        ids,
        drafter=ScriptedDrafter(plain, period=4),
        speculative_gamma=5,
        max_new_tokens=30,
        return_dict_in_generate=True,
    )
    stats = out.speculative_stats
    assert stats.emitted_tokens == 30 == stats.accepted_tokens + stats.target_calls
    assert sum(stats.accepted_length_histogram) == stats.target_calls
    assert sum(n * c for n, c in enumerate(stats.accepted_length_histogram)) == stats.accepted_tokens
    assert sum(stats.position_drafted) == stats.drafted_tokens and sum(stats.position_accepted) == stats.accepted_tokens
    assert 0 < stats.acceptance_rate < 1 and 0 < stats.alpha < 1
    assert stats.mean_accepted_length == pytest.approx(30 / stats.target_calls)
    assert stats.draft_time_s > 0 and stats.verify_time_s > 0
    assert stats.to_dict()["acceptance_rate"] == stats.acceptance_rate


def test_scores_and_logits_match_plain_generate():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    ids = prompt()
    kwargs = dict(
        max_new_tokens=15, repetition_penalty=1.4, return_dict_in_generate=True, output_scores=True, output_logits=True
    )
    plain = target.generate(ids, **kwargs)
    spec = target.generate(ids, assistant_model=noisy_copy(target, 0.5), speculative_gamma=4, **kwargs)
    assert torch.equal(spec.sequences, plain.sequences)
    assert len(spec.scores) == len(plain.scores) == 15 == len(spec.logits)
    for mine, theirs in zip(spec.scores + spec.logits, plain.scores + plain.logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ends += 1


def test_streamer_gets_every_token_in_order_and_one_end():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    ids = prompt()
    plain_streamer, spec_streamer = RecordingStreamer(), RecordingStreamer()
    plain = target.generate(ids, max_new_tokens=17, streamer=plain_streamer)
    target.generate(ids, assistant_model=target, speculative_gamma=4, max_new_tokens=17, streamer=spec_streamer)
    assert spec_streamer.puts == plain_streamer.puts and spec_streamer.ends == plain_streamer.ends == 1
    assert sum(spec_streamer.puts[1:], []) == plain[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "5"])
def test_bad_gamma(value):
    model = hf_specdec.enable(tiny_model("llama"))
    with pytest.raises(ValueError, match=rf"`speculative_gamma` must be a positive int, got {value!r}"):
        model.generate(prompt(), assistant_model=model, speculative_gamma=value)
    with pytest.raises(ValueError, match="`speculative_gamma` must be a positive int"):
        hf_specdec.SpeculativeGenerationConfig(speculative_gamma=value)


@pytest.mark.parametrize("value", [0.0, -0.5, 1.5, float("nan")])
def test_bad_lenience(value):
    model = hf_specdec.enable(tiny_model("llama"))
    with pytest.raises(ValueError, match=r"`speculative_lenience` must be a float in \(0, 1\]"):
        model.generate(prompt(), assistant_model=model, speculative_lenience=value)


def test_unknown_speculative_argument():
    model = hf_specdec.enable(tiny_model("llama"))
    with pytest.raises(TypeError, match="speculative_gama"):
        model.generate(prompt(), assistant_model=model, speculative_gama=3)


def test_vocabulary_mismatch():
    model = hf_specdec.enable(tiny_model("llama"))
    other = tiny_model("llama", vocab_size=128)
    with pytest.raises(ValueError, match="vocabulary of 128 tokens but the target has 96"):
        model.generate(prompt(), assistant_model=other, max_new_tokens=5)


def test_beam_search_with_a_drafter_is_plain_beam_search():
    # Appendix A.4 (tests/test_beam_search.py tests it in depth): the drafter is used, not dropped
    model = hf_specdec.enable(tiny_model("llama"))
    out = model.generate(prompt(), assistant_model=model, num_beams=3, max_new_tokens=5, return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(prompt(), num_beams=3, max_new_tokens=5))
    assert out.speculative_stats.accepted_tokens > 0


def test_use_cache_false_is_refused():
    model = hf_specdec.enable(tiny_model("llama"))
    with pytest.raises(ValueError, match="`use_cache=False` cannot be combined with a drafter"):
        model.generate(prompt(), assistant_model=model, use_cache=False, max_new_tokens=5)


def test_model_without_cache_is_refused():
    from transformers import AutoConfig

    config = AutoConfig.for_model("mamba", vocab_size=96, hidden_size=16, num_hidden_layers=1, state_size=4)
    model = hf_specdec.enable(AutoModelForCausalLM.from_config(config))
    with pytest.raises(
        ValueError, match="(cannot be rolled back|without a `Cache` object|ignores the state in the cache)"
    ):
        model.generate(prompt(), drafter=ScriptedDrafter(prompt(40)), max_new_tokens=5)


def test_out_of_vocabulary_proposal_is_caught_at_the_boundary():
    model = hf_specdec.enable(tiny_model("llama"))
    reference = torch.full((1, 40), 500)
    with pytest.raises(ValueError, match=r"ScriptedDrafter.propose returned token ids outside .*\[0, 96\)"):
        model.generate(prompt(), drafter=ScriptedDrafter(reference), max_new_tokens=5)


def test_drafter_argument_errors():
    model = hf_specdec.enable(tiny_model("llama"))
    with pytest.raises(ValueError, match="either `assistant_model` or `drafter`, not both"):
        model.generate(prompt(), assistant_model=model, drafter=model)
    with pytest.raises(ValueError, match="Unknown drafter 'nope' for `drafter`. Registered: .*'model'"):
        model.generate(prompt(), drafter="nope")
    with pytest.raises(TypeError, match="`drafter` must be a registered drafter name"):
        model.generate(prompt(), drafter=3)
    with pytest.raises(TypeError, match="`assistant_model` must be a transformers `PreTrainedModel`"):
        model.generate(prompt(), assistant_model="not-a-model")
    with pytest.raises(ValueError, match="`prompt_lookup_num_tokens=3` selects transformers' own"):
        model.generate(prompt(), assistant_model=model, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="`stop_strings`.*needs the model's tokenizer"):
        model.generate(prompt(), assistant_model=model, stop_strings="x")
    with pytest.raises(ValueError, match="`output_attentions` and `output_hidden_states` are not supported"):
        model.generate(prompt(), assistant_model=model, output_attentions=True, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="`cache_implementation='paged'` switches `generate` to continuous batching"):
        model.generate(prompt(), assistant_early_exit=1, cache_implementation="paged", max_new_tokens=3)


@pytest.mark.parametrize(
    "name, value, fix",
    [
        ("num_assistant_tokens", 3, "`speculative_gamma=3` instead"),
        ("max_matching_ngram_size", 4, 'drafter_kwargs={"max_ngram_size": 4}'),
        ("num_assistant_tokens_schedule", "heuristic", "`speculative_gamma_policy=...` instead"),
        ("assistant_confidence_threshold", 0.4, "Drop it: the γ policy"),
        ("assistant_lookbehind", 20, "`CrossTokenizerDrafter` realigns"),
        ("target_lookbehind", 20, "`CrossTokenizerDrafter` realigns"),
        ("assistant_ensemble_weight", 0.5, "`speculative_lenience`"),
    ],
)
def test_transformers_assisted_generation_settings_are_refused_not_ignored(name, value, fix):
    """transformers' own assisted-generation settings used to be silently unused next to an hf_specdec drafter
    (`num_assistant_tokens=3` drafted 5): refused in the call and in a passed config, naming the replacement."""
    model = hf_specdec.enable(tiny_model("llama"))
    message = rf"`{name}={value!r}` is a setting of transformers' own assisted generation.*{re.escape(fix)}"
    with pytest.raises(ValueError, match=message):
        model.generate(prompt(), assistant_model=model, max_new_tokens=3, **{name: value})
    config = GenerationConfig(max_new_tokens=3, do_sample=False)
    setattr(config, name, value)
    with pytest.raises(ValueError, match=message):
        model.generate(prompt(), drafter="prompt_lookup", generation_config=config)
    assert getattr(config, name) == value  # the user's config is left as it was
    # unset (None) or switched off (use_mtp=False): not refused
    model.generate(prompt(), assistant_model=model, max_new_tokens=3, **{name: False if name == "use_mtp" else None})


@pytest.mark.parametrize(
    "name, value, registered", [("use_mtp", True, "mtp"), ("assistant_early_exit", 2, "early_exit")]
)
def test_requests_for_the_models_own_drafter_beside_another_drafter_are_refused(name, value, registered):
    """`use_mtp=True` and `assistant_early_exit=k` ask for the drafter that ships with the model (served by
    hf_specdec's drafter of that family): beside another drafter they are refused, in the call and in a passed
    config, which is left as it was."""
    model = hf_specdec.enable(tiny_model("llama"))
    message = (
        rf"`{name}={value!r}` asks for the model's own drafter, but the call also passes .*drafter=\"{registered}\""
    )
    with pytest.raises(ValueError, match=message):
        model.generate(prompt(), assistant_model=model, max_new_tokens=3, **{name: value})
    config = GenerationConfig(max_new_tokens=3, do_sample=False)
    setattr(config, name, value)
    with pytest.raises(ValueError, match=message):
        model.generate(prompt(), drafter="prompt_lookup", generation_config=config)
    assert getattr(config, name) == value
    # unset (None) or switched off (use_mtp=False): another drafter runs
    model.generate(prompt(), assistant_model=model, max_new_tokens=3, **{name: False if name == "use_mtp" else None})


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(penalty_alpha=0.6, top_k=4), "`penalty_alpha` / `top_k` selects contrastive search"),
        (dict(force_words_ids=[[5]]), "`force_words_ids` / `constraints` selects constrained beam search"),
        (dict(dola_layers="high"), "`dola_layers` selects DoLa decoding"),
        (dict(dola_layers=[2], do_sample=True), "`dola_layers` selects DoLa decoding"),
        (dict(guidance_scale=1.5), "`guidance_scale` cannot be combined with a drafter"),
    ],
)
def test_decoding_methods_a_drafter_cannot_serve_are_refused_not_ignored(settings, message):
    """Contrastive search and DoLa are decoding methods of their own (plain `generate` fetches them from the Hub) and
    classifier-free guidance runs a second context per step: the loop used to decode greedily without the first two,
    silently. Refused in the call and in a passed config, which is left as it was; off, they are not refused."""
    model = hf_specdec.enable(tiny_model("llama"))
    for drafter in (dict(assistant_model=model), dict(drafter="prompt_lookup")):
        with pytest.raises(ValueError, match=re.escape(message)):
            model.generate(prompt(), max_new_tokens=3, **drafter, **settings)
    config = GenerationConfig(max_new_tokens=3, **settings)
    with pytest.raises(ValueError, match=re.escape(message)):
        model.generate(prompt(), drafter="prompt_lookup", generation_config=config)
    assert all(getattr(config, name) == value for name, value in settings.items())
    off = (
        dict(penalty_alpha=0.6, top_k=1) if "penalty_alpha" in settings else dict(dola_layers=None, guidance_scale=None)
    )
    out = model.generate(prompt(), drafter="prompt_lookup", max_new_tokens=6, **off)
    assert torch.equal(out, model.generate(prompt(), max_new_tokens=6, **off))


def test_registry():
    class Echo(hf_specdec.Drafter):
        def propose(self, input_ids, num_tokens):
            return hf_specdec.DraftProposal(tokens=input_ids[:, -1:].repeat(1, num_tokens))

    hf_specdec.register_drafter("echo-test", Echo)
    try:
        assert "echo-test" in hf_specdec.list_drafters() and "model" in hf_specdec.list_drafters()
        with pytest.raises(ValueError, match="'echo-test' is already registered .*Echo"):
            hf_specdec.register_drafter("echo-test", Echo)
        with pytest.raises(TypeError, match="subclass of `hf_specdec.drafters.base.Drafter`"):
            hf_specdec.register_drafter("bad", dict)
        model = hf_specdec.enable(tiny_model("llama"))
        ids = prompt()
        assert torch.equal(
            model.generate(ids, drafter="echo-test", max_new_tokens=10), model.generate(ids, max_new_tokens=10)
        )
    finally:
        _DRAFTERS._classes.pop("echo-test")  # the registry has no public unregister; leave it as found
