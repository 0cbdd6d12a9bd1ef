"""Drafters: what proposes the tokens the target verifies."""

from .base import DraftContext, Drafter, DraftProposal, get_drafter_class, list_drafters, register_drafter
from .cross_tokenizer import CrossTokenizerDrafter
from .dflash import DFlashDrafter
from .eagle import EagleDrafter
from .early_exit import EarlyExitDrafter
from .gemma4_assistant import Gemma4AssistantDrafter
from .model import ModelDrafter
from .mtp import MtpDrafter
from .ngram import NGramDrafter
from .prompt_lookup import PromptLookupDrafter
from .suffix import SuffixCache, SuffixDrafter

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
    "SuffixCache",
    "SuffixDrafter",
    "get_drafter_class",
    "list_drafters",
    "register_drafter",
]
