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

import functools
import importlib.util
import os
from types import ModuleType

import torch
from torch.autograd.function import once_differentiable

from .._validate import HeadArgs
from ..distributed import VocabParallel
from .options import Backend, HeadOptions, Schedule
from .rows import Rows, kernel_labels, select_rows

__all__ = [
    "Backend",
    "HeadOptions",
    "LinearLogprobsFunction",
    "Rows",
    "Schedule",
    "backend_module",
    "head_options",
    "kernel_labels",
    "resolve_backend",
    "select_rows",
]

_BACKENDS = ("auto", "triton", "torch")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: object, device: torch.device, head_dtype: torch.dtype) -> str:
    """The backend that runs a call: ``"torch"`` or ``"triton"``.

    ``"auto"`` picks Triton on CUDA when it is installed and the head runs in 16 bits (where it
    was measured faster, see the README's GPU section), the torch tiles otherwise; it never
    picks Triton on CPU. ``"triton"`` on a CPU tensor needs Triton's interpreter
    (``TRITON_INTERPRET=1`` set before the first call); anything else raises ``ValueError``.
    """
    if not isinstance(backend, str) or backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        fast = device.type == "cuda" and head_dtype in (torch.bfloat16, torch.float16)
        return "triton" if fast and _triton_installed() else "torch"
    if not _triton_installed():
        raise ValueError(
            "backend='triton' needs the triton package (pip install triton; CUDA builds of "
            "torch ship it), or use backend='torch'"
        )
    if device.type == "cuda" and not _interpreting():
        return "triton"
    if device.type == "cpu":
        if _interpreting():
            return "triton"
        raise ValueError(
            "backend='triton' on CPU tensors runs the kernels in Triton's interpreter, which "
            "is off: set the environment variable TRITON_INTERPRET=1 before the first call "
            "(slow; meant for tests), move the tensors to a CUDA device, or use "
            "backend='torch'"
        )
    raise ValueError(
        f"backend='triton' runs on CUDA tensors (or CPU ones under TRITON_INTERPRET=1), got "
        f"tensors on {device}; use backend='torch'"
    )


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
    backend: object = "auto",
    vocab_parallel: VocabParallel | None = None,
    fused: bool = False,
) -> HeadOptions:
    """Kernel options of a validated call.

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
        backend=resolve_backend(backend, args.weight.device, args.head_dtype),
        chunk_size=chunk_size,
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
    @once_differentiable
    def backward(ctx, grad_logp, grad_ent=None):
        # First-order only: the kernels work outside autograd, so a second differentiation
        # (create_graph=True) must refuse instead of returning a wrong number.
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
