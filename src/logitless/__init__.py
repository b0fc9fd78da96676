"""logitless: LM-head log-probs, entropy and RL policy losses without materializing logits."""

from . import reference
from .head import LinearLogprobs, linear_logprobs
from .types import LogProbs

__all__ = ["LinearLogprobs", "LogProbs", "linear_logprobs", "reference"]
__version__ = "0.1.0.dev0"
