"""`benchmarks/bench_suffix.py --smoke` runs on the embedded zoo model (so that the script cannot rot); its timings
mean nothing, but greedy outputs must equal plain decoding's for every method."""

import json

from conftest import benchmark_script


def test_the_smoke_run_covers_every_method_and_setting(tmp_path):
    output = tmp_path / "suffix.json"
    with benchmark_script("bench_suffix") as bench:
        bench.main(["--smoke", "--streams", "extraction", "code_edits", "--output", str(output)])
    results = json.loads(output.read_text())
    assert set(results["streams"]) == {"extraction", "code_edits"}
    for stream in results["streams"].values():
        assert set(stream) == {"greedy", "sampled_token", "sampled_block"}
        greedy = stream["greedy"]
        assert set(greedy["methods"]) == {
            "plain",
            "transformers_pld",
            "prompt_lookup",
            "ngram",
            "suffix",
            "suffix_tree",
            "suffix_x4",
        }
        assert all(row["identical_to_plain"] == greedy["requests"] for row in greedy["methods"].values())
        assert set(stream["sampled_block"]["methods"]) == {"plain", "prompt_lookup", "suffix"}
        assert greedy["suffix_cache"]["requests"] == greedy["requests"]  # every output entered the cache
