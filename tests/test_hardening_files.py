"""Hostile files and odd text (issue 45): JSONL split on "\\n" alone, `resume` only into files this project wrote,
writes that never follow a link, per-row options and rows checked before any work, and corrupt or malicious saved
training state refused naming the file and the fix. Real files, tiny models built from configs."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
from conftest import saved_target, tiny_model
from test_cli_hardening import assert_error
from test_eagle import eagle_target, published_layout
from test_hardening_eagle import _write_head

import hf_specdec
from hf_specdec.cli import main
from hf_specdec.dataset_generation import generate_dataset, read_jsonl
from hf_specdec.distill import train_eagle_drafter
from hf_specdec.file_writes import save_into

RUN = dict(drafter="prompt_lookup", max_new_tokens=3, batch_size=2, show_progress=False)


@pytest.fixture(scope="module")
def text_model(local_tokenizer):
    return hf_specdec.enable(tiny_model("llama", vocab_size=len(local_tokenizer)))


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def assert_training_error(capsys, argv, message):
    """`train-drafter` says its threads on stderr first; then the error: one line, exit status 2, no traceback."""
    capsys.readouterr()
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1].startswith("hf-specdec: error: "), err
    assert message in err.splitlines()[-1], err


def planted_link(folder, name, victim_text="the victim's own file\n"):
    """`folder/name`, a link to a file outside `folder` holding `victim_text`; returns the victim."""
    victim = folder.parent / f"victim-{folder.name}-{name}"
    victim.write_text(victim_text)
    os.symlink(victim, folder / name)
    return victim


# ----- text: lines end at "\n" alone ------------------------------------------------------------------------------


def test_line_separators_in_prompts_survive_the_reorder_and_resume(text_model, local_tokenizer, tmp_path):
    prompts = ["the cat\u2028sat", "a fox\u2029jumps", "def add\u0085(a, b):", "the dog\x1csat\x0bon\r\nthe log"]
    data = write_rows(tmp_path / "odd.jsonl", [{"prompt": text} for text in prompts])
    output = tmp_path / "out.jsonl"
    assert generate_dataset(text_model, local_tokenizer, data, output, **RUN) == 4
    assert [row["prompt"] for row in read_jsonl(output)] == prompts
    assert [row["index"] for row in read_jsonl(output)] == [0, 1, 2, 3]
    finished = output.read_bytes()
    assert generate_dataset(text_model, local_tokenizer, data, output, resume=True, **RUN) == 0
    assert output.read_bytes() == finished


def test_a_completion_with_a_line_separator_survives_the_reorder(text_model, local_tokenizer, tmp_path):
    """A completion holding U+2028 (the model is made to write it: every step scores only the next token of its
    encoding) is one JSONL line like any other, and the file is put back in order."""
    from transformers import LogitsProcessor, LogitsProcessorList

    forced = local_tokenizer.encode("a\u2028b", add_special_tokens=False)
    data = write_rows(tmp_path / "rows.jsonl", [{"prompt": "the cat"}, {"prompt": "the dog sat"}])

    class Force(LogitsProcessor):
        """The forced tokens after each row's prompt (a function of the prefix: the prompt ends before them)."""

        def __call__(self, input_ids, scores):
            for row, ids in enumerate(input_ids.tolist()):
                # how much of the encoding the row has written: the longest prefix of it that the row ends with
                step = next(k for k in range(min(len(forced), len(ids)), -1, -1) if ids[len(ids) - k :] == forced[:k])
                if step < len(forced):
                    scores[row] = torch.where(torch.arange(scores.shape[-1]) == forced[step], 0.0, float("-inf"))
            return scores

    output = tmp_path / "out.jsonl"
    run = dict(RUN, max_new_tokens=len(forced), batch_size=1, logits_processor=LogitsProcessorList([Force()]))
    assert generate_dataset(text_model, local_tokenizer, data, output, **run) == 2
    rows = read_jsonl(output)
    assert [row["index"] for row in rows] == [0, 1]
    assert all("\u2028" in row["completion"] for row in rows)
    assert output.read_text(encoding="utf-8").count("\n") == 2


def test_train_drafter_prompts_are_split_at_newlines_only(tmp_path, local_tokenizer, capsys, monkeypatch):
    target = saved_target(tmp_path, local_tokenizer)
    (tmp_path / "prompts.txt").write_text("the cat\u2028sat\r\ndef add(a, b):\n")
    seen = []

    def record(target, prompts, texts, **kwargs):
        seen.append(prompts)
        raise ValueError("stop here")

    monkeypatch.setattr(hf_specdec.distill, "train_eagle_drafter", record)
    argv = ["train-drafter", "--target", str(target), "--prompts", str(tmp_path / "prompts.txt")]
    assert_training_error(capsys, [*argv, "--output", str(tmp_path / "head"), "--steps", "1"], "stop here")
    assert seen == [["the cat\u2028sat", "def add(a, b):"]]


# ----- resume: only into files this project wrote ------------------------------------------------------------------


@pytest.mark.parametrize("content", ["my notes, no newline", "my notes\n", '{"note": "mine"}'])
def test_resume_refuses_a_file_it_did_not_write_and_leaves_it_whole(text_model, local_tokenizer, tmp_path, content):
    data = write_rows(tmp_path / "rows.jsonl", [{"prompt": "the cat"}])
    notes = tmp_path / "notes.txt"
    notes.write_text(content)
    with pytest.raises(ValueError, match=r"cannot resume: line 1 of .*notes.txt' is not a row this function wrote"):
        generate_dataset(text_model, local_tokenizer, data, notes, resume=True, **RUN)
    assert notes.read_text() == content


def test_resume_drops_the_start_of_a_row_cut_short_by_an_interruption(text_model, local_tokenizer, tmp_path):
    rows = [{"prompt": "the cat", "id": 7}, {"prompt": "a fox"}]
    data = write_rows(tmp_path / "rows.jsonl", rows)
    output = tmp_path / "out.jsonl"
    output.write_text('{"prompt": "a fox", "ind')  # the first line's write, cut short
    assert generate_dataset(text_model, local_tokenizer, data, output, resume=True, **RUN) == 2
    assert [(row["index"], row["prompt"]) for row in read_jsonl(output)] == [(0, "the cat"), (1, "a fox")]


# ----- writes never follow a link ----------------------------------------------------------------------------------


def test_generate_dataset_never_writes_through_a_link(text_model, local_tokenizer, tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", [{"prompt": "the cat"}, {"prompt": "a fox jumps"}])
    folder = tmp_path / "out"
    folder.mkdir()
    victim = planted_link(folder, "out.jsonl.sorting")  # where the reorder's temporary file used to go
    assert generate_dataset(text_model, local_tokenizer, data, folder / "out.jsonl", **RUN) == 2
    assert victim.read_text() == "the victim's own file\n"
    assert not (folder / "out.jsonl").is_symlink() and len(read_jsonl(folder / "out.jsonl")) == 2
    for name, resume in (("link.jsonl", True), ("dangling.jsonl", False)):
        victim = planted_link(folder, name)
        if name == "dangling.jsonl":
            victim.unlink()
        with pytest.raises(ValueError, match=rf"`output_file` '.*{name}' is a symbolic link \(to .*never writes"):
            generate_dataset(text_model, local_tokenizer, data, folder / name, resume=resume, **RUN)
        assert (victim.read_text() == "the victim's own file\n") if resume else not victim.exists()


@pytest.mark.parametrize("kind", ["head", "table", "tokenizer"])
def test_saved_heads_tables_and_tokenizers_replace_links_instead_of_writing_through(tmp_path, local_tokenizer, kind):
    target = eagle_target("llama")
    head = hf_specdec.EagleDrafter.from_target(target)
    table = hf_specdec.NGramDrafter.from_corpus([[1, 2, 3, 1, 2, 4]], n=2, vocab_size=8)
    save, files = {
        "head": (head.save_pretrained, ["config.json", "model.safetensors", "README.md"]),
        "table": (table.save_pretrained, ["config.json", "model.safetensors", "README.md"]),
        "tokenizer": (
            lambda folder: save_into(folder, local_tokenizer.save_pretrained),
            ["tokenizer_config.json", "tokenizer.json"],
        ),
    }[kind]
    folder = tmp_path / kind
    folder.mkdir()
    victims = [planted_link(folder, file) for file in files]
    victims[-1].unlink()  # a dangling link: writing through it would create the file it names
    save(folder)
    assert all(victim.read_text() == "the victim's own file\n" for victim in victims[:-1])
    assert not victims[-1].exists()
    assert not any((folder / file).is_symlink() for file in files)
    assert not [path.name for path in folder.iterdir() if path.name.startswith(".")]  # no temporary file left
    if kind == "head":
        again = hf_specdec.EagleDrafter.from_pretrained(folder, target)
        assert torch.equal(again.model.fc.weight, head.model.fc.weight)
    elif kind == "table":
        assert hf_specdec.NGramDrafter.from_pretrained(folder).n == 2


# ----- rows and per-row options: checked before any work, named -----------------------------------------------


@pytest.mark.parametrize(
    "options, match",
    [
        (
            {"max_new_tokens": "5"},
            r"row 0 \(line 1 of .*rows.jsonl'\): its 'generation_kwargs' \{'max_new_tokens': '5'\} are not valid "
            r"`generate` options \(TypeError",
        ),
        (
            {"attention_mask": [1]},
            r"row 0 \(line 1 of .*\): its 'generation_kwargs' \{'attention_mask': \[1\]\} set \['attention_mask'\], "
            r"which `generate_dataset` sets itself",
        ),
        (
            {"foo": 1},
            r"row 0 \(line 1 of .*rows.jsonl'\), with 'generation_kwargs' \{'foo': 1\}: `generate` failed "
            r"\(ValueError: .*foo.*\). Fix or drop these rows' 'generation_kwargs'",
        ),
    ],
)
def test_bad_per_row_options_name_the_row_and_leave_no_file(text_model, local_tokenizer, tmp_path, options, match):
    rows = [{"prompt": "the cat", "generation_kwargs": options}, {"prompt": "a fox"}]
    data = write_rows(tmp_path / "rows.jsonl", rows)
    output = tmp_path / "out.jsonl"
    with pytest.raises(ValueError, match=match):
        generate_dataset(text_model, local_tokenizer, data, output, **RUN)
    assert not output.exists()  # a rerun needs no `resume`
    write_rows(data, rows[1:])
    assert generate_dataset(text_model, local_tokenizer, data, output, **RUN) == 1


def test_a_rows_own_pad_token_id_is_honoured(text_model, local_tokenizer, tmp_path):
    rows = [{"prompt": "the cat", "generation_kwargs": {"pad_token_id": 0, "max_new_tokens": 2}}]
    output = tmp_path / "out.jsonl"
    assert generate_dataset(text_model, local_tokenizer, rows, output, **RUN) == 1
    assert read_jsonl(output)[0]["num_new_tokens"] == 2


@pytest.mark.parametrize(
    "content, match",
    [
        (
            b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n',
            r"line 2 of .*rows.jsonl' is not UTF-8 \(byte 0xe9 at column 16\)",
        ),
        (b'{"prompt": "a"}\n' + b"[" * 100_000 + b"\n", r"line 2 of .*rows.jsonl' nests JSON too deeply to read"),
        (b'{"prompt": "a", "index": 5}\n', r"row 0 \(line 1 of .*\) has its own 'index' field \(5\), which"),
        (b'{"prompt": "a", "completion": "ref"}\n', r"own 'completion' field \('ref'\).*another `completion_field`"),
        (b'{"prompt": "a", "batch_size": 2}\n', r"own 'batch_size' field \(2\), which `generate_dataset` writes"),
    ],
)
def test_bad_dataset_files_name_the_file_and_the_line(text_model, local_tokenizer, tmp_path, content, match):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        generate_dataset(text_model, local_tokenizer, data, tmp_path / "out.jsonl", **RUN)
    assert not (tmp_path / "out.jsonl").exists()


def test_a_rows_own_completion_field_is_kept_under_another_completion_field(text_model, local_tokenizer, tmp_path):
    rows = [{"prompt": "the cat", "completion": "a reference"}]
    output = tmp_path / "out.jsonl"
    generate_dataset(text_model, local_tokenizer, rows, output, completion_field="generated", **RUN)
    (record,) = read_jsonl(output)
    assert record["completion"] == "a reference" and isinstance(record["generated"], str)


def test_cli_dataset_output_links_and_clashing_fields_are_one_line_errors(capsys, tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", [{"prompt": "a", "completion": "ref"}])
    (tmp_path / "out").mkdir()
    victim = planted_link(tmp_path / "out", "out.jsonl")
    argv = ["generate", "--drafter", "prompt_lookup", "--dataset", str(data)]
    assert_error(capsys, [*argv, "--output", str(tmp_path / "out" / "out.jsonl"), "--resume"], "is a symbolic link")
    assert victim.read_text() == "the victim's own file\n"
    assert_error(capsys, [*argv, "--output", str(tmp_path / "new.jsonl")], "--completion-field")
    assert_error(capsys, ["generate", "--completion-field", "x"], "--completion-field goes with --dataset FILE")


# ----- training: saved data and state ------------------------------------------------------------------------------


class _Exploit:
    def __reduce__(self):
        return (exec, ("open('/tmp/hf_specdec_pwned_45', 'w').write('x')",))


@pytest.fixture(scope="module")
def trained_folder(tmp_path_factory):
    """A finished training run with a checkpoint: the head, `eagle_data.pt`, `checkpoint-1/training_state.pt`."""
    folder = tmp_path_factory.mktemp("trained")
    target = eagle_target("llama")
    texts = [list(range(i, i + 12)) for i in range(6)]
    run = dict(texts=texts, num_steps=1, batch_size=4, ttt_steps=1, save_every=1, show_progress=False)
    train_eagle_drafter(target, output_dir=folder, **run)
    return target, run, folder


@pytest.mark.parametrize(
    "file, match",
    [
        ("eagle_data.pt", r"Could not read .*eagle_data.pt \(.*Delete .*eagle_data.pt: the resumed run then"),
        ("checkpoint-1/training_state.pt", r"Could not read .*training_state.pt .*Resume from an earlier checkpoint"),
    ],
)
@pytest.mark.parametrize("content", ["malicious", "corrupt", "wrong"])
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_corrupt_or_malicious_training_files_are_named_on_resume(trained_folder, tmp_path, file, match, content):
    target, run, trained = trained_folder
    folder = tmp_path / "run"
    shutil.copytree(trained, folder)
    if content == "malicious":
        (folder / file).write_bytes(pickle.dumps({"sequences": _Exploit()}))
    elif content == "corrupt":
        (folder / file).write_bytes((folder / file).read_bytes()[:100])
    else:  # plain tensors, but not what was saved
        torch.save({"something": torch.zeros(2)}, folder / file)
        match = rf"{file.split('/')[-1]} is not the (data|training state) `train_eagle_drafter` saves \(KeyError"
    if os.path.exists("/tmp/hf_specdec_pwned_45"):
        os.remove("/tmp/hf_specdec_pwned_45")
    with pytest.raises(OSError, match=match):
        train_eagle_drafter(target, output_dir=folder, resume_from_checkpoint=True, **run)
    assert not os.path.exists("/tmp/hf_specdec_pwned_45")


def test_training_replaces_links_in_its_output_folder(trained_folder, tmp_path):
    target, run, _ = trained_folder
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "checkpoint-1").mkdir()
    victims = [planted_link(folder, name) for name in ("eagle_data.pt", "training_log.json", "config.json")]
    victims.append(planted_link(folder / "checkpoint-1", "training_state.pt"))
    train_eagle_drafter(target, output_dir=folder, **run)
    assert all(victim.read_text() == "the victim's own file\n" for victim in victims)
    assert not any(path.is_symlink() for path in folder.rglob("*"))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_cli_train_drafter_replaces_a_linked_data_file_and_names_a_malicious_state(tmp_path, local_tokenizer, capsys):
    target = saved_target(tmp_path, local_tokenizer)
    texts = [tmp_path / "one.txt", tmp_path / "two.txt"]
    texts[0].write_text("the dog sat on the log and the cat watches the fox " * 4)
    texts[1].write_text("def add(a, b):\n    return a + b\n" * 4)
    output = tmp_path / "head"
    output.mkdir()
    victim = planted_link(output, "eagle_data.pt")
    argv = ["train-drafter", "--target", str(target), "--texts", *map(str, texts), "--output", str(output)]
    argv += ["--steps", "1", "--ttt-steps", "1", "--threads", "1"]
    capsys.readouterr()
    assert main(argv) == 0
    assert victim.read_text() == "the victim's own file\n" and not (output / "eagle_data.pt").is_symlink()
    (output / "checkpoint-1").mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(output / name, output / "checkpoint-1" / name)
    (output / "checkpoint-1" / "training_state.pt").write_bytes(pickle.dumps({"optimizer": _Exploit()}))
    assert_training_error(
        capsys, [*argv, "--resume"], f"Could not read {output / 'checkpoint-1' / 'training_state.pt'}"
    )
    assert_training_error(capsys, [*argv, "--resume"], "or start over without `resume_from_checkpoint` (--resume)")


def test_a_head_saved_over_a_published_one_keeps_no_link(tmp_path):
    target = eagle_target("llama")
    config, tensors = published_layout(target)
    folder = _write_head(tmp_path / "head", config, tensors)
    head = hf_specdec.EagleDrafter.from_pretrained(folder, target)
    victim = planted_link(tmp_path / "head", "README.md")
    head.save_pretrained(folder)
    assert (
        victim.read_text() == "the victim's own file\n" and "EAGLE-3 draft head" in (folder / "README.md").read_text()
    )


def test_json_nested_too_deeply_is_named_not_a_recursion_error(tmp_path, capsys):
    table = hf_specdec.NGramDrafter.from_corpus([[1, 2, 3, 1, 2, 4]], n=2, vocab_size=8)
    table.save_pretrained(tmp_path / "table")
    (tmp_path / "table" / "config.json").write_text("[" * 100_000)
    with pytest.raises(OSError, match=r"config.json is not a readable JSON file \(RecursionError"):
        hf_specdec.NGramDrafter.from_pretrained(tmp_path / "table")
    deep = "{" + '"a": {' * 100_000
    assert_error(capsys, ["generate", "--device-map", deep], "is not valid JSON (nested too deeply)")
