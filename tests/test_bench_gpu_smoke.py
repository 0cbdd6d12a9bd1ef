"""`benchmarks/bench_gpu.py --smoke`: every method and batch size of the GPU benchmark, on tiny float32 models on the
CPU, so that the script keeps running between the runs on a lent GPU."""

import json
import math

import pytest
from conftest import benchmark_script

BATCHES = (1, 8)  # the script's defaults
EVERY_METHOD = {"plain", "plain_compiled", "transformers", "ours", "ours_tree", "ours_compiled"} | {
    f"ours_constant_{gamma}" for gamma in (1, 2, 3)
}
BATCH_ONLY_ONE = {"transformers", "ours_tree"}  # transformers' assisted generation and our token trees refuse batches


@pytest.fixture
def bench_gpu():
    with benchmark_script("bench_gpu") as module:
        yield module


def test_smoke_run_covers_every_method_and_batch(bench_gpu, tmp_path):
    payloads = bench_gpu.main(["--smoke", "--output-dir", str(tmp_path)])
    assert set(payloads) == {"8b", "1.1b"}
    for pair, payload in payloads.items():
        written = json.loads((tmp_path / f"gpu_{pair}_cpu.json").read_text())
        assert written["smoke"] and written["dtype"] == "float32"
        assert set(written["batches"]) == {str(batch) for batch in BATCHES}
        for batch in BATCHES:
            group = written["batches"][str(batch)]
            expected = EVERY_METHOD | ({"ours_1b"} if pair == "8b" else set())
            if batch > 1:
                expected -= BATCH_ONLY_ONE
                assert set(group["skipped"]) == BATCH_ONLY_ONE
            assert set(group["methods"]) == expected, (pair, batch)
            for name, row in group["methods"].items():
                assert math.isfinite(row["speedup"]) and row["speedup"] > 0, (pair, batch, name)
                assert row["tokens_per_target_call"] > 0 and row["host_reads_per_target_call"] >= 0
                if name.startswith("ours"):  # float32: greedy speculative decoding is token for token plain greedy
                    assert row["equals_plain"], (pair, batch, name)
                    assert 0.0 <= row["alpha"] <= 1.0
                    assert math.isfinite(row["theorem_3_8_best"])
            assert group["methods"]["ours"]["alpha"] > 0.5, (pair, batch)  # the early exit agrees by construction
            for gamma in (1, 2, 3):  # a constant γ drafts γ in every round (fewer near the end)
                history = [g for g in group["methods"][f"ours_constant_{gamma}"]["gamma_history"] if g]
                assert max(history) == gamma and history.count(gamma) >= len(history) - 2, (pair, batch, gamma)
            assert group["methods"]["ours_compiled"]["rows_equal_plain_compiled"] == batch
            assert group["methods"]["ours_compiled"]["graphs_compiled"] > 0
        assert payload["batches"].keys() == written["batches"].keys()


def test_without_cudnn_attention_writes_its_own_results_and_restores_the_setting(bench_gpu, tmp_path):
    import torch

    before = torch.backends.cuda.cudnn_sdp_enabled()
    seen = []
    original = bench_gpu.run_group

    def run_group(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return original(*args, **kwargs)

    bench_gpu.run_group = run_group
    try:
        args = ["--smoke", "--pairs", "1.1b", "--batches", "1", "--no-cudnn-attention", "--output-dir", str(tmp_path)]
        bench_gpu.main(args)
    finally:
        bench_gpu.run_group = original
    assert seen == [False] and torch.backends.cuda.cudnn_sdp_enabled() == before
    written = json.loads((tmp_path / "gpu_1.1b_cpu_no_cudnn_attention.json").read_text())
    assert written["settings"]["no_cudnn_attention"] is True
    assert written["batches"]["1"]["methods"]["ours"]["gamma_history"]


def test_cudnn_rows_and_a_chosen_subset_of_methods(bench_gpu, tmp_path):
    """`--cudnn-rows` adds our eager rows with `speculative_cudnn_attention=True` as `<name>_cudnn`; `--methods` keeps
    plain and the named ones, lists the rest as skipped, and refuses a name it does not know."""
    common = ["--smoke", "--pairs", "8b", "--batches", "1", "--constant-gammas", "3", "--output-dir", str(tmp_path)]
    payload = bench_gpu.main([*common, "--cudnn-rows", "--methods", "ours,ours_constant_3_cudnn"])["8b"]
    group = payload["batches"]["1"]
    assert set(group["methods"]) == {"plain", "ours", "ours_constant_3_cudnn"}
    assert group["skipped"]["ours_tree_cudnn"] == group["skipped"]["transformers"] == "not in --methods"
    assert "ours_compiled_cudnn" not in group["skipped"]  # compiled rows get no cuDNN twin
    assert group["methods"]["ours_constant_3_cudnn"]["equals_plain"]
    with pytest.raises(ValueError, match=r"--methods: unknown method\(s\) \['ours_cudnn'\]"):
        bench_gpu.main([*common, "--methods", "ours_cudnn"])  # no --cudnn-rows: no such row
