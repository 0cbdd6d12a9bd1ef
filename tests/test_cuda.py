"""On a CUDA device (skipped without one): greedy identity for every kind of drafting, the sampler's distribution, host
reads per round, and the static cache compiled with `mode="reduce-overhead"`, whose verify forward and draft-model
step run as captured CUDA graphs in a bounded number of shapes.

The rest of the suite runs on the CPU; this file is the CUDA pass (`python -m pytest -q tests/test_cuda.py` on a machine
with a GPU). Everything is float32: TF32 matrix products are left off, as torch's default."""

import pytest
import torch
from conftest import ScriptedDrafter, noisy_copy, prompt, tiny_model
from test_host_reads import reads_per_round
from test_sampling_distribution import CONFIGS, P_THRESHOLD, SAMPLES, exact_two_token_distribution, goodness_of_fit
from transformers import CompileConfig

import hf_specdec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
NEW_TOKENS = 24


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Graphs of earlier tests (and their CUDA graphs) would count against this test's bounds."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def llama():
    return hf_specdec.enable(tiny_model("llama")).to(CUDA)


def greedy(model, ids, **kwargs):
    return model.generate(
        ids,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        speculative_gamma=4,
        speculative_gamma_policy="constant",
        return_dict_in_generate=True,
        **kwargs,
    )


def test_greedy_identity_on_cuda(llama):
    ids = prompt(seed=3).to(CUDA)
    plain = llama.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert plain.device.type == "cuda"
    cases = {
        "always_right": dict(drafter=ScriptedDrafter(plain)),
        "never_right": dict(drafter=ScriptedDrafter(plain, period=1)),
        "partly_right": dict(drafter=ScriptedDrafter(plain, period=3)),
        "assistant": dict(assistant_model=noisy_copy(llama, 0.05)),
        "assistant_tree": dict(assistant_model=noisy_copy(llama, 0.05), speculative_tree_budget=6),
        "prompt_lookup": dict(drafter="prompt_lookup"),
        "early_exit": dict(assistant_early_exit=1),
        "static_target": dict(assistant_model=noisy_copy(llama, 0.05), cache_implementation="static"),
    }
    accepted = {}
    for name, kwargs in cases.items():
        if name == "static_target":  # eager here: the compiled static cache is the CUDA-graph test's
            kwargs = dict(kwargs, disable_compile=True)
            reference = llama.generate(
                ids, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static", disable_compile=True
            )
        else:
            reference = plain
        out = greedy(llama, ids, **kwargs)
        assert torch.equal(out.sequences, reference), name
        accepted[name] = out.speculative_stats.acceptance_rate
    assert accepted["always_right"] == 1.0 and accepted["never_right"] == 0.0
    assert 0.0 < accepted["partly_right"] < 1.0 and 0.0 < accepted["assistant"]


@pytest.mark.parametrize("cudnn_attention", [False, True])
def test_cudnn_attention_is_off_while_speculating_unless_asked(llama, cudnn_attention):
    """`speculative_cudnn_attention=False` (the default): every forward of the call (target and drafter) runs with
    cuDNN's attention off, turned back on afterwards; True leaves torch's setting alone."""
    ids = prompt(seed=5).to(CUDA)
    drafter = noisy_copy(llama, 0.05)
    seen = []

    def record(module, args):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())

    hooks = [model.register_forward_pre_hook(record) for model in (llama, drafter)]
    assert torch.backends.cuda.cudnn_sdp_enabled()  # torch's default
    try:
        out = greedy(llama, ids, assistant_model=drafter, speculative_cudnn_attention=cudnn_attention)
    finally:
        for hook in hooks:
            hook.remove()
    assert out.speculative_stats.drafted_tokens > 0
    assert len(seen) > 4 and set(seen) == {cudnn_attention}
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_padded_batch_is_exact_on_cuda(llama):
    ids = torch.cat([prompt(8, seed=1), prompt(8, seed=2), prompt(8, seed=4)]).to(CUDA)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0
    kwargs = dict(attention_mask=mask, pad_token_id=0)
    plain = llama.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    out = greedy(llama, ids, assistant_model=noisy_copy(llama, 0.1), **kwargs)
    assert torch.equal(out.sequences, plain)
    assert 0.0 < out.speculative_stats.acceptance_rate < 1.0


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_host_reads_per_round_on_cuda(llama, do_sample):
    drafter = noisy_copy(llama, 0.3)
    kwargs = dict(do_sample=do_sample, new_tokens=90)  # CUDA's samples differ from the CPU's: enough rounds for both
    torch.manual_seed(0)
    assert reads_per_round(llama, drafter, prompt(8).to(CUDA), **kwargs) <= 2
    ids = torch.cat([prompt(8, seed=1), prompt(8, seed=2)]).to(CUDA)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    # rows that finish apart read a little more per round in a longer call
    assert reads_per_round(llama, drafter, ids, attention_mask=mask, do_sample=do_sample, new_tokens=45) <= 2
    static_drafter = hf_specdec.ModelDrafter(drafter, cache_implementation="static")
    compiled = dict(cache_implementation="static", compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    # the loop's two, transformers' own check of a static cache's offset for a query of several tokens, and a
    # fraction more from the last rounds, which run eagerly once the compiled sizes no longer fit in the cache
    torch.manual_seed(1)  # sampling: both calls accept and reject (seed 0's short call accepted all 12 on an H200)
    with torch._dynamo.config.patch(recompile_limit=32):  # three cache lengths (4, 15 and 45 new tokens)
        per_round = reads_per_round(
            llama, static_drafter, prompt(8).to(CUDA), **compiled, do_sample=do_sample, new_tokens=45
        )
    assert per_round < 3.5


def samples_of(model, ids, n, **kwargs):
    torch.manual_seed(1234)
    return [
        tuple(model.generate(ids, do_sample=True, max_new_tokens=2, **kwargs)[0, ids.shape[1] :].tolist())
        for _ in range(n)
    ]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "cuda_graphs"])
def test_sampling_follows_the_target_on_cuda(compiled):
    """The drafted tokens' q and the target's p survive the next forward: with CUDA graphs a replay overwrites the
    previous replay's outputs in place, so a sampler that kept a view of them would accept with the wrong ratio."""
    target_cpu = tiny_model("llama", seed=0)
    drafter_cpu = tiny_model("llama", seed=1)  # far from the target: without exact acceptance the test fails
    config = CONFIGS["temperature_top_k"]
    ids = prompt(6, seed=11)
    table = exact_two_token_distribution(target_cpu, ids, config)
    target, drafter = hf_specdec.enable(target_cpu.to(CUDA)), drafter_cpu.to(CUDA)
    kwargs = dict(speculative_gamma=2, speculative_gamma_policy="constant", **config)
    if compiled:
        kwargs.update(
            drafter=hf_specdec.ModelDrafter(drafter, cache_implementation="static"),
            cache_implementation="static",
            compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"),
        )
    else:
        kwargs["assistant_model"] = drafter
    samples = samples_of(target, ids.to(CUDA), SAMPLES, **kwargs)
    assert goodness_of_fit(table, samples) > P_THRESHOLD
    # power: the same test rejects the drafter's own samples
    drafter_samples = samples_of(hf_specdec.enable(drafter), ids.to(CUDA), SAMPLES, **config)
    assert any(s not in table for s in drafter_samples) or goodness_of_fit(table, drafter_samples) < P_THRESHOLD


class CudaGraphRecordings:
    """Counts the CUDA graphs torch's cudagraph trees record (`mode="reduce-overhead"`) while it is active."""

    def __init__(self, monkeypatch):
        from torch._inductor import cudagraph_trees

        self.count = 0
        original = cudagraph_trees.CUDAGraphTreeManager.record_function

        def record_function(manager, *args, **kwargs):
            self.count += 1
            return original(manager, *args, **kwargs)

        monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", record_function)


def test_static_compiled_rounds_run_as_cuda_graphs_in_a_bounded_number_of_shapes(llama, monkeypatch):
    """`cache_implementation="static"` with `CompileConfig(mode="reduce-overhead")`: the verify forward (padded to a
    few sizes) and the static draft cache's step are compiled once per shape and replayed as CUDA graphs; calls after
    the first compile nothing, a call records a few graphs whatever its number of rounds (transformers makes a new
    target cache per call, whose new addresses plain decoding records again too), and no graph is skipped for a
    host-dependent shape or input."""
    recordings = CudaGraphRecordings(monkeypatch)
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    kwargs = dict(max_new_tokens=3 * NEW_TOKENS, do_sample=False, cache_implementation="static", compile_config=config)
    # one drafter for every call, as a user keeps it: its static cache (and the graphs captured over it) is reused
    drafter = hf_specdec.ModelDrafter(noisy_copy(llama, 0.2), cache_implementation="static")
    calls = []
    for seed in (7, 8, 7):
        ids = prompt(seed=seed).to(CUDA)
        before = recordings.count
        plain = llama.generate(ids, **kwargs)
        plain_recorded = recordings.count - before
        before = recordings.count
        out = llama.generate(
            ids,
            drafter=drafter,
            speculative_gamma=4,
            speculative_gamma_policy="constant",
            return_dict_in_generate=True,
            **kwargs,
        )
        stats = out.speculative_stats
        calls.append((recordings.count - before, stats.target_compilations, stats.drafter_compilations))
        print(
            f"seed {seed}: recorded, target compilations, drafter compilations = {calls[-1]}; plain recorded "
            f"{plain_recorded}; stats {stats}"
        )
        assert torch.equal(out.sequences, plain), seed
        # every round but the prompt's and the last few (a padded size past the cache's end runs eagerly)
        assert stats.compiled_rounds >= stats.target_calls - 4
        assert 0.0 < stats.acceptance_rate < 1.0  # partly right: the verify forward sees several accepted lengths
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips
    assert calls[0][0] > 0  # CUDA graphs were recorded
    assert calls[0][1] <= 4 and calls[0][2] <= 2  # a few padded shapes, not one per round
    assert all(recorded <= 4 for recorded, _, _ in calls), calls  # a few per call, not one per round (~30 rounds)
    assert all(target == drafter == 0 for _, target, drafter in calls[1:]), calls  # later calls compile nothing
