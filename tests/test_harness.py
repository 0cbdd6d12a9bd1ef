"""The timing core (`hf_specdec.benchmarking`) on a fake clock, and the layout of `benchmarks/`: every script measures
through the shared modules and no script imports another."""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest

from hf_specdec import benchmarking
from hf_specdec.benchmarking import Run, interleaved, rotated, spread, summarize, write_results

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SHARED = {"harness", "pairs", "real_model_prompts"}  # what the scripts may import from benchmarks/


class FakeClock:
    """`time.perf_counter` for `hf_specdec.benchmarking`: time moves only when a method says it took some."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def method(self, name: str, seconds: float, calls: list):
        def run(*args):
            calls.append((name, *args))
            self.now += seconds
            return f"{name}{args}"

        return run


@pytest.fixture
def clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(benchmarking.time, "perf_counter", clock)
    return clock


@pytest.mark.parametrize(
    "shift, expected",
    [(0, ["a", "b", "c"]), (1, ["b", "c", "a"]), (2, ["c", "a", "b"]), (3, ["a", "b", "c"]), (5, ["c", "a", "b"])],
)
def test_rotated(shift, expected):
    assert rotated(["a", "b", "c"], shift) == expected


def test_interleaved_rotates_the_order_each_repeat(clock):
    calls = []
    methods = {name: clock.method(name, seconds, calls) for name, seconds in (("a", 1.0), ("b", 2.0), ("c", 4.0))}
    seconds = interleaved(methods, repeats=4, warmup=1)
    assert calls == [("a",), ("b",), ("c",)] + [
        (name,) for name in ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    ]  # the warm-up, then one rotation per repeat
    assert seconds == {"a": [1.0] * 4, "b": [2.0] * 4, "c": [4.0] * 4}


def test_interleaved_over_inputs_rotates_per_input_and_sums_per_repeat(clock):
    calls, runs = [], []
    methods = {"a": clock.method("a", 1.0, calls), "b": clock.method("b", 10.0, calls)}
    seconds = interleaved(methods, repeats=2, warmup=0, inputs=["x", "y", "z"], on_run=runs.append)
    assert calls == [
        ("a", "x"), ("b", "x"), ("b", "y"), ("a", "y"), ("a", "z"), ("b", "z"),  # repeat 0
        ("b", "x"), ("a", "x"), ("a", "y"), ("b", "y"), ("b", "z"), ("a", "z"),  # repeat 1
    ]  # fmt: skip
    assert seconds == {"a": [3.0, 3.0], "b": [30.0, 30.0]}  # each repeat: the method's runs over all inputs
    assert runs[0] == Run("a", 0, 0, 1.0, "a('x',)")
    assert [(run.name, run.repeat, run.index) for run in runs[6:8]] == [("b", 1, 0), ("a", 1, 0)]


def test_interleaved_times_each_run_on_its_own(clock):
    calls = []
    methods = {"fast": clock.method("fast", 1.0, calls), "slow": clock.method("slow", 3.0, calls)}
    seconds = interleaved(methods, repeats=3, warmup=2)
    assert len(calls) == 2 * 2 + 3 * 2
    assert seconds == {"fast": [1.0, 1.0, 1.0], "slow": [3.0, 3.0, 3.0]}


def test_summarize_and_spread():
    assert summarize([4.0, 1.0, 2.0, 10.0]) == {"median": 3.0, "min": 1.0, "max": 10.0, "n": 4}
    assert spread([4.0, 1.0, 2.0, 10.0]) == pytest.approx(3.0)  # (10 - 1) / 3
    assert spread([2.0, 2.0]) == 0.0
    assert spread([5.0]) == 0.0  # one run: no spread to speak of


def test_write_results_adds_the_machine_and_replaces_a_link(tmp_path):
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("untouched")
    path = tmp_path / "results" / "run.json"
    path.parent.mkdir()
    path.symlink_to(elsewhere)
    write_results(path, {"rows": [1, 2], "threads": 3, "output": Path("x.json")})
    written = json.loads(path.read_text())
    assert not path.is_symlink() and elsewhere.read_text() == "untouched"
    assert written["rows"] == [1, 2] and written["threads"] == 3 and written["output"] == "x.json"
    assert set(written["machine"]) >= {"machine", "device", "threads", "torch", "transformers", "hf_specdec", "date"}
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o644)
    write_results(path, {"machine": {"date": "2024-01-01"}})  # the payload's own machine fields win
    assert json.loads(path.read_text()) == {"machine": {"date": "2024-01-01"}}


# ------------------------------------------------------------------------------------------- benchmarks/ layout


def local_imports(path: Path) -> set[str]:
    """The modules of benchmarks/ that `path` imports, anywhere in it (inside functions too)."""
    local = {file.stem for file in BENCHMARKS.glob("*.py")}
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & local


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda path: path.name)
def test_benchmarks_import_only_the_shared_modules(path):
    imported = local_imports(path)
    assert imported <= SHARED, f"{path.name} imports {sorted(imported - SHARED)}: move what it needs to harness.py"
    if path.stem in SHARED:
        assert not imported, f"{path.name} is shared: it imports nothing from benchmarks/"
    if path.name.startswith("bench_"):
        assert "harness" in imported, f"{path.name} should time and write its results through harness.py"


@pytest.fixture
def harness():
    """benchmarks/harness.py as a module, benchmarks/ on sys.path only while it is imported."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import harness
    finally:
        sys.path.remove(str(BENCHMARKS))
    yield harness
    sys.modules.pop("harness", None)


def test_the_harness_serves_the_package_core(harness):
    for name in benchmarking.__all__:
        assert getattr(harness, name) is getattr(benchmarking, name), name


def test_forward_counter_takes_the_forwards_since_the_last_take(harness):
    import torch

    model = torch.nn.Linear(2, 2)
    counter = harness.ForwardCounter(model)
    for _ in range(3):
        model(torch.zeros(1, 2))
    assert counter.take() == 3 and counter.take() == 0
    model(torch.zeros(1, 2))
    counter.close()
    model(torch.zeros(1, 2))  # after close(): not counted
    assert counter.take() == 1 and counter.count == 4
