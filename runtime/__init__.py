"""Runtime: backends, the EAGLE loop and the embedding API."""

from .api import EagleRuntime, GenerationStream
from .guard import GuardPolicy
from .results import GenerationResult, GenerationStats
from .sampling import SamplingParams
from .scheduler import RequestStream
from .stream_text import StreamChunk

__all__ = ["EagleRuntime", "GenerationStream", "GenerationResult", "GenerationStats", "GuardPolicy", "RequestStream",
           "SamplingParams", "StreamChunk"]
