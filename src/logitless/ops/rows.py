"""What every op does first: gather the valid rows of a checked call, and cut its work.

:func:`select_rows` drops the rows whose label is ``ignore_index`` before any FLOP;
:func:`kernel_batch` and :func:`kernel_options` hand those rows and the call's options to a
backend (:mod:`logitless.backends`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..backends.base import KernelOptions, RowBatch, Schedule, check_invariant_blas
from ..contract.head import HeadCall


class Rows(NamedTuple):
    """The valid rows of a head call (label != ignore_index), ready for the kernels.

    hidden: [M, H] (a differentiable gather of the caller's rows); labels: [M] int64 (global
    ids); temperature: [M] or None (scalar temperature); index: [M] row ids into the flattened
    batch, or None when every row is kept; num_tokens / batch_shape: the caller's layout;
    valid: [M] bool in the capturable mode, whose rows include ignored ones (their label set to
    0, their hidden row to 0 by :func:`mask_rows`, their results masked by :meth:`scatter`),
    else None (every row is valid).
    """

    hidden: torch.Tensor
    labels: torch.Tensor
    temperature: torch.Tensor | None
    index: torch.Tensor | None
    num_tokens: int
    batch_shape: torch.Size
    valid: torch.Tensor | None = None

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """A per-token tensor of the caller's ``labels.shape`` -> its [M] rows (zero at the
        ignored rows of the capturable mode: an upstream gradient there must not count)."""
        flat = values.reshape(-1)
        rows = flat if self.index is None else flat.index_select(0, self.index)
        if self.valid is not None:
            rows = torch.where(self.valid, rows, rows.new_zeros(()))
        return rows

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[M] per-row values (any dtype) -> the caller's ``labels.shape``, zero at ignored rows."""
        if self.valid is not None:
            values = torch.where(self.valid, values, values.new_zeros(()))
        if self.index is not None:
            values = values.new_zeros(self.num_tokens).index_copy(0, self.index, values)
        return values.reshape(self.batch_shape)


def select_rows(call: HeadCall) -> Rows:
    """Drop ignored rows before any FLOP; no copy when every row is valid.

    The number of valid rows was read on the host by the checks (``call.num_valid``), so the
    index is built without another host synchronization. The capturable mode never reads it:
    see :func:`_capturable_rows`.
    """
    if call.capturable:
        return _capturable_rows(call)
    n = call.labels.numel()
    hidden, labels, temp = call.hidden, call.labels, call.temperature
    idx = None
    if call.num_valid < n:
        valid = labels != call.ignore_index
        # Positions of the valid rows in order, without nonzero()'s host sync: each valid row
        # writes its own index to its rank among the valid rows; ignored rows go to a spare slot.
        slot = torch.where(valid, valid.cumsum(0) - 1, call.num_valid)
        arange = torch.arange(n, device=labels.device)
        idx = arange.new_empty(call.num_valid + 1).scatter_(0, slot, arange)[: call.num_valid]
        hidden = hidden.index_select(0, idx)
        labels = labels.index_select(0, idx)
        temp = None if temp is None else temp.index_select(0, idx)
    return Rows(hidden, labels, temp, idx, n, call.batch_shape)


def _capturable_rows(call: HeadCall) -> Rows:
    """The rows of a capturable call, with shapes that depend on the input shapes only.

    Without ``row_capacity``, every row: the ignored ones get label 0 (any valid id) and a
    zero hidden row (whatever they held: NaN padding must not reach dW), and their results
    are masked afterwards. With ``row_capacity=C``, ``C`` rows: the valid rows in their
    order, then ignored ones (a stable sort of the validity flags, zeroed the same way), and
    a device-side assertion that no valid row was left out.
    """
    n = call.labels.numel()
    valid = call.labels != call.ignore_index
    labels = torch.where(valid, call.labels, 0)
    hidden, temp, idx = call.hidden, call.temperature, None
    if call.row_capacity is not None and call.row_capacity < n:
        cap = call.row_capacity
        torch._assert_async(
            valid.sum() <= cap,
            f"more valid rows than row_capacity={cap}: raise row_capacity (at most "
            f"{n} rows) or use capturable=True without it",
        )
        idx = torch.argsort((~valid).to(torch.int8), stable=True)[:cap]
        hidden, labels, valid = hidden.index_select(0, idx), labels[idx], valid[idx]
        temp = None if temp is None else temp.index_select(0, idx)
    return Rows(mask_rows(hidden, valid), labels, temp, idx, n, call.batch_shape, valid)


def mask_rows(hidden: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``hidden`` ``[M, H]`` with the rows where ``valid`` is False set to 0.

    A selected, not a multiplied, zero: a padding row may hold NaN or inf (some models'
    attention gives NaN on fully masked rows), and ``0 * nan`` is NaN, which the head's
    gradient would carry into every entry of dW. Zeroed, an ignored row has finite logits,
    a zero gradient, and its dh is exactly 0 (``where``'s backward selects it too).
    """
    return torch.where(valid.unsqueeze(-1), hidden, hidden.new_zeros(()))


def kernel_batch(call: HeadCall, rows: Rows) -> RowBatch:
    """The rows as the kernels take them: labels shard-local under vocab parallelism (out of
    ``[0, V_local)`` for labels another rank owns; the kernels mask those)."""
    vp = call.vocab_parallel
    labels = rows.labels if vp is None or vp.vocab_start == 0 else rows.labels - vp.vocab_start
    return RowBatch(rows.hidden, call.weight, call.bias, labels, rows.temperature)


def kernel_options(call: HeadCall, num_rows: int, *, fused: bool = False) -> KernelOptions:
    """The kernels' options of a checked call over ``num_rows`` rows.

    ``fused``: the gradient-in-forward path, whose torch row chunk keeps all V logits (in the
    batch-invariant mode: the log-prob op's very schedule, after the one-time check that the
    device's matmul allows it). Under
    vocab parallelism the torch schedule is sized by the largest shard, so every rank cuts the
    same row chunks (each one is a collective).
    """
    vp = call.vocab_parallel
    vocab = call.weight.shape[0] if vp is None else vp.max_shard
    dev, invariant = call.weight.device, call.batch_invariant
    schedule = Schedule.choose(
        num_rows, vocab, dev, call.chunk_size, invariant=invariant, fused=fused
    )
    if invariant:
        check_invariant_blas(dev, call.head_dtype, call.weight.shape[1], schedule)
    return KernelOptions(
        transform=call.transform,
        with_entropy=call.with_entropy,
        head_dtype=call.head_dtype,
        schedule=schedule,
        vocab_parallel=vp,
        backend=call.backend,
        chunk_size=call.chunk_size,
        weight_grad_into=call.weight_grad_into,
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
