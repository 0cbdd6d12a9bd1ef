"""Bad input through the Python API: each kind fails with a clear error (argument, value, fix) or is honoured, never
silently changed or ignored (issue 17). CLI cases are in `test_cli_hardening.py`."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import VOCAB, prompt, tiny_model
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig

import hf_specdec
from hf_specdec.zoo import ZOO_DIR


@pytest.fixture(scope="module")
def target():
    return hf_specdec.enable(tiny_model("llama", seed=0))


# ----- DraftProposal.probs: what a drafter promises is checked at the boundary ----------------------------------


class ProbsDrafter(hf_specdec.Drafter):
    """Drafts token 7 with the q that `make_probs(q)` turns a valid q (uniform) into."""

    def __init__(self, make_probs):
        self.make_probs = make_probs

    def propose(self, input_ids, num_tokens):
        tokens = torch.full((1, num_tokens), 7, dtype=torch.long)
        probs = torch.full((1, num_tokens, VOCAB), 1.0 / VOCAB)
        return hf_specdec.DraftProposal(tokens=tokens, probs=self.make_probs(probs))


def zero_on_drafted(q):
    q[..., 7] = 0.0
    q[..., 8] += 1.0 / VOCAB
    return q


def negative(q):
    q[..., 3] = -0.5
    q[..., 4] += 0.5
    return q


def nan(q):
    q[..., 3] = float("nan")
    return q


@pytest.mark.parametrize(
    "make_probs, match",
    [
        (
            zero_on_drafted,
            r"ProbsDrafter.propose returned probs with q\(x\) = 0 for drafted tokens .* return `probs=None`",
        ),
        (negative, r"ProbsDrafter.propose returned probs with negative, NaN or infinite entries: `probs\[b, i\]` must"),
        (nan, r"ProbsDrafter.propose returned probs with negative, NaN or infinite entries"),
        (lambda q: q * 2, r"probs that do not sum to 1 over the vocabulary \(sums: \[\[2\.0.*softmax"),
        (lambda q: q[..., :10], r"returned probs of shape \(1, 3, 10\), expected \(1, 3, 96\)"),
        (lambda q: q.tolist(), r"returned probs of shape list, expected \(1, 3, 96\)"),
    ],
)
def test_proposal_probs_that_break_exactness_are_refused(target, make_probs, match):
    with pytest.raises(ValueError, match=match):
        target.generate(
            prompt(),
            drafter=ProbsDrafter(make_probs),
            do_sample=True,
            speculative_gamma=3,
            speculative_gamma_policy="constant",
            max_new_tokens=6,
        )  # 3 drafts in the first round


def test_valid_sampled_probs_pass_the_check(target):
    out = target.generate(
        prompt(),
        drafter=ProbsDrafter(lambda q: q),
        do_sample=True,
        speculative_gamma=3,
        max_new_tokens=6,
        return_dict_in_generate=True,
    )
    assert out.speculative_stats.drafted_tokens > 0


def test_a_proposal_that_is_not_a_draft_proposal_names_the_fix(target):
    class TensorDrafter(hf_specdec.Drafter):
        def propose(self, input_ids, num_tokens):
            return input_ids[:, -1:]

    with pytest.raises(
        TypeError,
        match=r"TensorDrafter.propose must return a `hf_specdec.DraftProposal`, got Tensor. "
        r"Return `DraftProposal\(tokens=...\)`",
    ):
        target.generate(prompt(), drafter=TensorDrafter(), max_new_tokens=4)


# ----- values silently changed or ignored ------------------------------------------------------------------------


def test_gamma_above_the_default_max_is_honoured(target):
    out = target.generate(
        prompt(),
        drafter="prompt_lookup",
        speculative_gamma=40,
        max_new_tokens=60,
        speculative_gamma_policy="constant",
        return_dict_in_generate=True,
    )
    assert out.speculative_stats.gamma_history[0] == 40
    assert torch.equal(out.sequences, target.generate(prompt(), max_new_tokens=60))


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (
            dict(speculative_gamma=40, speculative_max_gamma=16),
            ValueError,
            r"`speculative_gamma=40` is larger than `speculative_max_gamma=16`.*Raise `speculative_max_gamma` to at least 40",
        ),
        (
            dict(speculative_max_gamma=10**6),
            ValueError,
            r"`speculative_max_gamma` must be a positive int, got 1000000, above its limit of 256.*"
            r"`speculative_max_gamma=16`",
        ),
        (
            dict(speculative_gamma=10**9),
            ValueError,
            r"`speculative_gamma` must be a positive int, got 1000000000, above",
        ),
        (
            dict(speculative_tree_budget=0),
            ValueError,
            r"`speculative_tree_budget` must be a positive int, got 0. .*or `speculative_tree_budget=None`",
        ),
    ],
)
def test_speculative_values_out_of_range(target, bad, error, match):
    with pytest.raises(error, match=match):
        target.generate(prompt(), drafter="prompt_lookup", max_new_tokens=4, **bad)
    with pytest.raises(error, match=match):
        hf_specdec.SpeculativeGenerationConfig(**bad)


def test_bad_speculative_value_names_its_source_not_a_drafter(target):
    """Without a drafter the speculative fields are still validated, but the message names where the value came from
    and does not tell the caller to drop a drafter they never passed."""
    with pytest.raises(
        ValueError,
        match=r"`speculative_gamma` must be a positive int, got 0\. Use for example "
        r"`speculative_gamma=5`\. \(Value read from the `generate` call's",
    ) as info:
        target.generate(prompt(), speculative_gamma=0, max_new_tokens=4)
    assert "drafter" not in str(info.value)
    config = GenerationConfig(max_new_tokens=4, speculative_gamma=0)
    with pytest.raises(
        ValueError, match=r"got 0\..*\(Value read from the `generation_config` passed to `generate`\.\)"
    ):
        target.generate(prompt(), generation_config=config)


def test_speculative_arguments_on_a_model_never_enabled_name_the_fix():
    """transformers rejects them as unused `model_kwargs`; the message also says to call `hf_specdec.enable`, while a
    typo that is not one of ours gets transformers' message unchanged and the model stays as it was."""
    plain = tiny_model("llama", seed=0)
    with pytest.raises(
        ValueError,
        match=r"not used by the model: \['speculative_gamma', 'drafter'\].*`drafter`, "
        r"`speculative_gamma` are hf_specdec's arguments, and this LlamaForCausalLM "
        r"was not enabled .*call `model = hf_specdec\.enable\(model\)` first",
    ):
        plain.generate(prompt(), max_new_tokens=2, speculative_gamma=4, drafter="prompt_lookup")
    with pytest.raises(
        ValueError,
        match=r"not used by the model: \['speculativ_gamma'\] \(note: typos in the generate "
        r"arguments will also show up in this list\)$",
    ):
        plain.generate(prompt(), max_new_tokens=2, speculativ_gamma=4)
    assert not isinstance(plain, hf_specdec.SpeculativeGenerationMixin)


def test_misspelt_speculative_field_in_a_config_fails_like_the_keyword(target, tmp_path):
    with pytest.raises(
        TypeError,
        match=r"Unknown speculative argument\(s\) \['speculative_gama'\] passed to "
        r"`generate` \(did you mean `speculative_gamma` for `speculative_gama`\?\)",
    ):
        target.generate(prompt(), drafter="prompt_lookup", speculative_gama=3, max_new_tokens=4)
    (tmp_path / "generation_config.json").write_text(json.dumps({"speculative_gama": 3, "max_new_tokens": 4}))
    config = GenerationConfig.from_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"Unknown speculative field\(s\) \['speculative_gama'\] in the "
        r"`generation_config` passed to `generate` \(did you mean `speculative_gamma`"
        r".*\{'speculative_gama': 3\}.*Rename or remove them",
    ):
        target.generate(prompt(), drafter="prompt_lookup", generation_config=config)
    with pytest.raises(
        ValueError,
        match=r"Unknown speculative field\(s\) \['speculative_gama'\] in this "
        r"`SpeculativeGenerationConfig`",
    ):
        hf_specdec.SpeculativeGenerationConfig(speculative_gama=3)


@pytest.mark.parametrize(
    "name, kwargs, match",
    [
        (
            "prompt_lookup",
            {"max_ngram": 4},
            r"Unknown `drafter_kwargs` key\(s\) \['max_ngram'\] for PromptLookupDrafter, "
            r"got drafter_kwargs=\{'max_ngram': 4\}. PromptLookupDrafter accepts "
            r"\['max_ngram_size'",
        ),
        (
            "model",
            {},
            r"ModelDrafter needs \['model'\] in `drafter_kwargs`, got drafter_kwargs=\{\}. Pass "
            r"`drafter_kwargs=\{'model': ...\}`",
        ),
        (
            "ngram",
            {"pretrained_model_name_or_path": str(ZOO_DIR / "ngram"), "top": 2},
            r"Unknown `drafter_kwargs` key\(s\) \['top'\] for NGramDrafter, got drafter_kwargs=\{"
            r"'pretrained_model_name_or_path': '.*ngram', 'top': 2\}. NGramDrafter accepts "
            r"\['pretrained_model_name_or_path', 'n', 'top_k'",
        ),
        (
            "eagle",
            {"pretrained": "unused", "tree_topk": 2},
            r"Unknown `drafter_kwargs` key\(s\) \['tree_topk'\] for EagleDrafter, got drafter_kwargs="
            r"\{'pretrained': 'unused', 'tree_topk': 2\}. EagleDrafter accepts \['model', 'pretrained'",
        ),
    ],
)
def test_unknown_or_missing_drafter_kwargs(target, name, kwargs, match):
    with pytest.raises(TypeError, match=match):
        target.generate(prompt(), drafter=name, drafter_kwargs=kwargs, max_new_tokens=4)


def test_ngram_overrides_are_honoured_or_refused():
    table = hf_specdec.NGramDrafter.from_pretrained(ZOO_DIR / "ngram", n=2, top_k=2, draft_mode="sample")
    assert (table.n, table.top_k, table.draft_mode) == (2, 2, "sample")
    assert sorted(table.tables) == [f"order_{k}.{part}" for k in (1, 2) for part in ("contexts", "probs", "tokens")]
    assert table.tables["order_2.tokens"].shape[1] == 2
    with pytest.raises(ValueError, match=r"`n=5` is larger than the stored table's n=3 .*Pass `n` <= 3"):
        hf_specdec.NGramDrafter.from_pretrained(ZOO_DIR / "ngram", n=5)
    with pytest.raises(TypeError, match=r"Unknown option\(s\) \['vocab'\] for `NGramDrafter.from_pretrained`"):
        hf_specdec.NGramDrafter.from_pretrained(ZOO_DIR / "ngram", vocab=3)


def copied_table(tmp_path, name="table"):
    path = tmp_path / name
    shutil.copytree(ZOO_DIR / "ngram", path)
    return path


def test_ngram_config_that_does_not_match_its_tables(tmp_path):
    path = copied_table(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "n": 2}))
    with pytest.raises(
        ValueError,
        match=r"config.json says n=2, but model.safetensors holds the tables of orders "
        r"\[1, 2, 3\]: the two files do not belong together",
    ):
        hf_specdec.NGramDrafter.from_pretrained(path)


def test_ngram_rows_with_all_zero_probabilities_are_refused(tmp_path):
    table = hf_specdec.NGramDrafter.from_corpus([prompt(50)[0]], n=2, vocab_size=VOCAB)
    table.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["order_2.probs"][0] = 0.0
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"order_2.probs has 1 context row\(s\) whose continuations all have "
        r"probability 0 \(rows \[0\]\).*Rebuild it",
    ):
        hf_specdec.NGramDrafter.from_pretrained(tmp_path)


# ----- errors that name the file or the fix ----------------------------------------------------------------------


def test_unreadable_ngram_files_are_named(tmp_path):
    path = copied_table(tmp_path, "json")
    (path / "config.json").write_text("{not json")
    with pytest.raises(OSError, match=rf"{path}/config.json is not a readable JSON file .*save the drafter again"):
        hf_specdec.NGramDrafter.from_pretrained(path)
    path = copied_table(tmp_path, "truncated")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        OSError,
        match=rf"{path}/model.safetensors is not a readable safetensors file .*corrupt or "
        "truncated",
    ):
        hf_specdec.NGramDrafter.from_pretrained(path)
    path = copied_table(tmp_path, "linked")
    (path / "model.safetensors").unlink()
    (tmp_path / "other.txt").write_text("not a table")
    os.symlink(tmp_path / "other.txt", path / "model.safetensors")
    with pytest.raises(OSError, match=rf"model.safetensors \(a link to {tmp_path}/other.txt\) is not a readable"):
        hf_specdec.NGramDrafter.from_pretrained(path)
    (path / "model.safetensors").unlink()
    os.symlink(tmp_path / "gone", path / "model.safetensors")
    with pytest.raises(OSError, match=r"model.safetensors is a broken link"):
        hf_specdec.NGramDrafter.from_pretrained(path)


@pytest.mark.parametrize("missing", ["./no/such/table", "no-such-table", "/no/such/table"])
def test_a_missing_local_directory_is_not_called_a_bad_repo_id(missing):
    with pytest.raises(OSError, match=rf"No such directory: '{missing}' \(and it is not a Hub repo id"):
        hf_specdec.NGramDrafter.from_pretrained(missing)


# ----- metrics ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def metric():
    return hf_specdec.metrics.load("speculative")


@pytest.mark.parametrize(
    "stats, error, match",
    [
        ([], ValueError, r"`stats` is empty: there is nothing to aggregate.*Pass `stats=\[output.speculative_stats"),
        ({"alpha": 1}, TypeError, r"`stats` must be a list of `SpeculativeStats.to_dict\(\)`, got dict"),
        (
            [{"target_calls": 1}],
            ValueError,
            r"`stats\[0\]` is not a `SpeculativeStats.to_dict\(\)`: missing keys "
            r"\['acceptance_rate'",
        ),
        ([3], TypeError, r"`stats\[0\]` must be a dict from `SpeculativeStats.to_dict\(\)`, got int"),
        ([hf_specdec.SpeculativeStats().to_dict()], ValueError, r"record no target call"),
    ],
)
def test_metric_refuses_malformed_stats(metric, stats, error, match):
    with pytest.raises(error, match=match):
        metric.compute(stats=stats)


def test_metric_takes_stats_objects_and_checks_its_numbers(metric):
    stats = hf_specdec.SpeculativeStats(
        target_calls=2,
        row_rounds=2,
        drafted_tokens=4,
        accepted_tokens=3,
        emitted_tokens=5,
        beta_sum=3.0,
        beta_count=4,
        drafted_history=[2, 2],
    )
    assert metric.compute(stats=[stats])["alpha"] == 0.75
    with pytest.raises(ValueError, match=r"`plain_seconds_per_token` must be a positive number or None, got 0"):
        metric.compute(stats=[stats], plain_seconds_per_token=0)


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: hf_specdec.expected_speedup(alpha=float("nan"), gamma=3, c=0.1),
            r"`alpha` must be in \[0, 1\], got nan",
        ),
        (lambda: hf_specdec.expected_speedup(alpha="0.5", gamma=3, c=0.1), r"`alpha` must be in \[0, 1\], got '0.5'"),
        (
            lambda: hf_specdec.expected_speedup(alpha=0.5, gamma=3, c=float("inf")),
            r"`c` .* must be a finite number >= 0",
        ),
        (
            lambda: hf_specdec.optimal_gamma(alpha=0.5, c=0.1, max_gamma=-1),
            r"`max_gamma` must be an int in \[0, 10000\]",
        ),
    ],
)
def test_theory_refuses_values_that_are_not_numbers(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_drafter_kwargs_must_be_a_mapping():
    target = hf_specdec.enable(tiny_model("llama"))
    with pytest.raises(TypeError, match=r"`drafter_kwargs` must be a dict .*got list \[4\].*max_ngram_size"):
        target.generate(prompt(), drafter="prompt_lookup", drafter_kwargs=[4], max_new_tokens=4)


class _CallCounting:
    """A stateful processor: penalizes a token more on every call."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        scores = scores.clone()
        scores[:, 0] -= self.calls
        return scores


def test_a_stateful_logits_processor_is_refused():
    from transformers import LogitsProcessorList

    target = hf_specdec.enable(tiny_model("llama"))
    with pytest.raises(ValueError, match=r"keeps state between calls.*function of the `input_ids`"):
        target.generate(
            prompt(), drafter="prompt_lookup", max_new_tokens=6, logits_processor=LogitsProcessorList([_CallCounting()])
        )
    # a processor that is a function of the prefix passes
    out = target.generate(prompt(), drafter="prompt_lookup", max_new_tokens=6, repetition_penalty=1.3)
    assert out.shape[1] == prompt().shape[1] + 6


def test_processors_that_ban_every_token_are_not_taken_for_stateful_ones():
    """With every token banned and `renormalize_logits=True` the scores are NaN; the first round's check that a
    processor is stateless compared them with `torch.equal` (NaN is never equal to NaN) and refused the call as one
    whose processor "keeps state between calls". Plain `generate` returns, and so does speculation, identically."""
    model = hf_specdec.enable(tiny_model("llama"))
    ids = prompt(6, seed=4)
    banned = 7
    kwargs = dict(
        max_new_tokens=1,
        begin_suppress_tokens=[banned],
        forced_eos_token_id=banned,
        bad_words_ids=[[banned]],
        renormalize_logits=True,
        pad_token_id=0,
    )
    plain = model.generate(ids, **kwargs)
    for drafter in ({"drafter": "prompt_lookup"}, {"assistant_model": model}):
        assert torch.equal(model.generate(ids, speculative_gamma=5, **drafter, **kwargs), plain)


def test_the_demos_round_marker_ignores_other_threads_forwards():
    """`rounds_of` hooks the user's target: a forward another thread runs on the same model is not a round of the
    demo's call."""
    import threading

    from hf_specdec.demo import rounds_of

    class Marker:
        rounds = 0

        def new_round(self):
            self.rounds += 1

    model = tiny_model("llama")
    marker = Marker()
    with torch.no_grad(), rounds_of(model, marker):
        model(prompt(4))
        other = threading.Thread(target=lambda: model(prompt(4)))
        other.start()
        other.join()
    assert marker.rounds == 1


def test_a_call_that_fails_before_its_first_round_leaves_no_hook_on_the_target(monkeypatch):
    """The hidden-state hooks of a drafter that reads the target's features are set last, after everything else the
    call prepares, so an error while preparing leaves the user's model without them."""

    class Reading(hf_specdec.Drafter):
        reads_target_hidden_states = True

        def reset(self, context):
            self.target_hidden_layers = [1]

        def propose(self, input_ids, num_tokens):
            return hf_specdec.DraftProposal.empty(1, input_ids.device)

    model = hf_specdec.enable(tiny_model("llama"))

    def failing(*args, **kwargs):
        raise RuntimeError("preparing the forward failed")

    monkeypatch.setattr(hf_specdec.sequence.TargetForward, "for_call", failing)
    with pytest.raises(RuntimeError, match="preparing the forward failed"):
        model.generate(prompt(4), drafter=Reading(), max_new_tokens=3)
    layers = [model.get_input_embeddings(), *model.model.layers]
    assert not any(layer._forward_hooks for layer in layers)
