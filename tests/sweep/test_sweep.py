"""The architecture sweep: every model type in transformers' causal-LM, seq2seq-LM and speech-seq2seq mappings,
built tiny from its config, decoded greedily with speculation (the target as its own drafter; prompt lookup; a
left-padded batch of two) and compared token for token with plain `generate`, or refused with a message naming the
model class and the reason. Runs as its own CI step (`pytest -m sweep tests/sweep`); the default test run skips it.

Types whose `generate` takes other inputs than text ids get them from `INPUTS` (MusicGen's codebook rows, Pop2Piano's
audio features, VoxtralRealtime's streamed log-mel features); speech models get random features of their encoder's
shape. A model type that transformers cannot build even from a valid tiny config (`tiny.py`: a generic shrink plus
per-type overrides), or whose own plain `generate` fails on it, is listed in `NOT_RUN` with the error it raises; the
sweep asserts that error, so the list stays true as transformers changes. `KNOWN_DEFECTS` lists hf_specdec's own
failures on a type, asserted until fixed. Assistants that cannot generate alone (Gemma 4's, which read their target's
key/value states) run as drafters of their targets (`test_gemma4_assistants`). Sparse-indexer models, refused at the sweep's top-k of 8, are also run with
a top-k covering the context (`test_sparse_indexer_covering_the_context`).
"""

import functools
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

import hf_specdec
import hf_specdec.drafters.gemma4_assistant  # registers `drafter="gemma4_assistant"`

sys.path.insert(0, str(Path(__file__).parent))
from tiny import VOCAB, mapping_types, tiny_model

torch.set_num_threads(1)  # tiny models gain nothing from threads

pytestmark = pytest.mark.sweep

NEW_TOKENS = 20
GAMMA = 4

# refusals the sweep accepts: each names the model class (or the argument) and says why
REFUSALS = [
    r"\w+ cannot be verified exactly by speculative decoding: ",
    r"\w+ is stateful: its recurrent state cannot be rolled back",
    r"\w+ cannot be verified exactly on rows with padding: ",
    r"\w+ generates without a `Cache` object",
    r"The target's cache \(\w+, cache_implementation=.*\) cannot be rolled back",
    r"`assistant_model` \(\w+\) uses a cache that cannot be rolled back",
    r"`use_cache=False` cannot be combined with a drafter",  # the model's generation config turns the cache off
    # the model's generation config asks for beam search, which needs a draft model (prompt lookup is refused)
    r"Speculative beam search \(`num_beams` > 1\) needs a draft model",
    # a draft model whose own generate feeds it more per step (KyutaiSpeechToText's audio frames)
    r"`assistant_model` \(\w+\) failed in its first forward as a drafter",
    # a class whose own `generate` runs its own loop: it never takes hf_specdec's (MusicGen's causal LMs), or takes
    # and ignores it (Dia)
    r"\w+ cannot run speculative decoding: its own `generate` (decodes|takes `custom_generate` but decodes) with a "
    r"loop of its own",
    # a class that decodes with its own `_sample` (VibeVoice's audio between tokens), which the loop would replace
    r"\w+ cannot run speculative decoding: it decodes with its own `_sample`",
]

# model type -> (stage, start of the error), or a list of them where transformers releases differ: the tiny config is
# not built, or plain `generate` itself fails on it.
# Each says why: transformers' own model code, or a package this machine lacks; none is a limit of speculative
# decoding.
NOT_RUN = {
    # the multimodal wrapper needs timm and PIL (whichever is missing is named first), not installed here
    # (gemma3n_text runs)
    "gemma3n": ("build", "ImportError: TimmWrapperModel requires the "),
    # Gemma 4 assistants read every layer's keys and values from their target (the config requires it), but
    # transformers 5.23's Gemma4TextConfig.kv_sharing_modes requires a producing layer of each kind: the model does
    # not build even from a valid config (tiny.DEFAULTS). From 5.24 they build, and plain `generate` fails on their
    # cache, which holds no attention layer of their own: they cannot generate alone (their forward requires the
    # target's `inputs_embeds` and `shared_kv_states`). They run as drafters of their targets in
    # `test_gemma4_assistants`.
    "gemma4_assistant": [
        ("build", "ValueError: The set of layer types producing a cache is diff"),
        ("generate", "ValueError: `get_seq_length` can only be called on Attention layers"),
    ],
    "gemma4_unified_assistant": [
        ("build", "ValueError: The set of layer types producing a cache is diff"),
        ("generate", "ValueError: `get_seq_length` can only be called on Attention layers"),
    ],
    # its generate needs `diffusers`, not installed here
    "vibevoice": ("generate", "ImportError: The default VibeVoice noise scheduler (`DPMSolv"),
}

# model type -> (drafter runs, start of the error): known crashes or refusals inside hf_specdec that it should not
# have, kept visible here (each run asserts the error until it is fixed)
KNOWN_DEFECTS: dict[str, tuple[tuple[str, ...], str]] = {}

# stateful model types (transformers' `_is_stateful`) refused, with the start of the reason; every other stateful type
# that builds is identical to plain `generate` for every drafter run (its recurrent state rolled back from checkpoints)
STATEFUL_REFUSED = {
    # Mamba-1 layers (Zamba's too): the multi-token selective scan starts from zeros, not from the cached state
    "mamba": "its recurrent layers' forward over several new tokens ignores the state in the cache",
    "falcon_mamba": "its recurrent layers' forward over several new tokens ignores the state in the cache",
    "jamba": "its recurrent layers' forward over several new tokens ignores the state in the cache",
    "zamba": "its recurrent layers' forward over several new tokens ignores the state in the cache",
    # its RG-LRU and convolution states live on the modules, outside the cache
    "recurrent_gemma": "it keeps recurrent state on its modules",
    # no `Cache` object at all
    "rwkv": "generates without a `Cache` object",
    "xlstm": "generates without a `Cache` object",
}

# stateful model types served on rows without padding and refused, with the start of the reason, on a padded batch
# (DeepSeek-V4: its compressors count windows in cache slots, its several-token forward masks them by position ids)
PADDED_ROWS_REFUSED = {"deepseek_v4": "cannot be verified exactly on rows with padding"}

# model type -> why its drafters are silently not used (the output is plain `generate`'s, without speculation or a
# refusal): a defect inside hf_specdec, asserted until it is fixed
DRAFTER_IGNORED: dict[str, str] = {}


def raises_known_defect(model_type: str, label: str, run) -> bool:
    """Whether `KNOWN_DEFECTS` lists this model type and drafter run; if so, asserts `run()` still raises that error."""
    known = KNOWN_DEFECTS.get(model_type)
    if known is None or label not in known[0]:
        return False
    with pytest.raises(Exception, match=re.escape(known[1])):
        run()
    return True


def _codebook_inputs(model, batch: int, generator):
    """MusicGen's decoder: one row of ids per (prompt, codebook), as its own tests feed it."""
    return {"input_ids": torch.randint(4, VOCAB, (batch * model.config.num_codebooks, 8), generator=generator)}


def _piano_inputs(model, batch: int, generator):
    """Pop2Piano: audio features (batch, frames, d_model), as its feature extractor's beat-aligned ones."""
    return {"input_features": torch.randn(batch, 16, model.config.d_model, generator=generator)}


def _streaming_audio_inputs(model, batch: int, generator):
    """VoxtralRealtime: text ids with log-mel features (batch, mel bins, frames) whose audio covers every position of
    the generation (`audio_length_per_tok` frames each), as its own tests make them; no padding (its features would
    need the same)."""
    config = model.config
    ids = torch.randint(4, VOCAB, (batch, 8), generator=generator)
    frames = (ids.shape[1] + NEW_TOKENS) * config.audio_length_per_tok
    return {
        "input_ids": ids,
        "input_features": torch.randn(batch, config.audio_config.num_mel_bins, frames, generator=generator),
    }


# the model's config type -> its inputs, for types whose `generate` takes more than (or other than) text ids
INPUTS = {
    "musicgen_decoder": _codebook_inputs,
    "musicgen_melody_decoder": _codebook_inputs,
    "pop2piano": _piano_inputs,
    "voxtral_realtime": _streaming_audio_inputs,
}


def inputs_for(model, batch: int):
    generator = torch.Generator().manual_seed(0)
    config = model.config
    if config.model_type in INPUTS:
        return INPUTS[config.model_type](model, batch, generator)
    name = model.main_input_name
    if name == "inputs":  # a composite speech model (SpeechEncoderDecoder): its encoder's input
        name = model.get_encoder().main_input_name
    features = getattr(config, "feature_projection_input_dim", None) or getattr(config, "input_feat_per_channel", None)
    if name == "input_features" and features:  # (batch, frames, features), as Speech2Text and SeamlessM4T take them
        return {
            "input_features": torch.randn(
                batch, 64, features * getattr(config, "input_channels", 1), generator=generator
            )
        }
    if name == "input_features":
        bins = getattr(config, "num_mel_bins", None) or 80
        frames = min(2 * getattr(config, "max_source_positions", 64), 3000)
        return {"input_features": torch.randn(batch, bins, frames, generator=generator)}
    frame = getattr(getattr(config, "codec_config", None), "frame_size", None)
    if frame:  # streaming speech-to-text (Kyutai): one token per audio frame of its codec
        return {"input_values": torch.randn(batch, 1, frame * (NEW_TOKENS + 1), generator=generator)}
    if name == "input_values":
        return {"input_values": torch.randn(batch, 1600, generator=generator)}
    ids = torch.randint(4, VOCAB, (batch, 8), generator=generator)
    if batch > 1 and not config.is_encoder_decoder:  # left padding, as batched decoder-only generation needs
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        ids[1, :3] = model.generation_config.pad_token_id or 0
        return {"input_ids": ids, "attention_mask": mask}
    return {"input_ids": ids}


def greedy(model, inputs, **kwargs):
    """`generate`'s output as a `ModelOutput` (with `speculative_stats` when speculating): its ids are `.sequences`
    (Whisper's keep the decoder start token there, not in its plain tensor output)."""
    return model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True, **kwargs)


def outcome(model, inputs, plain, **drafter):
    """ "identical" (the same ids as plain `generate`, `plain`, with target calls booked by the speculative loop),
    "identical, drafter ignored" (the same ids, but the class's `generate` never ran the loop), or the refusal."""
    try:
        spec = greedy(model, inputs, speculative_gamma=GAMMA, **drafter)
    except ValueError as error:
        message = str(error)
        assert any(re.search(pattern, message) for pattern in REFUSALS), f"unexpected error: {message}"
        return "refused: " + message
    assert torch.equal(spec.sequences, plain), f"silent mismatch:\n{plain}\n{spec.sequences}"
    return "identical" if spec.speculative_stats.target_calls > 0 else "identical, drafter ignored"


@pytest.mark.parametrize("model_type", list(mapping_types()))
def test_architecture(model_type):
    warnings.simplefilter("ignore")
    expected_failure = NOT_RUN.get(model_type)
    try:
        model = tiny_model(model_type)
        stage = "generate"
        inputs = {1: inputs_for(model, 1), 2: inputs_for(model, 2)}
        plain = {batch: greedy(model, x).sequences for batch, x in inputs.items()}
    except Exception as error:
        stage = "build" if "model" not in locals() else "generate"
        assert expected_failure is not None, f"{model_type}: {stage} failed: {type(error).__name__}: {error}"
        message = f"{type(error).__name__}: {str(error).strip()}".splitlines()[0]
        expected = expected_failure if isinstance(expected_failure, list) else [expected_failure]
        assert any(stage == want and message.startswith(start) for want, start in expected), (stage, message)
        return
    assert expected_failure is None, f"{model_type} now builds and generates: move it out of NOT_RUN"
    hf_specdec.enable(model)
    assert torch.equal(greedy(model, inputs[1]).sequences, plain[1])
    runs = {
        "self": (1, dict(assistant_model=model)),
        "prompt_lookup": (1, dict(drafter="prompt_lookup")),
        "batch": (2, dict(drafter="prompt_lookup")),
    }
    results = {}
    for label, (batch, drafter) in runs.items():
        if raises_known_defect(
            model_type,
            label,
            functools.partial(
                model.generate,
                **inputs[batch],
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                speculative_gamma=GAMMA,
                **drafter,
            ),
        ):
            continue
        results[label] = outcome(model, inputs[batch], plain[batch], **drafter)
    ignored = {label for label, result in results.items() if result == "identical, drafter ignored"}
    assert ignored == ({"self", "prompt_lookup", "batch"} if model_type in DRAFTER_IGNORED else set()), results
    if getattr(model, "_is_stateful", False):
        reason = STATEFUL_REFUSED.get(model_type)
        padded = PADDED_ROWS_REFUSED.get(model_type)
        if padded is not None:
            batch = results.pop("batch")
            assert batch.startswith("refused") and padded in batch, batch
        if reason is None:
            assert set(results.values()) == {"identical"}, results
        else:
            assert all(result.startswith("refused") and reason in result for result in results.values()), results
    # a model refused for one drafter is refused for all: the reason is the target's
    refused = {label for label, result in results.items() if result.startswith("refused")}
    assert refused in (set(), set(results)) or all("assistant_model" in results[r] for r in refused), results


# assistants that draft from a target's shared key/value states (transformers' SinglePositionMultiTokenCandidateGenerator)
# -> the target types they serve
ASSISTANT_TARGETS = {
    "gemma4_assistant": ("gemma4", "gemma4_text"),
    "gemma4_unified_assistant": ("gemma4_unified", "gemma4_unified_text"),
}


@pytest.mark.parametrize(
    "assistant_type, target_type", [(a, t) for a, targets in ASSISTANT_TARGETS.items() for t in targets]
)
def test_gemma4_assistants(assistant_type, target_type):
    """A tiny target with a tiny assistant of the type: transformers' own assisted `generate` and hf_specdec's (one
    sequence, the assistant as `assistant_model` and as `drafter="gemma4_assistant"`; a left-padded batch of two)
    give plain `generate`'s ids."""
    warnings.simplefilter("ignore")
    target, assistant = tiny_model(target_type), tiny_model(assistant_type)
    assistant.generation_config.num_assistant_tokens = GAMMA  # what transformers drafts per round
    inputs = {1: inputs_for(target, 1), 2: inputs_for(target, 2)}
    plain = {batch: greedy(target, x).sequences for batch, x in inputs.items()}
    assert torch.equal(greedy(target, inputs[1], assistant_model=assistant).sequences, plain[1])
    hf_specdec.enable(target)
    by_name = dict(drafter="gemma4_assistant", drafter_kwargs={"assistant_model": assistant})
    runs = {"assistant_model": (1, dict(assistant_model=assistant)), "drafter": (1, by_name), "batch": (2, by_name)}
    results = {}
    for label, (batch, drafter) in runs.items():
        run = functools.partial(
            target.generate,
            **inputs[batch],
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            speculative_gamma=GAMMA,
            **drafter,
        )
        if not raises_known_defect(assistant_type, label, run):
            results[label] = outcome(target, inputs[batch], plain[batch], **drafter)
    assert set(results.values()) == {"identical"}, results


# sparse attention whose indexer picks `index_topk` keys per query: with the sweep's top-k of 8 the model is refused
# (a forward over several tokens selects differently); with a top-k covering the whole context it is dense attention
# through the same indexer and its cache (`indexer_keys` realigned and cropped with the keys), so it must be exact
SPARSE_INDEXER = ["axk2", "deepseek_v32", "dots3_note_text", "glm_moe_dsa", "hy_v4"]


@pytest.mark.parametrize("model_type", SPARSE_INDEXER)
def test_sparse_indexer_covering_the_context(model_type):
    warnings.simplefilter("ignore")
    model = tiny_model(model_type, index_topk=64)
    inputs = {1: inputs_for(model, 1), 2: inputs_for(model, 2)}
    assert inputs[1]["input_ids"].shape[1] + NEW_TOKENS <= model.config.index_topk
    plain = {batch: greedy(model, x).sequences for batch, x in inputs.items()}
    hf_specdec.enable(model)
    results = {
        label: outcome(model, inputs[1], plain[1], **drafter)
        for label, drafter in {
            "self": dict(assistant_model=model),
            "prompt_lookup": dict(drafter="prompt_lookup"),
        }.items()
    }
    results["batch"] = outcome(model, inputs[2], plain[2], drafter="prompt_lookup")
    assert set(results.values()) == {"identical"}, results
