"""Training wrappers around a transformers causal LM: run logitless inside the wrapper's forward.

The HF functions call the model's backbone and read its head weight; they never call
``model.forward``. Under a wrapper whose work hangs on that forward, calling the inner model
directly would skip it:

- ``DistributedDataParallel`` arms its gradient reducer in ``forward`` (``prepare_for_backward``):
  a backward after a call that bypassed it would leave the gradients un-averaged, or fail.
- FSDP2 (``fully_shard``) gathers the root module's parameters (embeddings, final norm, the
  head) in the root's pre-forward hook and reduce-scatters their gradients after backward;
  outside it they are sharded ``DTensor`` s.

:func:`run_in_forward` runs a function *as* the model's forward: it swaps the instance's
``forward`` for the duration of one call of the outermost module, so every hook runs as it
would for ``model(...)``, and the function gets the transformers model itself (PEFT's base
model) with its parameters ready to use. The function's arguments travel in a closure, not
through the wrapper's call: a wrapper that casts or moves its forward inputs (FSDP2's
``MixedPrecisionPolicy.cast_forward_inputs``) never touches them.
- A DeepSpeed engine (ZeRO stages 0-3) is unwrapped like DDP: the function runs as
  ``engine.module``'s forward inside the engine's, and under ZeRO-3 the head gathers its own
  weight (:mod:`~logitless.integrations.deepspeed`). No class is patched; the
instance's own ``forward`` (e.g. the autocast wrapper accelerate installs) is restored before
the function runs and after the call, also when it raises.

Accepted: the model itself; ``DistributedDataParallel`` of it; a model whose root is an FSDP2
``FSDPModule``; a PEFT ``PeftModel`` with a LoRA-type adapter (prompt learning is refused: it
changes the inputs of the backbone), alone or under DDP / FSDP2. Refused with ``ValueError``:
FSDP1 (``FullyShardedDataParallel``: flat parameters), a DeepSpeed engine with parameter or
optimizer offload or ZeRO++ partitions (untested), a ``torch.compile`` wrapper of the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import deepspeed
from .seam import FSDPModule, run_as_forward

__all__ = ["Unwrapped", "run_in_forward", "unwrap"]

T = TypeVar("T")


class Unwrapped(NamedTuple):
    """How to reach a wrapped causal LM.

    outer: the module to call so every wrapper hook runs (the model as given).
    borrowed: the module whose ``forward`` the call borrows (the one ``outer`` calls), or None
        when nothing wraps the model (the function is called directly).
    model: the transformers causal LM the HF functions read (PEFT's base model).
    """

    outer: nn.Module
    borrowed: nn.Module | None
    model: nn.Module


def _is_peft(module: nn.Module) -> bool:
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


def _peft_base(module: nn.Module) -> nn.Module:
    """PEFT's base model (the adapters live inside its layers); prompt learning refused."""
    configs = getattr(module, "peft_config", {}) or {}
    active = getattr(module, "active_adapter", None)
    config = configs.get(active) if isinstance(configs, dict) else None
    if config is not None and getattr(config, "is_prompt_learning", False):
        raise ValueError(
            f"PEFT adapter {active!r} is a prompt-learning adapter "
            f"({type(config).__name__}): it changes the backbone's inputs, which logitless "
            "builds itself; use a LoRA-type adapter (LoRA, DoRA, IA3, ...)"
        )
    return module.get_base_model()


def _refuse_unsupported_wrapper(model: nn.Module) -> None:
    cls = type(model)
    if deepspeed.is_engine(model):
        problem = deepspeed.engine_problem(model)
        if problem is not None:
            raise ValueError(f"this DeepSpeed engine cannot run logitless: {problem}")
    if cls.__name__ == "FullyShardedDataParallel":
        raise ValueError(
            "FSDP1 (FullyShardedDataParallel) is not supported: its flat parameters hide the "
            "head weight. Use FSDP2 (torch.distributed.fsdp.fully_shard; accelerate: "
            "fsdp_version: 2)."
        )


def unwrap(model: nn.Module) -> Unwrapped:
    """The wrapper layers of ``model`` (see the module doc); ``ValueError`` for unsupported ones."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a transformers causal LM, got {type(model).__name__}")
    _refuse_unsupported_wrapper(model)
    is_ddp = isinstance(model, DistributedDataParallel) or deepspeed.is_engine(model)
    inner = model.module if is_ddp else model
    _refuse_unsupported_wrapper(inner)
    lm = _peft_base(inner) if _is_peft(inner) else inner
    wrapped = inner is not model or isinstance(inner, FSDPModule) or isinstance(lm, FSDPModule)
    return Unwrapped(model, inner if wrapped else None, lm)


def run_in_forward(model: nn.Module, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(lm, *args, **kwargs)`` run as ``model``'s forward; returns what ``fn`` returns.

    ``lm`` is the transformers causal LM inside ``model`` (the model itself, DDP's
    ``.module``, PEFT's base model). With no wrapper this is a plain call. Under DDP the
    reducer is armed for the tensors ``fn`` returns, and under FSDP2 the root's parameters
    (the head included) are unsharded while ``fn`` runs and their gradients reduce-scattered
    after backward: so ``fn`` must compute everything that needs gradients (backbone, head,
    loss) and return it.

    >>> import torch
    >>> net = torch.nn.Linear(2, 3)
    >>> run_in_forward(net, lambda lm, x: lm.weight.shape[0] + x, 1)
    4
    """
    w = unwrap(model)
    if w.borrowed is None:
        return fn(w.model, *args, **kwargs)
    out = _borrow_forward(w, lambda: fn(w.model, *args, **kwargs))
    # the loss downstream of what the engine's output hooks see (see past_output_hooks)
    return deepspeed.past_output_hooks(out) if deepspeed.is_engine(w.outer) else out


def _borrow_forward(w: Unwrapped, thunk: Callable[[], T]) -> T:
    """``w.outer()`` with ``w.borrowed.forward`` replaced by ``thunk`` for this one call."""
    borrowed = w.borrowed
    assert borrowed is not None
    out, _ = run_as_forward(
        borrowed, lambda *_a, **_k: thunk(), w.outer, caller=f"{type(w.outer).__name__}'s forward"
    )
    return out
