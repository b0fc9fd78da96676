"""logitless: LM-head log-probs, entropy and RL policy losses without materializing logits."""

from . import accumulation, advantages, distributed, losses, modules, packing, reference
from .accumulation import AccumulatedStep, StepAccumulator
from .distributed import VocabParallel
from .fused_loss import fused_policy_loss
from .head import LinearLogprobs, linear_logprobs
from .losses import LossNormalizer, PolicyLossConfig, loss_normalizer, policy_loss
from .modules import LogprobHead, PolicyLossHead
from .packing import next_token_labels, segment_sum
from .sampling import SamplingMask
from .types import LogProbs

__all__ = [
    "AccumulatedStep",
    "LinearLogprobs",
    "LogProbs",
    "LogprobHead",
    "LossNormalizer",
    "PolicyLossConfig",
    "PolicyLossHead",
    "SamplingMask",
    "StepAccumulator",
    "VocabParallel",
    "accumulation",
    "advantages",
    "distributed",
    "fused_policy_loss",
    "linear_logprobs",
    "loss_normalizer",
    "losses",
    "modules",
    "next_token_labels",
    "packing",
    "policy_loss",
    "reference",
    "segment_sum",
]
__version__ = "0.1.0.dev0"
