"""`benchmarks/bench_hybrid.py --quick` runs (so that the script cannot rot); its timings mean nothing."""

import json

from conftest import benchmark_script


def test_the_quick_run_measures_both_hybrids_and_records_transformers_refusal(tmp_path):
    output = tmp_path / "hybrid.json"
    with benchmark_script("bench_hybrid") as bench:
        bench.main(
            ["--quick", "--prompts", "1", "--repeats", "1", "--max-new-tokens", "8", "--prompt-length", "12"]
            + ["--cost-repeats", "1", "--threads", "1", "--dtype", "float32", "--output", str(output)]
            + ["--mtp-steps", "2", "--mtp-texts", "4"]
        )
    results = json.loads(output.read_text())
    assert set(results["models"]) == {"qwen3_5", "mamba2"}
    # the hybrid with an attention layer gets an MTP layer fitted to it (two rows); the pure SSM gets none
    assert results["models"]["qwen3_5"]["mtp_training"]["steps"] == 2
    assert sum("MTP layer" in name for name in results["models"]["qwen3_5"]["methods"]) == 2
    assert results["models"]["mamba2"]["mtp_training"] is None
    for model in results["models"].values():
        assert "not supported with stateful models" in model["transformers_assisted_generation"]
        assert model["costs"]["checkpoint_bytes"] > 0
        for name, method in model["methods"].items():
            assert method["identical_to_plain"] == [True], name  # float32: greedy identity holds
            assert method["tokens_per_target_call"] > 0
    assert results["machine"]


def test_the_quick_run_with_batches_compares_lockstep_with_rows_one_at_a_time(tmp_path):
    output = tmp_path / "hybrid_batches.json"
    with benchmark_script("bench_hybrid") as bench:
        bench.main(
            ["--quick", "--models", "qwen3_5", "--prompts", "1", "--repeats", "1", "--max-new-tokens", "8"]
            + ["--prompt-length", "12", "--cost-repeats", "1", "--threads", "1", "--dtype", "float32"]
            + ["--mtp-steps", "0", "--batches", "3", "--gamma", "3", "--output", str(output)]
        )
    group = json.loads(output.read_text())["models"]["qwen3_5"]["batches"]["3"]
    methods = group["methods"]
    assert set(methods) == {"plain", "lockstep (defaults)", "lockstep (constant γ 3)", "rows one at a time (defaults)"}
    assert len(set(group["prompt_lengths"])) > 1  # rows of different lengths: left-padded
    for name, row in methods.items():
        assert row["rows_equal_plain"] == 3, name  # float32: greedy identity holds, row by row
    # lockstep verifies every row in each forward; rows one at a time never do (their forwards carry one row)
    assert methods["lockstep (constant γ 3)"]["whole_batch_forwards"] == 1.0
    assert methods["rows one at a time (defaults)"]["whole_batch_forwards"] < 0.5
    assert methods["lockstep (constant γ 3)"]["tokens_per_target_call"] > 3  # drafts accepted: more than plain's 3
