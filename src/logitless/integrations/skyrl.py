"""SkyRL's Megatron backend: ``logitless`` as a value of ``trainer.fused_lm_head_logprob_backend``.

SkyRL (the ``skyrl`` package, 0.4.x) can fold its Megatron policy's LM head into the log-prob
computation (``trainer.fused_lm_head_logprob=true``): its ``output_processor`` hands the loss
the decoder's hidden states instead of logits, and the log-probs come from one module-level
function, ``skyrl.backends.skyrl_train.distributed.megatron.model_utils
._fused_lm_head_logprob_apply(backend, hidden, weight, target, vocab_start_index,
vocab_end_index, chunk_size, tp_group, inference_only)``, whose ``backend`` is that switch
(``torch`` or ``triton``; SkyRL's ``TrainerConfig.__post_init__`` refuses any other value).
This module adds ``logitless``::

    python -m skyrl.train.entrypoints.main_base ... \\
        trainer.strategy=megatron \\
        trainer.override_entrypoint=logitless.integrations.skyrl \\
        trainer.fused_lm_head_logprob=true \\
        trainer.fused_lm_head_logprob_backend=logitless

Importing it (:func:`install`) replaces two things of SkyRL's, where SkyRL looks them up at
call time, and nothing else:

- ``TrainerConfig.__post_init__``: the same checks, with ``logitless`` accepted as a value of
  ``fused_lm_head_logprob_backend``. The accepted value is stored as :data:`BACKEND` (a
  ``str`` equal to ``"logitless"`` whose class lives here), so every process that unpickles
  the config (the Ray task that runs the trainer, each Megatron worker actor: SkyRL hands them
  the config object as an argument) imports this module before it reads the value, and so
  installs the backend there too;
- ``model_utils._fused_lm_head_logprob_apply``: for ``backend == "logitless"`` it runs
  :func:`logprob_apply`, for any other value SkyRL's own function with the same arguments.

``trainer.override_entrypoint`` is SkyRL's own hook for integrations: ``main_base.main()``
imports the named module and calls its ``main()``, which here is SkyRL's ``main()`` again
without that argument (:func:`main`). In a Python entrypoint of your own, ``import
logitless.integrations.skyrl`` before the config is built does the same.

:func:`logprob_apply` keeps SkyRL's contract: ``hidden`` ``[B, S, H]`` batch-first and already
gathered over sequence parallelism (SkyRL's output processor gathers it, and reduce-scatters
or all-reduces its gradient itself), ``weight`` this rank's ``[V/tp, H]`` shard (already
divided by the temperature), ``target`` ``[B, S]`` global token ids, ``[vocab_start_index,
vocab_end_index)`` the shard's rows; it returns ``[B, S]`` fp32 log-probs, the same on every
rank of ``tp_group``, and in backward gives this rank's ``dh`` (unsummed over the group, as
SkyRL's backends give it) and ``dW``. The ``[B, S, V/tp]`` logits never exist; the head is
:func:`logitless.linear_logprobs` with a :class:`logitless.VocabParallel` over ``tp_group``.
``chunk_size`` (SkyRL's ``logprobs_chunk_size`` along the sequence) is not used: logitless
tiles from its own memory budget, and its result does not depend on the tile.

Bad input raises ``ValueError`` on every rank of ``tp_group``, in SkyRL's terms.

SkyRL's fused path still refuses ``use_entropy_loss=True``: that ``raise`` is inline in the
loss function SkyRL's Megatron model wrapper builds inside ``forward_backward_mini_batch``,
not behind a module-level function, so it cannot be lifted from this seam (docs/skyrl.md).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import torch

from ..contract.checks import finite_number
from ..contract.collectives import agree, fingerprint
from ..contract.vocab import VocabParallel
from . import seam

__all__ = [
    "BACKEND",
    "install",
    "installed",
    "logprob_apply",
    "main",
    "uninstall",
]

_NAME = "logitless"
_MODEL_UTILS = "skyrl.backends.skyrl_train.distributed.megatron.model_utils"
_CONFIG = "skyrl.train.config.config"


class _Backend(str):
    """``"logitless"``, of a class of this module: unpickling it imports this module (and so
    installs the backend) in every process SkyRL hands the config to."""

    __slots__ = ()

    def __reduce__(self):
        return (_backend, ())


def _backend() -> _Backend:
    return BACKEND


#: The value ``TrainerConfig.fused_lm_head_logprob_backend`` holds once ``logitless`` is
#: accepted; equal to ``"logitless"``.
BACKEND = _Backend(_NAME)

_ORIGINAL: dict[str, Any] = {}


# --- the switch ---------------------------------------------------------------------------


def install() -> None:
    """Accept ``logitless`` in SkyRL's config and dispatch it here (idempotent).

    The config check is replaced when ``skyrl`` is installed; the dispatch when SkyRL's Megatron
    ``model_utils`` can be imported (it needs megatron-core)."""
    if importlib.util.find_spec("skyrl") is None:
        return
    from skyrl.train.config.config import SkyRLTrainConfig, TrainerConfig

    if "post_init" not in _ORIGINAL:
        _ORIGINAL["post_init"] = TrainerConfig.__post_init__
        TrainerConfig.__post_init__ = _post_init
    if "train_post_init" not in _ORIGINAL:
        _ORIGINAL["train_post_init"] = SkyRLTrainConfig.__post_init__
        SkyRLTrainConfig.__post_init__ = _train_post_init
    model_utils = _model_utils()
    if model_utils is not None and "apply" not in _ORIGINAL:
        _ORIGINAL["apply"] = model_utils._fused_lm_head_logprob_apply
        model_utils._fused_lm_head_logprob_apply = _fused_lm_head_logprob_apply


def uninstall() -> None:
    """Give SkyRL back its config check and its dispatch."""
    if "post_init" in _ORIGINAL:
        from skyrl.train.config.config import SkyRLTrainConfig, TrainerConfig

        TrainerConfig.__post_init__ = _ORIGINAL.pop("post_init")
        SkyRLTrainConfig.__post_init__ = _ORIGINAL.pop("train_post_init")
    if "apply" in _ORIGINAL:
        _model_utils()._fused_lm_head_logprob_apply = _ORIGINAL.pop("apply")


def installed() -> bool:
    """Whether SkyRL's dispatch is this module's (``logitless`` runs logitless)."""
    model_utils = _model_utils()
    return (
        model_utils is not None
        and model_utils._fused_lm_head_logprob_apply is _fused_lm_head_logprob_apply
    )


def _model_utils():
    if _MODEL_UTILS in sys.modules:
        return sys.modules[_MODEL_UTILS]
    try:
        return importlib.import_module(_MODEL_UTILS)
    except ImportError:  # no megatron-core: SkyRL's Megatron backend cannot run either
        return None


def _post_init(self) -> None:
    """SkyRL's ``TrainerConfig.__post_init__``, with ``logitless`` an accepted backend."""
    original = _ORIGINAL["post_init"]
    if self.fused_lm_head_logprob_backend != _NAME:
        return original(self)
    self.fused_lm_head_logprob_backend = "torch"  # SkyRL's checks of everything else
    try:
        original(self)
    finally:
        self.fused_lm_head_logprob_backend = BACKEND
    _check_temperature(self)


def _train_post_init(self) -> None:
    """SkyRL's ``SkyRLTrainConfig.__post_init__`` (which copies the sampling temperature into
    ``trainer.algorithm.temperature`` when unset), then the temperature's check."""
    _ORIGINAL["train_post_init"](self)
    _check_temperature(self.trainer)


def _check_temperature(trainer: Any) -> None:
    """SkyRL divides the head's weight by ``trainer.algorithm.temperature`` before the fused
    head gets it: a temperature of 0 (greedy sampling's) or one that is not finite would give
    infinite weights and NaN log-probs, so with logitless it is refused when the config is
    made, before any model runs."""
    if not (trainer.fused_lm_head_logprob and trainer.fused_lm_head_logprob_backend == _NAME):
        return
    t = trainer.algorithm.temperature
    if t is None:  # set from generator.sampling_params by SkyRLTrainConfig, checked then
        return
    if not finite_number(t) or t <= 0:
        raise ValueError(
            f"trainer.algorithm.temperature must be finite and > 0 with "
            f"fused_lm_head_logprob_backend=logitless (SkyRL divides the head weight by it; "
            f"without an explicit value it is generator.sampling_params.temperature), got {t!r}"
        )


def _fused_lm_head_logprob_apply(backend: str, *args: Any) -> torch.Tensor:
    """SkyRL's dispatch with ``logitless`` added; other values go to SkyRL's own function."""
    if backend == _NAME:
        return logprob_apply(*args)
    return _ORIGINAL["apply"](backend, *args)


def main() -> None:
    """``trainer.override_entrypoint=logitless.integrations.skyrl``: SkyRL's ``main_base.main()``
    with this module installed in the driver (and, through the config, in every worker)."""
    install()
    from skyrl.train.entrypoints import main_base

    sys.argv = [a for a in sys.argv if not a.startswith("trainer.override_entrypoint=")]
    main_base.main()


# --- the backend --------------------------------------------------------------------------

_VOCAB: dict[tuple[Any, int, int], VocabParallel] = {}


def logprob_apply(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    chunk_size: int,
    tp_group: Any,
    inference_only: bool = False,
) -> torch.Tensor:
    """The log-probs of SkyRL's ``_fused_lm_head_logprob_apply`` (its arguments after
    ``backend``) through logitless: ``[B, S]`` fp32, the same on every rank of ``tp_group``.

    ``hidden`` is cast to ``weight``'s dtype first, as SkyRL's backends cast it (the output
    layer's dtype); the softmax statistics are fp32. ``inference_only``: no graph is kept.
    A collective call over ``tp_group``; raises ``ValueError`` on every rank when any rank's
    inputs are wrong.
    """
    del chunk_size  # logitless picks its tiles from a memory budget (module docstring)
    error = None
    try:
        _check(hidden, weight, target, vocab_start_index, vocab_end_index)
    except ValueError as e:
        error = e
    low, high = 0, 0
    if error is None and target.numel():
        low, high = int(target.min()), int(target.max())
    key = (tp_group, vocab_start_index, vocab_end_index)
    cached = _VOCAB.get(key) if error is None else None
    tag = -1 if cached is None else fingerprint(cached.ranges)
    # one exchange: any rank's failure, the targets' range, and whether every rank holds the
    # same VocabParallel (else all ranks build a new one: its construction is a collective)
    neg_low, high, tag_max, neg_tag_min = agree(
        tp_group,
        error,
        "fused_lm_head_logprob_backend=logitless",
        [-low, high, tag, -tag],
        "the tensor-parallel group (tp_group)",
    )
    if cached is None or tag_max != -neg_tag_min:
        # the ranks' ranges are exchanged and checked to tile [0, V) (every rank raises)
        cached = _VOCAB[key] = _vocab_parallel(tp_group, vocab_start_index, vocab_end_index)
    vp = cached
    if -neg_low < 0 or high >= vp.vocab_size:
        raise ValueError(
            f"target: token ids must be in [0, {vp.vocab_size}) (the output layer's "
            f"vocabulary over the tensor-parallel group), got ids in [{-neg_low}, {high}] "
            "on the group's ranks"
        )
    with torch.set_grad_enabled(torch.is_grad_enabled() and not inference_only):
        head = seam.Head(weight)
        prep = seam.prepare(target, head, parallel=seam.Parallelism(vocab=vp))
        out = seam.logprobs(prep, seam.Tokens(hidden.to(weight.dtype), target), head)
    return out.logprobs.float()


def _check(hidden, weight, target, vocab_start_index, vocab_end_index) -> None:
    for name, v in (("vocab_start_index", vocab_start_index), ("vocab_end_index", vocab_end_index)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an int, got {v!r}")
    if not (isinstance(hidden, torch.Tensor) and hidden.dim() == 3):
        raise ValueError(
            "hidden (the decoder's hidden states) must be [batch, seq, hidden_size], got "
            f"{_shape(hidden)}"
        )
    if not (isinstance(weight, torch.Tensor) and weight.dim() == 2):
        raise ValueError(
            f"lm_head_weight must be [vocab_size // tp, hidden_size], got {_shape(weight)}"
        )
    if not (weight.is_floating_point() and hidden.is_floating_point()):
        raise ValueError(
            "hidden and lm_head_weight must be floating point, got "
            f"{hidden.dtype} and {weight.dtype}"
        )
    if weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"hidden's hidden_size {hidden.shape[2]} != lm_head_weight's {weight.shape[1]}"
        )
    if vocab_end_index - vocab_start_index != weight.shape[0]:
        raise ValueError(
            f"[vocab_start_index, vocab_end_index) = [{vocab_start_index}, {vocab_end_index}) "
            f"does not match lm_head_weight's {weight.shape[0]} rows (this rank's vocabulary "
            "shard)"
        )
    if not (isinstance(target, torch.Tensor) and target.shape == hidden.shape[:2]):
        raise ValueError(
            f"target must be [batch, seq] = {list(hidden.shape[:2])} like hidden, got "
            f"{_shape(target)}"
        )
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(f"target must hold integer token ids, got {target.dtype}")


def _shape(x: Any) -> str:
    return str(list(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def _vocab_parallel(group: Any, start: int, end: int) -> VocabParallel:
    """A :class:`VocabParallel` over the group (a collective: every rank builds one at once,
    which :func:`logprob_apply` agrees on), kept per (group, shard). The hidden gradient is
    left unsummed: SkyRL's output processor reduces it (the sequence-parallel gather's
    reduce-scatter, or ``copy_to_tensor_model_parallel_region``'s all-reduce)."""
    try:
        return VocabParallel(group, start, end, reduce_hidden_grad=False)
    except ValueError as e:  # raised on every rank: the ranges were exchanged first
        raise ValueError(
            "[vocab_start_index, vocab_end_index): the output layer's vocabulary shards of "
            f"the tensor-parallel group (tp_group) must tile the vocabulary ({e})"
        ) from e


install()
