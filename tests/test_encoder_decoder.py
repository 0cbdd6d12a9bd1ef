"""Encoder-decoder targets (T5, BART, Marian): exact greedy identity, exact sampling, drafters, errors."""

import copy

import pytest
import torch
from conftest import (
    SEQ2SEQ_ARCHITECTURES,
    VOCAB,
    ScriptedDrafter,
    noisy_copy,
    source,
    tiny_model,
    tiny_seq2seq,
    tiny_seq2seq_config,
)
from sweep.tiny import tiny_model as tiny_mapping_model
from test_sampling_distribution import P_THRESHOLD, SAMPLES, goodness_of_fit
from transformers import AutoModelForCausalLM, BartForCausalLM, EncoderDecoderCache

import hf_specdec
from hf_specdec.caches import cache_of

PROCESSING = dict(repetition_penalty=1.3, no_repeat_ngram_size=2)  # random-init decoders repeat themselves
NEW_TOKENS = 20


@pytest.fixture(scope="module", params=SEQ2SEQ_ARCHITECTURES)
def seq2seq_setup(request):
    target = hf_specdec.enable(tiny_seq2seq(request.param, seed=0))
    src = source(10, seed=3)
    plain = target.generate(src, max_new_tokens=NEW_TOKENS, **PROCESSING)
    assert plain.shape[1] == NEW_TOKENS + 1  # decoder start token + new tokens
    assert len(set(plain[0, 1:].tolist())) > 8  # not degenerate: a wrong drafter would show
    return request.param, target, src, plain


def run(target, src, gamma=4, **drafter_args):
    # constant γ: these tests count rounds and drafts; tiny drafters on a CPU are often measured not to pay, which
    # the default "auto" policy would act on
    drafter_args.setdefault("speculative_gamma_policy", "constant")
    out = target.generate(
        src,
        speculative_gamma=gamma,
        max_new_tokens=NEW_TOKENS,
        return_dict_in_generate=True,
        **PROCESSING,
        **drafter_args,
    )
    assert isinstance(out, hf_specdec.SpeculativeEncoderDecoderOutput)
    return out.sequences, out.speculative_stats


@pytest.mark.parametrize("gamma", (1, 4, 9))
def test_scripted_drafters(seq2seq_setup, gamma):
    _, target, src, plain = seq2seq_setup
    sequences, stats = run(target, src, gamma, drafter=ScriptedDrafter(plain))
    assert torch.equal(sequences, plain) and stats.acceptance_rate == 1.0
    assert stats.target_calls == -(-NEW_TOKENS // (gamma + 1))
    sequences, stats = run(target, src, gamma, drafter=ScriptedDrafter(plain, period=1))
    assert torch.equal(sequences, plain) and stats.accepted_tokens == 0 and stats.target_calls == NEW_TOKENS
    sequences, stats = run(target, src, gamma, drafter=ScriptedDrafter(plain, period=3))
    assert torch.equal(sequences, plain) and 0 < stats.accepted_tokens < stats.drafted_tokens


def test_encoder_decoder_model_drafters(seq2seq_setup):
    arch, target, src, plain = seq2seq_setup
    # always right: the target drafts for itself (its own encoder run once more, for the drafter)
    sequences, stats = run(target, src, assistant_model=target)
    assert torch.equal(sequences, plain) and stats.acceptance_rate == 1.0
    # partly right: a noisy copy
    sequences, stats = run(target, src, assistant_model=noisy_copy(target, scale=0.05))
    assert torch.equal(sequences, plain)
    assert 0 < stats.accepted_tokens < stats.drafted_tokens
    # mostly wrong: an unrelated model of the same family
    sequences, stats = run(target, src, assistant_model=tiny_seq2seq(arch, seed=7))
    assert torch.equal(sequences, plain)
    assert stats.acceptance_rate < 0.5


def test_drafter_leaves_user_models_untouched(seq2seq_setup):
    arch, target, src, _ = seq2seq_setup
    drafter = tiny_seq2seq(arch, seed=7)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    config_before = drafter.generation_config.to_dict()
    run(target, src, assistant_model=drafter)
    assert all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())
    assert drafter.generation_config.to_dict() == config_before


def test_prompt_lookup_and_ngram(seq2seq_setup):
    _, target, src, plain = seq2seq_setup
    sequences, _ = run(target, src, drafter="prompt_lookup", drafter_kwargs={"min_ngram_size": 1})
    assert torch.equal(sequences, plain)
    table = hf_specdec.NGramDrafter.from_corpus([plain[0].tolist()] * 2, n=2, vocab_size=VOCAB)
    sequences, stats = run(target, src, drafter=table)
    assert torch.equal(sequences, plain) and stats.accepted_tokens > 0


def test_decoder_only_drafter_shares_target_encoder_outputs():
    target = hf_specdec.enable(tiny_seq2seq("bart", seed=0))
    src = source(10, seed=3)
    plain = target.generate(src, max_new_tokens=NEW_TOKENS, **PROCESSING)
    # the distil-whisper pattern: a decoder-only drafter with cross-attention reads the target's encoder outputs
    config = copy.deepcopy(target.config)
    config.is_encoder_decoder, config.is_decoder = False, True
    decoder = BartForCausalLM(config).eval()
    decoder.model.decoder.load_state_dict(target.model.decoder.state_dict())
    decoder.lm_head.load_state_dict(target.lm_head.state_dict())
    sequences, stats = run(target, src, assistant_model=decoder)
    assert torch.equal(sequences, plain)
    assert stats.acceptance_rate == 1.0  # it is the target's own decoder: it must see the real encoder outputs
    # with different weights it is partly right, and still exact
    sequences, stats = run(target, src, assistant_model=noisy_copy(decoder, scale=0.05))
    assert torch.equal(sequences, plain) and stats.accepted_tokens < stats.drafted_tokens


@pytest.mark.parametrize("model_type", ["t5gemma", "t5gemma2"])
def test_sliding_window_decoder_drafts_for_itself(model_type):
    # self-attention with a window of 8 over a 12-token source: the drafter's cross-attention cache keeps the whole
    # source (t5gemma2's merged self + cross attention crashed on a windowed one: mask 9 vs keys 14)
    target = hf_specdec.enable(tiny_mapping_model(model_type))
    src = source(12, seed=3)
    assert target.config.get_text_config(decoder=True).sliding_window < src.shape[1]
    plain = target.generate(src, max_new_tokens=NEW_TOKENS, **PROCESSING)
    assert len(set(plain[0, 1:].tolist())) > 8
    sequences, stats = run(target, src, assistant_model=target)
    assert torch.equal(sequences, plain) and stats.acceptance_rate == 1.0


def test_cache_rollback_keeps_cross_attention():
    target = hf_specdec.enable(tiny_seq2seq("t5", seed=0))
    src = source(10, seed=3)
    plain = target.generate(src, max_new_tokens=NEW_TOKENS)
    out = target.generate(
        src,
        drafter=ScriptedDrafter(plain, period=3),
        speculative_gamma=5,
        max_new_tokens=NEW_TOKENS,
        return_dict_in_generate=True,
    )
    cache = cache_of(out)
    assert isinstance(cache, EncoderDecoderCache)
    # self-attention holds every decoder token but the newest; cross-attention still holds the whole source
    assert cache.self_attention_cache.get_seq_length() == out.sequences.shape[1] - 1
    assert cache.cross_attention_cache.get_seq_length() == src.shape[1]


def test_prompt_lookup_copies_from_the_source():
    target = hf_specdec.enable(tiny_seq2seq("t5", seed=0))
    drafter = hf_specdec.PromptLookupDrafter(max_ngram_size=2, min_ngram_size=1)
    src = torch.tensor([[10, 11, 12, 13, 14, 0, 0]])
    context = hf_specdec.DraftContext(
        target=target,
        input_ids=torch.tensor([[0]]),
        logits_processor=None,
        generation_config=target.generation_config,
        vocab_size=VOCAB,
        model_kwargs={"attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0, 0]])},
        inputs_tensor=src,
    )

    def propose(output, num_tokens):  # a fresh per-call copy: the index grows with one output
        return drafter.for_call(context).propose(torch.tensor([output]), num_tokens).tokens.tolist()[0]

    # the output so far ends with 11: copy what followed 11 in the source, stopping at its end (padding excluded)
    assert propose([0, 11], 5) == [12, 13, 14]
    assert propose([0, 11, 12, 13], 2) == [14]
    # a match in the output itself is more recent than the source's and wins
    assert propose([0, 14, 30, 31, 14], 2) == [30, 31]
    # the longest match wins over recency: (12, 13) occurs only in the source
    assert propose([0, 13, 40, 12, 13], 2) == [14]
    # no match anywhere: no proposal
    assert propose([0, 40], 3) == []


@torch.no_grad()
def test_sampling_follows_t5_target():
    target = hf_specdec.enable(tiny_seq2seq("t5", seed=0))
    drafter = tiny_seq2seq("t5", seed=1)
    src = source(8, seed=11)
    config = dict(temperature=0.9, top_k=4, repetition_penalty=1.3)
    generation_config, _ = target._prepare_generation_config(None, do_sample=True, **config)
    start = torch.tensor([[0]])
    procs = target._get_logits_processor(
        generation_config=generation_config,
        input_ids_seq_length=1,
        encoder_input_ids=src,
        prefix_allowed_tokens_fn=None,
        logits_processor=None,
        device=src.device,
        model_kwargs={},
    )

    def next_probs(decoder_ids):
        logits = target(input_ids=src, decoder_input_ids=decoder_ids).logits[:, -1].float()
        return procs(decoder_ids, logits).softmax(-1)[0]

    first = next_probs(start)
    table = {}
    for x1 in torch.nonzero(first).flatten().tolist():
        second = next_probs(torch.tensor([[0, x1]]))
        for x2 in torch.nonzero(second).flatten().tolist():
            table[(x1, x2)] = first[x1].item() * second[x2].item()
    assert len(table) >= 4

    def samples(model, **kwargs):  # one call: the rows of a batch are decoded one at a time, sharing the encoding
        torch.manual_seed(1234)
        out = model.generate(src, do_sample=True, max_new_tokens=2, num_return_sequences=SAMPLES, **config, **kwargs)
        return [tuple(row) for row in out[:, 1:].tolist()]

    assert goodness_of_fit(table, samples(target, assistant_model=drafter, speculative_gamma=2)) > P_THRESHOLD
    # power: the drafter's own samples fail the same test
    drafter_samples = samples(hf_specdec.enable(drafter))
    assert any(s not in table for s in drafter_samples) or goodness_of_fit(table, drafter_samples) < P_THRESHOLD


def test_encoder_decoder_drafter_for_decoder_only_target_is_refused():
    target = hf_specdec.enable(tiny_model("llama"))
    with pytest.raises(ValueError, match=r"`assistant_model` \(T5ForConditionalGeneration\) is an encoder-decoder"):
        target.generate(torch.tensor([[5, 6, 7]]), assistant_model=tiny_seq2seq("t5"), max_new_tokens=3)


def test_decoder_only_drafter_without_cross_attention_is_refused():
    target = hf_specdec.enable(tiny_seq2seq("t5"))
    with pytest.raises(
        ValueError, match=r"`assistant_model` \(LlamaForCausalLM\) is decoder-only without cross-attention"
    ):
        target.generate(source(), assistant_model=tiny_model("llama"), max_new_tokens=3)


def test_decoder_only_drafter_with_wrong_cross_attention_shape_is_refused():
    target = hf_specdec.enable(tiny_seq2seq("bart"))
    config = tiny_seq2seq_config("bart", d_model=16, is_encoder_decoder=False, is_decoder=True)
    with pytest.raises(ValueError, match=r"encoder states of size 16, but the target's encoder .* outputs size 32"):
        target.generate(source(), assistant_model=BartForCausalLM(config), max_new_tokens=3)


def test_encoder_decoder_drafter_vocabulary_mismatch_is_refused():
    target = hf_specdec.enable(tiny_seq2seq("t5"))
    with pytest.raises(ValueError, match="vocabulary of 64 tokens but the target has 96"):
        target.generate(source(), assistant_model=tiny_seq2seq("t5", vocab_size=64), max_new_tokens=3)


def test_a_source_given_as_embeddings_reaches_the_drafter_as_embeddings():
    """An encoder-decoder drafter whose encoder takes embeddings of the source's width encodes them as embeddings
    (Pop2Piano's `generate` always passes `inputs_embeds`); a drafter of another width needs the tokenized source."""
    target = hf_specdec.enable(tiny_seq2seq("t5"))
    embeds = target.get_input_embeddings()(source())  # [1, src_len, d_model]
    plain = target.generate(inputs_embeds=embeds, max_new_tokens=8)
    for drafter in (target, noisy_copy(target, scale=0.05), tiny_seq2seq("t5", seed=1)):
        out = target.generate(
            inputs_embeds=embeds, assistant_model=drafter, max_new_tokens=8, return_dict_in_generate=True
        )
        assert torch.equal(out.sequences, plain) and out.speculative_stats.target_calls > 0
    stats = target.generate(
        inputs_embeds=embeds, assistant_model=target, max_new_tokens=8, return_dict_in_generate=True
    ).speculative_stats
    assert stats.accepted_tokens == stats.drafted_tokens > 0  # the target as its own drafter: always right
    with pytest.raises(ValueError, match="needs the source as `input_ids`"):
        target.generate(inputs_embeds=embeds, assistant_model=tiny_seq2seq("t5", seed=1, d_model=48), max_new_tokens=3)


def test_decoder_only_llama_causal_drafter_still_works_for_decoder_only_target():
    # regression guard for the mode split in ModelDrafter
    target = hf_specdec.enable(tiny_model("llama"))
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = target.generate(ids, max_new_tokens=10)
    out = target.generate(ids, assistant_model=AutoModelForCausalLM.from_config(target.config), max_new_tokens=10)
    assert torch.equal(out, plain)


def test_encoder_decoder_drafter_without_source_is_refused():
    target = hf_specdec.enable(tiny_seq2seq("t5"))
    encoder_outputs = target.get_encoder()(input_ids=source())
    # generate then has no source tensor (it passes a placeholder of -100s)
    with pytest.raises(ValueError, match="needs the source as `input_ids`"):
        target.generate(encoder_outputs=encoder_outputs, assistant_model=tiny_seq2seq("t5", seed=1), max_new_tokens=3)


@pytest.mark.parametrize("arch", ["bart", "t5"])
def test_prefill_chunk_size_with_a_padded_source(arch):
    """Plain `generate`'s chunked prefill cuts an encoder-decoder's attention mask to the decoder prompt's length, so
    its first token sees the source's padding; speculation returned the unchunked answer instead, silently. A
    padded source with `prefill_chunk_size` is refused; an unpadded one stays exact."""
    target = hf_specdec.enable(tiny_seq2seq(arch))
    draft = noisy_copy(target, 0.05)
    sources = torch.cat([source(10, seed=0), source(10, seed=1)])
    padded = torch.ones_like(sources)
    padded[0, :4] = 0
    kwargs = dict(max_new_tokens=12, prefill_chunk_size=3)
    plain = target.generate(sources, attention_mask=padded, **kwargs)
    assert not torch.equal(plain, target.generate(sources, attention_mask=padded, max_new_tokens=12))  # the quirk
    for drafter in ({"assistant_model": draft}, {"drafter": "prompt_lookup"}):
        with pytest.raises(
            ValueError,
            match=r"`prefill_chunk_size=3` with the encoder-decoder \w+ and a padded "
            r"`attention_mask`: plain `generate`'s chunked prefill cuts",
        ):
            target.generate(sources, attention_mask=padded, speculative_gamma=3, **drafter, **kwargs)
        unpadded = torch.ones_like(sources)
        assert torch.equal(
            target.generate(sources, attention_mask=unpadded, speculative_gamma=3, **drafter, **kwargs),
            target.generate(sources, attention_mask=unpadded, **kwargs),
        )
