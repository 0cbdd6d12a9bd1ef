"""`benchmarks/bench_block_verification.py --smoke` runs (so that the script cannot rot); its timings mean nothing."""

import itertools
import json

import pytest
import torch
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
    ratios = run["methods"]["block_over_token_g3"]
    assert ratios["expected_accepted_block_over_token"] > 0
    low, high = ratios["tokens_per_target_call_95"]
    assert low <= ratios["tokens_per_target_call"] <= high
    assert ratios["round_ms_token"] > 0 and ratios["verify_extra_ms"] == ratios["verify_extra_ms"]  # a number
    slower = 1.0 + ratios["verify_extra_ms"] / ratios["round_ms_token"]
    assert ratios["speed_from_parts"] == pytest.approx(ratios["tokens_per_target_call"] / slower)
    assert ratios["speed_from_parts_95"] == pytest.approx([low / slower, high / slower])
    assert results["machine"]  # written by the shared harness


def test_the_ratio_interval_resamples_calls_in_pairs():
    token = [(10, 5), (30, 10), (8, 8), (20, 10)]
    block = [(12, 5), (33, 10), (8, 6), (20, 9)]
    with benchmark_script("bench_block_verification") as bench:
        ratio, low, high = bench.ratio_interval(block, token)
        assert ratio == pytest.approx((73 / 30) / (68 / 33))
        assert low <= ratio <= high and low < high
        # resampled in pairs, the same calls under both rules give exactly 1 (apart, their draws would spread)
        assert bench.ratio_interval(token, token) == (1.0, 1.0, 1.0)


def test_the_paired_expectations_are_each_rules_accepted_drafts():
    """`expected_accepted` against each rule's outcomes enumerated: every pass/fail pattern of the γ tests, with
    block's thresholds (τ the last pass) and token-wise ratios (n the first fail), sampled drafts and point masses."""
    generator = torch.Generator().manual_seed(0)
    gamma, vocab = 3, 6
    p = torch.rand(2, gamma + 1, vocab, generator=generator, dtype=torch.float64) ** 3
    q = torch.rand(2, gamma, vocab, generator=generator, dtype=torch.float64) ** 3
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    tokens = torch.randint(0, vocab, (2, gamma), generator=generator)
    with benchmark_script("bench_block_verification") as bench:
        from hf_specdec.block_verification import block_thresholds

        for probs in (q, None):
            h, _ = block_thresholds(tokens, probs, p)
            p_x = p[:, :gamma].gather(-1, tokens[..., None])[..., 0]
            q_x = torch.ones_like(p_x) if probs is None else probs.gather(-1, tokens[..., None])[..., 0]
            ratio = (p_x / q_x).clamp(max=1.0)
            block = token = 0.0
            for row in range(2):
                for passes in itertools.product([False, True], repeat=gamma):
                    chance_block = chance_token = 1.0
                    for i, passed in enumerate(passes):
                        chance_block *= float(h[row, i] if passed else 1 - h[row, i])
                        chance_token *= float(ratio[row, i] if passed else 1 - ratio[row, i])
                    block += chance_block * max((i + 1 for i, passed in enumerate(passes) if passed), default=0)
                    token += chance_token * next((i for i, passed in enumerate(passes) if not passed), gamma)
            got = bench.expected_accepted(tokens, probs, p)
            assert abs(got[0] - block) < 1e-12 and abs(got[1] - token) < 1e-12


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
