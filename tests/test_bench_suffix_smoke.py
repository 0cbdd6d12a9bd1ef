"""`benchmarks/bench_suffix.py --smoke` runs on the embedded zoo model (so that the script cannot rot); its timings
mean nothing, but greedy outputs must equal plain decoding's for every method."""

import json

from conftest import benchmark_script, prompt, tiny_model


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
        assert all(row["divergences"] == [] for row in greedy["methods"].values())  # float32: none
        assert set(stream["sampled_block"]["methods"]) == {"plain", "prompt_lookup", "suffix"}
        assert greedy["suffix_cache"]["requests"] == greedy["requests"]  # every output entered the cache


def test_a_divergence_is_located_with_the_logit_gap_there():
    target = tiny_model("llama")
    ids = prompt(6)
    plain = target.generate(ids, max_new_tokens=6, do_sample=False)
    other = plain.clone()
    other[0, ids.shape[1] + 2] = (other[0, ids.shape[1] + 2] + 1) % target.config.vocab_size
    with benchmark_script("bench_suffix") as bench:
        assert bench.first_divergence(target, ids, plain, plain) is None
        assert bench.first_divergence(target, ids, plain, plain[:, :-2]) is None  # stopped earlier, same tokens
        gap = bench.first_divergence(target, ids, plain, other[:, :-1])
    assert gap["first_differing_position"] == 2 and gap["plain_token"] == int(plain[0, ids.shape[1] + 2])
    assert gap["top2_logit_gap"] >= 0
