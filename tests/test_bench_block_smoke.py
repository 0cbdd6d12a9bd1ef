"""`benchmarks/bench_block_verification.py --smoke` runs (so that the script cannot rot); its timings mean nothing."""

import json

from conftest import benchmark_script


def test_the_smoke_run_compares_both_verifications(tmp_path):
    output = tmp_path / "block.json"
    with benchmark_script("bench_block_verification") as bench:
        bench.main(["--smoke", "--tasks", "completion", "--temperatures", "1.0", "--output", str(output)])
    results = json.loads(output.read_text())
    (run,) = results["runs"]
    assert run["temperature"] == 1.0
    assert set(run["methods"]) == {"plain", "token_g3", "block_g3", "block_over_token_g3"}
    for name in ("token_g3", "block_g3"):
        assert run["methods"][name]["tokens_per_target_call"] >= 1.0
        assert 0.0 <= run["methods"][name]["alpha"] <= 1.0
    assert results["machine"]  # written by the shared harness
