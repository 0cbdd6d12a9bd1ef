"""`evaluate` modules shipped inside the package, loadable offline: `hf_specdec.metrics.load("speculative")`."""

from __future__ import annotations

from pathlib import Path

__all__ = ["list_metrics", "load"]

_HERE = Path(__file__).resolve().parent


def list_metrics() -> list[str]:
    """Names of the metrics shipped with hf_specdec."""
    return sorted(p.name for p in _HERE.iterdir() if (p / f"{p.name}.py").is_file())


def load(name: str, **kwargs):
    """Loads a shipped metric with `evaluate.load` from its file inside the package (no Hub access).

    Example:

    ```python
    >>> import hf_specdec
    >>> metric = hf_specdec.metrics.load("speculative")
    >>> stats = hf_specdec.SpeculativeStats(target_calls=2, drafted_tokens=4, accepted_tokens=3, emitted_tokens=5,
    ...     beta_sum=3.5, beta_count=4, position_drafted=[2, 2], position_accepted=[2, 1], gamma_history=[2, 2])
    >>> metric.compute(stats=[stats.to_dict()])["alpha"]
    0.875

    ```
    """
    import evaluate

    if name not in list_metrics():
        raise ValueError(f"Unknown hf_specdec metric {name!r}; shipped metrics: {list_metrics()}.")
    return evaluate.load(str(_HERE / name / f"{name}.py"), **kwargs)
