"""Timing methods side by side: interleaved and rotated runs, medians with their spread, and the results file.

Every measurement here compares callables that do the same job (plain `generate`, transformers' assisted generation,
ours). Timing them one after another lets the machine's state (turbo, caches, a neighbour's load) favour one; here
every repeat runs every method once on every input, in an order rotated by one for each (repeat, input), and a
method's time is the median over repeats with its spread. `hf-specdec bench` and `hf-specdec demo` time with it, and
so does every script in `benchmarks/` (through `benchmarks/harness.py`, which adds the benchmark-only helpers).

Vocabulary: a *method* is a named callable; a *run* is one timed call of one method on one input; a *repeat* runs
every method on every input once. torch and transformers are imported by the functions that need them, not with
the module.

    >>> from hf_specdec.benchmarking import interleaved, spread, summarize
    >>> seconds = interleaved({"a": lambda: sum(range(100)), "b": lambda: sum(range(200))}, repeats=3)
    >>> [len(times) for times in seconds.values()]
    [3, 3]
    >>> summarize([3.0, 1.0, 2.0])
    {'median': 2.0, 'min': 1.0, 'max': 3.0, 'n': 3}
    >>> spread([1.0, 2.0, 3.0])
    1.0
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Run", "interleaved", "machine", "rotated", "spread", "summarize", "synchronize", "timed", "write_results"]


@dataclass(frozen=True)
class Run:
    """One timed call: `name` of the method, `repeat` and `index` (of the input, 0 without inputs), its wall
    `seconds` and what it returned."""

    name: str
    repeat: int
    index: int
    seconds: float
    output: Any


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """`(wall seconds, result)` of one call of `fn`."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def rotated(names: Sequence[str], shift: int) -> list[str]:
    """`names` rotated left by `shift`: run in this order, no method always goes first (or right after a slow one)."""
    names = list(names)
    shift %= len(names)
    return names[shift:] + names[:shift]


def interleaved(
    methods: Mapping[str, Callable[..., Any]],
    repeats: int,
    warmup: int = 1,
    *,
    inputs: Sequence[Any] | None = None,
    device=None,
    on_run: Callable[[Run], None] | None = None,
) -> dict[str, list[float]]:
    """Wall seconds of every method per repeat, the methods interleaved.

    Args:
        methods: name -> callable; called without arguments, or with each of `inputs`.
        repeats: timed repeats; each runs every method on every input once, in `rotated(names, repeat + index)`
            order.
        warmup (*optional*, defaults to 1): untimed calls of every method first (on the first input).
        inputs (*optional*): what each method is called with (prompts, say); `None`: called without arguments.
        device (*optional*): a torch device whose queued work each run waits for (`synchronize`) before its clock
            starts and before it stops; `None` waits for nothing (the CPU needs no wait).
        on_run (*optional*): called after every timed run with its `Run` (outputs, statistics, progress bars).

    Returns:
        name -> one time per repeat: the seconds of that repeat's runs of the method, summed over the inputs.
    """
    names = list(methods)
    items = [()] if inputs is None else [(item,) for item in inputs]
    for _ in range(warmup):
        for name in names:
            methods[name](*items[0])
    seconds: dict[str, list[float]] = {name: [0.0] * repeats for name in names}
    for repeat in range(repeats):
        for index, item in enumerate(items):
            for name in rotated(names, repeat + index):
                if device is not None:
                    synchronize(device)
                start = time.perf_counter()
                output = methods[name](*item)
                if device is not None:
                    synchronize(device)
                elapsed = time.perf_counter() - start
                seconds[name][repeat] += elapsed
                if on_run is not None:
                    on_run(Run(name, repeat, index, elapsed, output))
    return seconds


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of a list of measurements, and how many there are."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def spread(values: Sequence[float]) -> float:
    """(max - min) / median of one method's repeated times: how far to trust a ratio of medians (0 for one value)."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def synchronize(device) -> None:
    """Waits for the device's queued work (a no-op on the CPU): wall times of GPU calls are taken after it."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def machine() -> dict[str, Any]:
    """What the results were measured on: processor, cores, device, threads, library versions, date."""
    import torch
    import transformers

    from hf_specdec import __version__

    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_specdec": __version__,
        "date": datetime.date.today().isoformat(),
    }


def write_results(path: str | Path, payload: Mapping[str, Any]) -> Path:
    """Writes `payload` as indented JSON under a `machine` key holding `machine()` (a `machine` key of the payload's
    own wins), through a new temporary file (created, never followed if a link stands there) renamed over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as temporary:
        temporary.write(json.dumps({"machine": machine(), **payload}, indent=2, default=str) + "\n")
    os.chmod(temporary.name, 0o644)  # a results file others read, not a private temporary
    os.replace(temporary.name, path)
    return path
