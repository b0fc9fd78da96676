"""The divergence op: per-token KL / generalized JSD between a student's and a teacher's
next-token distributions, straight from both heads' hidden states."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from ...backends.base import DivOptions, DivRows, RowBatch, check_invariant_blas
from ...contract.divergence import (
    DivergenceCall,
    DivergenceOptions,
    TeacherTopK,
    check_divergence_call,
)
from ...contract.options import IGNORE_INDEX, Backend, HeadOptions, given_arguments
from ...contract.vocab import VocabParallel
from ...types import Divergence
from ..rows import kernel_batch, kernel_options, select_rows
from .function import run_rows


@given_arguments
def linear_divergence(
    given: Mapping[str, Any],
    /,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    *,
    teacher_topk: TeacherTopK | None = None,
    beta: float = 0.0,
    temperature: float | torch.Tensor = 1.0,
    bias: torch.Tensor | None = None,
    logit_scale: float | None = None,
    softcap: float | None = None,
    teacher_bias: torch.Tensor | None = None,
    teacher_logit_scale: float | None = None,
    teacher_softcap: float | None = None,
    vocab_size: int | None = None,
    with_logprobs: bool = False,
    with_entropy: bool = False,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
    vocab_parallel: VocabParallel | None = None,
    backend: Backend = "auto",
    batch_invariant: bool = False,
) -> Divergence:
    """Per-token divergence between a teacher's and a student's next-token distributions,
    straight from each model's hidden states and LM head (knowledge / on-policy distillation).

    Computes what this plain PyTorch computes, without allocating either ``[..., V]`` logits::

        z_s = transform(F.linear(hidden, weight, bias).float())          # student
        z_t = transform_t(F.linear(teacher_hidden, teacher_weight, teacher_bias).float())
        lp_s, lp_t = log_softmax(z_s / T), log_softmax(z_t / T)         # one temperature
        beta == 0:  D = Σ p_t·(lp_t - lp_s)                 # KL(teacher ‖ student), forward
        beta == 1:  D = Σ p_s·(lp_s - lp_t)                 # KL(student ‖ teacher), reverse
        otherwise:  log m = log((1-β)·p_s + β·p_t)
                    D = β·Σ p_t·(lp_t - log m) + (1-β)·Σ p_s·(lp_s - log m)

    (``transform``: logit scale, then softcap ``c·tanh(x / c)``, per head). ``beta`` follows
    TRL's convention (its GKD and ``DistillationTrainer`` losses, ``generalized_jsd_loss``):
    the generalized Jensen-Shannon divergence of Agarwal et al., "On-Policy Distillation of
    Language Models: Learning from Self-Generated Mistakes" (ICLR 2024, arXiv 2306.13649),
    which interpolates between the forward and the reverse KL through the mixture ``m``. Each
    KL takes one pass over both heads' vocabulary tiles; the JSD two (it needs both
    normalizers before ``log m``). Backward recomputes the tiles: no ``[N, V]`` tensor exists.

    Rows whose label equals ``ignore_index`` are dropped before any work and get 0.0 with a
    zero gradient. Gradients flow to the student's ``hidden``, ``weight`` and ``bias`` only;
    the teacher is frozen (a teacher tensor that requires grad is an error).

    Args:
        hidden: ``[..., H]`` the student's final hidden states.
        weight: ``[V, H]`` the student's LM head; bias: ``[V]`` or None.
        labels: ``[...]`` integer ids in ``[0, V)``, or ``ignore_index`` for rows to skip.
            They choose the rows, and the token of ``with_logprobs``.
        teacher_hidden: ``[..., H_t]`` the teacher's hidden states at the same positions (its
            width may differ). teacher_weight: ``[V_t, H_t]``; teacher_bias: ``[V_t]``.
        teacher_topk: a :class:`~logitless.TeacherTopK` (CSR top-k log-probs of the teacher,
            one row per label position) instead of the teacher's hidden states and head: the
            divergence of ``beta`` between two distributions over those ids plus one tail
            bucket (the teacher's remaining mass against the student's mass outside the ids).
            At ``beta=1`` a used position whose teacher mass is 1 over ids that miss part of
            the vocabulary raises ``ValueError`` (the reverse KL is infinite there).
        beta: 0 (forward KL), 1 (reverse KL) or in between (generalized JSD), as above.
        temperature: a float, or a per-token tensor broadcastable to ``labels``; divides both
            heads' logits.
        logit_scale, softcap: the student's logit transform (see
            :func:`~logitless.linear_logprobs`); teacher_logit_scale, teacher_softcap: the
            teacher's.
        vocab_size: the common vocabulary of two heads that differ only by padding rows (e.g.
            151936 of a 152064-row teacher): both use their first ``vocab_size`` rows. None: the
            heads must have the same number of rows.
        with_logprobs: also return the student's log-prob of each label (differentiable).
        with_entropy: also return the student's entropy of each row (differentiable).
        ignore_index, chunk_size, head_dtype: as in :func:`~logitless.linear_logprobs`
            (``head_dtype`` applies to both heads).
        vocab_parallel: a :class:`~logitless.VocabParallel` when both heads are split over one
            tensor-parallel group the same way: ``weight``, ``bias``, ``teacher_weight`` and
            ``teacher_bias`` are this rank's rows; every rank gets the same outputs.
        backend: ``"torch"`` (the bounded fp32 tiles), ``"triton"`` (both heads' tiles in one
            kernel program, logits in registers; CUDA tensors, or CPU ones under
            ``TRITON_INTERPRET=1``; fp32 / bf16 / fp16 heads) or ``"auto"``, which picks Triton
            where :func:`~logitless.linear_logprobs` would (16-bit heads on CUDA). Triton runs
            the dense teacher only: with ``teacher_topk`` or ``vocab_parallel``, ``"triton"``
            raises ``ValueError`` and ``"auto"`` runs the torch tiles.
        batch_invariant: as in :func:`~logitless.linear_logprobs`: each token's divergence,
            log-prob and entropy are the same bits whatever else is in the call, and its
            log-prob the bits :func:`~logitless.linear_logprobs` gives with it.

    Returns:
        :class:`~logitless.Divergence` ``(divergence, logprobs, entropy)``: fp32 tensors of
        ``labels.shape`` (float64 for a float64 head), 0.0 at ignored rows; ``logprobs`` and
        ``entropy`` are None unless asked for.

    Raises:
        ValueError: on any shape, dtype, device or value problem, before any work.

    Example:
        >>> import torch, logitless
        >>> hidden = torch.randn(2, 5, 16, requires_grad=True)
        >>> weight = torch.randn(100, 16, requires_grad=True)
        >>> t_hidden, t_weight = torch.randn(2, 5, 24), torch.randn(100, 24)  # a wider teacher
        >>> labels = torch.randint(0, 100, (2, 5))
        >>> labels[:, :2] = -100                                  # prompt tokens
        >>> out = logitless.linear_divergence(hidden, weight, labels, t_hidden, t_weight, beta=0.5)
        >>> out.divergence.shape, bool((out.divergence[:, 2:] > 0).all())
        (torch.Size([2, 5]), True)
        >>> out.divergence.sum().backward()
    """
    options = HeadOptions.pick(given)
    teacher = (teacher_hidden, teacher_weight, teacher_bias)
    div = DivergenceOptions.pick(given)
    call = check_divergence_call(hidden, weight, labels, bias, teacher, teacher_topk, options, div)
    return divergence_of_call(call)


def divergence_of_call(call: DivergenceCall) -> Divergence:
    """The divergence op on a checked call."""
    student = call.student
    rows = select_rows(student)
    num_rows = rows.labels.numel()
    s_opts = kernel_options(student, num_rows)
    teacher = t_opts = None
    if call.teacher is not None:
        t = call.teacher
        hidden = t.hidden if rows.index is None else t.hidden.index_select(0, rows.index)
        teacher = RowBatch(hidden, t.weight, t.bias, rows.labels, rows.temperature)
        t_opts = dataclasses.replace(s_opts, transform=t.transform, head_dtype=t.head_dtype)
        if student.batch_invariant:  # the teacher's matmul too (its own dtype and width)
            check_invariant_blas(t.weight.device, t.head_dtype, t.weight.shape[1], s_opts.schedule)
    topk = None if call.topk is None else _local_topk(call, rows.index)
    div_rows = DivRows(kernel_batch(student, rows), teacher, topk)
    stats = run_rows(div_rows, DivOptions(s_opts, t_opts, call.mode, call.beta))
    return Divergence(
        rows.scatter(stats.divergence),
        rows.scatter(stats.logp) if call.with_logprobs else None,
        None if stats.entropy is None else rows.scatter(stats.entropy),
    )


def _local_topk(call: DivergenceCall, index: torch.Tensor | None):
    """The sparse teacher's valid rows, ids shard-local under vocab parallelism (unused
    slots stay negative: outside every shard)."""
    topk = call.topk.take(index)
    vp = call.student.vocab_parallel
    if vp is None or vp.vocab_start == 0:
        return topk
    return topk._replace(ids=torch.where(topk.used, topk.ids - vp.vocab_start, -1))
