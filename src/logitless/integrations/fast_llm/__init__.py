"""Fast-LLM: its language-model head computed by logitless (``head: {type: logitless}``).

Fast-LLM (ServiceNow/Fast-LLM) computes its losses in its head from a registry of loss configs
(``head.losses``: ``label`` cross-entropy, ``distillation``, ``grpo``, ``gspo``, ...), each of
which receives the ``[tokens, vocab]`` logits the head built first. With this module imported,
a model's head config accepts ``type: logitless``::

    model:
      base_model:
        head:
          type: logitless
          losses:
            grpo: {type: grpo, epsilon_low: 0.2, epsilon_high: 0.28}

and its head (:class:`LogitlessHead`) computes the same losses, with Fast-LLM's semantics (its
labels, masks, divisors, loss weights, ``logits_scale_factor``, ``final_logit_softcap``,
vocabulary and sequence parallelism, multi-token-prediction heads, registered losses and
metrics), from the hidden states and the head weight: the logits never exist.

Fast-LLM has no plugin hook, so the module must be imported in every process before the config
is parsed: ``python -m logitless.integrations.fast_llm train gpt --config run.yaml`` (or
``torchrun ... -m logitless.integrations.fast_llm ...``) is Fast-LLM's command line with the
type registered (:func:`main`). docs/fast-llm.md has the details and the limits.
"""

from __future__ import annotations

import sys

from .config import LogitlessHeadConfig
from .head import LogitlessHead, LogitlessMultiTokenPrediction
from .losses import TeacherOutput

__all__ = [
    "LogitlessHead",
    "LogitlessHeadConfig",
    "LogitlessMultiTokenPrediction",
    "TeacherOutput",
    "main",
]


def main(args: list[str] | None = None) -> None:
    """Fast-LLM's command line (``fast_llm.cli.fast_llm_main``) with ``head: {type:
    logitless}`` registered (importing this module did it)."""
    from fast_llm.cli import fast_llm_main

    fast_llm_main(sys.argv[1:] if args is None else args)
