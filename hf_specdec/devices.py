"""Where a model computes, including models dispatched by accelerate."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

__all__ = ["HostReads", "cudnn_attention_off", "decode_step", "execution_device", "seconds_agreement", "to_device"]

_CUDNN_LOCK = threading.Lock()
_cudnn_off = {"holders": 0, "restore": False}  # calls inside `cudnn_attention_off`; whether the last one turns it on


@contextlib.contextmanager
def cudnn_attention_off(device: torch.device | str, off: bool = True) -> Iterator[None]:
    """Runs the block with cuDNN's scaled dot-product attention turned off when `device` is a CUDA device and `off`
    (`speculative_cudnn_attention=False`); otherwise changes nothing. cuDNN's attention sets itself up anew for each
    new pair of query and key lengths (30-55 ms for an 8B model on an H200), and speculative rounds meet many more
    such pairs than plain steps do; flash and memory-efficient attention need no set-up. The flag is process-wide,
    so concurrent calls share one switch: the first to enter turns it off (if it was on) and the last to leave
    turns it back on. Where neither flash nor memory-efficient attention is enabled (`sdpa_kernel` limited to cuDNN's
    by the caller), nothing changes: turning cuDNN's off would leave no kernel, or the slow math one."""
    backends = torch.backends.cuda
    if not off or torch.device(device).type != "cuda":
        yield
        return
    entered = False
    try:
        with _CUDNN_LOCK:
            if _cudnn_off["holders"] == 0:
                others = backends.flash_sdp_enabled() or backends.mem_efficient_sdp_enabled()
                _cudnn_off["restore"] = backends.cudnn_sdp_enabled() and others
                if _cudnn_off["restore"]:
                    backends.enable_cudnn_sdp(False)
            _cudnn_off["holders"] += 1
            entered = True
        yield
    finally:
        if entered:
            with _CUDNN_LOCK:
                _cudnn_off["holders"] -= 1
                if _cudnn_off["holders"] == 0 and _cudnn_off["restore"]:
                    backends.enable_cudnn_sdp(True)
                    _cudnn_off["restore"] = False


def execution_device(model: torch.nn.Module) -> torch.device:
    """The device a model computes on. For a model dispatched by accelerate (`device_map=...` with layers offloaded
    to the CPU or disk, or `accelerate.cpu_offload`), `model.device` names the device of its first parameter, which
    is `meta` when that parameter is offloaded: the device that matters for its inputs is where the hook of its input
    embeddings runs it (accelerate's `execution_device`)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for module in (embeddings, model):
        hook = getattr(module, "_hf_hook", None)
        for part in getattr(hook, "hooks", None) or [hook]:  # a SequentialHook chains several
            device = getattr(part, "execution_device", None)
            if device is not None:
                return torch.device(device)
    for tensor in embeddings.parameters() if embeddings is not None else ():
        if tensor.device.type != "meta":
            return tensor.device
    for tensor in model.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def to_device(values: list, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of the host's `values` on `device`, without waiting for the device: `torch.tensor(values,
    device="cuda")` copies from pageable memory, which synchronizes the stream (the host waits for every queued
    kernel); from pinned memory the copy is queued behind them instead."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def decode_step(model: torch.nn.Module):
    """The context plain `generate` runs its decode steps in (`GenerationMixin._optimize_model_for_decode`, where the
    installed transformers has it; a no-op context otherwise). On an accelerator it computes a mixture-of-experts
    model's experts with `batched_mm` instead of `grouped_mm` for the step, and switches back after it; on the CPU it
    changes nothing. transformers' sampling loop runs every forward but the prefill in it, and its assisted
    generation every verify forward but the first, so the target's forwards here do the same: the same kernels as
    plain decoding (its numerics, its speed on small inputs). transformers' beam search does not use it, and neither
    does speculative beam search."""
    enter = getattr(model, "_optimize_model_for_decode", None)
    return enter() if enter is not None else contextlib.nullcontext()


def seconds_agreement(model: torch.nn.Module):
    """A function `agree(*seconds) -> tuple` that gives every process serving `model` the same timings.

    A model sharded by tensor parallelism (transformers' `tp_plan`: weights are `DTensor`s on a device mesh) runs one
    forward in all the processes of its mesh together, so they must take the same steps: the same γ, the same plain
    steps. A policy that decides from measured seconds would not: each process measures its own, and a decision near
    a threshold can go one way in one process and the other way in the next, after which their collectives no longer
    match and the run crashes or hangs. `agree` replaces the seconds with the slowest process's (one all-reduce over
    the mesh, the same result in every process). For a model that is not sharded it returns the seconds as given."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):  # nothing can be sharded
        return lambda *seconds: seconds
    from torch.distributed.tensor import DTensor

    sharded = next((parameter for parameter in model.parameters() if isinstance(parameter, DTensor)), None)
    if sharded is None or sharded.device_mesh.size() == 1:
        return lambda *seconds: seconds
    mesh, device = sharded.device_mesh, sharded.to_local().device
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]

    def agree(*seconds):
        values = torch.tensor(seconds, dtype=torch.float64, device=device)
        for group in groups:  # the max over each axis in turn is the max over the whole mesh
            torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=group)
        return tuple(values.tolist())

    return agree


# the Tensor methods that copy a value to the host and so wait for the device
_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


class HostReads:
    """Counts reads of tensor values on the host while active (a context manager; restores the methods on exit).

    A read of a CPU tensor counts too: the count is what the same code would do on a GPU. `.cpu()` of a tensor
    already on the CPU is counted as well, since on a GPU it is the transfer. It patches `torch.Tensor` for the whole
    process while active: a diagnostic for tests and benchmarks, not for concurrent use.

    Args:
        outside_of (`list[torch.nn.Module]`, *optional*):
            Modules whose forwards' own reads are not counted (a model's forward reads what plain `generate` reads
            too, e.g. whether a padding mask can be skipped): only the reads of the loop around them count.
    """

    def __init__(self, outside_of: list[torch.nn.Module] = ()):
        self.count = 0
        self._saved: dict[str, Callable | None] = {}  # None: the method was inherited, not set on torch.Tensor
        self._modules = list(outside_of)
        self._handles = []
        self._inside = 0  # how many of the skipped forwards are running

    def __enter__(self) -> HostReads:
        for name in _READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = torch.Tensor.__dict__.get(name)

            def counted(tensor, *args, _original=original, **kwargs):
                self.count += self._inside == 0
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        for module in self._modules:
            self._handles.append(module.register_forward_pre_hook(self._enter_forward))
            self._handles.append(module.register_forward_hook(self._leave_forward, always_call=True))
        return self

    def _enter_forward(self, module, args):
        self._inside += 1

    def _leave_forward(self, module, args, output):
        self._inside -= 1

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        self._saved.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
