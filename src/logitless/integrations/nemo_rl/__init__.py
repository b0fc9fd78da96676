"""NeMo RL's Megatron backend: logitless behind ``policy.megatron_cfg.use_fused_linear_logprobs``.

NeMo RL (NVIDIA-NeMo/RL, its Megatron policy worker on megatron-core) computes per-token
log-probs from the hidden states with ``policy.megatron_cfg.use_fused_linear_logprobs=true``:
it replaces ``GPTModel.forward`` by a chunked linear log-prob
(``nemo_rl/distributed/model_utils.py``) and its LOGPROB losses (``ClippedPGLossFn``,
``NLLLossFn``, ``DPOLossFn``) get ``[B, S−1]`` log-probs instead of logits. That path refuses
context parallelism, the distributed optimizer's ``overlap_param_gather``, sequence packing
and top-k / top-p for GRPO, and has no temperature (NeMo RL divides its log-probs by it) and no
entropy. With one more key of the same config, the same path runs logitless::

    python -m logitless.integrations.nemo_rl examples/run_grpo.py --config ... \\
        policy.megatron_cfg.use_fused_linear_logprobs=true \\
        +policy.megatron_cfg.fused_linear_logprobs_backend=logitless

(``python -m logitless.integrations.nemo_rl SCRIPT ARGS`` runs ``SCRIPT`` with this package
installed; in a launch script of your own, ``import logitless.integrations.nemo_rl`` after
``nemo_rl.algorithms.grpo`` is imported does the same, or call :func:`install` with
``driver=True``). NeMo RL's config keeps the key (its ``TypedDict`` configs pass unknown keys
through pydantic), and ``grpo.setup`` stores its value as :data:`BACKEND`, a ``str`` equal to
``"logitless"`` whose class lives here: each Ray worker NeMo RL sends the policy config to
imports this package when it unpickles the config, before it builds its model, and so installs
it there too.

Importing the package (:func:`install`) replaces, where NeMo RL looks them up at call time
(``docs/nemo-rl.md`` has the table):

- ``model_utils._gpt_forward_with_linear_ce_fusion`` (what NeMo RL's patch installs as
  ``GPTModel.forward``): :func:`~.forward.fused_forward`, logitless's head inside
  ``output_layer``'s forward through :mod:`logitless.integrations.megatron`, in a step of a
  config that selects logitless; NeMo RL's own otherwise;
- in ``megatron/train.py``: ``forward_with_post_processing_fn`` (runs the step with the
  sampler's settings), ``apply_temperature_scaling`` (leaves logitless's log-probs alone),
  ``prepare_loss_input`` / ``prepare_packed_loss_input`` and ``SequencePackingLossWrapper``
  (take logitless's log-probs, already unpacked, whole);
- in ``megatron/setup.py``: ``_apply_parallelism_config`` and ``_create_megatron_config``,
  run on a view of the config without NeMo RL's fused flag (their refusals of context
  parallelism and ``overlap_param_gather`` are about NeMo RL's forward);
- ``grpo.setup``: its refusals of sequence packing and top-k / top-p passed the same way.

Bad input NeMo RL's config lets through (a temperature that is 0 or not finite, top-p outside
``(0, 1]``, a token id outside the vocabulary, multi-token prediction) raises ``ValueError``
naming the option, on every rank of the tensor- and context-parallel groups, before the
decoder runs.
"""

from __future__ import annotations

import runpy
import sys

from .forward import Extras, fused_forward, logitless_output
from .hooks import (
    BACKEND,
    ENTROPY_KEY,
    KEY,
    VALUE,
    install,
    installed,
    mark,
    prepare_logitless,
    selected,
    unfused,
    uninstall,
)

__all__ = [
    "BACKEND",
    "ENTROPY_KEY",
    "KEY",
    "VALUE",
    "Extras",
    "fused_forward",
    "install",
    "installed",
    "logitless_output",
    "main",
    "mark",
    "prepare_logitless",
    "selected",
    "uninstall",
    "unfused",
]


def main() -> None:
    """``python -m logitless.integrations.nemo_rl SCRIPT ARGS``: run ``SCRIPT`` (NeMo RL's
    ``examples/run_grpo.py``, ...) as ``__main__`` with this package installed."""
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m logitless.integrations.nemo_rl SCRIPT [ARGS ...]")
    install(driver=True)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


install()
