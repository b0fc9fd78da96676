"""TRL's trainers on logitless: the same training, without the ``[tokens, vocab]`` logits.

Switching is one line::

    from logitless.integrations.trl import LogitlessGRPOTrainer as GRPOTrainer
    from logitless.integrations.trl import LogitlessDistillationTrainer as DistillationTrainer

- :mod:`~logitless.integrations.trl.grpo`: ``LogitlessGRPOTrainer`` (``trl.GRPOTrainer``'s
  log-probs and loss on logitless), :func:`grpo_loss_config`, :func:`check_trainer`;
- :mod:`~logitless.integrations.trl.distillation`: ``LogitlessDistillationTrainer``
  (``trl.DistillationTrainer``'s loss on logitless), :func:`check_distillation`;
- :mod:`~logitless.integrations.trl.common`: what both share (the accelerate setups they
  accept, TRL's completion layout); it imports neither TRL nor transformers.

Each mixin (``LogitlessGRPOMixin``, ``LogitlessDistillationMixin``) gives a trainer subclass of
your own the same. Tested with TRL 1.16 (``pip install -e '.[trl]'`` in a logitless checkout
installs it); docs/trl.md.
"""

from .distillation import (
    LogitlessDistillationMixin,
    LogitlessDistillationTrainer,
    check_distillation,
)
from .grpo import (
    TESTED_TRL,
    LogitlessGRPOMixin,
    LogitlessGRPOTrainer,
    check_trainer,
    grpo_loss_config,
)

__all__ = [
    "TESTED_TRL",
    "LogitlessDistillationMixin",
    "LogitlessDistillationTrainer",
    "LogitlessGRPOMixin",
    "LogitlessGRPOTrainer",
    "check_distillation",
    "check_trainer",
    "grpo_loss_config",
]
