"""The paper's closed forms reproduce its printed tables."""

import pytest

import hf_specdec
from hf_specdec.theory import expected_tokens_per_round

# Table 1 (c = ĉ = 0): alpha, gamma, operations, speed, as printed
TABLE_1 = [
    (0.6, 2, 1.53, 1.96),
    (0.7, 3, 1.58, 2.53),
    (0.8, 2, 1.23, 2.44),
    (0.8, 5, 1.63, 3.69),
    (0.9, 2, 1.11, 2.71),
    (0.9, 10, 1.60, 6.86),
]
# Table 4: gamma, alpha, c, expected improvement (Theorem 3.8), as printed
TABLE_4 = [
    (7, 0.75, 0.02, 3.2),
    (7, 0.8, 0.04, 3.3),
    (7, 0.82, 0.11, 2.5),
    (7, 0.62, 0.02, 2.3),
    (5, 0.68, 0.04, 2.4),
    (3, 0.71, 0.11, 2.0),
    (5, 0.65, 0.02, 2.4),
    (5, 0.73, 0.04, 2.6),
    (3, 0.74, 0.11, 2.0),
    (5, 0.53, 0.02, 1.9),
    (3, 0.55, 0.04, 1.8),
    (3, 0.56, 0.11, 1.6),
]


@pytest.mark.parametrize("alpha, gamma, operations, speed", TABLE_1)
def test_table_1(alpha, gamma, operations, speed):
    assert round(hf_specdec.expected_speedup(alpha=alpha, gamma=gamma, c=0.0), 2) == speed
    assert round(hf_specdec.expected_operations(alpha=alpha, gamma=gamma, c_hat=0.0), 2) == operations


@pytest.mark.parametrize("gamma, alpha, c, expected", TABLE_4)
def test_table_4_expected_column(gamma, alpha, c, expected):
    # alpha and c are printed rounded to two digits and the column to one: the printed value must be reachable from
    # some alpha, c within their rounding intervals, up to the column's own rounding
    corners = [
        hf_specdec.expected_speedup(alpha=alpha + da, gamma=gamma, c=max(0.0, c + dc))
        for da in (-0.005, 0.005)
        for dc in (-0.005, 0.005)
    ]
    assert min(corners) - 0.05 <= expected <= max(corners) + 0.05


def test_optimal_gamma_follows_figure_3():
    # larger alpha or cheaper drafters call for longer drafts; a useless drafter for none
    assert hf_specdec.optimal_gamma(alpha=0.0, c=0.1) == 0
    assert hf_specdec.optimal_gamma(alpha=0.5, c=0.5) == 0  # (1 + α) / (1 + c) <= 1: no γ helps (Corollary 3.9)
    gammas = [hf_specdec.optimal_gamma(alpha=a, c=0.05) for a in (0.5, 0.7, 0.8, 0.9, 0.95)]
    assert gammas == sorted(gammas) and gammas[0] >= 1
    assert hf_specdec.optimal_gamma(alpha=0.9, c=0.01) > hf_specdec.optimal_gamma(alpha=0.9, c=0.1)
    assert hf_specdec.optimal_gamma(alpha=1.0, c=0.0, max_gamma=12) == 12
    assert expected_tokens_per_round(1.0, 4) == 5.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(alpha=1.5, gamma=2, c=0.1), "`alpha` must be in"),
        (dict(alpha=0.5, gamma=-1, c=0.1), "`gamma` must be a non-negative int"),
        (dict(alpha=0.5, gamma=2, c=-1.0), "`c`"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hf_specdec.expected_speedup(**kwargs)
