"""Bad input through `hf-specdec` (issue 17): numbers out of range, binary files, output paths that cannot be
written, pickle-only checkpoints; and what a first run shows (help texts, --version, threads, medians)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import transformers
from conftest import tiny_model

from hf_specdec import NGramDrafter, zoo
from hf_specdec.cli import _parser, main

CODE = 'def add(a, b):\n    """Add two numbers."""\n    return a + b\n'


def run(capsys, *argv):
    capsys.readouterr()
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def assert_error(capsys, argv, message):
    status, _, err = run(capsys, *argv)
    assert status == 2
    assert err.startswith("hf-specdec: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err


def assert_usage_error(capsys, argv, message):
    """argparse's own errors: usage, one `error:` line naming the argument, exit status 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--threads", "-1"], "argument --threads: must be a positive int, got -1 (for example 1)"),
        (["generate", "--threads", "0"], "argument --threads: must be a positive int, got 0"),
        (["demo", "--threads", "0"], "argument --threads: must be a positive int, got 0"),
        (["bench", "--repeats", "0"], "argument --repeats: must be a positive int, got 0"),
        (["bench", "--prompts", "0"], "argument --prompts: must be a positive int, got 0"),
        (["bench", "--gamma", "2", "0"], "argument --gamma: must be a positive int, got 0"),
        (["generate", "--max-new-tokens", "0"], "argument --max-new-tokens: must be a positive int, got 0"),
        (["generate", "--temperature", "0", "--do-sample"], "argument --temperature: must be a positive number, got 0"),
        (["demo", "--index", "-1"], "argument --index: invalid choice: -1 (choose from 0, 1,"),
        (["demo", "--index", "16"], "argument --index: invalid choice: 16"),
        (["distill", "x.py", "--output", "d", "--layers", "0"], "argument --layers: must be a positive int, got 0"),
        (["build-ngram", "x.py", "--output", "t", "--n", "0"], "argument --n: must be a positive int, got 0"),
        (["distill", "x.py", "--output", "d", "--lr", "-1"], "argument --lr: must be a positive number, got -1"),
    ],
)
def test_numbers_out_of_range_are_usage_errors(capsys, argv, message):
    assert_usage_error(capsys, argv, message)


def test_more_prompts_than_the_task_has(capsys):
    assert_error(
        capsys,
        ["bench", "--prompts", "17"],
        "--prompts 17: the completion task has 16 held-out prompts; pass --prompts 16 or fewer",
    )


def test_output_paths_are_checked_before_any_work(capsys, tmp_path, monkeypatch):
    from hf_specdec.cli import loading

    monkeypatch.setattr(loading, "load_target", lambda *a, **k: pytest.fail("loaded a model before checking --output"))
    missing = str(tmp_path / "no" / "such" / "rows.json")
    assert_error(
        capsys,
        ["bench", "--output", missing],
        f"--output {missing!r}: the folder {str(tmp_path / 'no' / 'such')!r} does not exist; create it",
    )
    assert_error(capsys, ["bench", "--plot", str(tmp_path / "none" / "p.png")], "--plot")
    assert_error(capsys, ["bench", "--output", str(tmp_path)], "is a directory; pass a file name")
    (tmp_path / "file").write_text("x")
    assert_error(
        capsys,
        ["build-ngram", str(tmp_path / "file"), "--output", str(tmp_path / "file")],
        "--output " + repr(str(tmp_path / "file")) + " is a file; pass a directory",
    )


def test_binary_prompt_file_is_named(capsys, tmp_path):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x00\x01\x02\xff" * 10)
    assert_error(
        capsys,
        ["generate", "--prompt-file", str(binary)],
        f"--prompt-file {str(binary)!r} is not a UTF-8 text file (binary data); pass a text file",
    )


def test_binary_files_are_refused_or_skipped_by_build_ngram(capsys, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text(CODE * 3)
    (tmp_path / "src" / "b.py").write_bytes(b"\x00\x00binary\xff")
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\x89PNG\x00\x00")
    assert_error(
        capsys,
        ["build-ngram", str(binary), "--output", str(tmp_path / "t")],
        f"{str(binary)!r} is not a UTF-8 text file (binary data); drop it from the corpus",
    )
    status, out, err = run(
        capsys, "build-ngram", str(tmp_path / "src"), "--output", str(tmp_path / "table"), "--n", "2"
    )
    assert status == 0 and "n=2, 1 files" in out
    assert f"hf-specdec: warning: skipped 1 binary or non-UTF-8 file(s): {tmp_path / 'src' / 'b.py'}" in err


def test_build_ngram_card_records_no_local_paths(capsys, tmp_path, local_tokenizer):
    (tmp_path / "a.py").write_text(CODE * 3)
    assert run(capsys, "build-ngram", str(tmp_path / "a.py"), "--output", str(tmp_path / "zoo-tok"))[0] == 0
    card = (tmp_path / "zoo-tok" / "README.md").read_text()
    config = json.loads((tmp_path / "zoo-tok" / "config.json").read_text())
    assert str(tmp_path) not in card and str(zoo.ZOO_DIR) not in card, card
    assert config["tokenizer_name"].startswith("hf-specdec/stdlib-llama-5m")
    local_tokenizer.save_pretrained(tmp_path / "my-tokenizer")
    assert (
        run(
            capsys,
            "build-ngram",
            str(tmp_path / "a.py"),
            "--output",
            str(tmp_path / "own-tok"),
            "--tokenizer",
            str(tmp_path / "my-tokenizer"),
        )[0]
        == 0
    )
    config = json.loads((tmp_path / "own-tok" / "config.json").read_text())
    assert config["tokenizer_name"] == "my-tokenizer (a local tokenizer)"
    assert str(tmp_path) not in (tmp_path / "own-tok" / "README.md").read_text()


def test_corpus_tokenization_does_not_warn_about_sequence_length():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = transformers.utils.logging.get_logger("transformers")
    logger.addHandler(handler)
    try:
        tokenizer = zoo.load_tokenizer()
        text = CODE * 400  # far more tokens than the tokenizer's model_max_length (2048)
        assert len(tokenizer(text, verbose=False).input_ids) > tokenizer.model_max_length
        NGramDrafter.from_texts([text], tokenizer=tokenizer, n=2)
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if "sequence length is longer" in r.getMessage()]


def test_pickle_only_checkpoints_are_refused(capsys, tmp_path):
    """--target and --drafter model load with use_safetensors=True: a pytorch_model.bin never reaches torch.load."""
    import torch

    path = tmp_path / "pickled"
    model = tiny_model("llama")
    model.save_pretrained(path)
    (path / "model.safetensors").unlink()
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    assert (path / "pytorch_model.bin").is_file() and not (path / "model.safetensors").exists()
    assert_error(
        capsys,
        ["generate", "--drafter", "model", str(path), "--max-new-tokens", "2"],
        f"could not load a model from {str(path)!r}",
    )
    assert_error(
        capsys,
        ["generate", "--drafter", "model", str(path), "--max-new-tokens", "2"],
        "hf-specdec loads safetensors only and never unpickles",
    )
    assert_error(
        capsys,
        ["generate", "--target", str(path), "--max-new-tokens", "2"],
        f"could not load a model from {str(path)!r}",
    )


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("hf-specdec 0.") and "torch " in out and "transformers " in out


@pytest.mark.parametrize("module", ["hf_specdec", "hf_specdec.cli"])
def test_python_dash_m_runs_the_command(module):
    # `python -m hf_specdec.cli` is how `torchrun` and `accelerate launch` start it
    result = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("hf-specdec 0.")


def subcommands():
    parser = _parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices


@pytest.mark.parametrize("name", ["demo", "generate", "bench", "serve", "build-ngram", "distill"])
def test_every_option_has_help_and_shows_its_default(name):
    sub = subcommands()[name]
    for action in sub._actions:
        assert action.help, f"{name} {action.option_strings or action.dest} has no help text"
    text = sub.format_help()
    for action in sub._actions:
        default = action.default
        if action.option_strings and default not in (None, False) and default is not __import__("argparse").SUPPRESS:
            assert f"(default: {default})" in " ".join(text.split()), (name, action.option_strings)


def test_drafter_usage_is_one_kind_and_an_optional_path():
    usage = subcommands()["generate"].format_usage()
    assert "[--drafter KIND [PATH]]" in usage and "[KIND [PATH] ...]" not in usage


def test_bench_reports_medians_spread_and_threads(capsys, tmp_path):
    status, out, _ = run(
        capsys,
        "bench",
        "--prompts",
        "1",
        "--max-new-tokens",
        "6",
        "--gamma",
        "2",
        "--repeats",
        "2",
        "--drafter",
        "prompt_lookup",
        "--output",
        str(tmp_path / "rows.json"),
    )
    assert status == 0
    assert "2 interleaved repeat(s) after a warm-up" in out and "thread(s)" in out and "spread" in out
    result = json.loads((tmp_path / "rows.json").read_text())
    row = result["rows"][0]
    assert result["repeats"] == 2 and len(row["runs_s"]["plain"]) == 2 and len(row["runs_s"]["transformers"]) == 2
    assert result["machine"]["threads"] >= 1 and result["machine"]["date"]  # written by hf_specdec.benchmarking
    assert row["v"] > 0 and row["theorem_3_8_at_measured_v"] > 0 and row["identical_to_plain"]
