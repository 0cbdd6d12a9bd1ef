"""`generate` outputs with `speculative_stats` attached (transformers' output classes plus one field)."""

from __future__ import annotations

from dataclasses import dataclass

from transformers.generation.utils import (
    GenerateBeamDecoderOnlyOutput,
    GenerateBeamEncoderDecoderOutput,
    GenerateDecoderOnlyOutput,
    GenerateEncoderDecoderOutput,
)

from .stats import SpeculativeStats

__all__ = [
    "SpeculativeBeamDecoderOnlyOutput",
    "SpeculativeBeamEncoderDecoderOutput",
    "SpeculativeDecoderOnlyOutput",
    "SpeculativeEncoderDecoderOutput",
]


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """[`~transformers.generation.GenerateDecoderOnlyOutput`] plus `speculative_stats` ([`SpeculativeStats`])."""

    speculative_stats: SpeculativeStats | None = None


@dataclass
class SpeculativeEncoderDecoderOutput(GenerateEncoderDecoderOutput):
    """[`~transformers.generation.GenerateEncoderDecoderOutput`] plus `speculative_stats` ([`SpeculativeStats`])."""

    speculative_stats: SpeculativeStats | None = None


@dataclass
class SpeculativeBeamDecoderOnlyOutput(GenerateBeamDecoderOnlyOutput):
    r"""
    [`~transformers.generation.GenerateBeamDecoderOnlyOutput`] (beam search with a drafter, the paper's Appendix A.4)
    plus `speculative_stats` ([`SpeculativeStats`]): `beam_steps_history` holds the beam steps each target forward
    gave, `target_forward_tokens` the forward's size. `sequences`, `sequences_scores` and `beam_indices` are those
    of plain beam search.

    Example:

    ```python
    >>> import torch, hf_specdec
    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> config = AutoConfig.for_model("gpt2", vocab_size=64, n_embd=32, n_layer=2, n_head=4)
    >>> model = hf_specdec.enable(AutoModelForCausalLM.from_config(config).eval())
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> out = model.generate(ids, assistant_model=model, num_beams=2, speculative_gamma=3, max_new_tokens=9,
    ...     return_dict_in_generate=True)
    >>> torch.equal(out.sequences, model.generate(ids, num_beams=2, max_new_tokens=9))
    True
    >>> out.speculative_stats.beam_steps_history  # the prefill's step, then 1 + 3 steps per target forward
    [1, 4, 4]

    ```
    """

    speculative_stats: SpeculativeStats | None = None


@dataclass
class SpeculativeBeamEncoderDecoderOutput(GenerateBeamEncoderDecoderOutput):
    """[`~transformers.generation.GenerateBeamEncoderDecoderOutput`] (beam search with a drafter) plus
    `speculative_stats` ([`SpeculativeStats`])."""

    speculative_stats: SpeculativeStats | None = None
