"""``head: {type: logitless}``: the head config Fast-LLM's registry selects by name.

Part of :mod:`logitless.integrations.fast_llm`. Fast-LLM's head builds the ``[tokens, vocab]``
logits before any loss runs (``LanguageModelHead._logits_loss_forward_backward_partial``) and
hands each loss only the logits, so no loss config can avoid them. The head config itself is
chosen by ``type`` from the registry of ``BlockConfig`` (every block config's), which this
class joins under ``logitless``: a subclass of ``LanguageModelHeadConfig`` with the same fields
(its losses keep their Fast-LLM configs) that builds :class:`~.head.LogitlessHead` and
:class:`~.head.LogitlessMultiTokenPrediction`, plus one field of its own,
``teacher_hidden_states``.

What logitless cannot do is refused when the config is validated (before any model is built),
with a ``ValueError`` naming the option: a loss type it has no equivalent for (``z_loss``,
``dpo``, any other), a zero ``logits_scale_factor``.
"""

import typing  # no `from __future__ import annotations`: Fast-LLM reads its fields' types

from fast_llm.config import Field, FieldHint, config_class
from fast_llm.layers.block.config import BlockConfig
from fast_llm.layers.language_model.config import LanguageModelHeadConfig
from fast_llm.layers.language_model.loss.config import LanguageModelLabelEntropyLossConfig

from .losses import KINDS

if typing.TYPE_CHECKING:
    from .head import LogitlessHead, LogitlessMultiTokenPrediction

__all__ = ["LogitlessHeadConfig"]


@config_class(dynamic_type={BlockConfig: "logitless"})
class LogitlessHeadConfig(LanguageModelHeadConfig):
    """Fast-LLM's head config, computed by logitless (``type: logitless``)."""

    _abstract = False

    teacher_hidden_states: bool = Field(
        default=False,
        desc="As the distillation teacher (a reference model) of a head of type logitless, hand"
        " the student this head's final hidden states and weight instead of its logits.",
        hint=FieldHint.feature,
    )

    def _validate(self) -> None:
        super()._validate()
        for name, loss in self.losses.items():
            layer = loss.loss_class
            if layer not in KINDS:
                raise ValueError(
                    f"head.losses.{name}: loss type {loss.dynamic_type_name!r} has no "
                    f"logitless equivalent with head type logitless (supported: label, grpo, "
                    f"gspo, distillation); use Fast-LLM's own head (remove head.type) for it"
                )
        if self.logits_scale_factor == 0:
            raise ValueError(
                "head.logits_scale_factor must be > 0 with head type logitless, got 0 (every "
                "logit would be 0)"
            )

    def get_effective_losses(self) -> dict:
        """The losses one by one, each its own logitless pass: Fast-LLM's shared-softmax
        ``MonolithicLoss`` exists to share the logits, which never exist here. No losses:
        Fast-LLM's default, the cross-entropy."""
        return dict(self.losses) or {"cross_entropy": LanguageModelLabelEntropyLossConfig()}

    def get_layer(
        self,
        distributed_config,
        embeddings_config,
        *,
        hidden_dim,
        lr_scale,
        peft,
        block_config=None,
    ) -> "tuple[LogitlessHead, LogitlessMultiTokenPrediction]":
        from fast_llm.engine.config_utils.parameter import combine_lr_scales

        from .head import LogitlessHead, LogitlessMultiTokenPrediction

        scale = combine_lr_scales(lr_scale, self.lr_scale)
        return LogitlessHead(
            self, distributed_config, embeddings_config, hidden_dim=hidden_dim, lr_scale=scale,
            peft=peft,
        ), LogitlessMultiTokenPrediction(
            self, distributed_config, embeddings_config, hidden_dim=hidden_dim, lr_scale=scale,
            peft=peft, block_config=block_config,
        )  # fmt: skip
