"""prime-rl's LM head: logitless behind ``model.lm_head(hidden_states, labels, temperature)``.

prime-rl (v0.8) replaces a model's ``lm_head`` with its own module
(``prime_rl/trainer/models/layers/lm_head.py``, ``inject_prime_lm_head``):
``FusedOutputLinear`` (``model.fused_lm_head_token_chunk_size``, an int: chunked over tokens
and over the vocabulary in blocks of 8192) or ``VanillaOutputLinear`` (``"disabled"``: the
logits), ``GemmaFusedOutputLinear`` / ``GemmaVanillaOutputLinear`` with the model's
``final_logit_softcapping``. It also gives the model an instance-level ``forward`` that runs
the backbone (``model.model``) and then ``model.lm_head(hidden_states, labels,
temperature=temperature)``; the trainer reads ``logprobs`` and ``entropy`` of the returned
``PrimeLmOutput``. Its fused backward refuses an entropy gradient.

The switch is prime-rl's custom loss, in the trainer's config::

    [trainer.loss]            # `rl @ rl.toml`; in a trainer-only config: [loss]
    type = "custom"
    import_path = "logitless.integrations.prime_rl.default_loss"   # or ipo_loss
    kwargs = { dppo_mask_low = 0.2, dppo_mask_high = 0.2 }          # prime-rl's loss options

prime-rl resolves ``import_path`` in every trainer process (``setup_rl_loss_fn``) right
after it built the model (``setup_model``: prime-rl's head injected, FSDP2 applied) and before
the first forward. Resolving ``default_loss`` / ``ipo_loss`` here (a module ``__getattr__``)
:func:`adopt`\\ s every model of the process whose ``lm_head`` is one of prime-rl's heads
(found by a one-time walk over the garbage collector's objects: prime-rl hands the loss
nothing else), then returns prime-rl's own loss function with its own config class
(``default_loss_fn`` with ``DefaultLossConfig(**kwargs)``; ``ipo_loss_fn`` with
``IPOLossConfig``).

:func:`adopt` changes the ``lm_head``'s instance-level ``forward`` (prime-rl sets the model's
the same way) to logitless's head (the module, its weight, its FSDP2 unit and hooks stay
prime-rl's: a tied weight stays tied), and registers a forward pre-hook on the model, first in
line, that checks the labels and the per-token temperatures before the backbone runs
(:func:`prepare`; a bad value costs no forward, and every rank of ``group`` raises together)
and hands the checked call to the head. Registered after FSDP2's ``fully_shard`` (as the
switch does), it reads the temperatures before FSDP2's mixed precision casts them to bf16. The
head returns prime-rl's ``PrimeLmOutput`` keys (``logprobs``, ``entropy``: fp32 ``[B, S]``),
both differentiable: the entropy's gradient is computed (prime-rl's loop uses the entropy only
as a metric). ``model.fused_lm_head_token_chunk_size`` is not used: logitless tiles from its
own memory budget, and its results do not depend on the tile. docs/prime-rl.md has the
contract.

Bad input raises ``ValueError`` in prime-rl's terms: a temperature that is not finite and > 0
(prime-rl's sampling config allows 0, its head then returns NaN), a label outside
``[0, vocab_size)`` (prime-rl's head scores it as logit 0), missing labels or temperatures,
shapes that differ.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..contract.checks import fmt_shape, is_dtensor
from ..contract.collectives import agree, check_then_agree
from ..contract.options import HeadOptions
from . import seam

# and ``default_loss`` / ``ipo_loss``, read through the module's ``__getattr__``
__all__ = ["WORLD", "adopt", "adopted", "prepare"]

_WHERE = "logitless as prime-rl's LM head (logitless.integrations.prime_rl)"
_LM_HEAD = "prime_rl.trainer.models.layers.lm_head"
_GEMMA_HEAD = "prime_rl.trainer.models.layers.lm_head_gemma"
_HEAD_CLASSES = {
    _LM_HEAD: ("FusedOutputLinear", "VanillaOutputLinear"),
    _GEMMA_HEAD: ("GemmaFusedOutputLinear", "GemmaVanillaOutputLinear"),
}
# prime-rl scores every position (its labels are the next input ids): no label value means
# "ignored", so the ignore index is one that no token id reaches.
_NO_IGNORE = -(2**63)
WORLD = "world"  # the default group of adopt(): torch.distributed's default group, if any

_ADOPTED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


# --- the state an adopted head carries -------------------------------------------------------


@dataclasses.dataclass
class _HeadState:
    """What :func:`adopt` stores on prime-rl's ``lm_head`` (attribute ``_logitless``): the
    softcap of a Gemma head, the group whose ranks raise together, and the call the model's
    forward prepared for the head (taken by the head's forward)."""

    softcap: float | None
    group: Any
    pending: tuple[tuple, seam.Prepared] | None = None

    def take(self, labels: Any, temperature: Any) -> seam.Prepared | None:
        """The call the model's forward prepared for these labels (a view of the same memory,
        shape and strides; the temperatures of that shape, perhaps cast by FSDP2 since: the
        prepared call holds them as they were given, in fp32), or None."""
        pending, self.pending = self.pending, None
        if pending is None or pending[0] != _identity(labels):
            return None
        prepared = pending[1]
        same = isinstance(temperature, torch.Tensor) and temperature.shape == prepared.labels.shape
        return prepared if same else None


def _identity(labels: Any) -> tuple:
    if not isinstance(labels, torch.Tensor):
        return (id(labels),)
    return (labels.data_ptr(), tuple(labels.shape), labels.stride())


# --- phase 1: the checks before the backbone --------------------------------------------------


def _weight_for_checks(weight: torch.Tensor) -> torch.Tensor:
    """The weight, or a stand-in of an FSDP2-sharded one's whole parameter (its global shape,
    dtype, device, requires_grad: the values exist only inside the head's forward)."""
    if not is_dtensor(weight):
        return weight
    zero = torch.zeros((), dtype=weight.dtype, device=weight.device)
    return zero.requires_grad_(weight.requires_grad).expand(weight.shape)


def _check_inputs(labels: Any, temperature: Any) -> None:
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        raise ValueError(
            f"{_WHERE}: labels (the next input ids, [batch, seq]) are required, got "
            f"{fmt_shape(labels) if isinstance(labels, torch.Tensor) else type(labels).__name__}"
        )
    if not isinstance(temperature, torch.Tensor) or temperature.shape != labels.shape:
        got = fmt_shape(temperature) if isinstance(temperature, torch.Tensor) else "None"
        raise ValueError(
            f"{_WHERE}: temperature (prime-rl's per-token sampling temperatures, "
            f"[batch, seq] like labels {fmt_shape(labels)}) is required, got {got}"
        )


def prepare(lm_head: nn.Module, labels: Any, temperature: Any, group: Any = None) -> seam.Prepared:
    """The head call of prime-rl's ``lm_head(hidden_states, labels, temperature)``, checked
    before any hidden state exists: ``labels`` ``[B, S]`` in ``[0, vocab_size)``,
    ``temperature`` ``[B, S]``, finite and > 0 (prime-rl's ``orchestrator.sampling.temperature``
    may be 0: the temperature of greedy sampling, for which no log-prob exists), the entropy
    asked for. One host read; raises ``ValueError`` on every rank of ``group`` together (None:
    this rank alone)."""
    state: _HeadState = lm_head._logitless

    def check() -> seam.Prepared:
        _check_inputs(labels, temperature)
        options = HeadOptions(temperature=temperature, with_entropy=True, ignore_index=_NO_IGNORE)
        head = seam.Head(_weight_for_checks(lm_head.weight), softcap=state.softcap)
        try:
            return seam.prepare(labels, head, options)
        except ValueError as e:
            raise ValueError(f"{_WHERE}: lm_head(hidden_states, labels, temperature): {e}") from e

    def together(_: Any, error: ValueError | None) -> None:
        if group is not None:
            agree(group, error, _WHERE, [], "the trainer's process group")

    prepared, _ = check_then_agree(check, together)
    return prepared


# --- phase 2: the head, as lm_head's forward -----------------------------------------------


def _head_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    labels: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
) -> dict[str, torch.Tensor | None]:
    """prime-rl's ``lm_head(hidden_states, labels, temperature)`` through logitless:
    ``PrimeLmOutput`` log-probs and entropy ``[B, S]``, fp32, both differentiable. Runs as the
    module's own forward, so its FSDP2 hooks (gather, reduce-scatter) run around it."""
    state: _HeadState = self._logitless
    prepared = state.take(labels, temperature)
    if prepared is None:  # called without the model's forward (or with logits_to_keep)
        prepared = prepare(self, labels, temperature, state.group)
    head = seam.Head(self.weight, softcap=state.softcap)
    out = seam.logprobs(prepared, seam.Tokens(hidden_states, labels), head)
    # no view among the outputs: FSDP2's pre-backward hook on a view would be lost ([B, S])
    return {
        k: t.clone() if t._base is not None else t for k, t in zip(out._fields, out, strict=True)
    }


def _check_before_backbone(state: _HeadState, inner: Callable[..., Any]):
    """A forward pre-hook of the model (with kwargs): the head's call prepared from the labels
    and temperatures ``inner`` (prime-rl's model forward) is about to get, before it runs the
    backbone. Registered first (``prepend``), it reads them before FSDP2's own pre-forward hook
    casts the temperatures to the mixed-precision dtype."""
    signature = inspect.signature(inner)

    def hook(model: nn.Module, args: tuple, kwargs: dict) -> None:
        bound = signature.bind_partial(*args, **kwargs).arguments
        labels, temperature = bound.get("labels"), bound.get("temperature")
        prepared = prepare(model.lm_head, labels, temperature, state.group)
        state.pending = (_identity(labels), prepared)

    return hook


# --- the switch ------------------------------------------------------------------------------


def _prime_head_classes() -> tuple[type, ...]:
    """prime-rl's head classes, from the modules prime-rl has imported (none: none)."""
    found = []
    for module_name, names in _HEAD_CLASSES.items():
        module = sys.modules.get(module_name)
        found += [getattr(module, n) for n in names if hasattr(module, n)]
    return tuple(found)


def _default_group() -> Any:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def adopt(model: nn.Module, group: Any = WORLD) -> nn.Module:
    """Make logitless the head of ``model``, a model prime-rl's ``inject_prime_lm_head`` has
    given its head and forward (before or after FSDP2's ``fully_shard``): ``model.lm_head``
    runs logitless and ``model``'s forward checks the labels and temperatures before the
    backbone. ``group``: the ranks that raise together on bad input (default: the default
    process group when torch.distributed is initialized; None: this rank alone). Idempotent;
    returns ``model``.

    Raises ``ValueError`` when ``model.lm_head`` is not one of prime-rl's heads or ``model``
    has no forward of prime-rl's (an instance-level ``forward``)."""
    if model in _ADOPTED:
        return model
    lm_head = getattr(model, "lm_head", None)
    classes = _prime_head_classes()
    if not classes or not isinstance(lm_head, classes):
        raise ValueError(
            f"{_WHERE}: model.lm_head must be one of prime-rl's heads (FusedOutputLinear, "
            "VanillaOutputLinear, their Gemma forms: prime_rl.trainer.models.layers.lm_head"
            f".inject_prime_lm_head), got {type(lm_head).__name__}"
        )
    inner = vars(model).get("forward")
    if inner is None:
        raise ValueError(
            f"{_WHERE}: {type(model).__name__} has no forward of prime-rl's (the one "
            "inject_prime_lm_head sets on the model, which passes labels and temperature to "
            "lm_head); inject prime-rl's head first"
        )
    state = _HeadState(
        getattr(lm_head, "softcap", None), _default_group() if group == WORLD else group
    )
    lm_head._logitless = state
    lm_head.forward = types.MethodType(_head_forward, lm_head)
    model.register_forward_pre_hook(
        _check_before_backbone(state, inner), prepend=True, with_kwargs=True
    )
    _ADOPTED.add(model)
    return model


def adopted(model: nn.Module) -> bool:
    """Whether :func:`adopt` made logitless ``model``'s head."""
    return model in _ADOPTED


def _adopt_built_models() -> int:
    """Adopt every model of this process whose ``lm_head`` is one of prime-rl's heads (the
    models prime-rl's ``setup_model`` built before it resolved the loss); how many are
    adopted now. Raises ``ValueError`` when there is none."""
    classes = _prime_head_classes()
    models = [
        obj
        for obj in (gc.get_objects() if classes else ())
        # type(), not isinstance(): the latter reads __class__, which some objects warn on
        if issubclass(type(obj), nn.Module) and isinstance(obj._modules.get("lm_head"), classes)
    ]
    for model in models:
        adopt(model)
    if not any(True for _ in _ADOPTED):
        raise ValueError(
            f"{_WHERE}: trainer.loss.import_path names a logitless loss, but this process has "
            "no model with prime-rl's lm_head (prime-rl resolves the loss after setup_model "
            "built it). In a loop of your own, call logitless.integrations.prime_rl.adopt(model)"
        )
    return len(models)


# --- the losses prime-rl imports by path ---------------------------------------------------


def _prime_loss(fn_name: str, config_name: str) -> Callable[..., Any]:
    """prime-rl's loss function ``fn_name`` with its config class ``config_name`` built from
    the custom loss's ``kwargs`` (prime-rl's checks of them)."""
    from prime_rl.configs import trainer as configs
    from prime_rl.trainer.rl import loss

    fn, config_cls = getattr(loss, fn_name), getattr(configs, config_name)
    built: dict[tuple, Any] = {}  # prime-rl calls the loss per sample with the same kwargs

    def rl_loss(inputs: Any, **kwargs: Any) -> Any:
        key = tuple(sorted(kwargs.items()))
        if key not in built:
            built[key] = config_cls(**kwargs)
        return fn(inputs, built[key])

    rl_loss.__name__ = rl_loss.__qualname__ = fn_name
    rl_loss.__doc__ = f"prime-rl's ``{fn_name}`` with ``{config_name}(**kwargs)``."
    return rl_loss


_LOSSES = {
    "default_loss": ("default_loss_fn", "DefaultLossConfig"),
    "ipo_loss": ("ipo_loss_fn", "IPOLossConfig"),
}


def __getattr__(name: str) -> Any:
    """``default_loss`` / ``ipo_loss``, as prime-rl's ``import_object`` reads them (``getattr``
    on this module): the models built so far are adopted first (module docstring)."""
    if name not in _LOSSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _adopt_built_models()
    return _prime_loss(*_LOSSES[name])


def __dir__() -> list[str]:
    return sorted([*globals(), *_LOSSES])
