"""The head op as a ``torch.library`` custom op, for code compiled with ``torch.compile``.

Eager calls run :func:`logitless.linear_logprobs` directly. Under ``torch.compile`` its
checks read label values on the host and its row selection has a data-dependent size, which
Dynamo cannot trace (a graph break). So when compiling, :func:`linear_logprobs` routes through
``logitless::linear_logprobs``: an opaque op whose outputs have static shapes (the labels'
shape), with a fake implementation for tracing and a registered backward (itself a custom op,
``logitless::linear_logprobs_backward``) that recomputes the tiles from the ``[N]``-sized
statistics the forward returns. Inside, both run exactly the eager code: same checks (raised at
run time), same kernels, same numbers.

Not routed (they run eagerly, with a graph break): ``vocab_parallel`` (a process group is not
an op argument).
"""

from __future__ import annotations

import torch

from .._validate import check_head_args
from ..types import LogProbs
from . import backend_module, head_options, select_rows
from .options import compute_dtype
from .rows import Rows

_NAMESPACE = "logitless"


def _head_args(
    hidden, weight, labels, bias, temperature, temperature_tensor, softcap, ignore_index,
    head_dtype, backend,
):  # fmt: skip
    return check_head_args(
        hidden,
        weight,
        labels,
        bias=bias,
        temperature=temperature if temperature_tensor is None else temperature_tensor,
        softcap=softcap,
        ignore_index=ignore_index,
        head_dtype=head_dtype,
        backend=backend,
    )


@torch.library.custom_op(f"{_NAMESPACE}::linear_logprobs", mutates_args=())
def _forward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    temperature_tensor: torch.Tensor | None,
    softcap: float | None,
    with_entropy: bool,
    ignore_index: int,
    chunk_size: int | None,
    head_dtype: torch.dtype | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs, entropy, lse, entropy for backward), each of ``labels.shape``; entropy is
    zeros when not asked for. lse / entropy are 0 at ignored rows (only valid rows use them)."""
    args = _head_args(
        hidden, weight, labels, bias, temperature, temperature_tensor, softcap, ignore_index,
        head_dtype, backend,
    )  # fmt: skip
    rows = select_rows(args, ignore_index)
    opts = head_options(args, rows, with_entropy, chunk_size=chunk_size)
    with torch.no_grad():
        logp, lse, ent, _ = backend_module(opts).forward_rows(
            rows.hidden, weight, bias, rows.labels, rows.temperature, opts
        )
    ent = torch.zeros_like(logp) if ent is None else ent
    return rows.scatter(logp), rows.scatter(ent), rows.scatter(lse), rows.scatter(ent.clone())


@_forward_op.register_fake
def _forward_fake(
    hidden, weight, labels, bias, temperature, temperature_tensor, softcap, with_entropy,
    ignore_index, chunk_size, head_dtype, backend,
):  # fmt: skip
    dtype = compute_dtype(head_dtype if head_dtype is not None else hidden.dtype)
    return tuple(hidden.new_empty(labels.shape, dtype=dtype) for _ in range(4))


@torch.library.custom_op(f"{_NAMESPACE}::linear_logprobs_backward", mutates_args=())
def _backward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    temperature_tensor: torch.Tensor | None,
    softcap: float | None,
    with_entropy: bool,
    ignore_index: int,
    chunk_size: int | None,
    head_dtype: torch.dtype | None,
    backend: str,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d hidden, d weight, d bias) of the head; an empty tensor for a gradient not needed."""
    args = _head_args(
        hidden, weight, labels, bias, temperature, temperature_tensor, softcap, ignore_index,
        head_dtype, backend,
    )  # fmt: skip
    rows: Rows = select_rows(args, ignore_index)
    opts = head_options(args, rows, with_entropy, chunk_size=chunk_size)
    need_h, need_w, need_b = needs
    gh, gw, gb = backend_module(opts).backward_rows(
        rows.hidden.detach(),
        weight.detach(),
        None if bias is None else bias.detach(),
        rows.labels,
        rows.temperature,
        rows.gather(lse),
        rows.gather(entropy) if with_entropy else None,
        rows.gather(grad_logprobs),
        None if grad_entropy is None or not with_entropy else rows.gather(grad_entropy),
        opts,
        (need_h, need_w, need_b and bias is not None),
    )
    dh = torch.zeros_like(hidden)
    if gh is not None:
        flat = dh.view(-1, hidden.shape[-1])
        if rows.index is None:
            flat.copy_(gh)
        else:
            flat.index_copy_(0, rows.index, gh)
    empty = hidden.new_empty(0)
    return (
        dh if need_h else empty,
        gw if gw is not None else (torch.zeros_like(weight) if need_w else empty),
        gb if gb is not None else empty,
    )


@_backward_op.register_fake
def _backward_fake(
    hidden, weight, labels, bias, temperature, temperature_tensor, softcap, with_entropy,
    ignore_index, chunk_size, head_dtype, backend, lse, entropy, grad_logprobs, grad_entropy,
    needs,
):  # fmt: skip
    empty = hidden.new_empty(0)
    return (
        torch.empty_like(hidden) if needs[0] else empty,
        torch.empty_like(weight) if needs[1] else empty,
        torch.empty_like(bias) if needs[2] and bias is not None else empty,
    )


_OPTIONS = (
    "temperature",
    "temperature_tensor",
    "softcap",
    "with_entropy",
    "ignore_index",
    "chunk_size",
    "head_dtype",
    "backend",
)


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, labels, bias, *options = inputs
    _, _, lse, ent = output
    ctx.options = dict(zip(_OPTIONS, options, strict=True))
    ctx.has_bias = bias is not None
    ctx.save_for_backward(hidden, weight, labels, bias, options[1], lse, ent)


def _backward(ctx, grad_logp, grad_ent, _grad_lse, _grad_ent2):
    from . import refuse_double_backward

    refuse_double_backward("linear_logprobs")
    hidden, weight, labels, bias, temperature_tensor, lse, ent = ctx.saved_tensors
    opts = dict(ctx.options, temperature_tensor=temperature_tensor)
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3]]
    if grad_logp is None:
        grad_logp = torch.zeros_like(lse)
    dh, dw, db = _backward_op(
        hidden, weight, labels, bias, *(opts[k] for k in _OPTIONS), lse, ent, grad_logp,
        grad_ent, needs,
    )  # fmt: skip
    return (
        dh if needs[0] else None,
        dw if needs[1] else None,
        None,
        db if needs[2] and ctx.has_bias else None,
        *([None] * len(_OPTIONS)),
    )


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def linear_logprobs_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None,
    temperature: float | torch.Tensor,
    softcap: float | None,
    with_entropy: bool,
    ignore_index: int,
    chunk_size: int | None,
    head_dtype: torch.dtype | None,
    backend: str,
) -> LogProbs:
    """:func:`logitless.linear_logprobs` through the custom op (what compiled code calls)."""
    is_tensor = isinstance(temperature, torch.Tensor)
    logp, ent, _, _ = _forward_op(
        hidden,
        weight,
        labels,
        bias,
        1.0 if is_tensor else float(temperature),
        temperature if is_tensor else None,
        None if softcap is None else float(softcap),
        with_entropy,
        ignore_index,
        chunk_size,
        head_dtype,
        backend,
    )
    return LogProbs(logp, ent if with_entropy else None)


__all__ = ["linear_logprobs_op"]
