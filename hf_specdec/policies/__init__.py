"""Draft-length (γ) policies: `auto` (the default: the γ up to the user's that `optimal`'s estimates predict pays
best; plain steps when drafting is measured not to pay), `constant`, `heuristic` (+2 / -1) and `optimal` (Theorem 3.8
with online estimates).

A policy is created for one `generate` call, so nothing it learns outlives the call or lands on a user object.
Before each round `next_gamma()` says how many tokens to draft (0 = a plain decoding step); after it `observe(...)`
reports what the round drafted, accepted and cost.

`GammaPolicy` and `heuristic` live in `base.py`, `optimal` (and the argument for how it picks γ) in `optimal.py`,
`auto` in `auto.py`; this module holds the registry that `speculative_gamma_policy` names.
"""

from __future__ import annotations

from ..registry import Registry
from .auto import AutoGammaPolicy
from .base import GammaPolicy, HeuristicGammaPolicy
from .optimal import OptimalGammaPolicy

__all__ = ["GammaPolicy", "get_gamma_policy_class", "list_gamma_policies", "register_gamma_policy"]

_POLICIES: Registry[type[GammaPolicy]] = Registry(
    GammaPolicy, "γ policy", "speculative_gamma_policy", "hf_specdec.policies.register_gamma_policy"
)


def register_gamma_policy(name: str, cls: type[GammaPolicy]) -> type[GammaPolicy]:
    """Registers a γ policy under `name` for `speculative_gamma_policy=name`; a name can be registered once."""
    return _POLICIES.register(name, cls)


def list_gamma_policies() -> list[str]:
    """Names of the registered γ policies."""
    return _POLICIES.names()


def get_gamma_policy_class(name: str) -> type[GammaPolicy]:
    """The policy class registered under `name`; unknown names fail with the list of known ones."""
    return _POLICIES.get(name)


register_gamma_policy("auto", AutoGammaPolicy)
register_gamma_policy("constant", GammaPolicy)
register_gamma_policy("heuristic", HeuristicGammaPolicy)
register_gamma_policy("optimal", OptimalGammaPolicy)
