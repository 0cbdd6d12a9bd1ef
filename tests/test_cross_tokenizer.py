"""Drafting with another tokenizer (`CrossTokenizerDrafter`): greedy identity, exact sampling, incremental tables.

Tokenizers are trained here with `tokenizers` on a few sentences, three kinds with different boundary behaviour:
a byte-level BPE (GPT-2 style: "Ġ" spaces, every byte a token), a Metaspace BPE with byte fallback (Llama style:
"▁" spaces, a prepended "▁", "<0xE6>" byte tokens for characters it never saw) and a WordPiece ("##" continuations,
whitespace not kept). Drafters:

- random: a tiny model of the drafter's vocabulary (never or rarely right);
- follower: a tiny model of the drafter's vocabulary trained for a few seconds on the target's own greedy text,
  tokenized with the drafter's tokenizer (partly right, across different boundaries);
- permuted copy: the target itself with its vocabulary renumbered (the same strings under other ids) and its
  embedding rows moved accordingly: a genuine model with another tokenizer that is always right, up to the target's
  non-canonical token sequences.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import noisy_copy, tiny_model, tiny_seq2seq
from test_sampling_distribution import P_THRESHOLD, exact_two_token_distribution, goodness_of_fit, sample_pairs
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForSeq2SeqLM, PreTrainedTokenizerFast, T5Config, pipeline

import hf_specdec
import hf_specdec.pipelines
from hf_specdec.drafters.cross_tokenizer import (
    CrossTokenizerDrafter,
    IncrementalDetokenizer,
    IncrementalRetokenizer,
    shared_vocabulary,
)
from hf_specdec.drafters.retokenization import token_strings
from hf_specdec.mixin import resolve_drafter
from hf_specdec.modeling import logits_width

SENTENCES = [
    "the cat sat on the mat and the dog sat on the log",
    "speculative decoding drafts tokens with a small model and verifies them with a large one",
    "def add(a, b):\n    return a + b\n",
    "a quick brown fox jumps over the lazy dog while the cat watches",
    "café naïve résumé, the cat's hat",
]
UNSEEN = "東京 😀 ü"  # characters only the byte-level tokenizer and byte fallback can spell
PROMPTS = [
    "the cat sat on the",
    "def add(a, b):\n    ret",
    "a quick brown fox jumps over the la",
    "café naïve " + UNSEEN,
]


def byte_level_bpe(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(SENTENCES * 10 + [UNSEEN], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>")


def metaspace_byte_fallback(vocab_size: int = 160) -> PreTrainedTokenizerFast:
    """Llama-style: Metaspace pre-tokenizer ("▁", prepended at the start), BPE with the 256 byte tokens."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(
        SENTENCES * 10, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"])
    )
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in model["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def word_piece(vocab_size: int = 200) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(cleanup=False)
    tokenizer.train_from_iterator(
        SENTENCES * 10, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=["[UNK]", "[SEP]"])
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="[SEP]")


def permuted(tokenizer: PreTrainedTokenizerFast, seed: int = 0):
    """The same tokenizer with its non-special ids renumbered; returns it and `new_id_of` (`[V]`)."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    special = {token["id"] for token in state["added_tokens"]}
    movable = sorted(i for i in vocab.values() if i not in special)
    shuffled = torch.tensor(movable)[torch.randperm(len(movable), generator=torch.Generator().manual_seed(seed))]
    new_id_of = torch.arange(len(tokenizer))
    new_id_of[torch.tensor(movable)] = shuffled
    state["model"]["vocab"] = {string: int(new_id_of[i]) for string, i in vocab.items()}
    backend = Tokenizer.from_str(json.dumps(state))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token=tokenizer.unk_token, eos_token=tokenizer.eos_token
    ), new_id_of


def permuted_copy(model, new_id_of: torch.LongTensor):
    """`model` reading and writing renumbered ids: row `new_id_of[i]` holds what row `i` held."""
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for layer in {clone.get_input_embeddings(), clone.get_output_embeddings()}:
            for name in ("weight", "bias"):
                if getattr(layer, name, None) is not None:
                    getattr(layer, name)[new_id_of] = getattr(layer, name).clone()
    return clone


@pytest.fixture(scope="module")
def tokenizers():
    return {"byte_level": byte_level_bpe(), "metaspace": metaspace_byte_fallback(), "word_piece": word_piece()}


def text_model(tokenizer, seed: int = 0):
    """A tiny target that writes text: its head has a bias of -1e4 on the tokens that are not whole characters
    (single bytes of a multi-byte character) and on the special tokens, as a trained model would not emit broken
    characters."""
    model = hf_specdec.enable(tiny_model("llama", seed=seed, vocab_size=len(tokenizer)))
    head = model.lm_head
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        model.lm_head.weight.copy_(head.weight)
        model.lm_head.bias.zero_()
        model.lm_head.bias[[i for i, string in enumerate(token_strings(tokenizer)) if string is None]] = -1e4
    return model


@pytest.fixture(scope="module")
def targets(tokenizers):
    return {name: text_model(tok) for name, tok in tokenizers.items()}


def encode(tokenizer, text: str) -> torch.LongTensor:
    return torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])


def train_follower(target, tokenizer, assistant_tokenizer, steps: int = 120, seed: int = 0):
    """A tiny drafter of `assistant_tokenizer`'s vocabulary trained on the target's greedy text: partly right."""
    texts = []
    for text in PROMPTS + SENTENCES:
        ids = encode(tokenizer, text)
        out = target.generate(ids, max_new_tokens=40, do_sample=False)
        texts.append(tokenizer.decode(out[0], skip_special_tokens=True))
    drafter = tiny_model("llama", seed=seed + 1, vocab_size=len(assistant_tokenizer))
    rows = [assistant_tokenizer(text, add_special_tokens=False).input_ids for text in texts]
    length = min(len(row) for row in rows)
    batch = torch.tensor([row[:length] for row in rows])
    optimizer = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    drafter.train()
    for _ in range(steps):
        loss = drafter(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return drafter.eval()


@pytest.fixture(scope="module")
def followers(tokenizers, targets):
    pairs = [("byte_level", "metaspace"), ("metaspace", "byte_level")]
    return {pair: train_follower(targets[pair[0]], tokenizers[pair[0]], tokenizers[pair[1]]) for pair in pairs}


# --- greedy: identical to plain generate -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pair, kind",
    [
        (("byte_level", "metaspace"), "random"),
        (("byte_level", "metaspace"), "follower"),
        (("metaspace", "byte_level"), "random"),
        (("metaspace", "byte_level"), "follower"),
        (("byte_level", "word_piece"), "random"),  # WordPiece drops whitespace: its text is only close to the target's
    ],
)
def test_greedy_is_plain_generate(tokenizers, targets, followers, pair, kind):
    target, tokenizer, assistant_tokenizer = targets[pair[0]], tokenizers[pair[0]], tokenizers[pair[1]]
    if kind == "follower":
        drafter = followers[pair]
    else:
        drafter = tiny_model("llama", seed=3, vocab_size=len(assistant_tokenizer))
    accepted = 0
    for text in PROMPTS:
        ids = encode(tokenizer, text)
        plain = target.generate(ids, max_new_tokens=24, do_sample=False)
        for gamma in (1, 4):
            out = target.generate(
                ids,
                assistant_model=drafter,
                tokenizer=tokenizer,
                assistant_tokenizer=assistant_tokenizer,
                max_new_tokens=24,
                do_sample=False,
                speculative_gamma=gamma,
                speculative_gamma_policy="constant",
                return_dict_in_generate=True,
            )
            assert torch.equal(out.sequences, plain), (text, gamma)
            accepted += out.speculative_stats.accepted_tokens
    if kind == "follower":
        assert accepted > 20  # partly right: many drafts survive the crossing


@pytest.mark.parametrize("name, least_acceptance", [("byte_level", 0.8), ("metaspace", 0.3)])
def test_always_right_drafter_with_renumbered_vocabulary(tokenizers, targets, name, least_acceptance):
    tokenizer, target = tokenizers[name], targets[name]
    assistant_tokenizer, new_id_of = permuted(tokenizer)
    drafter = permuted_copy(target, new_id_of)
    assert tokenizer.get_vocab() != assistant_tokenizer.get_vocab()
    accepted = drafted = 0
    for text in PROMPTS:
        ids = encode(tokenizer, text)
        plain = target.generate(ids, max_new_tokens=30, do_sample=False)
        out = target.generate(
            ids,
            assistant_model=drafter,
            tokenizer=tokenizer,
            assistant_tokenizer=assistant_tokenizer,
            max_new_tokens=30,
            do_sample=False,
            speculative_gamma=4,
            return_dict_in_generate=True,
            speculative_gamma_policy="constant",
        )  # the counts below must not depend on timing
        assert torch.equal(out.sequences, plain)
        accepted += out.speculative_stats.accepted_tokens
        drafted += out.speculative_stats.drafted_tokens
    # the drafter is the target, but it reads the text re-encoded canonically: a random target often emits
    # non-canonical sequences ("draf" + "t" where the tokenizer has "draft"), which the copy does not see as such
    assert accepted >= least_acceptance * drafted > 0


def test_prompt_whose_last_token_merges_with_the_draft(tokenizers, targets):
    tokenizer = tokenizers["byte_level"]
    drafter = CrossTokenizerDrafter(tiny_model("llama", vocab_size=len(tokenizer)), tokenizer, tokenizer)
    # the context ends in "ca"; the drafted text "t sat" would merge into "cat" if encoded together
    context = encode(tokenizer, "the ca")
    anchor = context[0].tolist()
    assert tokenizer.decode(anchor) == "the ca" and "cat" not in tokenizer.convert_ids_to_tokens(anchor)
    drafted = tokenizer("t sat", add_special_tokens=False).input_ids
    tokens = drafter._target_tokens(anchor, [], drafted)
    assert tokenizer.decode(anchor + tokens) == "the cat sat"
    # a Metaspace target cannot spell "t" after "ca" without a space: nothing is proposed
    metaspace = tokenizers["metaspace"]
    drafter = CrossTokenizerDrafter(tiny_model("llama", vocab_size=len(tokenizer)), metaspace, tokenizer)
    anchor = encode(metaspace, "the ca")[0].tolist()
    assert drafter._target_tokens(anchor, [], drafted) == []
    # end to end: the target continues the merged word, output identical
    target = targets["byte_level"]
    ids = encode(tokenizer, "the cat sat on the ma")
    assistant_tokenizer, new_id_of = permuted(tokenizer)
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    out = target.generate(
        ids,
        assistant_model=permuted_copy(target, new_id_of),
        tokenizer=tokenizer,
        assistant_tokenizer=assistant_tokenizer,
        max_new_tokens=20,
        do_sample=False,
    )
    assert torch.equal(out, plain)


def test_batches_and_stop_strings(tokenizers, targets, followers):
    tokenizer, assistant_tokenizer = tokenizers["byte_level"], tokenizers["metaspace"]
    target, drafter = targets["byte_level"], followers[("byte_level", "metaspace")]
    tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(PROMPTS[:3], return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    plain = target.generate(**batch, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    out = target.generate(
        **batch,
        max_new_tokens=16,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        assistant_model=drafter,
        tokenizer=tokenizer,
        assistant_tokenizer=assistant_tokenizer,
    )
    assert torch.equal(out, plain)
    ids = encode(tokenizer, PROMPTS[0])
    stop = tokenizer.decode(target.generate(ids, max_new_tokens=6, do_sample=False)[0, -3:])
    plain = target.generate(ids, max_new_tokens=30, do_sample=False, stop_strings=stop, tokenizer=tokenizer)
    out = target.generate(
        ids,
        max_new_tokens=30,
        do_sample=False,
        stop_strings=stop,
        tokenizer=tokenizer,
        assistant_model=drafter,
        assistant_tokenizer=assistant_tokenizer,
    )
    assert torch.equal(out, plain) and out.shape[1] < ids.shape[1] + 30


def test_prompt_lookup_and_same_tokenizer_are_unaffected(tokenizers, targets):
    tokenizer, target = tokenizers["byte_level"], targets["byte_level"]
    ids = encode(tokenizer, PROMPTS[1])
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    out = target.generate(
        ids,
        drafter="prompt_lookup",
        drafter_kwargs={"max_ngram_size": 2},
        tokenizer=tokenizer,
        max_new_tokens=12,
        do_sample=False,
    )
    assert torch.equal(out, plain)
    # the same vocabulary on both sides needs no translation: the plain model drafter
    assert (
        type(resolve_drafter(None, target, tokenizer=tokenizer, assistant_tokenizer=tokenizer, target=target))
        is hf_specdec.ModelDrafter
    )
    other = tiny_model("llama", vocab_size=len(tokenizers["metaspace"]))
    drafter = resolve_drafter(
        None, other, tokenizer=tokenizer, assistant_tokenizer=tokenizers["metaspace"], target=target
    )
    assert isinstance(drafter, CrossTokenizerDrafter)
    # by registered name
    out = target.generate(
        ids,
        drafter="cross_tokenizer",
        max_new_tokens=12,
        do_sample=False,
        drafter_kwargs={"model": other, "tokenizer": tokenizer, "assistant_tokenizer": tokenizers["metaspace"]},
    )
    assert torch.equal(out, plain)


# --- sampling: the target's distribution ---------------------------------------------------------------------------


class GreedyButReportsQ(CrossTokenizerDrafter):
    """A wrong sampler for the power check: drafts q's argmax while returning q (transformers #32867's bug)."""

    def _draw(self, q):
        return q.argmax(dim=-1)


@pytest.mark.parametrize("kind", ["follower", "noisy_renumbered"])
def test_sampling_follows_the_target(tokenizers, targets, followers, kind):
    tokenizer, target = tokenizers["byte_level"], targets["byte_level"]
    if kind == "follower":  # another tokenizer: q lives on the shared tokens only
        assistant_tokenizer, model = tokenizers["metaspace"], followers[("byte_level", "metaspace")]
    else:  # the same strings under other ids, a partly-right copy: q and p overlap a lot
        assistant_tokenizer, new_id_of = permuted(tokenizer)
        noisy = noisy_copy(target, 0.5)
        with torch.no_grad():  # noise on the weights, not on the head's bias that keeps the text whole
            noisy.lm_head.bias.copy_(target.lm_head.bias)
        model = permuted_copy(noisy, new_id_of)
    config = dict(temperature=0.9, top_k=4)
    constant = dict(speculative_gamma=2, speculative_gamma_policy="constant")
    ids = encode(tokenizer, PROMPTS[0])
    table = exact_two_token_distribution(target, ids, config)
    assert len(table) >= 4
    exact = CrossTokenizerDrafter(model, tokenizer, assistant_tokenizer)
    samples = sample_pairs(target, ids, config, 1500, drafter=exact, **constant)
    assert goodness_of_fit(table, samples) > P_THRESHOLD
    out = target.generate(
        ids, drafter=exact, do_sample=True, max_new_tokens=30, return_dict_in_generate=True, **constant, **config
    )
    assert out.speculative_stats.drafted_tokens >= 20
    if kind == "noisy_renumbered":
        assert out.speculative_stats.accepted_tokens >= 5  # the drafts matter to the outcome
        # power: the same test rejects a drafter that returns a q it did not sample from
        wrong = GreedyButReportsQ(model, tokenizer, assistant_tokenizer)
        assert goodness_of_fit(table, sample_pairs(target, ids, config, 600, drafter=wrong, **constant)) < P_THRESHOLD


def test_proposal_q_is_the_shared_vocabulary(tokenizers, targets):
    tokenizer, assistant_tokenizer = tokenizers["byte_level"], tokenizers["metaspace"]
    target = targets["byte_level"]
    drafter = CrossTokenizerDrafter(
        tiny_model("llama", seed=5, vocab_size=len(assistant_tokenizer)), tokenizer, assistant_tokenizer
    )
    ids = encode(tokenizer, PROMPTS[0])
    from hf_specdec.proposals import draft_context

    generation_config, _ = target._prepare_generation_config(None, do_sample=True, temperature=1.0, top_k=0)
    call = drafter.for_call(
        draft_context(
            target,
            ids,
            target._get_logits_processor(
                generation_config=generation_config,
                input_ids_seq_length=ids.shape[1],
                encoder_input_ids=ids,
                prefix_allowed_tokens_fn=None,
                logits_processor=None,
                device="cpu",
                model_kwargs={},
            ),
            generation_config,
            {},
            None,
        )
    )
    proposal = call.propose(ids, 3)
    target_ids, _ = shared_vocabulary(tokenizer, assistant_tokenizer)
    support = torch.zeros(len(tokenizer), dtype=torch.bool)
    support[target_ids] = True
    assert proposal.probs.shape == (1, 3, target.config.vocab_size)
    assert torch.allclose(proposal.probs.sum(-1), torch.ones(1, 3))
    assert not proposal.probs[0, :, ~support].any()  # nothing outside the intersection
    assert bool(support[proposal.tokens[0]].all())


# --- incremental translation tables ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["byte_level", "metaspace", "word_piece"])
def test_token_strings_and_intersection(tokenizers, name):
    tokenizer = tokenizers[name]
    strings = token_strings(tokenizer)
    cat = tokenizer("the cat", add_special_tokens=False).input_ids[-1]
    assert strings[cat] == " cat"  # as it reads inside a text, leading space included
    assert all(strings[i] is None for i in tokenizer.all_special_ids)
    target_ids, assistant_ids = shared_vocabulary(tokenizers["byte_level"], tokenizer)
    assert len(set(target_ids.tolist())) == len(target_ids) and len(set(assistant_ids.tolist())) == len(assistant_ids)
    byte_strings = token_strings(tokenizers["byte_level"])
    for t, a in zip(target_ids.tolist()[:-1], assistant_ids.tolist()[:-1]):  # the last pair is the two EOS
        assert byte_strings[t] == strings[a]


@pytest.mark.parametrize("name", ["byte_level", "metaspace", "word_piece"])
def test_incremental_detokenizer(tokenizers, name):
    tokenizer = tokenizers[name]
    for text in SENTENCES + [UNSEEN + " and " + UNSEEN]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        whole = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        for step in (1, 2, 5):
            detokenizer = IncrementalDetokenizer(tokenizer)
            pieces = [detokenizer.advance(ids[i : i + step]) for i in range(0, len(ids), step)]
            assert "".join(pieces) == whole
            assert all("\ufffd" not in piece for piece in pieces)  # a character split across tokens waits


def test_detokenizer_holds_back_partial_characters(tokenizers):
    tokenizer = tokenizers["metaspace"]
    ids = tokenizer("東", add_special_tokens=False).input_ids
    assert len(ids) >= 3  # three byte-fallback tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.advance([i]) for i in ids[-3:]][:2] == ["", ""]


@pytest.mark.parametrize("name", ["byte_level", "metaspace", "word_piece"])
@pytest.mark.parametrize("step", [1, 3, 11])
def test_incremental_retokenizer(tokenizers, name, step):
    tokenizer = tokenizers[name]
    text = " ".join(SENTENCES) + " " + UNSEEN + " " + " ".join(SENTENCES)
    retokenizer = IncrementalRetokenizer(tokenizer, window=4)
    for start in range(0, len(text), step):
        retokenizer.extend(text[start : start + step])
        ids = retokenizer.ids()
        # always a tokenization of the text so far, and frozen ids are never re-encoded
        assert tokenizer.decode(ids, clean_up_tokenization_spaces=False) == tokenizer.decode(
            tokenizer(text[: start + step], add_special_tokens=False).input_ids, clean_up_tokenization_spaces=False
        )
    assert len(retokenizer.frozen) > len(ids) - 4 * 4
    if name != "word_piece":  # WordPiece splits on punctuation only at the pre-tokenizer: same ids too
        assert ids == tokenizer(text, add_special_tokens=False).input_ids


# --- bad input -----------------------------------------------------------------------------------------------------


def test_errors_name_the_argument_and_the_fix(tokenizers, targets):
    tokenizer, assistant_tokenizer = tokenizers["byte_level"], tokenizers["metaspace"]
    target = targets["byte_level"]
    drafter = tiny_model("llama", vocab_size=len(assistant_tokenizer))
    ids = encode(tokenizer, PROMPTS[0])
    with pytest.raises(
        ValueError,
        match=r"`assistant_tokenizer` \(\w+\) needs the target's tokenizer.*"
        r"`tokenizer=tokenizer`",
    ):
        target.generate(ids, assistant_model=drafter, assistant_tokenizer=assistant_tokenizer, max_new_tokens=3)
    with pytest.raises(ValueError, match=r"vocabulary of \d+ tokens but the target has \d+.*assistant_tokenizer="):
        target.generate(ids, assistant_model=drafter, tokenizer=tokenizer, max_new_tokens=3)
    with pytest.raises(
        ValueError,
        match=r"`assistant_tokenizer` .* needs an `assistant_model`.*"
        r"drafter='prompt_lookup'",
    ):
        target.generate(ids, drafter="prompt_lookup", tokenizer=tokenizer, assistant_tokenizer=assistant_tokenizer)
    with pytest.raises(
        TypeError,
        match=r"`assistant_tokenizer` must be a transformers tokenizer, got str.*"
        r"AutoTokenizer.from_pretrained",
    ):
        target.generate(ids, assistant_model=drafter, tokenizer=tokenizer, assistant_tokenizer="org/tokenizer")
    # a tokenizer without a decoder cannot move text
    mute = copy.deepcopy(assistant_tokenizer)
    mute.backend_tokenizer.decoder = None
    with pytest.raises(ValueError, match=r"`assistant_tokenizer` .* does not decode its tokens back.*decoder"):
        target.generate(ids, assistant_model=drafter, tokenizer=tokenizer, assistant_tokenizer=mute)
    # two tokenizers that share no string
    greek = Tokenizer(models.BPE(unk_token="<unk>"))
    greek.pre_tokenizer = pre_tokenizers.Metaspace()
    greek.decoder = decoders.Metaspace()
    greek.train_from_iterator(["αβγ δεζ ηθι"] * 5, trainers.BpeTrainer(vocab_size=40, special_tokens=["<unk>"]))
    greek = PreTrainedTokenizerFast(tokenizer_object=greek, unk_token="<unk>")
    greek_drafter = tiny_model("llama", vocab_size=len(greek))
    with pytest.raises(ValueError, match=r"`tokenizer` .* and `assistant_tokenizer` .* share no token string"):
        target.generate(
            ids, assistant_model=greek_drafter, tokenizer=tokenizer, assistant_tokenizer=greek, max_new_tokens=3
        )
    with pytest.raises(ValueError, match=r"`assistant_tokenizer` has \d+ tokens but `assistant_model`.*scores only"):
        CrossTokenizerDrafter(greek_drafter, tokenizer, assistant_tokenizer)
    with pytest.raises(ValueError, match=r"`tokenizer` has \d+ tokens but the target .* scores only"):
        target.generate(
            ids,
            assistant_model=tiny_model("llama", vocab_size=len(tokenizer)),
            tokenizer=assistant_tokenizer,
            assistant_tokenizer=tokenizer,
            max_new_tokens=3,
        )


# --- pipelines -----------------------------------------------------------------------------------------------------


def test_text_generation_pipeline(tokenizers, targets, followers):
    tokenizer, assistant_tokenizer = tokenizers["byte_level"], tokenizers["metaspace"]
    target, drafter = targets["byte_level"], followers[("byte_level", "metaspace")]
    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer)
    expected = pipe(PROMPTS[0], max_new_tokens=12, do_sample=False)
    # per call (the pipeline's tokenizer is found for `generate`), and at construction
    assert (
        pipe(
            PROMPTS[0],
            max_new_tokens=12,
            do_sample=False,
            assistant_model=drafter,
            assistant_tokenizer=assistant_tokenizer,
        )
        == expected
    )
    built = pipeline(
        "text-generation",
        model=target,
        tokenizer=tokenizer,
        assistant_model=drafter,
        assistant_tokenizer=assistant_tokenizer,
    )
    assert built(PROMPTS[0], max_new_tokens=12, do_sample=False) == expected


def test_text2text_pipeline_with_an_encoder_decoder_assistant(tokenizers):
    target, tokenizer, assistant, assistant_tokenizer = seq2seq_pair(tokenizers)
    texts = ["the cat sat on the mat", "speculative decoding drafts tokens"]
    for text in texts:
        assert_plain(target, encode(tokenizer, text), tokenizer, assistant, assistant_tokenizer)
    pipe = pipeline("text2text-generation", model=target, tokenizer=tokenizer)
    expected = pipe(texts[0], max_new_tokens=10)
    assert (
        pipe(texts[0], max_new_tokens=10, assistant_model=assistant, assistant_tokenizer=assistant_tokenizer)
        == expected
    )
    built = pipeline(
        "text2text-generation",
        model=target,
        tokenizer=tokenizer,
        assistant_model=assistant,
        assistant_tokenizer=assistant_tokenizer,
    )
    assert built(texts[0], max_new_tokens=10) == expected
    with pytest.raises(
        ValueError,
        match=r"`assistant_tokenizer` .* needs an `assistant_model`|"
        r"is the tokenizer of an `assistant_model`",
    ):
        pipeline("text2text-generation", model=target, tokenizer=tokenizer, assistant_tokenizer=assistant_tokenizer)
    # a decoder-only assistant for an encoder-decoder target is refused clearly
    with pytest.raises(ValueError, match=r"`assistant_model` .* must be of the target's kind"):
        target.generate(
            encode(tokenizer, texts[0]),
            assistant_model=tiny_model("llama", vocab_size=len(assistant_tokenizer)),
            tokenizer=tokenizer,
            assistant_tokenizer=assistant_tokenizer,
            max_new_tokens=3,
        )


def test_retokenizer_pending_text_stays_short_without_safe_points(tokenizers):
    # a Metaspace tokenizer prepends "▁" to every text: a text without spaces has no safe point
    tokenizer = tokenizers["metaspace"]
    text = "thecatsatonthemat" * 20
    retokenizer = IncrementalRetokenizer(tokenizer, window=2)
    for start in range(0, len(text), 5):
        retokenizer.extend(text[start : start + 5])
    assert len(retokenizer.pending_ids()) <= 8 * 2 + 5
    # the price: each forced boundary reads as a space to this tokenizer (the drafter's input only, never the output)
    assert tokenizer.decode(retokenizer.ids()).replace(" ", "") == text


# --- one tokenizer, vocabularies padded to other widths (Qwen2.5-0.5B's 151936 logits, Qwen2.5-7B's 152064) --------


def padded_copy(model, width: int, seed: int = 7):
    """`model` with its vocabulary padded (or cut) to `width` rows: the shared rows keep its weights, new head rows
    are zero (never the argmax of a model whose real logits are sharp), new embedding rows random."""
    other = tiny_model("llama", seed=seed, vocab_size=width)
    state = model.state_dict()
    with torch.no_grad():
        for name, param in other.state_dict().items():
            source = state[name]
            if param.shape == source.shape:
                param.copy_(source)
            else:  # a vocabulary-sized matrix: rows are token ids
                rows = min(param.shape[0], source.shape[0])
                if name.startswith("lm_head"):
                    param.zero_()
                param[:rows] = source[:rows]
    return other


@pytest.fixture(scope="module")
def padded_pair(tokenizers):
    """A target whose 16 logits past its tokenizer are padding (as a trained model has untrained rows there, but here
    it may emit them, which reaches a narrower drafter's embedding)."""
    tokenizer = tokenizers["byte_level"]
    target = hf_specdec.enable(tiny_model("llama", seed=0, vocab_size=len(tokenizer) + 16))
    return tokenizer, target


@pytest.mark.parametrize("extra", [-16, 16])  # the drafter's width against the target's
@pytest.mark.parametrize("kind", ["always_right", "partly_right", "never_right"])
@pytest.mark.parametrize("layout", ["chain", "tree", "beam"])
def test_a_vocabulary_padded_to_another_width_drafts_exactly(padded_pair, extra, kind, layout):
    tokenizer, target = padded_pair
    width = logits_width(target) + extra
    drafter = {
        "always_right": lambda: padded_copy(target, width),
        "partly_right": lambda: noisy_copy(padded_copy(target, width), 0.5),
        "never_right": lambda: tiny_model("llama", seed=5, vocab_size=width),
    }[kind]()
    # the prompt ends in one of the target's padding ids: past a narrower drafter's vocabulary
    ids = torch.cat([encode(tokenizer, PROMPTS[0]), torch.tensor([[logits_width(target) - 1]])], dim=-1)
    options = {
        "chain": dict(speculative_gamma=3),
        "tree": dict(speculative_gamma=3, speculative_tree_budget=6),
        "beam": dict(num_beams=2, speculative_gamma=2),
    }[layout]
    plain = target.generate(ids, max_new_tokens=16, do_sample=False, num_beams=options.get("num_beams", 1))
    resolved = resolve_drafter(None, drafter, tokenizer=tokenizer, assistant_tokenizer=tokenizer, target=target)
    assert type(resolved) is hf_specdec.ModelDrafter and resolved.same_tokenizer  # ids need no translation
    out = target.generate(
        ids,
        max_new_tokens=16,
        do_sample=False,
        assistant_model=drafter,
        tokenizer=tokenizer,
        assistant_tokenizer=tokenizer,
        return_dict_in_generate=True,
        speculative_gamma_policy="constant",
        **options,
    )
    assert torch.equal(out.sequences, plain)
    stats = out.speculative_stats
    if kind == "always_right":
        assert stats.accepted_tokens > 0
    if kind == "never_right" and layout == "chain":
        assert stats.accepted_tokens < stats.drafted_tokens


@pytest.mark.parametrize("extra", [-16, 16])
def test_a_vocabulary_padded_to_another_width_samples_the_target(padded_pair, extra):
    tokenizer, target = padded_pair
    drafter = noisy_copy(padded_copy(target, logits_width(target) + extra), 0.3)
    config = dict(temperature=1.0, top_k=8)
    ids = torch.cat([encode(tokenizer, PROMPTS[1]), torch.tensor([[logits_width(target) - 1]])], dim=-1)
    table = exact_two_token_distribution(target, ids, config)
    # the target's padding ids (past the tokenizer, and past the narrower drafter) take part: 13% of the mass
    assert sum(p for pair, p in table.items() if max(pair) >= len(tokenizer)) > 0.1
    samples = sample_pairs(
        target,
        ids,
        config,
        2000,
        assistant_model=drafter,
        tokenizer=tokenizer,
        assistant_tokenizer=tokenizer,
        speculative_gamma=2,
        speculative_gamma_policy="constant",
    )
    assert goodness_of_fit(table, samples) > P_THRESHOLD
    # power: the same test rejects the drafter's own samples (on the prompt as it reaches the drafter)
    drafter_samples = sample_pairs(hf_specdec.enable(drafter), ids.clamp(max=logits_width(drafter) - 1), config, 2000)
    assert not set(drafter_samples) <= set(table) or goodness_of_fit(table, drafter_samples) < P_THRESHOLD


def test_a_vocabulary_of_another_width_is_refused_without_the_tokenizers(padded_pair):
    tokenizer, target = padded_pair
    drafter = padded_copy(target, len(tokenizer))
    with pytest.raises(ValueError, match=r"vocabulary of 300 tokens but the target has 316.*assistant_tokenizer="):
        target.generate(encode(tokenizer, PROMPTS[0]), assistant_model=drafter, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"vocabulary of 300 tokens but the target has 316.*same_tokenizer=True"):
        target.generate(encode(tokenizer, PROMPTS[0]), drafter=hf_specdec.ModelDrafter(drafter), max_new_tokens=4)
    with pytest.raises(TypeError, match="`same_tokenizer` must be a bool, got str 'yes'"):
        hf_specdec.ModelDrafter(drafter, same_tokenizer="yes")
    # set by hand, it drafts exactly
    ids = encode(tokenizer, PROMPTS[0])
    out = target.generate(ids, drafter=hf_specdec.ModelDrafter(drafter, same_tokenizer=True), max_new_tokens=8)
    assert torch.equal(out, target.generate(ids, max_new_tokens=8))


# --- edge cases: prompts without text, tokens outside the intersection, positions, tokenizer conventions ----------


def seq2seq_pair(tokenizers, **assistant_overrides):
    """A T5 target of the Metaspace tokenizer and a BART assistant of the byte-level one."""
    tokenizer, assistant_tokenizer = tokenizers["metaspace"], tokenizers["byte_level"]
    target = hf_specdec.enable(
        tiny_seq2seq(
            "t5",
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.unk_token_id,
            decoder_start_token_id=tokenizer.unk_token_id,
        )
    )
    overrides = dict(decoder_start_token_id=1, **assistant_overrides)
    assistant = tiny_seq2seq("bart", seed=2, vocab_size=len(assistant_tokenizer), **overrides)
    return target, tokenizer, assistant, assistant_tokenizer


def assert_plain(target, ids, tokenizer, assistant, assistant_tokenizer, **options):
    """Greedy with the cross-tokenizer assistant equals plain greedy; returns the speculative stats."""
    plain = target.generate(ids, max_new_tokens=10, do_sample=False)
    out = target.generate(
        ids,
        max_new_tokens=10,
        do_sample=False,
        assistant_model=assistant,
        tokenizer=tokenizer,
        assistant_tokenizer=assistant_tokenizer,
        return_dict_in_generate=True,
        **options,
    )
    assert torch.equal(out.sequences, plain)
    return out.speculative_stats


@pytest.mark.parametrize(
    "target_name, assistant_name, prompt",
    [
        ("byte_level", "metaspace", "<eos>"),  # unconditional generation from EOS
        ("metaspace", "byte_level", "<s>"),  # a Llama-style prompt of BOS alone
        ("metaspace", "byte_level", "<0xE6>"),  # one byte of a character: held back, no text yet
        ("word_piece", "byte_level", "[UNK]"),
    ],
)
def test_a_prompt_without_text_drafts_once_there_is_text(tokenizers, targets, target_name, assistant_name, prompt):
    tokenizer, assistant_tokenizer = tokenizers[target_name], tokenizers[assistant_name]
    ids = torch.tensor([[tokenizer.convert_tokens_to_ids(prompt)]])
    assert tokenizer.decode(ids[0], skip_special_tokens=True).strip("\ufffd") == ""
    drafter = tiny_model("llama", seed=3, vocab_size=len(assistant_tokenizer))
    stats = assert_plain(targets[target_name], ids, tokenizer, drafter, assistant_tokenizer)
    assert stats.drafted_tokens > 0  # the rounds after the first one have text to draft from


def test_sampled_draft_of_a_token_outside_the_intersection_ends_the_draft(tokenizers, targets):
    # `forced_bos_token_id` forces the first new token to one the vocabularies do not share (here <unk>)
    tokenizer, assistant_tokenizer = tokenizers["byte_level"], tokenizers["metaspace"]
    target = targets["byte_level"]
    forced = tokenizer.unk_token_id
    target_ids, _ = shared_vocabulary(tokenizer, assistant_tokenizer)
    assert forced not in target_ids.tolist()
    model = tiny_model("llama", seed=5, vocab_size=len(assistant_tokenizer))
    drafter = CrossTokenizerDrafter(model, tokenizer, assistant_tokenizer)
    ids = encode(tokenizer, "the")[:, -1:]  # forced_bos acts on a one-token prompt
    config = dict(temperature=0.9, top_k=4, forced_bos_token_id=forced)
    from test_sampling_distribution import processors

    from hf_specdec.proposals import draft_context

    generation_config, _ = target._prepare_generation_config(None, do_sample=True, **config)
    call = drafter.for_call(draft_context(target, ids, processors(target, ids, config), generation_config, {}, None))
    proposal = call.propose(ids, 3)
    assert proposal.tokens.tolist() == [[forced]] and proposal.probs[0, 0, forced] == 1  # drawn from q, then stop
    table = exact_two_token_distribution(target, ids, config)
    assert len(table) >= 3 and all(pair[0] == forced for pair in table)
    samples = sample_pairs(target, ids, config, 400, drafter=drafter, speculative_gamma=3)
    assert goodness_of_fit(table, samples) > P_THRESHOLD


def test_max_draft_steps_past_the_drafters_positions(tokenizers, targets):
    tokenizer, assistant_tokenizer = tokenizers["byte_level"], tokenizers["metaspace"]
    gpt2 = tiny_model("gpt2", seed=3, vocab_size=len(assistant_tokenizer), n_positions=40)  # learned positions
    ids = encode(tokenizer, PROMPTS[2])
    plain = targets["byte_level"].generate(ids, max_new_tokens=20, do_sample=False)
    for steps in (None, 30):
        out = targets["byte_level"].generate(
            ids,
            drafter=CrossTokenizerDrafter(gpt2, tokenizer, assistant_tokenizer, max_draft_steps=steps),
            max_new_tokens=20,
            do_sample=False,
            speculative_gamma=2,
            speculative_gamma_policy="constant",
        )
        assert torch.equal(out, plain), steps


def test_encoder_decoder_assistant_without_room_or_text_drafts_nothing(tokenizers):
    target, tokenizer, assistant, assistant_tokenizer = seq2seq_pair(tokenizers, max_position_embeddings=32)
    long_source = encode(tokenizer, SENTENCES[1] + " " + SENTENCES[1])
    assert len(assistant_tokenizer(SENTENCES[1] + " " + SENTENCES[1]).input_ids) > 32  # past its encoder's positions
    assert assert_plain(target, long_source, tokenizer, assistant, assistant_tokenizer).drafted_tokens == 0
    no_text = torch.tensor([[tokenizer.unk_token_id, tokenizer.eos_token_id]])  # nothing for the assistant to encode
    assert assert_plain(target, no_text, tokenizer, assistant, assistant_tokenizer).drafted_tokens == 0
    assert assert_plain(
        target, encode(tokenizer, SENTENCES[0]), tokenizer, assistant, assistant_tokenizer
    ).drafted_tokens


def test_encoder_decoder_assistant_decoder_start_as_transformers_finds_it(tokenizers):
    target, tokenizer, assistant, assistant_tokenizer = seq2seq_pair(tokenizers)
    ids = encode(tokenizer, SENTENCES[0])
    assistant.config.decoder_start_token_id = None  # in its generation config only
    assistant.generation_config.decoder_start_token_id = 1
    assert assert_plain(target, ids, tokenizer, assistant, assistant_tokenizer).drafted_tokens > 0
    # a T5Config built without the field has no such attribute
    config = T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=4, d_kv=8, vocab_size=len(assistant_tokenizer))
    assert not hasattr(config, "decoder_start_token_id")
    t5 = AutoModelForSeq2SeqLM.from_config(config).eval()
    t5.generation_config.decoder_start_token_id = 0
    assert assert_plain(target, ids, tokenizer, t5, assistant_tokenizer).drafted_tokens > 0
    t5.generation_config.decoder_start_token_id = t5.generation_config.bos_token_id = None
    with pytest.raises(ValueError, match=r"`assistant_model` \(T5\w+\) has no `decoder_start_token_id`.*Set"):
        assert_plain(target, ids, tokenizer, t5, assistant_tokenizer)


def t5_style_tokenizer() -> PreTrainedTokenizerFast:
    """Unigram with Metaspace (prepended "▁") and "▁" alone as the first plain id, as T5 / mT5 / Flan-T5 have."""
    words = ["▁the", "▁cat", "▁sat", "▁on", "▁mat", "▁dog", "▁a", "▁and", "the", "cat", "s", "a", "t", "o", "n", "m"]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)] + [
        (w, -3.0 - i / 10) for i, w in enumerate(words)
    ]
    backend = Tokenizer(models.Unigram(vocab, unk_id=2))
    backend.normalizer = normalizers.Replace(Regex(" {2,}"), " ")
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def byte_level_with_prefix_space(tokenizers) -> PreTrainedTokenizerFast:
    tokenizer = copy.deepcopy(tokenizers["byte_level"])
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    return tokenizer


@pytest.mark.parametrize("build", [lambda tokenizers: t5_style_tokenizer(), byte_level_with_prefix_space])
def test_tokenizers_with_start_of_text_conventions_are_accepted(tokenizers, targets, build):
    tokenizer, target, assistant_tokenizer = tokenizers["metaspace"], targets["metaspace"], build(tokenizers)
    drafter = tiny_model("llama", seed=3, vocab_size=len(assistant_tokenizer))
    stats = assert_plain(target, encode(tokenizer, "the cat sat on the"), tokenizer, drafter, assistant_tokenizer)
    assert stats.drafted_tokens > 0


def test_refusals_name_the_assistant_tokenizer(tokenizers, targets):
    from hf_specdec.continuous_batching import drafting_kwargs_error

    tokenizer, assistant_tokenizer = tokenizers["byte_level"], tokenizers["metaspace"]
    message = str(drafting_kwargs_error("assistant_tokenizer", assistant_tokenizer))
    assert message.startswith(f"`assistant_tokenizer=<{type(assistant_tokenizer).__name__}>` is not served")
    assert len(message) < 400
    with pytest.raises(ValueError, match=r"beam search \(`num_beams` > 1\) cannot draft with `assistant_tokenizer`"):
        targets["byte_level"].generate(
            encode(tokenizer, PROMPTS[0]),
            num_beams=2,
            max_new_tokens=4,
            assistant_model=tiny_model("llama", vocab_size=len(assistant_tokenizer)),
            tokenizer=tokenizer,
            assistant_tokenizer=assistant_tokenizer,
        )
