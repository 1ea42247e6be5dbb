"""Runtime: backends, the EAGLE loop and the embedding API."""

from .api import EagleRuntime, GenerationStream
from .generator import GenerationResult, GenerationStats
from .sampling import SamplingParams

__all__ = ["EagleRuntime", "GenerationStream", "GenerationResult", "GenerationStats", "SamplingParams"]
