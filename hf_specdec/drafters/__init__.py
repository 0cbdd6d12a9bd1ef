"""Drafters: what proposes the tokens the target verifies."""

from .base import DraftContext, DraftProposal, Drafter, get_drafter_class, list_drafters, register_drafter
from .model import ModelDrafter

__all__ = [
    "DraftContext",
    "DraftProposal",
    "Drafter",
    "ModelDrafter",
    "get_drafter_class",
    "list_drafters",
    "register_drafter",
]
