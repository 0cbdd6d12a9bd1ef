"""`SpeculativeGenerationConfig`: a `GenerationConfig` with the `speculative_*` fields, validated in one place."""

from __future__ import annotations

import dataclasses
import difflib
import numbers
from typing import Any

from transformers import GenerationConfig

__all__ = ["SPECULATIVE_DEFAULTS", "SpeculativeGenerationConfig", "SpeculativeOptions", "resolve_speculative_options"]


MAX_TREE_BUDGET = 1024  # a verify forward over more nodes costs more than any tree saves


MAX_DRAFT_BEAMS = 256  # the drafter's beam width: the target scores every beam it keeps, each step

MAX_GAMMA = 256  # drafts per round: a verify forward over more tokens costs more than any draft saves

VERIFICATIONS = ("auto", "token", "block")  # `speculative_verification`: block where it gains, Algorithm 1, block


def _check_int(name: str, value, high: int, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}. Use for example `{example}`.")
    if value > high:
        raise ValueError(
            f"`{name}` must be a positive int, got {value!r}, above its limit of {high}: a verify forward over that "
            f"many drafts costs more than they can save. Use for example `{example}`."
        )


@dataclasses.dataclass(frozen=True)
class SpeculativeOptions:
    """The speculative settings one `generate` call runs with; built and validated once per call."""

    speculative_gamma: int = 5
    """How many tokens the drafter proposes per target forward (γ in the paper): every round under "constant", the most
    a round drafts under "auto"."""
    speculative_lenience: float = 1.0
    """Lenience l in (0, 1] (Appendix A.5); 1.0 is the exact algorithm, smaller values are lossy."""
    speculative_gamma_policy: str = "auto"
    """How γ is chosen each round: "auto" (one token first, then the γ up to speculative_gamma predicted to pay best;
    plain steps while drafting is measured not to pay), "constant", "heuristic" (+2 / -1) or "optimal" (Theorem 3.8,
    online, up to speculative_max_gamma)."""
    speculative_max_gamma: int | None = None
    """The largest γ any policy may choose; None: max(16, speculative_gamma)."""
    speculative_tree_budget: int | None = None
    """The most draft nodes one round may verify as a token tree (γ stays its depth); None: chains only."""
    speculative_draft_beams: int | None = None
    """Beam search (`num_beams` > 1): the drafter's beam width u ≥ num_beams (Appendix A.4); None: 2 x num_beams."""
    speculative_verification: str = "auto"
    """How a sampled chain of drafts is verified: "token" (Algorithm 1, each draft on its own), "block" (Sun et al.,
    ICLR 2025: the drafts jointly, never fewer accepted in expectation; `hf_specdec.block_verification`) or "auto"
    (block for sampled drafts, where it can gain; token-wise for deterministic ones, where it cannot)."""
    speculative_cudnn_attention: bool = False
    """Whether the call's forwards on a CUDA device may use cuDNN's attention (torch's default for half-precision
    scaled dot-product attention on recent GPUs); False (the default) turns it off while the call runs
    (`hf_specdec.devices.cudnn_attention_off`): it sets itself up anew for each new query and key length."""
    given: frozenset = frozenset()
    """The fields set by the call or a config rather than left at their defaults (beam search, whose drafts are
    accepted less often, drafts fewer steps by default: `hf_specdec.beam`)."""

    def __post_init__(self):
        gamma = self.speculative_gamma
        _check_int("speculative_gamma", gamma, MAX_GAMMA, "speculative_gamma=5")
        lenience = self.speculative_lenience
        if isinstance(lenience, bool) or not isinstance(lenience, numbers.Real) or not 0.0 < lenience <= 1.0:
            raise ValueError(
                f"`speculative_lenience` must be a float in (0, 1], got {lenience!r}. Use `speculative_lenience=1.0` "
                "(the default) for exact speculative decoding."
            )
        max_gamma = self.speculative_max_gamma
        if max_gamma is None:
            max_gamma = max(16, int(gamma))
        _check_int("speculative_max_gamma", max_gamma, MAX_GAMMA, "speculative_max_gamma=16")
        if gamma > max_gamma and "speculative_gamma" not in self.given:
            gamma = max_gamma  # a default γ (the library's, a drafter's, beam search's) under an explicit cap
        elif gamma > max_gamma:  # every policy starts at γ: capping it silently would run another γ than asked for
            raise ValueError(
                f"`speculative_gamma={gamma!r}` is larger than `speculative_max_gamma={max_gamma!r}`, the largest γ "
                f"a round may draft. Raise `speculative_max_gamma` to at least {gamma}, or lower `speculative_gamma`."
            )
        budget = self.speculative_tree_budget
        if budget is not None:
            _check_int(
                "speculative_tree_budget",
                budget,
                MAX_TREE_BUDGET,
                "speculative_tree_budget=12` for trees of up to 12 nodes, or `speculative_tree_budget=None",
            )
            if self.speculative_lenience != 1.0:
                raise ValueError(
                    f"`speculative_lenience={lenience!r}` cannot be combined with `speculative_tree_budget="
                    f"{budget!r}`: token trees are verified exactly only. Drop one of them."
                )
            object.__setattr__(self, "speculative_tree_budget", int(budget))
        draft_beams = self.speculative_draft_beams
        if draft_beams is not None:
            _check_int(
                "speculative_draft_beams",
                draft_beams,
                MAX_DRAFT_BEAMS,
                "speculative_draft_beams=8` (at least `num_beams`), or `speculative_draft_beams=None",
            )
            object.__setattr__(self, "speculative_draft_beams", int(draft_beams))
        verification = self.speculative_verification
        if verification not in VERIFICATIONS:
            raise ValueError(
                f"`speculative_verification` must be one of {list(VERIFICATIONS)}, got {verification!r}. Leave it "
                'at "auto" (the default: block verification for sampled drafts), or force "token" or "block".'
            )
        if verification == "block" and self.speculative_lenience != 1.0:
            raise ValueError(
                f'`speculative_lenience={lenience!r}` cannot be combined with `speculative_verification="block"`: '
                "lenience is defined for token-wise verification. Drop one of them."
            )
        if verification == "block" and budget is not None:
            raise ValueError(
                f'`speculative_verification="block"` cannot be combined with `speculative_tree_budget={budget!r}`: '
                "token trees are verified with multi-candidate rejection (SpecInfer), for which there is no block "
                "rule. Drop one of them."
            )
        if not isinstance(self.speculative_cudnn_attention, bool):
            raise ValueError(
                f"`speculative_cudnn_attention` must be a bool, got {self.speculative_cudnn_attention!r}. Leave it at "
                "False (the default: no cuDNN attention while speculating on a GPU), or pass True to keep torch's "
                "choice of attention kernels."
            )
        from .policies import get_gamma_policy_class

        get_gamma_policy_class(self.speculative_gamma_policy)  # raises with the known names
        object.__setattr__(self, "speculative_gamma", int(gamma))
        object.__setattr__(self, "speculative_max_gamma", int(max_gamma))
        object.__setattr__(self, "speculative_lenience", float(lenience))

    def with_default_gamma(self, gamma: int | None, source: str) -> SpeculativeOptions:
        """These options with `gamma`, a default named `source` in errors (a drafter class's `default_gamma`, or beam
        search's), as γ when `speculative_gamma` was left unset, capped by an explicitly set `speculative_max_gamma`;
        an explicitly set `speculative_gamma` always wins."""
        if gamma is None or "speculative_gamma" in self.given:
            return self
        _check_int(source, gamma, MAX_GAMMA, f"{source} = 10` (or None), or pass `speculative_gamma=5` to `generate")
        max_gamma = self.speculative_max_gamma if "speculative_max_gamma" in self.given else None
        return dataclasses.replace(self, speculative_gamma=gamma, speculative_max_gamma=max_gamma)


SPECULATIVE_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(SpeculativeOptions) if f.name.startswith("speculative_")
}


class SpeculativeGenerationConfig(GenerationConfig):
    r"""
    A [`~transformers.GenerationConfig`] with the settings of speculative decoding. It saves to and loads from
    `generation_config.json` like any generation config, and every `speculative_*` field can also be passed to
    `generate(...)` as a keyword argument, which then wins for that call.

    Args:
        speculative_gamma (`int`, *optional*):
            How many tokens the drafter proposes before the target verifies them in one forward (γ in the paper):
            every round under `"constant"`, the most a round drafts under `"auto"` (the default policy, which drafts
            fewer where they pay better), the start of `"heuristic"` and `"optimal"`. `None` (the default) is 5, or
            the drafter's own default (`Drafter.default_gamma`): prompt lookup drafts 10, like transformers'
            recommended `prompt_lookup_num_tokens`.
        speculative_lenience (`float`, *optional*, defaults to 1.0):
            Lenience l in (0, 1] of the paper's Appendix A.5. `1.0` keeps the output exactly the target's; smaller
            values accept more drafts and are lossy, with the guarantee that no token is sampled with probability
            above p(x) / l.
        speculative_gamma_policy (`str`, *optional*, defaults to `"auto"`):
            How γ is chosen before each round. `"auto"` drafts one token in the first round, then, while drafting
            pays, the γ in 1 ... `speculative_gamma` that `"optimal"`'s estimates predict emits the most tokens per
            second (a tree drafts `speculative_gamma` as its depth); when the call's recent rounds emit fewer tokens
            per second than 95% of a plain step's, a chain steps down to a smaller γ predicted to pay, or else takes
            plain steps, probing the drafter again after 16, 32, 64, ... of them, so a drafter that accepts nothing
            costs a few rounds. `"constant"` always drafts `speculative_gamma`. `"heuristic"` is transformers'
            schedule: +2 after a fully accepted round, -1 otherwise, starting from `speculative_gamma`, for this call
            only. `"optimal"` maximises Theorem 3.8's expected speedup from online estimates of acceptance per draft
            position and of the drafting and verifying costs measured during the call (γ = 0 is a plain step). A
            policy registered with `hf_specdec.policies.register_gamma_policy` is accepted by its name.
        speculative_max_gamma (`int`, *optional*):
            The largest γ a round may draft: the bound of the `"heuristic"` and `"optimal"` policies. Defaults to
            `max(16, speculative_gamma)`. A `speculative_gamma` set above an explicit `speculative_max_gamma` is an
            error; one left unset (5, the drafter's default, beam search's 2) is capped by it. Both are at most 256.
        speculative_tree_budget (`int`, *optional*):
            Verify token trees of at most this many draft nodes in one target forward (SpecInfer / EAGLE-2 style):
            drafters that can branch propose several candidate continuations and the longest accepted path wins;
            `speculative_gamma` stays the tree's depth. Choose it where a target forward over that many tokens
            still costs about one token's forward (memory-bound decoding). `None` (the default) verifies chains.
            Exact for greedy decoding and sampling alike; one sequence at a time, decoder-only targets.
        speculative_draft_beams (`int`, *optional*):
            With beam search (`num_beams` > 1): the width u of the drafter's own beam search, at least `num_beams`
            (the paper's Appendix A.4). Each round the drafter keeps u beams for `speculative_gamma` steps, the
            target scores all of them in one forward, and the target's beam search takes every step whose beams
            the drafter kept; the output is plain beam search's. `None` (the default) uses `2 * num_beams`. With
            beam search, `speculative_gamma` left unset drafts 2 steps (`hf_specdec.beam.DEFAULT_BEAM_GAMMA`).
        speculative_verification (`str`, *optional*, defaults to `"auto"`):
            How a chain of drafts is verified when sampling. `"token"` is the paper's Algorithm 1: each draft passes
            its own ratio test and the round stops at the first failure. `"block"` is block verification (Sun et al.,
            "Block Verification Accelerates Speculative Decoding", ICLR 2025): the drafts are verified jointly, the
            output is still exactly the target's distribution, and the expected number of accepted drafts is never
            lower. `"auto"` verifies jointly when the drafts were sampled (draft models, EAGLE-3 heads, MTP layers,
            ...: q is a distribution) and token by token when they are deterministic (prompt lookup, n-gram tables,
            suffix decoding: q is a point mass, and both rules accept the same number in expectation, so block's
            extra work would buy nothing). Greedy decoding is unaffected; token trees (`speculative_tree_budget`),
            `speculative_lenience` < 1 and beam search are verified token-wise under `"auto"` and refuse
            `"block"`.
        speculative_cudnn_attention (`bool`, *optional*, defaults to `False`):
            Whether the call's forwards on a CUDA device may use cuDNN's fused attention, which torch picks by default
            for bfloat16 and float16 scaled dot-product attention on recent GPUs (Hopper). cuDNN's attention sets
            itself up anew for each new pair of query and key lengths (tens of milliseconds each time), and
            speculative decoding meets many more such pairs than plain decoding (verify forwards of each γ + 1 at
            each length), so these stalls can make it slower than plain decoding. `False` (the default) turns
            cuDNN's attention off while the call runs (`torch.backends.cuda.enable_cudnn_sdp(False)`, restored
            when the last speculative call running ends; torch then picks flash or memory-efficient attention).
            The setting is process-wide: a plain `generate` in another thread meanwhile runs without it too. It
            changes nothing on a CPU, nor for attention implementations other than `"sdpa"`, nor where the target's
            forwards are compiled (a static cache with `torch.compile`: the graphs are shared with plain `generate`),
            nor where the caller kept only cuDNN's attention enabled. `True` keeps torch's settings as they are.
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
            # γ left unset stays None: its default depends on the drafter (and on beam search) of each call
            setattr(self, name, kwargs.pop(name, None if name == "speculative_gamma" else default))
        super().__init__(**kwargs)

    def validate(self, strict: bool = False, user_set_attributes: set[str] | None = None):
        super().validate(strict=strict, user_set_attributes=user_set_attributes)
        _check_no_unknown_fields(self, "this `SpeculativeGenerationConfig`")
        values = {name: getattr(self, name) for name in SPECULATIVE_DEFAULTS if getattr(self, name) is not None}
        SpeculativeOptions(**values, given=frozenset(values))

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        from . import __version__

        output["hf_specdec_version"] = __version__
        return output

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> SpeculativeGenerationConfig:
        config_dict = {k: v for k, v in config_dict.items() if k != "hf_specdec_version"}
        return super().from_dict(config_dict, **kwargs)


def resolve_speculative_options(
    call_kwargs: dict[str, Any], *configs: GenerationConfig | None, entry: str = "generate"
) -> SpeculativeOptions:
    """Pops the `speculative_*` keyword arguments of one `generate` call (or of the call `entry` names:
    `generate_batch`, ...) and resolves every field.

    Priority: the call's keyword argument, then the first config in `configs` that sets the attribute (the
    `generation_config` passed to the call, then the model's own), then the default. None sets nothing, like a
    field transformers leaves at its default in a passed `generation_config` (the model's own value applies);
    `speculative_gamma` left None everywhere may be chosen by the drafter (`with_default_gamma`). Nothing is written
    anywhere.
    A bad value fails naming where it came from; an unknown `speculative_*` name fails in a config as in the call.
    """
    sources = [
        f"the `generation_config` passed to `{entry}`",
        "`model.generation_config` (the model's generation_config.json)",
    ]
    unknown = sorted(k for k in call_kwargs if k.startswith("speculative_") and k not in SPECULATIVE_DEFAULTS)
    if unknown:
        raise TypeError(
            f"Unknown speculative argument(s) {unknown} passed to `{entry}`{_did_you_mean(unknown)}. Known ones: "
            f"{sorted(SPECULATIVE_DEFAULTS)}."
        )
    for config, source in zip(configs, sources):
        if config is not None:
            _check_no_unknown_fields(config, source)
    values, origin = {}, {}
    for name, default in SPECULATIVE_DEFAULTS.items():
        # None sets nothing: the next source decides (`speculative_gamma` None everywhere: 5, or the drafter's own)
        values[name], origin[name] = next(
            (
                (value, source)
                for value, source in (
                    (call_kwargs.pop(name, None), f"the `{entry}` call's keyword arguments"),
                    *(
                        (getattr(config, name, None), source)
                        for config, source in zip(configs, sources)
                        if config is not None
                    ),
                )
                if value is not None
            ),
            (default, "the defaults"),
        )
    try:
        return SpeculativeOptions(**values, given=frozenset(k for k, v in origin.items() if v != "the defaults"))
    except ValueError as err:
        culprits = sorted({origin[name] for name in values if f"`{name}" in str(err)} - {"the defaults"})
        if not culprits:
            raise
        raise ValueError(f"{err} (Value read from {' and '.join(culprits)}.)") from None


def _did_you_mean(names: list[str]) -> str:
    close = {name: difflib.get_close_matches(name, list(SPECULATIVE_DEFAULTS), n=1) for name in names}
    hints = [f"`{match[0]}` for `{name}`" for name, match in close.items() if match]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def _check_no_unknown_fields(config: GenerationConfig, source: str) -> None:
    """A misspelt `speculative_*` field in a config fails like the same typo as a keyword argument."""
    unknown = sorted(k for k in vars(config) if k.startswith("speculative_") and k not in SPECULATIVE_DEFAULTS)
    if unknown:
        raise ValueError(
            f"Unknown speculative field(s) {unknown} in {source}{_did_you_mean(unknown)}: "
            f"{ {k: getattr(config, k) for k in unknown} }. Known ones: {sorted(SPECULATIVE_DEFAULTS)}. Rename or "
            "remove them."
        )
