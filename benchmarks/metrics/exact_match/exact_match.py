"""`exact_match` as an offline `evaluate` module: the fraction of predictions equal to their reference.

Same semantics as the Hub's `exact_match` metric without its normalisation options (the benchmark compares
decoded token sequences, which must match exactly), kept here because the Hub cannot be reached from the
benchmark machines. Load it with `evaluate.load("benchmarks/metrics/exact_match/exact_match.py")`.
"""

import datasets
import evaluate


class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="",
            inputs_description="predictions (list of str), references (list of str) -> {'exact_match': float}",
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references):
        matches = [prediction == reference for prediction, reference in zip(predictions, references)]
        return {"exact_match": sum(matches) / len(matches) if matches else 0.0}
