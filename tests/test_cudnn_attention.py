"""`speculative_cudnn_attention`: on a CUDA device a speculative call runs with cuDNN's attention off (it sets itself
up anew for each new query and key length, and speculation meets many), restored when the last concurrent call ends;
on the CPU nothing changes. The switch is torch's process-wide flag, which a CPU build of torch sets as well, so the
guard's bookkeeping is checked here; `tests/test_cuda.py` checks a real call on a GPU."""

import threading

import pytest
import torch
from conftest import noisy_copy, prompt, tiny_model

import hf_specdec
from hf_specdec.devices import cudnn_attention_off


@pytest.fixture(autouse=True)
def cudnn_flag_restored():
    backends = torch.backends.cuda
    before = backends.cudnn_sdp_enabled(), backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled()
    yield
    for enable, value in zip(
        (backends.enable_cudnn_sdp, backends.enable_flash_sdp, backends.enable_mem_efficient_sdp), before
    ):
        enable(value)


def flag() -> bool:
    return torch.backends.cuda.cudnn_sdp_enabled()


def test_the_guard_turns_it_off_on_cuda_only_and_back_on():
    torch.backends.cuda.enable_cudnn_sdp(True)
    with cudnn_attention_off("cuda:0"):
        assert not flag()
    assert flag()
    for device, off in (("cpu", True), (torch.device("cuda"), False)):
        with cudnn_attention_off(device, off):
            assert flag()
        assert flag()


def test_the_guard_leaves_it_off_when_it_was_off_and_restores_after_an_error():
    torch.backends.cuda.enable_cudnn_sdp(False)
    with cudnn_attention_off("cuda"):
        assert not flag()
    assert not flag()
    torch.backends.cuda.enable_cudnn_sdp(True)
    with pytest.raises(RuntimeError, match="inside"), cudnn_attention_off("cuda"):
        raise RuntimeError("inside")
    assert flag()


def test_a_caller_limited_to_cudnn_attention_keeps_it():
    """Under `sdpa_kernel(SDPBackend.CUDNN_ATTENTION)` (flash and memory-efficient attention off) turning cuDNN's off
    would leave no fast kernel: the guard changes nothing."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    with cudnn_attention_off("cuda"):
        assert flag()
    assert flag()
    torch.backends.cuda.enable_mem_efficient_sdp(True)  # one other fast kernel is enough
    with cudnn_attention_off("cuda"):
        assert not flag()
    assert flag()


def test_overlapping_calls_keep_it_off_until_the_last_one_leaves():
    torch.backends.cuda.enable_cudnn_sdp(True)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with cudnn_attention_off("cuda"):
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second():
        first_in.wait(5)
        with cudnn_attention_off("cuda"):
            second_in.set()
            first_out.wait(5)
            seen["after the first left"] = flag()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == {"after the first left": False}  # the first's exit did not turn it back on under the second
    assert flag()


def test_a_cpu_call_leaves_the_flag_alone_and_a_bad_value_is_refused():
    model = hf_specdec.enable(tiny_model("llama"))
    drafter = noisy_copy(model, 0.05)
    seen = []
    hook = model.register_forward_pre_hook(lambda module, args: seen.append(flag()))
    try:
        out = model.generate(prompt(seed=1), assistant_model=drafter, max_new_tokens=8, do_sample=False)
    finally:
        hook.remove()
    assert out.shape[1] > prompt(seed=1).shape[1] and set(seen) == {True}
    with pytest.raises(ValueError, match=r"`speculative_cudnn_attention` must be a bool, got 'no'\. .*pass True"):
        model.generate(prompt(seed=1), assistant_model=drafter, max_new_tokens=4, speculative_cudnn_attention="no")
