"""Everything below the public op: row selection, options, and the backends behind one dispatch.

Two backends meet one contract (``reference.py`` within float64-derived tolerances):

- ``torch`` (:mod:`.tiles`): bounded fp32 tiles and torch matmuls; the CPU path and the
  fallback on any device.
- ``triton`` (:mod:`.triton_head`): Triton kernels that keep the logits in registers in
  forward and write the logit gradient once, in the compute dtype, into a bounded workspace
  that cuBLAS multiplies out in backward. CUDA; on CPU tensors only under Triton's interpreter
  (``TRITON_INTERPRET=1``), which is how the test suite checks the kernels without a GPU.

A call picks one with ``backend="auto" | "triton" | "torch"`` (:func:`resolve_backend`); the
choice travels in :class:`~.options.HeadOptions` and :func:`backend_module` dispatches on it.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch

from ..parallel.vocab import VocabParallel
from .options import Backend, HeadOptions, Schedule, resolve_backend
from .rows import Rows, kernel_labels, select_rows

if TYPE_CHECKING:
    from .._validate import HeadArgs

__all__ = [
    "Backend",
    "HeadOptions",
    "LinearLogprobsFunction",
    "Rows",
    "Schedule",
    "backend_module",
    "head_options",
    "kernel_labels",
    "refuse_double_backward",
    "resolve_backend",
    "select_rows",
]


def backend_module(opts: HeadOptions) -> ModuleType:
    """The module implementing ``opts.backend``: ``forward_rows``, ``backward_rows`` and
    ``fused_rows`` with the same signatures in each."""
    if opts.backend == "triton":
        from . import triton_head

        return triton_head
    from . import tiles

    return tiles


def head_options(
    args: HeadArgs,
    rows: Rows,
    with_entropy: bool,
    *,
    chunk_size: int | None,
    vocab_parallel: VocabParallel | None = None,
    fused: bool = False,
) -> HeadOptions:
    """Kernel options of a validated call (its backend was resolved by the checks).

    ``fused``: the gradient-in-forward path, whose torch row chunk keeps all V logits. Under
    vocab parallelism the torch schedule is sized by the largest shard, so every rank cuts the
    same row chunks (each one is a collective).
    """
    vocab = args.weight.shape[0]
    if fused and vocab_parallel is not None:
        vocab = vocab_parallel.max_shard
    choose = Schedule.choose_fused if fused else Schedule.choose
    return HeadOptions(
        softcap=args.softcap,
        temperature=None if rows.temperature is not None else float(args.temperature),
        with_entropy=with_entropy,
        head_dtype=args.head_dtype,
        schedule=choose(rows.labels.numel(), vocab, args.weight.device, chunk_size),
        vocab_parallel=vocab_parallel,
        backend=args.backend,
        chunk_size=chunk_size,
    )


def refuse_double_backward(op: str) -> None:
    """The kernels compute first-order gradients outside autograd: a backward that runs with
    ``create_graph=True`` (grad mode on) would return gradients without a graph, i.e. a silently
    zero second derivative. Refuse instead."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{op} is first-order: its backward ran with create_graph=True (a gradient penalty "
            "or a Hessian-vector product through the head), and it computes no second "
            "derivatives. Use logitless.reference for such terms, or differentiate without "
            "create_graph=True."
        )


class LinearLogprobsFunction(torch.autograd.Function):
    """Autograd wrapper: tensors positionally, every other option in one frozen dataclass."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temp, opts: HeadOptions):
        keep = any(ctx.needs_input_grad[:3])
        impl = backend_module(opts)
        logp, lse, ent, kept = impl.forward_rows(hidden, weight, bias, labels, temp, opts, keep)
        ctx.opts = opts
        ctx.kept = kept
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, labels, temp, lse, ent)
        if ent is None:
            return logp
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent=None):
        refuse_double_backward("linear_logprobs")
        hidden, weight, bias, labels, temp, lse, ent = ctx.saved_tensors
        # The kept tile is overwritten by backward: use it once, recompute on a second call
        # (retain_graph=True).
        kept, ctx.kept = ctx.kept, None
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        if grad_logp is None and grad_ent is None:
            return None, None, None, None, None, None
        gh, gw, gb = backend_module(ctx.opts).backward_rows(
            hidden,
            weight,
            bias,
            labels,
            temp,
            lse,
            ent,
            grad_logp,
            grad_ent,
            ctx.opts,
            needs,
            kept,
        )
        return gh, gw, gb, None, None, None
