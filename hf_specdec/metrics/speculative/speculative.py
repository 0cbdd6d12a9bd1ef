"""The `speculative` metric: aggregates `speculative_stats` of many `generate` calls into the paper's quantities."""

import math

import datasets
import evaluate

from hf_specdec.stats import SpeculativeStats
from hf_specdec.theory import expected_speedup

_DESCRIPTION = """
Aggregates the `speculative_stats` (as `stats.to_dict()`) of many speculative `generate` calls: α (the mean of
sum_x min(p, q) over verified positions, Corollary 3.6), the acceptance rate, the mean number of tokens per target
call, the acceptance rate at each draft position, the mean γ, and Theorem 3.8's predicted speedup from α, the mean
γ and c. c is measured from the stats (drafting seconds per drafted token over verify seconds per round) unless
given. With `plain_seconds_per_token` (the time plain `generate` takes per token on the same hardware), the
measured speedup is reported too.
"""

_KWARGS_DESCRIPTION = """
Args:
    stats (`list[dict]`): `SpeculativeStats.to_dict()` of each call (`SpeculativeStats` objects are converted); an
        empty list or a dict with other keys is an error.
    c (`float`, *optional*): drafter cost relative to the target; measured from the stats when omitted.
    plain_seconds_per_token (`float`, *optional*): plain `generate`'s seconds per token, for the measured speedup.
Returns:
    alpha, acceptance_rate, mean_accepted_length, position_acceptance_rate, mean_gamma, c, predicted_speedup,
    measured_speedup (None without `plain_seconds_per_token`), target_calls, emitted_tokens.
Example:
    >>> import hf_specdec
    >>> metric = hf_specdec.metrics.load("speculative")
    >>> results = metric.compute(stats=[output.speculative_stats.to_dict()])  # doctest: +SKIP
"""

_CITATION = """
@inproceedings{leviathan2023fast,
  title={Fast Inference from Transformers via Speculative Decoding},
  author={Leviathan, Yaniv and Kalman, Matan and Matias, Yossi},
  booktitle={International Conference on Machine Learning},
  year={2023}
}
"""

_INT = datasets.Value("int64")
_FLOAT = datasets.Value("float64")
_FEATURES = datasets.Features(
    {
        "stats": {
            "target_calls": _INT,
            "row_rounds": _INT,
            "drafted_tokens": _INT,
            "accepted_tokens": _INT,
            "emitted_tokens": _INT,
            "beta_sum": _FLOAT,
            "beta_count": _INT,
            "accepted_length_histogram": datasets.Sequence(_INT),
            "position_drafted": datasets.Sequence(_INT),
            "position_accepted": datasets.Sequence(_INT),
            "gamma_history": datasets.Sequence(_INT),
            "drafted_history": datasets.Sequence(_INT),
            "beam_steps_history": datasets.Sequence(_INT),
            "target_forward_tokens": datasets.Sequence(_INT),
            "lenience": _FLOAT,
            "draft_time_s": _FLOAT,
            "verify_time_s": _FLOAT,
            "compiled_rounds": _INT,
            "target_compilations": _INT,
            "drafter_compilations": _INT,
            "acceptance_rate": _FLOAT,
            "alpha": _FLOAT,
            "mean_accepted_length": _FLOAT,
            "position_acceptance_rate": datasets.Sequence(_FLOAT),
        }
    }
)


def _checked_stats(stats):
    """`stats` as a list of `SpeculativeStats.to_dict()`; anything else fails naming what is wrong and the fix."""
    fix = "Pass `stats=[output.speculative_stats.to_dict(), ...]`, one per `generate` call."
    if isinstance(stats, (dict, SpeculativeStats)) or not isinstance(stats, (list, tuple)):
        raise TypeError(f"`stats` must be a list of `SpeculativeStats.to_dict()`, got {type(stats).__name__}. {fix}")
    if not stats:
        raise ValueError(f"`stats` is empty: there is nothing to aggregate (no α, no speedup). {fix}")
    required, checked = set(_FEATURES["stats"]), []
    for index, item in enumerate(stats):
        if isinstance(item, SpeculativeStats):
            item = item.to_dict()
        if not isinstance(item, dict):
            raise TypeError(
                f"`stats[{index}]` must be a dict from `SpeculativeStats.to_dict()`, got {type(item).__name__}. {fix}"
            )
        item = {key: value for key, value in item.items() if key != "rows"}  # per-row detail: the totals aggregate
        missing, unknown = sorted(required - set(item)), sorted(set(item) - required)
        if missing or unknown:
            raise ValueError(
                f"`stats[{index}]` is not a `SpeculativeStats.to_dict()`: missing keys {missing}, unknown "
                f"keys {unknown}. {fix}"
            )
        checked.append(item)
    return checked


class Speculative(evaluate.Metric):
    def add_batch(self, *, predictions=None, references=None, **kwargs):
        """`evaluate.Metric.add_batch`, with `stats` checked first."""
        if "stats" in kwargs:
            kwargs["stats"] = _checked_stats(kwargs["stats"])
        return super().add_batch(predictions=predictions, references=references, **kwargs)

    def add(self, *, prediction=None, reference=None, **kwargs):
        """`evaluate.Metric.add`, with `stats` (one dict) checked first."""
        if "stats" in kwargs:
            kwargs["stats"] = _checked_stats([kwargs["stats"]])[0]
        return super().add(prediction=prediction, reference=reference, **kwargs)

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation=_CITATION, inputs_description=_KWARGS_DESCRIPTION, features=_FEATURES
        )

    def _compute(self, stats, c=None, plain_seconds_per_token=None):
        def total(key):
            return sum(s[key] for s in stats)

        def summed_lists(key):
            width = max((len(s[key]) for s in stats), default=0)
            return [sum(s[key][i] for s in stats if i < len(s[key])) for i in range(width)]

        for name, value, low in (
            ("c", c, "non-negative"),
            ("plain_seconds_per_token", plain_seconds_per_token, "positive"),
        ):
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
                or (low == "positive" and value == 0)
            ):
                raise ValueError(f"`{name}` must be a {low} number or None, got {value!r}.")
        calls, drafted, accepted = total("target_calls"), total("drafted_tokens"), total("accepted_tokens")
        if not calls:
            raise ValueError(
                f"The {len(stats)} `stats` record no target call (target_calls=0 in all): nothing was generated "
                "speculatively, so there is no α or speedup to report. Pass the stats of speculative `generate` calls."
            )
        rounds = total("row_rounds")
        alpha = total("beta_sum") / total("beta_count") if total("beta_count") else 0.0
        gammas = [g for s in stats for g in s["drafted_history"]]
        mean_gamma = sum(gammas) / len(gammas) if gammas else 0.0
        if c is None:
            draft_per_token = total("draft_time_s") / drafted if drafted else 0.0
            verify_per_round = total("verify_time_s") / calls if calls else 0.0
            c = draft_per_token / verify_per_round if verify_per_round else 0.0
        position_drafted, position_accepted = summed_lists("position_drafted"), summed_lists("position_accepted")
        measured = None
        if plain_seconds_per_token is not None:
            spent = total("draft_time_s") + total("verify_time_s")
            measured = plain_seconds_per_token * total("emitted_tokens") / spent if spent else None
        return {
            "alpha": alpha,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": (accepted + rounds) / rounds if rounds else 0.0,
            "position_acceptance_rate": [a / d if d else 0.0 for a, d in zip(position_accepted, position_drafted)],
            "mean_gamma": mean_gamma,
            "c": c,
            "predicted_speedup": expected_speedup(alpha=min(alpha, 1.0), gamma=round(mean_gamma), c=c),
            "measured_speedup": measured,
            "target_calls": calls,
            "emitted_tokens": total("emitted_tokens"),
        }
