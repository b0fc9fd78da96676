"""DeepSpeed: the engine as a wrapper, and the ZeRO-3 head weight gathered for the head.

Package-internal; the HF functions and the TRL trainers reach it through
:mod:`~logitless.integrations.wrappers` (the engine is unwrapped like DDP: logitless runs as
``engine.module``'s forward, inside the engine's) and :func:`~logitless.integrations.hf_model.
with_head` (where the head runs). It never imports DeepSpeed unless a ZeRO-3 parameter is
there to gather.

**ZeRO-2** (and 0 / 1) leaves every parameter whole on every rank: the head reads the weight
as it is, and the engine's gradient hooks reduce whatever lands in ``.grad``.

**ZeRO-3** keeps each rank's partition of a parameter in ``ds_tensor`` and an empty ``.data``
outside the forward of the module that owns it. The head never calls ``lm_head``, so
:func:`run_gathered` gathers its weight (``deepspeed.zero.GatheredParameters``) for exactly as
long as the head needs it:

- the fused loss computes the weight gradient in its forward and saves no weight for backward:
  the weight is released as soon as the head returns;
- the log-prob and divergence ops read the weight again in backward (they save it): the gather
  is held until the gradient reaches the head's inputs (the hidden states, or the weight's own
  accumulated gradient when the hidden states need none), then released.

Either way the weight's gradient lands in ``.grad`` through autograd, where ZeRO-3's
post-accumulate-grad hook reduce-scatters it into the rank's partition: no full-size copy of
the weight or of its gradient outlives the step. A weight the caller gathered with its own
``GatheredParameters`` is used as it is. A persistent parameter (no more elements than
``stage3_param_persistence_threshold``, 1e5 by default) is partitioned like any other until
DeepSpeed first gathers it, in its module's forward (which the head never runs) or after an
optimizer step, and then stays whole on every rank: gathered as above while it is a
partition (the first step), used as it is once whole.

Refused by name (:func:`config_problem`): parameter or optimizer offload (ZeRO-Infinity,
``offload_param`` / ``offload_optimizer``) and ZeRO++'s quantized or hierarchical partitions:
none is tested here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import nn

from ..contract.checks import check_gathered, is_zero3_partitioned

__all__ = [
    "config_problem",
    "engine_problem",
    "gathered_copy",
    "is_engine",
    "is_zero3",
    "needs_gather",
    "own_params",
    "past_output_hooks",
    "run_gathered",
    "stand_in",
]

T = TypeVar("T")


def is_engine(module: object) -> bool:
    """A DeepSpeed engine (``DeepSpeedEngine`` or a subclass; checked by name: no import)."""
    return any(c.__name__ == "DeepSpeedEngine" for c in type(module).__mro__)


def is_zero3(t: object) -> bool:
    """A parameter that ZeRO-3 partitions (it carries DeepSpeed's ``ds_id``)."""
    return isinstance(t, torch.Tensor) and hasattr(t, "ds_id") and hasattr(t, "ds_status")


def _gathered_by_caller(t: torch.Tensor) -> bool:
    from deepspeed.runtime.zero.partition_parameters import DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR

    return getattr(t, DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR, 0) > 0


def own_params(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own parameters by name, read without ``module.<name>``: inside a ZeRO-3
    engine's forward that attribute read of a partitioned parameter makes DeepSpeed register it
    as an external parameter of the running module (gathered for that module's whole forward
    and backward from then on) and gather it."""
    return dict(module._parameters.items())


def needs_gather(t: object) -> bool:
    """A ZeRO-3 parameter that the head must gather: not inside a ``GatheredParameters`` of
    the caller's, and either partitioned or not persistent.

    A persistent parameter (``stage3_param_persistence_threshold``) is partitioned too until
    its first gather: DeepSpeed gathers it in its own module's forward (never run for the
    head) and after each optimizer step, and keeps it whole from then on. Any other parameter
    that is whole here was gathered by a module's hooks, which may release it before the head's
    backward is done."""
    if not is_zero3(t) or _gathered_by_caller(t):
        return False
    return not getattr(t, "ds_persist", False) or is_zero3_partitioned(t)


def stand_in(t: torch.Tensor | None) -> torch.Tensor | None:
    """A ZeRO-3 parameter's dtype, device, full shape (``ds_shape``) and requires_grad, without
    its values (an expanded 0-dim tensor): what the checks before the backbone need."""
    if t is None or not is_zero3(t):
        return t
    zero = torch.zeros((), dtype=t.dtype, device=t.device, requires_grad=t.requires_grad)
    return zero.expand(t.ds_shape)


def gathered_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    """A detached whole copy of a ZeRO-3 parameter (a frozen teacher's head); others detached.
    A partition that :func:`needs_gather` leaves alone (none, as it stands) is refused with the
    ``ValueError`` naming the fix, not detached into a ``[0]`` that no longer says what it is."""
    if t is None:
        return None
    if not needs_gather(t):
        check_gathered("weight", t)
        return t.detach()
    import deepspeed

    with deepspeed.zero.GatheredParameters([t], modifier_rank=None):
        return t.detach().clone()


# --- the head under ZeRO-3 ---------------------------------------------------------------


class _Hold:
    """One ``GatheredParameters`` over a head's parameters, shared by the head calls whose
    backward still needs it (:func:`run_gathered`) and closed when the last one is done."""

    open_holds: dict[tuple[int, ...], _Hold] = {}  # by the parameters' ds_id

    def __init__(self, key: tuple[int, ...], params: list[torch.Tensor]) -> None:
        import deepspeed

        self.key, self.users = key, 0
        self.gather = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        self.gather.__enter__()
        _Hold.open_holds[key] = self

    @classmethod
    def of(cls, params: list[torch.Tensor]) -> _Hold:
        key = tuple(sorted(p.ds_id for p in params))
        hold = cls.open_holds.get(key) or cls(key, params)
        hold.users += 1
        return hold

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            del _Hold.open_holds[self.key]
            self.gather.__exit__(None, None, None)


class _Lease:
    """One head call's claim on a :class:`_Hold`, given back once (by the first trigger)."""

    def __init__(self, hold: _Hold) -> None:
        self.hold: _Hold | None = hold
        self.handles: list[Any] = []

    def close(self, *_: Any) -> None:
        hold, self.hold = self.hold, None
        if hold is not None:
            for h in self.handles:
                h.remove()
            hold.release()


class _CloseOnGrad(torch.autograd.Function):
    """Identity on a head input; its backward (autograd reaches a node's inputs after the
    node: the head's backward is done by then) gives the lease back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, lease: _Lease) -> torch.Tensor:
        ctx.lease = lease
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.lease.close()
        return grad, None


def _map_grad_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Any, int]:
    """``value`` with ``fn`` applied to each tensor that requires grad (not a parameter; in
    tuples, lists, dicts and frozen dataclasses such as the seam's ``Tokens``); and how many."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad and not isinstance(value, nn.Parameter):
            return fn(value), 1
        return value, 0
    if isinstance(value, (tuple, list)):
        items = [_map_grad_tensors(v, fn) for v in value]
        values, count = [v for v, _ in items], sum(n for _, n in items)
        if hasattr(value, "_fields"):  # a NamedTuple
            return type(value)(*values), count
        return type(value)(values), count
    if isinstance(value, dict):
        mapped = {k: _map_grad_tensors(v, fn) for k, v in value.items()}
        return {k: v for k, (v, _) in mapped.items()}, sum(n for _, n in mapped.values())
    fields = getattr(value, "__dataclass_fields__", None)
    if fields is not None and not isinstance(value, type):
        mapped = {k: _map_grad_tensors(getattr(value, k), fn) for k in fields}
        count = sum(n for _, n in mapped.values())
        if count:
            return dataclasses.replace(value, **{k: v for k, (v, _) in mapped.items()}), count
    return value, 0


def _mark_inputs(value: Any, lease: _Lease) -> tuple[Any, int]:
    """``value`` with each tensor that requires grad passed through :class:`_CloseOnGrad`."""
    return _map_grad_tensors(value, lambda t: _CloseOnGrad.apply(t, lease))


def past_output_hooks(value: T) -> T:
    """What ran as a DeepSpeed engine's forward, each tensor that requires grad replaced by a
    view of it: the caller's loss is then downstream of the engine's forward outputs, as the
    loss a trainer computes from a model's logits is.

    The engine hooks its forward's output tensors; one hook (``_backward_prologue_per_tensor``)
    divides the gradient by the accumulation steps unless ``engine.backward``'s own hook on the
    loss it is given has run first. Given the output tensor itself, the engine's hook on it was
    registered first and runs first: under ZeRO stage 0 (no ZeRO optimizer to scale the loss
    into a new tensor) with ``engine.backward(loss, scale_wrt_gas=False)`` (transformers'
    Trainer under DeepSpeed) the gradients came out divided by the accumulation steps twice.
    """
    return _map_grad_tensors(value, lambda t: t.view_as(t))[0]


def run_gathered(params: Iterable[torch.Tensor | None], fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with the ZeRO-3 parameters among ``params`` whole (see the module doc).

    Gathered before ``fn`` runs. Released when ``fn`` returns if no backward can need them
    (grad mode off, or the parameters frozen and none saved by ``fn``'s autograd graph);
    else when the gradient reaches ``fn``'s tensor inputs (``args``) or a parameter's
    gradient has been accumulated (and reduced by ZeRO-3's hook), whichever comes first.
    torch accumulates a gradient only into a parameter of its full shape, so a trainable
    weight is held to that point even when ``fn`` computed its gradient in forward. Head calls
    whose backward is pending share one gather. A no-op for parameters that need none.
    """
    todo = [p for p in params if p is not None and is_zero3(p)]
    key = tuple(sorted(p.ds_id for p in todo))
    todo = [p for p in todo if needs_gather(p) or key in _Hold.open_holds]
    if not todo:
        return fn(*args)
    lease = _Lease(_Hold.of(todo))
    try:
        storages = {p.data.untyped_storage().data_ptr() for p in todo}
        saved: list[bool] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.numel() and t.untyped_storage().data_ptr() in storages:
                saved.append(True)
            return t

        marked = 0
        if torch.is_grad_enabled():
            args, marked = _mark_inputs(args, lease)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(*args)
    except BaseException:
        lease.close()
        raise
    trainable = [p for p in todo if p.requires_grad] if torch.is_grad_enabled() else []
    if not (saved or trainable) or not (marked or trainable):
        lease.close()  # no backward will read the weight or accumulate into it
        return out
    lease.handles = [p.register_post_accumulate_grad_hook(lease.close) for p in trainable]
    return out


# --- what is refused ----------------------------------------------------------------------


def config_problem(config: dict | None) -> str | None:
    """Why logitless cannot run under this DeepSpeed config (a dict as DeepSpeed takes it), or
    None. Stages 0-3 run; offload and ZeRO++ partitions are refused (untested)."""
    zero = (config or {}).get("zero_optimization") or {}
    for key in ("offload_param", "offload_optimizer"):
        device = (zero.get(key) or {}).get("device", "none")
        if str(device).lower() != "none":
            return (
                f"DeepSpeed {key} (device {device!r}: ZeRO-Offload / ZeRO-Infinity) is not "
                "tested with logitless; remove zero_optimization." + key
            )
    if zero.get("zero_quantized_weights") or zero.get("zero_quantized_gradients"):
        return "ZeRO++ quantized weights or gradients are not tested with logitless"
    if int(zero.get("zero_hpz_partition_size", 1) or 1) > 1:
        return "ZeRO++ hierarchical partitioning (zero_hpz_partition_size > 1) is not tested"
    return None


def engine_problem(engine: nn.Module) -> str | None:
    """:func:`config_problem` of a DeepSpeed engine's own config."""
    config = getattr(getattr(engine, "_config", None), "_param_dict", None)
    return config_problem(config)
