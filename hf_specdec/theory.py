"""The paper's closed forms: expected tokens per round, Theorem 3.8 (speedup) and the best γ (section 3.5)."""

from __future__ import annotations

import math
import numbers

__all__ = ["expected_operations", "expected_speedup", "expected_tokens_per_round", "optimal_gamma"]


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _check(alpha: float, gamma: int | None = None, c: float | None = None) -> None:
    if not _is_number(alpha) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"`alpha` must be in [0, 1], got {alpha!r}. Pass a number, for example `alpha=0.8`.")
    if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0):
        raise ValueError(f"`gamma` must be a non-negative int, got {gamma!r}.")
    if c is not None and (not _is_number(c) or c < 0):
        raise ValueError(f"`c` (drafter cost / target cost) must be a finite number >= 0, got {c!r}.")


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """Equation (1): E[tokens per target call] = (1 - α^(γ+1)) / (1 - α), capped geometric (γ + 1 when α = 1)."""
    _check(alpha, gamma)
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: int, c: float) -> float:
    """Theorem 3.8: expected wall-time improvement (1 - α^(γ+1)) / ((1 - α)(γ c + 1)).

    Example:

    ```python
    >>> import hf_specdec
    >>> round(hf_specdec.expected_speedup(alpha=0.8, gamma=5, c=0.05), 2)
    2.95

    ```
    """
    _check(alpha, gamma, c)
    return expected_tokens_per_round(alpha, gamma) / (gamma * c + 1.0)


def expected_operations(alpha: float, gamma: int, c_hat: float = 0.0) -> float:
    """Theorem 3.11: expected factor of increase in arithmetic operations, (1 - α)(γ ĉ + γ + 1) / (1 - α^(γ+1)).

    `c_hat` (ĉ) is the drafter's arithmetic operations per token relative to the target's.

    Example:

    ```python
    >>> import hf_specdec
    >>> round(hf_specdec.expected_operations(alpha=0.8, gamma=5), 2)
    1.63

    ```
    """
    _check(alpha, gamma, c_hat)
    return (gamma * c_hat + gamma + 1.0) / expected_tokens_per_round(alpha, gamma)


def optimal_gamma(alpha: float, c: float, max_gamma: int = 64) -> int:
    """The γ in {0, ..., max_gamma} that maximises Theorem 3.8 (γ = 0, plain decoding, when nothing beats it).

    Example:

    ```python
    >>> import hf_specdec
    >>> hf_specdec.optimal_gamma(alpha=0.8, c=0.05)
    8

    ```
    """
    _check(alpha, None, c)
    if isinstance(max_gamma, bool) or not isinstance(max_gamma, int) or not 0 <= max_gamma <= 10_000:
        raise ValueError(
            f"`max_gamma` must be an int in [0, 10000], got {max_gamma!r}. Use for example `max_gamma=64`."
        )
    return max(range(max_gamma + 1), key=lambda gamma: (expected_speedup(alpha, gamma, c), -gamma))
