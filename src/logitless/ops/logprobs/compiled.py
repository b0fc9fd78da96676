"""The head op as a ``torch.library`` custom op, for code compiled with ``torch.compile``.

Eager calls run :func:`logitless.linear_logprobs` directly. Under ``torch.compile`` its
checks read label values on the host and its row selection has a data-dependent size, which
Dynamo cannot trace (a graph break). So when compiling, :func:`linear_logprobs` routes through
``logitless::linear_logprobs``: an opaque op whose outputs have static shapes (the labels'
shape), with a fake implementation for tracing and a registered backward (itself a custom op,
``logitless::linear_logprobs_backward``) that recomputes the tiles from the ``[N]``-sized
statistics the forward returns. Inside, both run exactly the eager code: same checks (raised at
run time), same kernels, same numbers.

A custom op's schema takes flat arguments, so :class:`HeadOptions` crosses it as its fields
(:data:`_FIELDS`) and is rebuilt inside. Not routed (they run eagerly, with a graph break):
``vocab_parallel`` (a process group is not an op argument) and sampling replay.
"""

from __future__ import annotations

import torch

from ...backends import backend_for
from ...backends.base import RowStats, Upstream
from ...contract.head import HeadCall, check_head_call
from ...contract.options import HeadOptions
from ...transform import compute_dtype
from ...types import LogProbs
from ..rows import kernel_batch, kernel_options, refuse_double_backward, select_rows

_NAMESPACE = "logitless"
# HeadOptions fields as the ops' flat arguments, with their schema types (temperature: a float
# and an optional tensor). Both ops' schemas are built from this one table.
_FIELD_TYPES = {
    "temperature": "float",
    "temperature_tensor": "Tensor?",
    "softcap": "float?",
    "logit_scale": "float?",
    "with_entropy": "bool",
    "ignore_index": "int",
    "chunk_size": "int?",
    "head_dtype": "ScalarType?",
    "backend": "str",
    "capturable": "bool",
    "row_capacity": "int?",
    "batch_invariant": "bool",
}
_FIELDS = tuple(_FIELD_TYPES)
_HEAD_ARGS = "Tensor hidden, Tensor weight, Tensor labels, Tensor? bias, " + ", ".join(
    f"{t} {name}" for name, t in _FIELD_TYPES.items()
)


def _flat(options: HeadOptions) -> tuple:
    """``options`` as the ops' arguments, in :data:`_FIELDS` order."""
    t = options.temperature
    is_tensor = isinstance(t, torch.Tensor)
    return (
        1.0 if is_tensor else float(t),
        t if is_tensor else None,
        options.softcap,
        options.logit_scale,
        options.with_entropy,
        options.ignore_index,
        options.chunk_size,
        options.head_dtype,
        options.backend,
        options.capturable,
        options.row_capacity,
        options.batch_invariant,
    )


def _call(hidden, weight, labels, bias, flat: tuple) -> HeadCall:
    fields = dict(zip(_FIELDS, flat, strict=True))
    tensor = fields.pop("temperature_tensor")
    if tensor is not None:
        fields["temperature"] = tensor
    return check_head_call(hidden, weight, labels, bias, HeadOptions(**fields))


@torch.library.custom_op(
    f"{_NAMESPACE}::linear_logprobs",
    mutates_args=(),
    schema=f"({_HEAD_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)",
)
def _forward_op(hidden, weight, labels, bias, *flat):
    """(logprobs, entropy, lse, entropy for backward), each of ``labels.shape``; entropy is
    zeros when not asked for. lse / entropy are 0 at ignored rows (only valid rows use them)."""
    call = _call(hidden, weight, labels, bias, flat)
    rows = select_rows(call)
    opts = kernel_options(call, rows.labels.numel())
    with torch.no_grad():
        stats = backend_for(opts).forward_rows(kernel_batch(call, rows), opts)
    ent = torch.zeros_like(stats.logp) if stats.entropy is None else stats.entropy
    return (
        rows.scatter(stats.logp),
        rows.scatter(ent),
        rows.scatter(stats.lse),
        rows.scatter(ent.clone()),
    )


@_forward_op.register_fake
def _forward_fake(hidden, weight, labels, bias, *flat):
    head_dtype = flat[_FIELDS.index("head_dtype")]
    dtype = compute_dtype(head_dtype if head_dtype is not None else hidden.dtype)
    return tuple(hidden.new_empty(labels.shape, dtype=dtype) for _ in range(4))


@torch.library.custom_op(
    f"{_NAMESPACE}::linear_logprobs_backward",
    mutates_args=(),
    schema=f"({_HEAD_ARGS}, Tensor lse, Tensor entropy, Tensor grad_logprobs, "
    "Tensor? grad_entropy, bool[] needs) -> (Tensor, Tensor, Tensor)",
)
def _backward_op(hidden, weight, labels, bias, *rest):
    """(d hidden, d weight, d bias) of the head; an empty tensor for a gradient not needed."""
    *flat, lse, entropy, grad_logprobs, grad_entropy, needs = rest
    with_entropy = flat[_FIELDS.index("with_entropy")]
    call = _call(
        hidden.detach(), weight.detach(), labels, None if bias is None else bias.detach(), flat
    )
    rows = select_rows(call)
    opts = kernel_options(call, rows.labels.numel())
    need_h, need_w, need_b = needs
    gh, gw, gb = backend_for(opts).backward_rows(
        kernel_batch(call, rows),
        RowStats(None, rows.gather(lse), rows.gather(entropy) if with_entropy else None),
        Upstream(
            rows.gather(grad_logprobs),
            None if grad_entropy is None or not with_entropy else rows.gather(grad_entropy),
        ),
        opts,
        (need_h, need_w, need_b and bias is not None),
    )
    dh = torch.zeros_like(hidden)
    if gh is not None:
        flat_dh = dh.view(-1, hidden.shape[-1])
        if rows.index is None:
            flat_dh.copy_(gh)
        else:
            flat_dh.index_copy_(0, rows.index, gh)
    empty = hidden.new_empty(0)
    return (
        dh if need_h else empty,
        gw if gw is not None else (torch.zeros_like(weight) if need_w else empty),
        gb if gb is not None else empty,
    )


@_backward_op.register_fake
def _backward_fake(hidden, weight, labels, bias, *rest):
    needs = rest[-1]
    empty = hidden.new_empty(0)
    return (
        torch.empty_like(hidden) if needs[0] else empty,
        torch.empty_like(weight) if needs[1] else empty,
        torch.empty_like(bias) if needs[2] and bias is not None else empty,
    )


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, labels, bias, *flat = inputs
    _, _, lse, ent = output
    ctx.flat = flat
    ctx.has_bias = bias is not None
    ctx.save_for_backward(hidden, weight, labels, bias, flat[1], lse, ent)


def _backward(ctx, grad_logp, grad_ent, _grad_lse, _grad_ent2):
    refuse_double_backward("linear_logprobs")
    hidden, weight, labels, bias, temperature_tensor, lse, ent = ctx.saved_tensors
    flat = list(ctx.flat)
    flat[1] = temperature_tensor
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3]]
    if grad_logp is None:
        grad_logp = torch.zeros_like(lse)
    dh, dw, db = _backward_op(
        hidden, weight, labels, bias, *flat, lse, ent, grad_logp, grad_ent, needs
    )
    return (
        dh if needs[0] else None,
        dw if needs[1] else None,
        None,
        db if needs[2] and ctx.has_bias else None,
        *([None] * len(_FIELDS)),
    )


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def linear_logprobs_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    options: HeadOptions,
) -> LogProbs:
    """:func:`logitless.linear_logprobs` through the custom op (what compiled code calls)."""
    logp, ent, _, _ = _forward_op(hidden, weight, labels, bias, *_flat(options))
    return LogProbs(logp, ent if options.with_entropy else None)


__all__ = ["linear_logprobs_op"]
