"""The benchmark harness: methods timed side by side in one process, interleaved and rotated, summarized by medians.

Every benchmark compares callables that do the same job (plain `generate`, transformers' assisted generation, ours,
a reference loop). Timing them one after another lets the machine's state (turbo, caches, a neighbour's load) favour
one; here each repeat runs every method once, in an order rotated by one each repeat, and the summary is the median
with its spread (min and max). Host reads (a tensor's value read on the host: `.item()`, `.tolist()`, `bool(t)`,
`int(t)`, `float(t)`, `.cpu()`, `.numpy()`) are counted by `HostReads`: on a GPU each one waits for the device.

    from harness import HostReads, assistant_with_gamma, interleaved, machine, summarize, timed, write_results
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hf_specdec.devices import HostReads  # re-exported: benchmarks count reads with it

__all__ = [
    "ForwardCounter",
    "HostReads",
    "assistant_with_gamma",
    "cached_forward_ms",
    "interleaved",
    "machine",
    "summarize",
    "synchronize",
    "timed",
    "write_results",
]


def assistant_with_gamma(drafter, gamma: int):
    """A shallow copy of `drafter` for transformers' assisted generation, which reads the draft length from the
    assistant's own generation config: constant `gamma`, no confidence cut-off (the user's drafter is untouched)."""
    assistant = copy.copy(drafter)
    assistant.generation_config = copy.deepcopy(drafter.generation_config)
    assistant.generation_config.num_assistant_tokens = gamma
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    return assistant


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


class ForwardCounter:
    """Counts a model's forwards (a forward pre-hook), the same way for every method: tokens per target call of plain
    `generate`, transformers' assisted generation and ours alike. `close()` removes the hook."""

    def __init__(self, model):
        self.count = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


def interleaved(methods: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Wall seconds of each method per repeat: every repeat runs each method once, the order rotated by one each
    repeat; `warmup` rounds first, untimed."""
    names = list(methods)
    for _ in range(warmup):
        for name in names:
            methods[name]()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            methods[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def summarize(values: list[float]) -> dict[str, float]:
    """Median, min and max of a list of measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def machine() -> dict[str, object]:
    """What the results were measured on: processor, cores, threads, library versions, date."""
    import transformers

    import hf_specdec

    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_specdec": hf_specdec.__version__,
        "date": datetime.date.today().isoformat(),
    }


def write_results(path: str | Path, payload: dict) -> Path:
    """Writes `payload` with the `machine()` fields as indented JSON, through a new temporary file (created, never
    followed if a link stands there) renamed over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as temporary:
        temporary.write(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    os.chmod(temporary.name, 0o644)  # a results file others read, not a private temporary
    os.replace(temporary.name, path)
    return path


def synchronize(device: torch.device | str) -> None:
    """Waits for the device's queued work (a no-op on the CPU): wall times of GPU calls are taken after it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def cached_forward_ms(model, batch: int, context: int, new_tokens: int, repeats: int = 7) -> float:
    """Median ms of one forward over `new_tokens` new tokens per row after `context` cached ones (a `DynamicCache`,
    cropped back to `context` after each forward), on the model's device, synchronized; one untimed forward first."""
    from transformers import DynamicCache

    from hf_specdec.caches import CACHE_KWARG

    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(1, vocab, (batch, context), generator=generator, device="cpu").to(model.device)
    tokens = torch.randint(1, vocab, (batch, new_tokens), generator=generator, device="cpu").to(model.device)
    cache = DynamicCache(config=model.config)
    model(prompt, **{CACHE_KWARG: cache}, use_cache=True)
    times = []
    for _ in range(repeats + 1):
        synchronize(model.device)
        start = time.perf_counter()
        model(tokens, **{CACHE_KWARG: cache}, use_cache=True, logits_to_keep=new_tokens)
        synchronize(model.device)
        times.append(time.perf_counter() - start)
        cache.crop(-new_tokens)
    return 1000 * statistics.median(times[1:])
