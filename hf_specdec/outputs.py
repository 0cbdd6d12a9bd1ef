"""`generate` outputs with `speculative_stats` attached (transformers' output classes plus one field)."""

from __future__ import annotations

from dataclasses import dataclass

from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

from .stats import SpeculativeStats

__all__ = ["SpeculativeDecoderOnlyOutput", "SpeculativeEncoderDecoderOutput"]


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """[`~transformers.generation.GenerateDecoderOnlyOutput`] plus `speculative_stats` ([`SpeculativeStats`])."""

    speculative_stats: SpeculativeStats | None = None


@dataclass
class SpeculativeEncoderDecoderOutput(GenerateEncoderDecoderOutput):
    """[`~transformers.generation.GenerateEncoderDecoderOutput`] plus `speculative_stats` ([`SpeculativeStats`])."""

    speculative_stats: SpeculativeStats | None = None
