"""EAGLE-3 heads under concurrency and from hostile files (issue 45): concurrent calls on one target read their own
features only, a published head without `eagle_config` saves again, and a head whose files do not fit fails naming
the tensor or field, its value and the fix. Tiny targets built from configs."""

from __future__ import annotations

import copy
import json
import re
import threading

import pytest
import torch
from conftest import VOCAB, prompt
from safetensors.torch import save_file
from test_eagle import eagle_target, published_layout
from test_mtp import deepseek

import hf_specdec
from hf_specdec.capture import HiddenStateCapture
from hf_specdec.drafters.mtp import MtpDrafter

THREADS = 8


def _in_threads(work, count: int = THREADS) -> list:
    """`work(i)` for i < count, all started together; the results in order (an exception is returned, not raised)."""
    results = [None] * count
    start = threading.Barrier(count)

    def run(i):
        start.wait()
        try:
            results[i] = work(i)
        except Exception as error:  # reported by the caller's assertion, with the others
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.parametrize("case", ["chain", "tree", "by name", "mtp"])
def test_concurrent_calls_sharing_a_target_and_a_head_are_exact(case, tmp_path):
    """Every drafter that reads the target's hidden states (an EAGLE-3 head, a checkpoint's MTP layers)."""
    if case == "mtp":
        target, mtp = deepseek(1)
        drafter = dict(drafter=MtpDrafter(mtp))
    else:
        target = eagle_target("llama")
        head = hf_specdec.EagleDrafter.from_target(target, seed=1)
    if case == "by name":
        head.save_pretrained(tmp_path)
        drafter = dict(drafter="eagle", drafter_kwargs={"pretrained": str(tmp_path)})
    elif case in ("chain", "tree"):
        drafter = dict(drafter=head, speculative_tree_budget=6 if case == "tree" else None)
    run = dict(
        max_new_tokens=12,
        do_sample=False,
        speculative_gamma=3,
        speculative_gamma_policy="constant",
        return_dict_in_generate=True,
        **drafter,
    )
    prompts = [prompt(5 + i, seed=i) for i in range(THREADS)]

    def call(i):
        out = target.generate(prompts[i], **run)
        stats = out.speculative_stats
        return out.sequences, stats.drafted_tokens, stats.accepted_length_histogram

    serial = [call(i) for i in range(THREADS)]
    concurrent = _in_threads(call)
    failures = [repr(result)[:200] for result in concurrent if isinstance(result, Exception)]
    assert not failures, failures
    for (sequences, drafted, histogram), (want, want_drafted, want_histogram) in zip(concurrent, serial):
        # the same tokens, and the same drafts accepted: each call read its own features
        assert torch.equal(sequences, want)
        assert (drafted, histogram) == (want_drafted, want_histogram)
    assert all(not layer._forward_hooks for layer in target.model.layers)  # no hook is left behind


def test_a_capture_records_the_forwards_of_its_own_thread_only():
    target = eagle_target("llama")
    ids = prompt(6)
    mine = HiddenStateCapture(target, [1, 3])
    other = {}

    def another_call():
        other["capture"] = HiddenStateCapture(target, [1, 3])
        target(ids)
        other["recorded"] = other["capture"].take()

    worker = threading.Thread(target=another_call)
    worker.start()
    worker.join()
    assert mine.take() is None  # the other thread's forward is not this call's
    assert other["recorded"].shape == (1, 6, 64)
    target(ids[:, :4])
    assert mine.take().shape == (1, 4, 64) and other["capture"].take() is None
    copy.deepcopy(target)(ids)  # a copy made during the call carries no capture of it
    assert mine.take() is None
    other["capture"].close()
    assert all(len(layer._forward_hooks) == (i in (0, 2)) for i, layer in enumerate(target.model.layers))
    mine.close()
    mine.close()  # twice is harmless
    assert all(not layer._forward_hooks for layer in target.model.layers)


def _write_head(folder, config, tensors):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_a_published_head_without_eagle_config_saves_and_loads_again(tmp_path):
    target = eagle_target("llama")
    config, tensors = published_layout(target)
    del config["eagle_config"]  # as several published heads ship: the default layers
    drafter = hf_specdec.EagleDrafter.from_pretrained(_write_head(tmp_path / "published", config, tensors), target)
    drafter.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    layers = drafter.model.config.eagle_layers
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in layers]
    assert f"entries {layers}" in (tmp_path / "saved" / "README.md").read_text()
    again = hf_specdec.EagleDrafter.from_pretrained(tmp_path / "saved", target)
    run = dict(max_new_tokens=10, do_sample=False, speculative_gamma_policy="constant")
    ids = prompt(6, seed=3)
    assert torch.equal(target.generate(ids, drafter=drafter, **run), target.generate(ids, drafter=again, **run))


@pytest.mark.parametrize(
    "name, shape",
    [
        ("midlayer.self_attn.k_proj.weight", (24, 64)),
        ("midlayer.mlp.gate_proj.weight", (65, 32)),
        ("norm.weight", (31,)),
        ("lm_head.weight", (39, 32)),
        ("t2d", (95,)),
        ("embed_tokens.weight", (VOCAB, 16)),
    ],
)
def test_weights_of_the_wrong_size_are_named_with_the_size_the_config_gives(tmp_path, name, shape):
    target = eagle_target("llama")
    config, tensors = published_layout(target)
    want = tuple(tensors[name].shape)
    tensors[name] = torch.zeros(shape, dtype=tensors[name].dtype)
    folder = _write_head(tmp_path, config, tensors)
    with pytest.raises(
        ValueError,
        match=rf"has weights whose sizes do not match its config \(hidden_size=32, .*\): `{name}` is "
        rf"{re.escape(str(tuple(shape)))}, the config gives {re.escape(str(want))}.*config.json do not belong together",
    ):
        hf_specdec.EagleDrafter.from_pretrained(folder, target)


def test_a_d2t_outside_the_vocabulary_is_refused_at_load(tmp_path):
    target = eagle_target("llama")
    config, tensors = published_layout(target)
    tensors["d2t"][-1] += VOCAB
    folder = _write_head(tmp_path, config, tensors)
    with pytest.raises(
        ValueError,
        match=r"`d2t` that maps 1 draft id\(s\) outside the target's vocabulary \[0, 96\) \(draft id 39 -> "
        r"target id 1\d\d; `target = draft \+ d2t\[draft\]`\)",
    ):
        hf_specdec.EagleDrafter.from_pretrained(folder, target)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"hidden_size": "32"}, r"`hidden_size` must be a positive int, got '32'"),
        ({"num_attention_heads": 5}, r"`num_attention_heads` 5 is not a multiple of `num_key_value_heads` 2"),
        (
            {"num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": None},
            r"`hidden_size` 32 is not a multiple of `num_attention_heads` 5 \(and it gives no `head_dim`\)",
        ),
        ({"draft_vocab_size": 0}, r"`draft_vocab_size` must be a positive int, got 0"),
        ({"eagle_config": [0, 1]}, r"`eagle_config` must be an object whose `eagle_aux_hidden_state_layer_ids`"),
        ({"rms_norm_eps": "small"}, r"`rms_norm_eps` must be a positive number, got 'small'"),
    ],
)
def test_a_bad_head_config_names_the_field_and_the_file(tmp_path, change, match):
    target = eagle_target("llama")
    config, tensors = published_layout(target)
    config.update(change)
    folder = _write_head(tmp_path, config, tensors)
    with pytest.raises(ValueError, match=match + r".*Fix it in .*config.json"):
        hf_specdec.EagleDrafter.from_pretrained(folder, target)


@pytest.mark.parametrize("text", ["[" * 100_000, "[1, 2]"])
def test_a_config_json_that_is_not_a_json_object_is_named(tmp_path, text):
    target = eagle_target("llama")
    config, tensors = published_layout(target)
    folder = _write_head(tmp_path, config, tensors)
    (folder / "config.json").write_text(text)
    with pytest.raises(OSError, match=r"config.json (is not valid JSON \(RecursionError|holds a JSON list)"):
        hf_specdec.EagleDrafter.from_pretrained(folder, target)
