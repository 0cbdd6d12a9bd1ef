"""What `hf-specdec demo` shows: plain and speculative `generate` streamed side by side, then a summary table.

A speculative round is one target forward: the drafter proposes up to γ tokens, the target verifies them all in that
forward, and the round emits the drafted tokens it accepted followed by one token of the target's own (the recovered
token after a rejection, or the bonus token when every draft was accepted). `generate` hands a round's tokens to its
streamer one `put` at a time, all after the round's forward; a [`RoundStreamer`] that is also told when each target
forward starts ([`rounds_of`], a forward pre-hook) therefore knows each round's tokens, and all but the last of them
are accepted drafts. Plain `generate` is one forward per token: every token is the target's own. A round cut short by
a stopping criterion (an EOS among the accepted drafts) ends on a draft, which is then shown as the target's.

In a terminal (stdout a TTY, `NO_COLOR` unset, `TERM` not `dumb`) the two runs are drawn as two columns redrawn in
place with ANSI escapes, accepted drafts in green and underlined, with live tokens per second; anywhere else (a pipe,
CI, tests) the same content is printed once as plain text, without escapes.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from transformers.generation.streamers import BaseStreamer

__all__ = [
    "Console",
    "RoundStreamer",
    "Row",
    "SideBySide",
    "print_prompt",
    "print_stream_summary",
    "print_table",
    "rounds_of",
    "stream_pair",
    "styled_lines",
]

_DRAFTED = "\x1b[4;32m"  # accepted drafts: green, underlined
_DRAFTED_SPACE = "\x1b[32m"  # (an underlined space would join the words around it)
_DIM = "\x1b[2m"
_BOLD = "\x1b[1m"
_GREEN = "\x1b[32m"
_RED = "\x1b[31m"
_RESET = "\x1b[0m"


class RoundStreamer(BaseStreamer):
    """A `generate` streamer that keeps each new token with where it came from: a drafted token the target accepted,
    or the target's own token (one per target forward). Use it inside [`rounds_of`] on the target, which tells it
    where each round begins.

    `on_update(final)` is called at the end of every round (`final=False`) and when `generate` ends (`final=True`).

    Example:

    ```python
    >>> import hf_specdec
    >>> from hf_specdec.demo import RoundStreamer, rounds_of
    >>> from hf_specdec.zoo import load_default
    >>> target, _, tokenizer = load_default()
    >>> target = hf_specdec.enable(target)
    >>> ids = tokenizer("def add(a, b):\\n    return a + b", return_tensors="pt").input_ids
    >>> streamer = RoundStreamer(tokenizer)
    >>> with rounds_of(target, streamer):
    ...     out = target.generate(ids, drafter="prompt_lookup", max_new_tokens=12, do_sample=False, streamer=streamer)
    >>> len(streamer.tokens), sum(streamer.drafted) + streamer.rounds  # accepted drafts + one own token per round
    (12, 12)

    ```
    """

    def __init__(self, tokenizer, on_update: Callable[[bool], None] | None = None):
        self.tokenizer = tokenizer
        self.on_update = on_update
        self.tokens: list[int] = []
        self.drafted: list[bool] = []  # per token: an accepted draft (True) or the target's own token (False)
        self.pieces: list[str] = []  # per token: the text it adds
        self.rounds = 0  # rounds (target forwards) that emitted tokens
        self.started: float | None = None  # when generate streamed the prompt
        self.finished: float | None = None  # when generate ended
        self._round_start = 0  # index of the current round's first token
        self._text = ""

    def put(self, value) -> None:
        if self.started is None:  # generate streams the prompt first
            self.started = time.perf_counter()
            return
        for token in value.reshape(-1).tolist():
            self.tokens.append(token)
            self.drafted.append(True)  # until the round ends: its last token is the target's
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            self.pieces.append(text[len(self._text) :] if text.startswith(self._text) else text[-1:])
            self._text = text

    def _close_round(self) -> bool:
        if len(self.tokens) == self._round_start:
            return False  # a forward that emitted nothing (a prefill of its own)
        self.drafted[-1] = False
        self._round_start = len(self.tokens)
        self.rounds += 1
        return True

    def new_round(self) -> None:
        """A target forward starts: the tokens since the previous one were one round's."""
        if self._close_round() and self.on_update is not None:
            self.on_update(False)

    def end(self) -> None:
        self._close_round()
        self.finished = time.perf_counter()
        if self.on_update is not None:
            self.on_update(True)

    @property
    def text(self) -> str:
        return self._text

    def seconds(self) -> float:
        """Seconds since generate started (until it ended, once it has)."""
        if self.started is None:
            return 0.0
        return (self.finished or time.perf_counter()) - self.started

    def tokens_per_second(self) -> float:
        seconds = self.seconds()
        return len(self.tokens) / seconds if seconds > 0 else 0.0


@contextlib.contextmanager
def rounds_of(target, streamer: RoundStreamer):
    """Tells `streamer` whenever a forward of `target` starts in this thread (a forward pre-hook, removed on exit:
    another thread's call on the same model is not this demo's round)."""
    thread = threading.get_ident()

    def new_round(module, args):
        if threading.get_ident() == thread:
            streamer.new_round()

    handle = target.register_forward_pre_hook(new_round)
    try:
        yield streamer
    finally:
        handle.remove()


class Console:
    """Where the demo writes: `fancy` (ANSI colours and redraws) only on a terminal that wants them and is at least
    60 x 16; symbols fall back to ASCII when the stream's encoding cannot write them."""

    def __init__(self, out=None, err=None):
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        size = shutil.get_terminal_size((100, 40))
        # two columns need room: a narrow or short terminal gets the plain text
        self.fancy = (
            _is_terminal(self.out)
            and not os.environ.get("NO_COLOR")
            and os.environ.get("TERM") != "dumb"
            and size.columns >= 60
            and size.lines >= 16
        )
        self.err_fancy = _is_terminal(self.err) and os.environ.get("TERM") != "dumb"
        self.width = min(size.columns, 140) if self.fancy else 100
        self.height = size.lines if self.fancy else 1000
        try:
            "✓✗│─┼αγ·".encode(getattr(self.out, "encoding", None) or "ascii")
            self.check, self.cross, self.bar, self.rule, self.cross_rule = "✓", "✗", "│", "─", "┼"
            self.alpha, self.gamma, self.dot = "α", "γ", "·"
        except (UnicodeEncodeError, LookupError):
            self.check, self.cross, self.bar, self.rule, self.cross_rule = "yes", "NO", "|", "-", "+"
            self.alpha, self.gamma, self.dot = "alpha", "gamma", "-"

    def style(self, text: str, code: str) -> str:
        return f"{code}{text}{_RESET}" if self.fancy else text

    def bold(self, text: str) -> str:
        return self.style(text, _BOLD)

    def print(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    @contextlib.contextmanager
    def status(self, message: str):
        """Says on stderr what is running, right away (loading takes a few seconds); on a terminal the line is erased
        when done."""
        start = time.perf_counter()
        if self.err_fancy:
            print(f"{message} ...", end="", file=self.err, flush=True)
        else:
            print(f"hf-specdec: {message} ...", file=self.err, flush=True)
        try:
            yield
        finally:
            if self.err_fancy:
                print("\r\x1b[K", end="", file=self.err, flush=True)
            else:
                print(f"hf-specdec: {message}: done in {time.perf_counter() - start:.1f} s", file=self.err, flush=True)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _wrap(cells: list, width: int) -> list[list]:
    """`cells` (one line's characters) cut into lines of at most `width`, after a space where one is near the end;
    the lines it continues on keep its indentation (a hanging indent, as an editor's soft wrap)."""
    indent = 0
    while indent < len(cells) and cells[indent][0] == " ":
        indent += 1
    indent = min(indent, width // 2)
    lines = []
    while len(cells) > width:
        cut = width
        for position in range(width, width * 2 // 3, -1):
            if cells[position - 1][0] == " ":
                cut = position
                break
        lines.append(cells[:cut])
        cells = [(" ", False)] * indent + cells[cut:]
    lines.append(cells)
    return lines


def styled_lines(pieces: list[str], drafted: list[bool], width: int, mark: bool) -> list[str]:
    """The text of `pieces` cut at newlines and wrapped at `width` columns, each line padded to `width`; with
    `mark`, the characters of drafted pieces are green, and underlined but for spaces (ANSI escapes)."""
    lines: list[list[tuple[str, bool]]] = [[]]
    for piece, from_draft in zip(pieces, drafted):
        for char in piece.replace("\t", "    "):
            if char == "\n":
                lines.append([])
            elif char.isprintable():
                lines[-1].append((char, from_draft))
    rendered = []
    for cells in (wrapped for line in lines for wrapped in _wrap(line, width)):
        text, current = "", ""
        for char, from_draft in cells:
            style = (_DRAFTED_SPACE if char == " " else _DRAFTED) if mark and from_draft else ""
            if style != current:
                text += _RESET + style if current else style
                current = style
            text += char
        if current:
            text += _RESET
        rendered.append(text + " " * (width - len(cells)))
    return rendered


class SideBySide:
    """Two `generate` runs in two columns, redrawn in place as they stream (a terminal only): the left one first,
    then the right one, each with its live tokens per second."""

    def __init__(self, console: Console, tokenizer, titles: tuple[str, str]):
        self.console = console
        self.titles = titles
        self.column = (console.width - 3) // 2
        update = self._update if console.fancy else None  # redrawn on a terminal only
        self.left = RoundStreamer(tokenizer, update)
        self.right = RoundStreamer(tokenizer, update)
        self.notes = ["", ""]  # shown under each side's numbers once it is done
        self._drawn = 0  # lines of the frame on screen
        self._last_draw = 0.0

    def _update(self, final: bool) -> None:
        if final or time.perf_counter() - self._last_draw > 1 / 30:
            self.draw()

    def _numbers(self, streamer: RoundStreamer) -> str:
        if streamer.started is None:
            return self.console.style("waiting", _DIM)
        rate = f"{streamer.tokens_per_second():5.0f} tokens/s"
        return f"{self.console.style(rate, _BOLD)}  {len(streamer.tokens):3d} tokens  {streamer.seconds():5.2f} s"

    def frame(self) -> list[str]:
        console, width = self.console, self.column
        body_rows = max(5, console.height - 9)
        sides = [self.left, self.right]
        columns = [styled_lines(side.pieces, side.drafted, width, console.fancy)[-body_rows:] for side in sides]
        rows = max(len(column) for column in columns)
        blank = " " * width

        def pad(text: str) -> str:
            visible = len(_strip_ansi(text))
            return text + " " * max(0, width - visible)

        bar = console.style(console.bar, _DIM)
        lines = [
            f"{pad(console.style(self.titles[0], _BOLD))} {bar} {console.style(self.titles[1], _BOLD)}",
            f"{pad(self._numbers(self.left))} {bar} {self._numbers(self.right)}",
            f"{pad(self.notes[0])} {bar} {self.notes[1]}",
            console.style(console.rule * (width + 1) + console.cross_rule + console.rule * (width + 1), _DIM),
        ]
        for row in range(rows):
            left = columns[0][row] if row < len(columns[0]) else blank
            right = columns[1][row] if row < len(columns[1]) else ""
            lines.append(f"{left} {bar} {right.rstrip()}")
        return lines

    def draw(self) -> None:
        lines = self.frame()
        up = f"\x1b[{self._drawn}F\x1b[J" if self._drawn else ""
        self.console.out.write(up + "\n".join(lines) + "\n")
        self.console.out.flush()
        self._drawn = len(lines)
        self._last_draw = time.perf_counter()


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)


def stream_pair(console: Console, target, tokenizer, run_left, run_right, titles: tuple[str, str]):
    """Runs `run_left(streamer)` then `run_right(streamer)` (each a `generate` call), drawn side by side as they
    stream on a terminal; returns the two outputs and their streamers."""
    view = SideBySide(console, tokenizer, titles)
    if console.fancy:
        console.out.write("\x1b[?25l")  # hide the cursor while redrawing
    try:
        if console.fancy:
            view.draw()
        outputs = []
        for streamer, run in ((view.left, run_left), (view.right, run_right)):
            with rounds_of(target, streamer):
                outputs.append(run(streamer))
            note = f"{streamer.rounds} target forwards, " + (
                "one per token" if streamer is view.left else f"{sum(streamer.drafted)} accepted drafts"
            )
            view.notes[0 if streamer is view.left else 1] = console.style(note, _DIM)
            if console.fancy:
                view.draw()
    finally:
        if console.fancy:
            console.out.write("\x1b[?25h")
            console.out.flush()
    return outputs, view


@dataclass
class Row:
    """One line of the summary table."""

    method: str
    seconds: float
    spread: float  # (max - min) / median of the repeated timings
    speedup: float  # plain seconds / these seconds
    alpha: float | None  # None for plain generate
    tokens_per_call: float
    identical: bool


def print_table(console: Console, rows: list[Row]) -> None:
    """The summary: seconds, speedup over plain, α and tokens per target call, and whether the output equals plain
    `generate`."""
    header = f"{'method':30s} {'seconds':>8s} {'spread':>7s} {'speedup':>8s} {console.alpha:>6s} {'tokens/call':>12s}"
    console.print(console.style(f"{header}  {'= plain':>7s}", _BOLD))
    for row in rows:
        speedup = f"{row.speedup:7.2f}x"
        if row.alpha is not None:
            speedup = console.style(speedup, _GREEN if row.speedup >= 1 else _RED)
        alpha = f"{row.alpha:6.3f}" if row.alpha is not None else f"{'-':>6s}"
        same = (
            console.style(f"{console.check:>7s}", _GREEN)
            if row.identical
            else console.style(f"{console.cross:>7s}", _RED)
        )
        console.print(
            f"{row.method:30s} {row.seconds:8.3f} {row.spread:6.0%} {speedup} {alpha} {row.tokens_per_call:12.2f}  "
            f"{same}"
        )


def print_prompt(console: Console, title: str, prompt: str, prompt_tokens: int, lines: int = 5) -> None:
    """Which prompt runs, and its last lines, `lines` of them not blank (where the model takes over)."""
    console.print(f"{title} ({prompt_tokens} tokens), ending:")
    all_lines = prompt.rstrip("\n").splitlines()
    filled = [number for number, line in enumerate(all_lines) if line.strip()]
    tail = all_lines[filled[-lines] if len(filled) >= lines else 0 :]
    for line in tail:
        console.print(console.style(_clip(line.replace("\t", "    "), console.width), _DIM))
    console.print()


def _clip(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def print_stream_summary(console: Console, view: SideBySide, identical: bool) -> None:
    """Under the columns (a terminal), what the colours mean; elsewhere, both runs' numbers and the text, once."""
    left, right = view.left, view.right
    drafted = sum(right.drafted)
    if console.fancy:
        speedup = right.tokens_per_second() / max(left.tokens_per_second(), 1e-9)
        same = f"{console.check} same output" if identical else f"{console.cross} the outputs differ"
        console.print(
            f"{console.style('green underlined', _DRAFTED)} = accepted drafts ({drafted} of {len(right.tokens)} "
            f"tokens) {console.dot} {speedup:.2f}x plain's tokens/s {console.dot} "
            + console.style(same, _GREEN if identical else _RED)
        )
        return
    console.print(
        f"{view.titles[0]}: {len(left.tokens)} tokens in {left.seconds():.2f} s ({left.tokens_per_second():.0f} "
        "tokens/s), one target forward per token"
    )
    console.print(
        f"{view.titles[1]}: {len(right.tokens)} tokens in {right.seconds():.2f} s ({right.tokens_per_second():.0f} "
        f"tokens/s), {right.rounds} target forwards: {drafted} tokens from accepted drafts, "
        f"{len(right.tokens) - drafted} from the target"
    )
    console.print(
        f"--- generated ({'identical on both sides' if identical else 'THE OUTPUTS DIFFER; plain shown'}) ---"
    )
    console.print(left.text)
    console.print("---")
