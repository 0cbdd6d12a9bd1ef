"""`benchmarks/bench_native_drafters.py --quick`: every method of the native-drafter benchmark on the smoke-test shape,
so that the script keeps running between full runs; every output equal to plain `generate`'s."""

import json

import pytest
from conftest import benchmark_script


@pytest.fixture
def bench_native():
    with benchmark_script("bench_native_drafters") as module:
        yield module


def test_quick_run_covers_every_method_exactly(bench_native, tmp_path):
    output = tmp_path / "native.json"
    bench_native.main(
        [
            "--quick",
            "--repeats",
            "1",
            "--prompts",
            "1",
            "--max-new-tokens",
            "8",
            "--threads",
            "1",
            "--output",
            str(output),
        ]
    )
    payload = json.loads(output.read_text())
    assert set(payload["results"]) == {"plain", "transformers", "ours", "ours_tree"}
    for name, row in payload["results"].items():
        assert row["identical_to_plain"] == "1/1", name
        assert row["tokens_per_target_call"] >= 1.0
    # transformers' drafts run the same model: only its full-depth forwards are target calls
    assert payload["results"]["plain"]["tokens_per_target_call"] == 1.0
    assert payload["results"]["transformers"]["tokens_per_target_call"] > 1.0
    assert payload["machine"]["threads"] == 1


def test_quick_mtp_run_trains_a_layer_and_decodes_exactly(bench_native, tmp_path):
    output = tmp_path / "native_mtp.json"
    bench_native.main(
        ["--quick", "--family", "mtp", "--repeats", "1", "--prompts", "1", "--max-new-tokens", "8", "--threads", "1"]
        + ["--mtp-steps", "2", "--mtp-texts", "4", "--output", str(output)]
    )
    payload = json.loads(output.read_text())
    assert payload["family"] == "mtp" and payload["mtp_training"]["steps"] == 2
    # transformers 5.24 serves MTP only for types that declare and register MTP layers: the row says why not
    assert "num_mtp_layers" in payload["results"].pop("transformers")["refused"]
    assert set(payload["results"]) == {"plain", "ours", "ours_constant_3", "ours_tree", "early_exit"}
    for name, row in payload["results"].items():
        assert row["identical_to_plain"] == "1/1", name
    assert payload["results"]["ours_constant_3"]["tokens_per_target_call"] > 1.0


def test_quick_mtp_batch_run_verifies_every_row_in_one_forward(bench_native, tmp_path):
    """`--batch 2`: left-padded batches; transformers' assisted generation refuses them (one sequence at a time);
    `ours_rows` decodes each row alone, as hf_specdec did before it verified every row in one forward. bfloat16
    greedy outputs may leave plain's only at near ties, recorded with their logit gap."""
    output = tmp_path / "native_mtp_batch.json"
    bench_native.main(
        ["--quick", "--family", "mtp", "--target", "deepseek_v3", "--batch", "2", "--repeats", "1", "--prompts", "1"]
        + ["--max-new-tokens", "8", "--threads", "1", "--mtp-steps", "2", "--mtp-texts", "4", "--output", str(output)]
    )
    payload = json.loads(output.read_text())
    assert payload["batch"] == 2
    assert "batch_size = 1" in payload["results"].pop("transformers")["refused"]
    assert set(payload["results"]) == {"plain", "ours", "ours_constant_3", "early_exit", "ours_use_mtp", "ours_rows"}
    assert payload["results"]["plain"]["tokens_per_target_call"] == 2.0  # both rows' tokens per batched forward
    assert payload["results"]["ours_constant_3"]["tokens_per_target_call"] > 2.0
    for name, row in payload["results"].items():
        for gap in row["divergences"]:
            assert gap["top2_logit_gap"] <= 0.25, (name, gap)
