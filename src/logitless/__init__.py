"""logitless: LM-head log-probs, entropy and RL policy losses without materializing logits."""

from . import packing, reference
from .head import LinearLogprobs, linear_logprobs
from .packing import next_token_labels, segment_sum
from .types import LogProbs

__all__ = [
    "LinearLogprobs",
    "LogProbs",
    "linear_logprobs",
    "next_token_labels",
    "packing",
    "reference",
    "segment_sum",
]
__version__ = "0.1.0.dev0"
