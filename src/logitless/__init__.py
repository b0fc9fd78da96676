"""logitless: LM-head log-probs, entropy and RL policy losses without materializing logits."""

from . import reference
from .types import LogProbs

__all__ = ["LogProbs", "reference"]
__version__ = "0.1.0.dev0"
