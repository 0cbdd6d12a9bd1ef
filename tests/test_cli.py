"""`hf-specdec` commands through `hf_specdec.cli.main([...])`, with the embedded zoo and real files; every user
error is one `hf-specdec: error: ...` line and exit status 2."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import tiny_model
from transformers import AutoModelForCausalLM

from hf_specdec import NGramDrafter, zoo
from hf_specdec.cli import main

CODE = 'def add(a, b):\n    """Add two numbers."""\n    return a + b\n\n\nclass Point:\n    pass\n'


def run(capsys, *argv):
    status = main(["--help"] if not argv else list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def assert_error(capsys, argv, message):
    capsys.readouterr()  # drop what fixtures printed
    status, _, err = run(capsys, *argv)
    assert status == 2
    assert err.startswith("hf-specdec: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert message in err, err


def test_demo_runs_and_matches_plain(capsys):
    status, out, _ = run(capsys, "demo", "--max-new-tokens", "24", "--threads", "1")
    assert status == 0
    assert "output identical to plain generate: True" in out
    assert "speedup" in out and "alpha" in out and "Held-out completion prompt" in out


@pytest.mark.parametrize("drafter", [["prompt_lookup"], ["ngram"], ["model"]])
def test_generate_with_each_embedded_drafter(capsys, drafter):
    status, out, err = run(capsys, "generate", "--prompt", CODE, "--max-new-tokens", "12", "--drafter", *drafter)
    assert status == 0
    assert out.startswith(CODE)
    assert "alpha" in err


def test_generate_from_a_prompt_file_with_sampling_and_local_paths(capsys, tmp_path):
    prompt = tmp_path / "prompt.py"
    prompt.write_text(CODE)
    target = str(zoo.ZOO_DIR / "target")
    status, out, _ = run(
        capsys,
        "generate",
        "--target",
        target,
        "--drafter",
        "model",
        str(zoo.ZOO_DIR / "drafter"),
        "--prompt-file",
        str(prompt),
        "--max-new-tokens",
        "8",
        "--do-sample",
        "--temperature",
        "0.8",
        "--seed",
        "0",
        "--gamma",
        "3",
    )
    assert status == 0 and out.startswith(CODE)


def test_bench_table(capsys, tmp_path):
    status, out, _ = run(
        capsys,
        "bench",
        "--prompts",
        "1",
        "--max-new-tokens",
        "12",
        "--gamma",
        "2",
        "3",
        "--output",
        str(tmp_path / "bench.json"),
    )
    assert status == 0
    assert "x plain" in out and "Thm 3.8" in out
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [row["gamma"] for row in rows] == [2, 3] and all(row["identical_to_plain"] for row in rows)
    assert [row["gammas_drafted"] for row in rows] == [[2], [3]]  # each γ measured as itself, never fewer drafts


def test_bench_plot_needs_matplotlib(capsys, tmp_path):
    argv = [
        "bench",
        "--prompts",
        "1",
        "--max-new-tokens",
        "8",
        "--drafter",
        "prompt_lookup",
        "--plot",
        str(tmp_path / "plot.png"),
    ]
    if importlib.util.find_spec("matplotlib") is None:
        assert_error(capsys, argv, "--plot needs matplotlib, which is not installed")
    else:
        assert run(capsys, *argv)[0] == 0 and (tmp_path / "plot.png").stat().st_size > 0


def test_build_ngram(capsys, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text(CODE)
    (tmp_path / "b.txt").write_text(CODE * 2)
    status, out, _ = run(
        capsys,
        "build-ngram",
        str(tmp_path / "src"),
        str(tmp_path / "b.txt"),
        "--n",
        "2",
        "--output",
        str(tmp_path / "table"),
    )
    assert status == 0 and "n=2, 2 files" in out
    table = NGramDrafter.from_pretrained(tmp_path / "table")
    assert table.n == 2 and table.vocab_size == 8192


def test_distill(capsys, tmp_path):
    (tmp_path / "a.py").write_text(CODE * 20)
    status, out, _ = run(
        capsys,
        "distill",
        str(tmp_path / "a.py"),
        "--output",
        str(tmp_path / "drafter"),
        "--steps",
        "2",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--objective",
        "tv",
        "--cpu",
    )
    assert status == 0 and "1-layer drafter" in out
    drafter = AutoModelForCausalLM.from_pretrained(tmp_path / "drafter")
    assert drafter.config.num_hidden_layers == 1
    assert (tmp_path / "drafter" / "tokenizer.json").is_file()


@pytest.fixture
def wrong_vocab_model(tmp_path):
    path = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(path)
    return str(path)


@pytest.fixture
def corrupt_checkpoint(tmp_path):
    path = tmp_path / "corrupt"
    path.mkdir()
    (path / "config.json").write_text((zoo.ZOO_DIR / "drafter" / "config.json").read_text())
    (path / "model.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    return str(path)


def test_errors_are_one_line(capsys, tmp_path, wrong_vocab_model, corrupt_checkpoint):
    missing = str(tmp_path / "missing.py")
    empty = tmp_path / "empty.py"
    empty.write_text("")
    assert_error(capsys, ["generate", "--prompt-file", missing], "cannot read --prompt-file")
    assert_error(capsys, ["generate", "--prompt-file", str(empty)], "is empty")
    assert_error(capsys, ["generate", "--target", str(tmp_path / "no_model")], "no such model directory")
    assert_error(
        capsys,
        ["generate", "--drafter", "model", wrong_vocab_model, "--max-new-tokens", "2"],
        "the drafter has a vocabulary of 96 tokens but the target has 8192",
    )
    assert_error(capsys, ["generate", "--drafter", "model", corrupt_checkpoint], "could not load a model from")
    assert_error(capsys, ["generate", "--drafter", "ngram", str(tmp_path / "nope")], "no such n-gram drafter")
    assert_error(capsys, ["generate", "--drafter", "eagle"], "--drafter must be 'prompt_lookup'")
    assert_error(capsys, ["generate", "--target", wrong_vocab_model], "could not load a tokenizer")
    assert_error(capsys, ["build-ngram", missing, "--output", str(tmp_path / "t")], "cannot read")
    assert_error(capsys, ["build-ngram", str(empty), "--output", str(tmp_path / "t")], "the corpus is empty")
    assert_error(capsys, ["distill", str(empty), "--output", str(tmp_path / "d")], "the corpus is empty")
    assert_error(capsys, ["distill", missing, "--output", str(tmp_path / "d")], "cannot read")
    assert_error(
        capsys,
        ["bench", "--drafter", "model", wrong_vocab_model, "--prompts", "1"],
        "the drafter has a vocabulary of 96 tokens",
    )


def test_ngram_with_another_vocabulary_is_rejected(capsys, tmp_path):
    NGramDrafter.from_corpus([[1, 2, 3, 1, 2]], n=2, vocab_size=50).save_pretrained(tmp_path / "small")
    assert_error(
        capsys,
        ["generate", "--drafter", "ngram", str(tmp_path / "small"), "--max-new-tokens", "2"],
        "built for a vocabulary of 50 tokens but the target has 8192",
    )
