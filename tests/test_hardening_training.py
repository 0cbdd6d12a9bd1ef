"""Training and its saved files under bad input: arguments refused up front by name, checkpoint folders never
written through a link, resumes that contradict their checkpoint refused, and heads read from their published weight
files only. Tiny targets built from configs."""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file, save_file
from test_eagle import eagle_target

import hf_specdec
from hf_specdec.distill import distill_drafter, train_eagle_drafter, train_mtp_layers
from hf_specdec.training_checks import eval_split

FAST = dict(num_steps=1, batch_size=4, ttt_steps=1, show_progress=False)


def _texts(count: int = 8, length: int = 16, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (count, length), generator=generator).tolist()


@pytest.fixture(scope="module")
def target():
    return hf_specdec.enable(eagle_target("llama", seed=0))


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    """A head trained 2 steps with a checkpoint at step 2 (layers [1, 2, 3], a draft vocabulary of 40)."""
    folder = tmp_path_factory.mktemp("trained")
    train_eagle_drafter(
        target,
        texts=_texts(),
        **{**FAST, "num_steps": 2},
        save_every=2,
        layers=[1, 2, 3],
        draft_vocab_size=40,
        output_dir=folder,
    )
    return folder


# 1. eval_fraction


@pytest.mark.parametrize("value", [1.0, 2.0, float("nan"), -0.1])
def test_eval_fraction_outside_0_1_is_refused_by_name(target, value):
    with pytest.raises(ValueError, match=r"`eval_fraction` must be in \[0, 1\)"):
        train_eagle_drafter(target, texts=_texts(), **FAST, eval_fraction=value)


def test_mtp_eval_fraction_1_is_refused_not_an_endless_loop(target):
    with pytest.raises(ValueError, match=r"`eval_fraction` must be in \[0, 1\), got 1.0"):
        train_mtp_layers(target, texts=_texts(), num_steps=2, batch_size=4, eval_fraction=1.0, show_progress=False)


def test_an_empty_training_split_is_refused():
    assert eval_split([3, 1, 2], 0.5, "f") == ([3], [1, 2])
    with pytest.raises(ValueError, match="leaving none to train on"):
        eval_split([0], 0.5, "f")


# 2. checkpoint folders


def test_a_checkpoint_link_in_output_dir_is_refused_not_written_through(target, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "config.json").write_text("the victim's own file\n")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / "checkpoint-1")
    with pytest.raises(OSError, match=r"checkpoint-1 is a link .* Remove the link"):
        train_eagle_drafter(target, texts=_texts(), **FAST, save_every=1, output_dir=out)
    assert sorted(os.listdir(victim)) == ["config.json"]
    assert (victim / "config.json").read_text() == "the victim's own file\n"


# 3. the weight files a head is read from


def test_only_the_published_weight_files_of_a_head_are_read(target, trained, tmp_path):
    head = tmp_path / "head"
    shutil.copytree(trained, head)
    tensors = load_file(str(head / "model.safetensors"))
    stale = {**tensors, "fc.weight": torch.zeros_like(tensors["fc.weight"])}
    save_file(stale, str(head / "old_head.safetensors"), metadata={"format": "pt"})
    loaded = hf_specdec.EagleDrafter.from_pretrained(head, target=target)
    assert not bool((loaded.model.fc.weight == 0).all())
    # shards listed in the index are read; a folder with neither published name is refused
    (head / "model.safetensors").rename(head / "shard-1.safetensors")
    with pytest.raises(OSError, match=r"no `model.safetensors`, `model.safetensors.index.json`"):
        hf_specdec.EagleDrafter.from_pretrained(head, target=target)
    weight_map = dict.fromkeys(tensors, "shard-1.safetensors")
    (head / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    again = hf_specdec.EagleDrafter.from_pretrained(head, target=target)
    assert torch.equal(again.model.fc.weight, loaded.model.fc.weight)


# 4. resuming


@pytest.mark.parametrize(
    "change, match",
    [
        ({"layers": [2, 3, 4]}, r"`layers=\[2, 3, 4\]`, but the checkpoint .* `layers=\[1, 2, 3\]`"),
        ({"draft_vocab_size": 60}, r"`draft_vocab_size=60`, but the checkpoint .* `draft_vocab_size=40`"),
        ({"num_steps": 1}, r"`num_steps=1`, but the checkpoint .* already at step 2"),
        ({"other_target": True}, r"trained for another target"),
    ],
)
def test_a_resume_that_contradicts_its_checkpoint_is_refused(target, trained, tmp_path, change, match):
    folder = tmp_path / "resumed"
    shutil.copytree(trained, folder)
    change = dict(change)
    model = eagle_target("llama", seed=1) if change.pop("other_target", False) else target
    arguments = {**FAST, "num_steps": 3, **change}
    with pytest.raises(ValueError, match=match):
        train_eagle_drafter(model, texts=_texts(), resume_from_checkpoint=True, output_dir=folder, **arguments)


def test_a_resume_at_its_last_step_trains_no_further(target, trained, tmp_path):
    folder = tmp_path / "resumed"
    shutil.copytree(trained, folder)
    resumed = train_eagle_drafter(
        target, texts=_texts(), **{**FAST, "num_steps": 2}, resume_from_checkpoint=True, output_dir=folder
    )
    assert resumed.training_info["steps"] == 2
    assert resumed.model.config.eagle_layers == [1, 2, 3] and resumed.model.config.draft_vocab_size == 40


# 5. output_dir


@pytest.mark.parametrize("kind", ["file", "broken link"])
@pytest.mark.parametrize("trainer", ["eagle", "mtp", "distill"])
def test_an_output_dir_that_is_a_file_or_a_broken_link_is_refused_before_training(target, tmp_path, kind, trainer):
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("x")
    else:
        os.symlink(tmp_path / "missing", out)
    match = rf"`output_dir` .* is a {'file' if kind == 'file' else 'broken link'}, not a folder"
    with pytest.raises(ValueError, match=match):
        if trainer == "eagle":
            train_eagle_drafter(target, texts=_texts(), **FAST, output_dir=out)
        elif trainer == "mtp":
            train_mtp_layers(target, texts=_texts(), num_steps=1, show_progress=False, output_dir=out)
        else:
            config = copy.deepcopy(target.config)
            config.num_hidden_layers = 1
            distill_drafter(target, torch.tensor(_texts()), config, **_DISTILL, output_dir=out)


def test_cli_refuses_an_output_that_is_a_broken_link(tmp_path, capsys):
    from hf_specdec.cli import main

    out = tmp_path / "out"
    os.symlink(tmp_path / "missing", out)
    argv = ["train-drafter", "--target", str(tmp_path / "no-model"), "--output", str(out), "--steps", "1"]
    assert main([*argv, "--texts", str(tmp_path / "t.txt")]) == 2
    err = capsys.readouterr().err
    assert "--output" in err and "broken link" in err


# 6 and 9. values refused by name


_DISTILL = dict(num_steps=1, seq_len=8, batch_size=4, show_progress=False)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"draft_vocab_size": 0}, r"`draft_vocab_size` must be a positive int, got 0"),
        ({"draft_vocab_size": -5}, r"`draft_vocab_size` must be a positive int, got -5"),
        ({"texts": [[1.9, 2.9, 3.9, 4.9]] * 4}, r"`texts\[0\]` holds torch.float32 values"),
        ({"texts": [[1, 2, 3, 500]] * 4}, r"`texts\[0\]` holds the token id 500, outside .* \[0, 96\)"),
        ({"layers": []}, r"`layers` must be a non-empty list"),
        ({"batch_size": 0}, r"`batch_size` must be a positive int, got 0"),
        ({"warmup_steps": -1}, r"`warmup_steps` must be an int >= 0, got -1"),
        ({"save_every": -1}, r"`save_every` must be an int >= 0, got -1"),
        ({"answer_temperature": -1.0}, r"`answer_temperature` must be a finite number >= 0"),
        ({"answer_temperature": float("nan")}, r"`answer_temperature` must be a finite number >= 0"),
        ({"generation_batch_size": 0}, r"`generation_batch_size` must be a positive int, got 0"),
        ({"max_answer_tokens": 0}, r"`max_answer_tokens` must be a positive int, got 0"),
        ({"feature_dtype": "int64"}, r"`feature_dtype` must be a floating torch.dtype"),
    ],
)
def test_bad_eagle_training_values_are_refused_by_name(target, change, match):
    arguments = {"texts": _texts(), **FAST, **change}
    with pytest.raises(ValueError, match=match):
        train_eagle_drafter(target, **arguments)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"texts": [[1, 2, 3, 500]] * 4}, r"`texts\[0\]` holds the token id 500"),
        ({"answer_temperature": -1.0}, r"`answer_temperature` must be a finite number >= 0"),
        ({"generation_batch_size": -2}, r"`generation_batch_size` must be a positive int"),
        ({"warmup_steps": -1}, r"`warmup_steps` must be an int >= 0"),
    ],
)
def test_bad_mtp_training_values_are_refused_by_name(target, change, match):
    arguments = {"texts": _texts(), "num_steps": 1, "show_progress": False, **change}
    with pytest.raises(ValueError, match=match):
        train_mtp_layers(target, **arguments)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"num_epochs": 0, "num_steps": None}, r"`num_epochs` must be a finite number > 0"),
        ({"num_epochs": -3, "num_steps": None}, r"`num_epochs` must be a finite number > 0"),
        ({"num_steps": 1.5}, r"`num_steps` must be a positive int, got 1.5"),
        ({"log_every": 0}, r"`log_every` must be a positive int, got 0"),
        ({"seq_len": 1}, r"`seq_len` must be an int >= 2, got 1"),
        ({"seq_len": -4}, r"`seq_len` must be an int >= 2, got -4"),
        ({"batch_size": 0}, r"`batch_size` must be a positive int, got 0"),
        ({"warmup_ratio": float("nan")}, r"`warmup_ratio` must be a finite number >= 0"),
        ({"data": torch.tensor(_texts()).float() + 0.7}, r"`texts_or_token_ids` holds torch.float32 values"),
        ({"data": [[1.5, 2.5, 3.5]] * 8}, r"`texts_or_token_ids\[0\]` holds torch.float32 values"),
        ({"data": torch.full((4, 8), 500)}, r"holds the token id 500, outside the target's vocabulary"),
    ],
)
def test_bad_distill_values_are_refused_by_name(change, match):
    model = tiny_model("llama", seed=0)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 1
    change = dict(change)
    data = change.pop("data", torch.tensor(_texts()))
    with pytest.raises(ValueError, match=match):
        distill_drafter(model, data, config, **{**_DISTILL, **change})


# 8. messages at load


def test_a_head_config_with_an_unknown_activation_is_named(target, trained, tmp_path):
    head = tmp_path / "head"
    shutil.copytree(trained, head)
    config = json.loads((head / "config.json").read_text())
    config["hidden_act"] = "nope"
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"`hidden_act` must be the name of an activation .* got 'nope'"):
        hf_specdec.EagleDrafter.from_pretrained(head, target=target)


class _Exploit:
    def __reduce__(self):
        return (print, ("code ran",))


def test_a_pickled_bin_head_is_refused_without_torch_s_advice_to_unpickle(target, trained, tmp_path):
    head = tmp_path / "head"
    shutil.copytree(trained, head)
    (head / "model.safetensors").unlink()
    (head / "pytorch_model.bin").write_bytes(pickle.dumps({"fc.weight": _Exploit()}))
    with pytest.raises(OSError, match="never unpickles code") as error:
        hf_specdec.EagleDrafter.from_pretrained(head, target=target)
    assert "weights_only=False" not in str(error.value) and "will likely succeed" not in str(error.value)


class _NoPadTokenizer:
    pad_token_id = eos_token_id = chat_template = None

    def __call__(self, text, **kwargs):
        return {"input_ids": [1, 2, 3]}


def test_answering_prompts_with_a_tokenizer_without_pad_or_eos_is_refused(target):
    from hf_specdec.eagle_data import answer_prompts

    with pytest.raises(ValueError, match="neither a pad token nor an eos token"):
        answer_prompts(
            target, _NoPadTokenizer(), ["hi"], max_answer_tokens=2, batch_size=1, temperature=0.0, show_progress=False
        )
