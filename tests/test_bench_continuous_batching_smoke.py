"""`benchmarks/bench_continuous_batching.py --smoke` runs on the embedded zoo model (so that the script cannot rot);
its timings mean nothing, but every method's greedy outputs must equal plain continuous batching's."""

import json

from conftest import benchmark_script


def test_the_smoke_run_covers_every_method_and_checks_outputs(tmp_path):
    output = tmp_path / "continuous_batching.json"
    with benchmark_script("bench_continuous_batching") as bench:
        bench.main(["--smoke", "--output", str(output)])
        methods = set(bench.METHODS)
    results = json.loads(output.read_text())["results"]
    assert set(results) == {"editing"}
    assert set(results["editing"]) == {"B=1", "B=2"}
    for row in results["editing"].values():
        assert set(row) == methods | {"requests"}
        assert all(row[m]["identical_to_plain"] for m in methods)
        assert all(row[m]["tokens_per_s"] > 0 and row[m]["p95_s"] >= row[m]["p50_s"] for m in methods)
    assert results["editing"]["B=1"]["prompt_lookup_constant"]["tokens_per_call"] > 1.0
    assert results["editing"]["B=1"]["model_constant"]["tokens_per_call"] > 1.0  # the distilled draft model drafted
