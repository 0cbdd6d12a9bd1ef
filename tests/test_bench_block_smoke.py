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


def test_the_smoke_run_adds_an_eagle_heads_rows(tmp_path):
    output = tmp_path / "block.json"
    args = ["--smoke", "--tasks", "completion", "--temperatures", "1.0", "--eagle-minutes", "0.05"]
    with benchmark_script("bench_block_verification") as bench:
        bench.main([*args, "--output", str(output)])
    results = json.loads(output.read_text())
    (run,) = results["runs"]
    assert {"eagle_token_g3", "eagle_block_g3", "eagle_block_over_token_g3"} <= set(run["methods"])
    assert run["methods"]["eagle_block_g3"]["tokens_per_target_call"] >= 1.0
    assert results["eagle_head"]["files"] == 4
    assert (tmp_path / "block" / "eagle_head" / "config.json").is_file()  # the trained head, saved beside the results
