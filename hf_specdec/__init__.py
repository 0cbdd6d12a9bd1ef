"""hf_specdec: exact speculative decoding (Leviathan et al., 2023) inside transformers' `model.generate`."""

__version__ = "0.2.0.dev0"

from . import distill, metrics, pipelines, policies, zoo
from .configuration import SpeculativeGenerationConfig
from .dataset_generation import generate_dataset
from .drafters import (
    CrossTokenizerDrafter,
    DFlashDrafter,
    DraftContext,
    Drafter,
    DraftProposal,
    EagleDrafter,
    EarlyExitDrafter,
    Gemma4AssistantDrafter,
    ModelDrafter,
    MtpDrafter,
    NGramDrafter,
    PromptLookupDrafter,
    SuffixCache,
    SuffixDrafter,
    list_drafters,
    register_drafter,
)
from .mixin import SpeculativeGenerationMixin, enable
from .outputs import (
    SpeculativeBeamDecoderOnlyOutput,
    SpeculativeBeamEncoderDecoderOutput,
    SpeculativeDecoderOnlyOutput,
    SpeculativeEncoderDecoderOutput,
)
from .stats import SpeculativeStats
from .theory import expected_operations, expected_speedup, optimal_gamma

__all__ = [
    "CrossTokenizerDrafter",
    "DFlashDrafter",
    "DraftContext",
    "DraftProposal",
    "Drafter",
    "EagleDrafter",
    "EarlyExitDrafter",
    "Gemma4AssistantDrafter",
    "ModelDrafter",
    "MtpDrafter",
    "NGramDrafter",
    "PromptLookupDrafter",
    "SpeculativeBeamDecoderOnlyOutput",
    "SpeculativeBeamEncoderDecoderOutput",
    "SpeculativeDecoderOnlyOutput",
    "SpeculativeEncoderDecoderOutput",
    "SpeculativeGenerationConfig",
    "SpeculativeGenerationMixin",
    "SpeculativeStats",
    "SuffixCache",
    "SuffixDrafter",
    "__version__",
    "distill",
    "enable",
    "expected_operations",
    "expected_speedup",
    "generate_dataset",
    "list_drafters",
    "metrics",
    "optimal_gamma",
    "pipelines",
    "policies",
    "register_drafter",
    "zoo",
]
