"""`hf-specdec` commands through `hf_specdec.cli.main([...])`, with the embedded zoo and real files; every user
error is one `hf-specdec: error: ...` line and exit status 2."""

from __future__ import annotations

import importlib.util
import io
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


# the demo, shortened: few tokens, one timed run (and one prompt)
SHORT = ["--max-new-tokens", "12", "--repeats", "1", "--threads", "1"]
FAST_DEMO = ["demo", "--prompts", "1", *SHORT]


def test_demo_runs_and_matches_plain(capsys):
    status, out, err = run(capsys, *FAST_DEMO)
    assert status == 0, err
    assert "\x1b" not in out  # not a terminal: plain text, no escapes
    assert "held-out" in out and "--- generated (identical on both sides) ---" in out
    assert "speculative: prompt lookup: 12 tokens" in out and "tokens from accepted drafts" in out
    header = next(line for line in out.splitlines() if line.startswith("method"))
    assert all(word in header for word in ("seconds", "speedup", "tokens/call", "= plain"))
    rows = [line for line in out.splitlines() if line.startswith(("plain generate ", "prompt lookup "))]
    assert len(rows) == 2 and all(line.rstrip().endswith("✓") for line in rows)
    assert out.rstrip().endswith("output identical to plain generate: True")
    assert "loading the embedded zoo model" in err  # progress, on stderr


def test_demo_with_another_drafter_and_a_held_out_prompt(capsys):
    status, out, _ = run(capsys, "demo", *SHORT, "--drafter", "ngram", "--task", "continuation", "--index", "3")
    assert status == 0
    assert "held-out continuation prompt" in out and "n-gram table (n=3)" in out and "prompt lookup" not in out


def test_demo_on_a_local_model(capsys):
    # --threads 2: the command sets torch's threads, and main() gives the caller its own back (the fixture checks)
    status, out, _ = run(capsys, "demo", "--model", str(zoo.ZOO_DIR / "target"), *SHORT, "--threads", "2")
    assert status == 0
    assert "LlamaForCausalLM from" in out and "prompt lookup" in out
    assert "output identical to plain generate: True" in out


def test_demo_exits_non_zero_when_an_output_differs(capsys, monkeypatch):
    from hf_specdec.cli import loading

    load_drafter = loading.load_drafter

    def suppressing(spec, **kwargs):  # a "drafter" that also bans most tokens: its output cannot be plain's
        return {**load_drafter(spec, **kwargs), "suppress_tokens": list(range(1, 8192))}

    monkeypatch.setattr(loading, "load_drafter", suppressing)
    status, out, _ = run(capsys, *FAST_DEMO)
    assert status == 1
    assert "output identical to plain generate: False" in out and "THE OUTPUTS DIFFER" in out


def test_demo_flag_errors(capsys):
    assert_error(capsys, ["demo", "--gguf-file", "x.gguf"], "--gguf-file goes with --model DIR")
    assert_error(capsys, ["demo", "--model", str(zoo.ZOO_DIR / "target"), "--task", "editing"], "--task picks")
    assert_error(capsys, ["demo", "--prompts", "2", "--index", "3"], "--prompts counts the demo's own prompts")


class _Digits:
    """A tokenizer stand-in for the tiny models: token i is the text "i "."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"{i} " for i in ids)


@pytest.mark.parametrize("period", [None, 2, 1])
def test_round_streamer_marks_accepted_drafts(period):
    """Every round's tokens but the last are accepted drafts; the counts agree with the loop's own statistics."""
    import torch
    from conftest import ScriptedDrafter, prompt
    from transformers import GenerationMixin

    from hf_specdec import enable
    from hf_specdec.demo import RoundStreamer, rounds_of

    target = enable(tiny_model("llama"))
    ids = prompt()
    reference = GenerationMixin.generate(target, ids, max_new_tokens=12, do_sample=False)
    streamer = RoundStreamer(_Digits())
    with rounds_of(target, streamer):
        out = target.generate(
            ids,
            drafter=ScriptedDrafter(reference, period=period),
            speculative_gamma=3,
            speculative_gamma_policy="constant",
            max_new_tokens=12,
            do_sample=False,
            return_dict_in_generate=True,
            streamer=streamer,
        )
    stats = out.speculative_stats
    assert torch.equal(out.sequences, reference)
    assert streamer.tokens == reference[0, ids.shape[1] :].tolist()
    assert sum(streamer.drafted) == stats.accepted_tokens and streamer.rounds == stats.target_calls
    if period is None:  # every draft right: three drafts and the bonus token per round
        assert streamer.drafted == [True, True, True, False] * 3
    if period == 1:  # every draft wrong: each round emits the target's own token only
        assert not any(streamer.drafted)
    assert streamer.text == _Digits().decode(streamer.tokens) and "".join(streamer.pieces) == streamer.text
    assert not target._forward_pre_hooks  # the hook is gone

    plain = RoundStreamer(_Digits())
    with rounds_of(target, plain):
        GenerationMixin.generate(target, ids, max_new_tokens=5, do_sample=False, streamer=plain)
    assert plain.drafted == [False] * 5 and plain.rounds == 5


def test_styled_lines_mark_drafts_and_wrap():
    from hf_specdec.demo import styled_lines

    pieces, drafted = ["def", " f", "(x):\n", "    return", " x"], [False, True, True, False, True]
    # a long line goes on under its own indentation
    assert styled_lines(pieces, drafted, 10, mark=False) == ["def f(x): ", "    return", "     x    "]
    marked = styled_lines(pieces, drafted, 40, mark=True)
    # drafted characters green and underlined, spaces green only (an underline would join the words)
    assert marked[0].startswith("def\x1b[32m \x1b[0m\x1b[4;32mf(x):\x1b[0m")
    assert marked[1].startswith("    return\x1b[32m \x1b[0m\x1b[4;32mx\x1b[0m")
    # long lines break after a space near the end
    assert styled_lines(["aaaa bbbb cccc"], [False], 12, mark=False) == ["aaaa bbbb   ", "cccc        "]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_side_by_side_redraws_on_a_terminal_only(monkeypatch):
    from conftest import prompt
    from transformers import GenerationMixin

    from hf_specdec import enable
    from hf_specdec.demo import Console, print_stream_summary, stream_pair

    target = enable(tiny_model("llama"))
    ids = prompt()

    def runs(console):
        return stream_pair(
            console,
            target,
            _Digits(),
            lambda streamer: GenerationMixin.generate(
                target, ids, max_new_tokens=6, do_sample=False, streamer=streamer
            ),
            lambda streamer: target.generate(
                ids,
                drafter="prompt_lookup",
                max_new_tokens=6,
                do_sample=False,
                return_dict_in_generate=True,
                streamer=streamer,
            ),
            ("plain generate", "speculative: prompt lookup"),
        )

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    console = Console(_Terminal(), _Terminal())
    assert console.fancy
    _, view = runs(console)
    print_stream_summary(console, view, identical=True)
    drawn = console.out.getvalue()
    assert "\x1b[?25l" in drawn and drawn.count("\x1b[?25h") == 1  # the cursor is shown again
    assert "\x1b[J" in drawn and "speculative: prompt lookup" in drawn and "same output" in drawn

    monkeypatch.setenv("NO_COLOR", "1")
    console = Console(_Terminal(), _Terminal())
    assert not console.fancy
    runs(console)
    assert console.out.getvalue() == ""  # nothing drawn: the plain-text summary comes after the runs


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
