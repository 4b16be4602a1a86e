"""Speculative decoding: drafting tokens that one forward step verifies."""

from loom.spec_decode.config import SpeculativeConfig
from loom.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer", "SpeculativeConfig"]
