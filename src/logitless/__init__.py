"""logitless: LM-head log-probs, entropy and RL policy losses without materializing logits."""

from . import advantages, distributed, losses, packing, reference
from .distributed import VocabParallel
from .fused_loss import fused_policy_loss
from .head import LinearLogprobs, linear_logprobs
from .losses import LossNormalizer, PolicyLossConfig, loss_normalizer, policy_loss
from .packing import next_token_labels, segment_sum
from .types import LogProbs

__all__ = [
    "LinearLogprobs",
    "LogProbs",
    "LossNormalizer",
    "PolicyLossConfig",
    "VocabParallel",
    "advantages",
    "distributed",
    "fused_policy_loss",
    "linear_logprobs",
    "loss_normalizer",
    "losses",
    "next_token_labels",
    "packing",
    "policy_loss",
    "reference",
    "segment_sum",
]
__version__ = "0.1.0.dev0"
