"""slime (THUDM/slime, and the slime family on its Megatron backend): its policy loss without the
``[tokens, vocab]`` logits, through slime's own two hooks::

    python train.py ... \\
        --custom-model-provider-path logitless.integrations.slime.model_provider \\
        --loss-type custom_loss \\
        --custom-loss-function-path logitless.integrations.slime.policy_loss

slime loads both by name in every Megatron worker (``load_function``), so nothing else is
needed there. :func:`model_provider` builds slime's own model (from the same arguments, as
slime would without the first option) whose ``GPTModel.forward`` hands the loss the decoder's
hidden states instead of logits (megatron-core 0.19's ``output_processor``: :func:`with_head`,
:func:`output_processor`); :func:`policy_loss` is slime's ``policy_loss_function`` on them,
with the head run as the output layer's forward and logitless's fused loss
(:func:`logitless.fused_policy_loss`): PPO's clip (asymmetric, dual clip), GSPO, CISPO, the KL
estimators (unbiased too), the entropy bonus, TIS and IcePop, OPSM, slime's per-sample mean or
token sum, its context-parallel layouts (zigzag, ``--allgather-cp``), sequence, tensor and
pipeline parallelism. :func:`loss_config` maps slime's arguments onto a
:class:`~logitless.PolicyLossConfig` and refuses, by option, what logitless cannot follow; the
model provider calls it before any model is built, on every rank alike.

The package, by concern: :mod:`~.config` (slime's options), :mod:`~.layout` (a micro-batch's
response tokens on this rank), :mod:`~.head` (the processor and the loss: the switch's two
halves, which meet in the hidden states the one hands the other), :mod:`~.model` (the
provider). docs/slime.md has the contract and the limits.
"""

from .config import MODEL_PROVIDER, POLICY_LOSS, check_switch, loss_config
from .head import HeadStage, head_stage, output_processor, policy_loss, with_head
from .layout import Responses, responses
from .model import model_provider

__all__ = [
    "MODEL_PROVIDER",
    "POLICY_LOSS",
    "HeadStage",
    "Responses",
    "check_switch",
    "head_stage",
    "loss_config",
    "model_provider",
    "output_processor",
    "policy_loss",
    "responses",
    "with_head",
]
