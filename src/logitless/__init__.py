"""logitless: LM-head log-probs, entropy and RL policy losses without materializing logits.

The core a training step needs is importable from here (``logitless.__all__``). The
submodules hold the rest and are importable by name: :mod:`logitless.losses` (every loss
variant as a small function), :mod:`logitless.advantages`, :mod:`logitless.packing` (labels
and document ids of packed streams), :mod:`logitless.parallel` (vocab / context parallelism),
:mod:`logitless.accumulation`, :mod:`logitless.reference` (the naive oracle),
:mod:`logitless.integrations.hf`.
"""

from . import advantages, losses, packing, parallel, reference  # noqa: F401  (importable by name)
from .accumulation import StepAccumulator
from .contract.divergence import TeacherTopK
from .contract.options import WeightGradInto
from .contract.sampling import RolloutTopK
from .losses import LossNormalizer, PolicyLossConfig, loss_normalizer, policy_loss
from .modules import DivergenceHead, LinearLogprobs, LogprobHead, PolicyLossHead
from .ops.divergence.op import linear_divergence
from .ops.fused_loss.op import fused_policy_loss
from .ops.logprobs.op import linear_logprobs
from .packing import next_token_labels
from .parallel import VocabParallel
from .sampling import SamplingMask
from .types import Divergence, LogProbs, TeacherHead

__all__ = [
    "Divergence",
    "DivergenceHead",
    "LinearLogprobs",
    "LogProbs",
    "LogprobHead",
    "LossNormalizer",
    "PolicyLossConfig",
    "PolicyLossHead",
    "RolloutTopK",
    "SamplingMask",
    "StepAccumulator",
    "TeacherHead",
    "TeacherTopK",
    "VocabParallel",
    "WeightGradInto",
    "fused_policy_loss",
    "linear_divergence",
    "linear_logprobs",
    "loss_normalizer",
    "next_token_labels",
    "policy_loss",
]
__version__ = "0.2.0.dev0"
