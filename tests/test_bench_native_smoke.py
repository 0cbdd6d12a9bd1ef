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
