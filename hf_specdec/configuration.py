"""`SpeculativeGenerationConfig`: a `GenerationConfig` with the `speculative_*` fields, validated in one place."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from transformers import GenerationConfig

__all__ = ["SPECULATIVE_DEFAULTS", "SpeculativeGenerationConfig", "SpeculativeOptions", "resolve_speculative_options"]


MAX_TREE_BUDGET = 1024  # a verify forward over more nodes costs more than any tree saves


@dataclasses.dataclass(frozen=True)
class SpeculativeOptions:
    """The speculative settings one `generate` call runs with; built and validated once per call."""

    speculative_gamma: int = 5
    """How many tokens the drafter proposes per target forward (γ in the paper)."""
    speculative_lenience: float = 1.0
    """Lenience l in (0, 1] (Appendix A.5); 1.0 is the exact algorithm, smaller values are lossy."""
    speculative_gamma_policy: str = "constant"
    """How γ is chosen each round: "constant", "heuristic" (+2 / -1) or "optimal" (Theorem 3.8, online)."""
    speculative_max_gamma: int = 16
    """The largest γ the "heuristic" and "optimal" policies may choose."""
    speculative_tree_budget: int | None = None
    """The most draft nodes one round may verify as a token tree (γ stays its depth); None: chains only."""

    def __post_init__(self):
        gamma = self.speculative_gamma
        if isinstance(gamma, bool) or not isinstance(gamma, numbers.Integral) or gamma < 1:
            raise ValueError(
                f"`speculative_gamma` must be a positive int, got {gamma!r}. Use for example `speculative_gamma=5`, "
                "or call `generate` without `assistant_model`/`drafter` to decode without speculation."
            )
        lenience = self.speculative_lenience
        if isinstance(lenience, bool) or not isinstance(lenience, numbers.Real) or not 0.0 < lenience <= 1.0:
            raise ValueError(
                f"`speculative_lenience` must be a float in (0, 1], got {lenience!r}. Use `speculative_lenience=1.0` "
                "(the default) for exact speculative decoding."
            )
        max_gamma = self.speculative_max_gamma
        if isinstance(max_gamma, bool) or not isinstance(max_gamma, numbers.Integral) or max_gamma < 1:
            raise ValueError(
                f"`speculative_max_gamma` must be a positive int, got {max_gamma!r}. Use for example "
                "`speculative_max_gamma=16`."
            )
        budget = self.speculative_tree_budget
        if budget is not None:
            if (isinstance(budget, bool) or not isinstance(budget, numbers.Integral)
                    or not 1 <= budget <= MAX_TREE_BUDGET):
                raise ValueError(
                    f"`speculative_tree_budget` must be None or an int in [1, {MAX_TREE_BUDGET}], got {budget!r}. Use "
                    "for example `speculative_tree_budget=12` (choose it from the target's cost of a forward over "
                    "that many tokens), or `None` for chains."
                )
            if self.speculative_lenience != 1.0:
                raise ValueError(
                    f"`speculative_lenience={lenience!r}` cannot be combined with `speculative_tree_budget="
                    f"{budget!r}`: token trees are verified exactly only. Drop one of them."
                )
            object.__setattr__(self, "speculative_tree_budget", int(budget))
        from .policies import get_gamma_policy_class

        get_gamma_policy_class(self.speculative_gamma_policy)  # raises with the known names
        object.__setattr__(self, "speculative_gamma", int(gamma))
        object.__setattr__(self, "speculative_max_gamma", int(max_gamma))
        object.__setattr__(self, "speculative_lenience", float(lenience))


SPECULATIVE_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SpeculativeOptions)}


class SpeculativeGenerationConfig(GenerationConfig):
    r"""
    A [`~transformers.GenerationConfig`] with the settings of speculative decoding. It saves to and loads from
    `generation_config.json` like any generation config, and every `speculative_*` field can also be passed to
    `generate(...)` as a keyword argument, which then wins for that call.

    Args:
        speculative_gamma (`int`, *optional*, defaults to 5):
            How many tokens the drafter proposes before the target verifies them in one forward (γ in the paper).
        speculative_lenience (`float`, *optional*, defaults to 1.0):
            Lenience l in (0, 1] of the paper's Appendix A.5. `1.0` keeps the output exactly the target's; smaller
            values accept more drafts and are lossy, with the guarantee that no token is sampled with probability
            above p(x) / l.
        speculative_gamma_policy (`str`, *optional*, defaults to `"constant"`):
            How γ is chosen before each round: `"constant"` (always `speculative_gamma`), `"heuristic"` (+2 after a
            fully accepted round, -1 otherwise, starting from `speculative_gamma`, never persisted), or `"optimal"`
            (maximises Theorem 3.8's expected speedup from online estimates of acceptance per position and of the
            drafting and verifying costs measured during the call; γ = 0 decodes a plain step).
        speculative_max_gamma (`int`, *optional*, defaults to 16):
            The largest γ the `"heuristic"` and `"optimal"` policies may choose.
        speculative_tree_budget (`int`, *optional*):
            Verify token trees of at most this many draft nodes in one target forward (SpecInfer / EAGLE-2 style):
            drafters that can branch propose several candidate continuations and the longest accepted path wins;
            `speculative_gamma` stays the tree's depth. Choose it where a target forward over that many tokens
            still costs about one token's forward (memory-bound decoding). `None` (the default) verifies chains.
            Exact for greedy decoding and sampling alike; one sequence at a time, decoder-only targets.
        kwargs:
            Any [`~transformers.GenerationConfig`] argument.

    Example:

    ```python
    >>> import hf_specdec
    >>> config = hf_specdec.SpeculativeGenerationConfig(speculative_gamma=4, max_new_tokens=64)
    >>> config.speculative_gamma
    4
    ```
    """

    def __init__(self, **kwargs):
        for name, default in SPECULATIVE_DEFAULTS.items():
            setattr(self, name, kwargs.pop(name, default))
        super().__init__(**kwargs)

    def validate(self, strict: bool = False, user_set_attributes: set[str] | None = None):
        super().validate(strict=strict, user_set_attributes=user_set_attributes)
        SpeculativeOptions(**{name: getattr(self, name) for name in SPECULATIVE_DEFAULTS})

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        from . import __version__

        output["hf_specdec_version"] = __version__
        return output

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> "SpeculativeGenerationConfig":
        config_dict = {k: v for k, v in config_dict.items() if k != "hf_specdec_version"}
        return super().from_dict(config_dict, **kwargs)


def resolve_speculative_options(
    call_kwargs: dict[str, Any], *configs: GenerationConfig | None
) -> SpeculativeOptions:
    """Pops the `speculative_*` keyword arguments of one `generate` call and resolves every field.

    Priority: the call's keyword argument, then the first config in `configs` that has the attribute (the
    `generation_config` passed to the call, then the model's own), then the default. Nothing is written anywhere.
    """
    values = {}
    for name, default in SPECULATIVE_DEFAULTS.items():
        if name in call_kwargs:
            values[name] = call_kwargs.pop(name)
            continue
        values[name] = next(
            (getattr(config, name) for config in configs if config is not None and hasattr(config, name)), default
        )
    unknown = sorted(k for k in call_kwargs if k.startswith("speculative_"))
    if unknown:
        raise TypeError(
            f"Unknown speculative argument(s) {unknown} passed to `generate`. Known ones: {sorted(SPECULATIVE_DEFAULTS)}."
        )
    return SpeculativeOptions(**values)
