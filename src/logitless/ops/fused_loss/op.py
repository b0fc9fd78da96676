"""LM head + policy loss in one pass: the parameter gradients are computed in the forward pass.

This is the one module where the head and the losses meet. The composed path
``policy_loss(linear_logprobs(...).logprobs, ...)`` recomputes the logits in backward (four
head matmuls). Here, the gradient of the loss with respect to each row's log-prob and entropy
is taken while that row chunk's logits are still in memory, so the head costs three matmuls
and one ``[chunk, V]`` buffer; only the gradients (dW, dh, db) live until ``backward()``.

Which losses allow that is decided in one place, ``PolicyLossConfig.is_token_local``: the
gradient for a token depends only on that token's own log-prob (PPO clip, CISPO, SAPO,
REINFORCE, DPPO, KL, entropy bonus, every aggregation, and the mismatch corrections, whose
weights come from old vs rollout log-probs). Sequence-level ratios (GSPO's
``ratio_level="sequence"``, GMPO) and sequence masks on the current ratio (``ratio_seq_mask``)
need whole-document sums before any token's gradient is known: they get a cheap no-grad pass
first (one matmul), then the same gradient pass, so documents may span chunks freely. (The
Triton backend always runs the statistics first, see its module.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from ...backends import backend_for
from ...backends.base import RowBatch
from ...contract.divergence import TeacherTopK
from ...contract.head import HeadCall, check_head_call
from ...contract.options import (
    IGNORE_INDEX,
    Backend,
    HeadOptions,
    SamplerOptions,
    WeightGradInto,
    given_arguments,
)
from ...contract.vocab import VocabParallel
from ...losses import LossNormalizer, PolicyLossConfig
from ...losses.call import LossCall
from ...losses.checks import LossArgs, check_policy_loss
from ...sampling import SamplingMask
from ...types import LogProbs, TeacherHead
from ..divergence.op import linear_divergence
from ..logprobs.function import run_rows
from ..rows import kernel_batch, kernel_options, refuse_double_backward, select_rows
from .replay import replay_policy_loss
from .row_loss import PolicyRowLoss, RowLoss, all_rows_grad_fn, chunk_grad_fn


@given_arguments
def fused_policy_loss(
    given: Mapping[str, Any],
    /,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    config: PolicyLossConfig | None = None,
    bias: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    logit_scale: float | None = None,
    head_dtype: torch.dtype | None = None,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    document_ids: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    normalizer: LossNormalizer | None = None,
    vocab_parallel: VocabParallel | None = None,
    context_group: object | None = None,
    backend: Backend = "auto",
    sampling_mask: SamplingMask | torch.Tensor | None = None,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    with_kept_mass: bool = False,
    capturable: bool = False,
    row_capacity: int | None = None,
    batch_invariant: bool = False,
    teacher: TeacherHead | TeacherTopK | None = None,
    weight_grad_into: WeightGradInto | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss straight from hidden states, with the head's gradients taken in forward.

    Returns the same ``(loss, metrics)`` as, and the same gradients for hidden, weight and
    bias as::

        out = linear_logprobs(hidden, weight, labels, bias=bias, temperature=temperature,
                              softcap=softcap, logit_scale=logit_scale, head_dtype=head_dtype,
                              with_entropy=config.entropy_coef != 0)
        policy_loss(out.logprobs, old_logprobs, advantages, labels != ignore_index,
                    config=config, document_ids=document_ids, ref_logprobs=ref_logprobs,
                    rollout_logprobs=rollout_logprobs, entropy=out.entropy,
                    normalizer=normalizer)

    without ``[tokens, vocab]`` logits and with three head matmuls instead of four for
    token-local losses (four for sequence-level ratios: a no-grad pass, then the gradient pass).

    ``loss.backward()`` works as for any loss; scaling the loss (gradient accumulation, loss
    scale) scales the stored gradients. The gradients are released by the first backward: a
    second one raises ``RuntimeError``. Under ``torch.no_grad()`` only the loss and metrics are
    computed (one head matmul) and nothing is stored.

    Args:
        hidden: ``[N, H]`` or ``[B, T, H]`` final hidden states.
        weight: ``[V, H]`` head weight; bias ``[V]`` or None.
        labels: ``[N]`` / ``[B, T]`` next-token ids; ``ignore_index`` marks tokens that do not
            count (prompt, padding): they are the loss mask.
        old_logprobs, advantages, document_ids, ref_logprobs, rollout_logprobs, normalizer,
            config: as in :func:`logitless.policy_loss`.
        temperature, softcap, logit_scale, head_dtype, chunk_size, backend: as in
            :func:`logitless.linear_logprobs`; with the torch tiles ``chunk_size`` is the rows
            whose ``[rows, V]`` logits are held at once (None: a 256 MiB fp32 budget on CPU,
            1 GiB on accelerators). The Triton backend computes the statistics of every row
            first (no logits kept), then the loss gradient, then the head gradients through
            a bounded workspace: four head matmuls instead of three, in far less memory.
        vocab_parallel: as in :func:`logitless.linear_logprobs`: ``weight``/``bias`` are this
            rank's vocabulary shard, every rank computes the same loss from the combined
            log-probs, its weight shard gets its gradient and the hidden gradient is summed
            over the group (unless ``reduce_hidden_grad=False``). One ``[chunk, V/tp]`` buffer.
        context_group: the context-parallel group when this rank holds a shard of a packed
            stream (as in :func:`logitless.policy_loss`): per-document statistics are summed
            over the group, the returned loss is this rank's share and the metrics are the
            group's. A collective call; the number of collectives does not depend on the rank's
            data or chunk count (the per-chunk gradients use precomputed document statistics).
        sampling_mask, top_k, top_p, min_p, with_kept_mass: sampling replay, as in
            :func:`logitless.linear_logprobs`: the log-probs (and entropy) the loss sees are
            over each row's kept set. Then the replay forward runs first, the loss gradient of
            every row next, and the (sparse) replay backward last; the metrics gain
            ``replay_kept_size``, ``replay_label_added`` and, with ``with_kept_mass``,
            ``replay_log_kept_mass`` (see :mod:`logitless.ops.fused_loss.replay`).
        capturable, row_capacity: as in :func:`logitless.linear_logprobs`, and the loss's
            checks as in :func:`logitless.policy_loss` with ``capturable=True``: no host read,
            static shapes (docs/capturable.md). Compiled (``torch.compile``, ``fullgraph=True``
            works), a capturable call runs the composed form above, which Dynamo can trace:
            the same numbers, four head matmuls, and a second backward is not refused.
        batch_invariant: as in :func:`logitless.linear_logprobs`: the log-probs (and entropy)
            the loss sees are the bits :func:`logitless.linear_logprobs` gives with it (the
            same forward, row block by row block), so the ratio to old log-probs recorded that
            way is exactly 1.0 on unchanged weights; the gradients are deterministic.
        teacher: a :class:`~logitless.TeacherHead` (the teacher's hidden states and head) or
            a :class:`~logitless.TeacherTopK` (its top-k log-probs): the loss gains the
            distillation term ``config.distill_coef · D`` with ``D`` from
            :func:`logitless.linear_divergence` (``beta=config.distill_beta``, this call's
            temperature, head options and labels), exactly as ``policy_loss(...,
            divergence=D)``; metric ``distill_divergence``. The divergence is its own pass
            over both heads; its gradient reaches hidden, weight and bias through autograd.
            Not with sampling replay or ``capturable``.
        weight_grad_into: as in :func:`logitless.linear_logprobs` (gradient-accumulation
            fusion). The weight gradient is taken in the forward pass, before the loss's
            upstream gradient is known, so it waits in an fp32 ``[V, H]`` scratch until
            ``backward()``, which adds it (times that upstream gradient) into the buffer and
            frees it. The distillation term's weight gradient (``teacher=``) still reaches
            the weight through autograd.

    Returns:
        ``(loss, metrics)``: a 0-dim fp32 loss and a dict of detached 0-dim metrics.
    """
    return fused_loss_of(
        hidden,
        weight,
        labels,
        bias,
        HeadOptions.pick(given),
        SamplerOptions.pick(given),
        old_logprobs,
        advantages,
        config=config,
        document_ids=document_ids,
        ref_logprobs=ref_logprobs,
        rollout_logprobs=rollout_logprobs,
        normalizer=normalizer,
        context_group=context_group,
        teacher=teacher,
    )


def fused_loss_of(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    options: HeadOptions,
    sampler: SamplerOptions,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    **loss_inputs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`fused_policy_loss` with the head's options as objects (the module's entry);
    ``loss_inputs``: ``config``, ``document_ids``, ``ref_logprobs``, ``rollout_logprobs``,
    ``normalizer``, ``context_group`` as in :func:`logitless.policy_loss`."""
    config = loss_inputs.get("config")
    teacher = loss_inputs.pop("teacher", None)
    entropy = isinstance(config, PolicyLossConfig) and config.entropy_coef != 0
    call = check_head_call(
        hidden, weight, labels, bias, options.replace(with_entropy=entropy), sampler
    )
    divergence = None
    if teacher is not None:
        divergence = teacher_divergence(call, hidden, weight, labels, bias, options, teacher)
        divergence = divergence(config)
    loss_call = check_loss_of_head(
        call,
        old_logprobs=old_logprobs,
        advantages=advantages,
        divergence=None if divergence is None else divergence.detach(),
        **loss_inputs,
    )
    return fused_loss_of_call(call, loss_call, divergence)


def teacher_divergence(call: HeadCall, hidden, weight, labels, bias, options, teacher):
    """``config -> D``: the per-token divergence from ``teacher`` (``[*batch_shape]``,
    differentiable), with the call's labels, temperature and head options."""
    if call.replay is not None or call.capturable:
        raise ValueError(
            "teacher= is not supported with sampling replay or capturable=True: the "
            "divergence op has neither"
        )
    if isinstance(teacher, TeacherTopK):
        pair = dict(teacher_topk=teacher)
    elif isinstance(teacher, TeacherHead):
        pair = dict(
            teacher_hidden=teacher.hidden, teacher_weight=teacher.weight,
            teacher_bias=teacher.bias, teacher_logit_scale=teacher.logit_scale,
            teacher_softcap=teacher.softcap, vocab_size=teacher.vocab_size,
        )  # fmt: skip
    else:
        raise ValueError(
            f"teacher must be a logitless.TeacherHead or logitless.TeacherTopK, got "
            f"{type(teacher).__name__}"
        )

    def divergence(config: PolicyLossConfig | None) -> torch.Tensor:
        beta = config.distill_beta if isinstance(config, PolicyLossConfig) else 0.0
        return linear_divergence(
            hidden, weight, labels, bias=bias, beta=beta, temperature=options.temperature,
            logit_scale=options.logit_scale, softcap=options.softcap,
            ignore_index=options.ignore_index, chunk_size=options.chunk_size,
            head_dtype=options.head_dtype, vocab_parallel=options.vocab_parallel,
            backend=options.backend, batch_invariant=options.batch_invariant, **pair,
        ).divergence  # fmt: skip

    return divergence


def check_loss_of_head(
    call: HeadCall, *, old_logprobs: torch.Tensor, advantages: torch.Tensor, **loss_inputs
) -> LossCall:
    """The loss contract of a fused call, checked once before any head FLOP (one collective
    under context parallelism): the log-probs only lend their shape here, and the loss mask is
    ``labels != ignore_index``."""
    if len(call.batch_shape) not in (1, 2):
        raise ValueError(
            f"labels must have shape [N] or [B, T] (hidden [N, H] or [B, T, H]), got "
            f"{list(call.batch_shape)}"
        )
    if call.rollout is not None:
        raise ValueError(
            "rollout_topk is not taken by the fused policy loss: its forward runs its own "
            "schedule; pass rollout_topk to the log-prob pass (linear_logprobs, the old "
            "log-probs of the integrations) and log its mismatch (docs/rollout-mismatch.md)"
        )
    mask = (call.labels != call.ignore_index).reshape(call.batch_shape)
    like = torch.zeros(call.batch_shape, device=call.labels.device)
    config = loss_inputs.get("config")
    with_entropy = isinstance(config, PolicyLossConfig) and config.entropy_coef != 0
    group = loss_inputs.pop("context_group", None)
    args = LossArgs(
        like, old_logprobs, advantages, mask, entropy=like if with_entropy else None, **loss_inputs
    )
    return check_policy_loss(args, context_group=group, capturable=call.capturable)


def fused_loss_of_call(
    call: HeadCall, loss_call: LossCall, divergence: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict]:
    """:func:`fused_policy_loss` of a checked head call and loss call (the HF integration
    checks both before its backbone runs, then calls this). ``divergence``: the distillation
    term's ``D`` with its autograd history (the loss call holds it detached)."""
    value, metrics, _ = _fused_loss(call, loss_call, divergence)
    return value, metrics


def fused_loss_and_logprobs_of_call(
    call: HeadCall, loss_call: LossCall, divergence: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict, LogProbs]:
    """:func:`fused_loss_of_call`, and the per-token log-probs (and entropy, with the call's
    ``with_entropy``) its pass computed, detached, in the labels' shape (0 at ignored rows):
    what a trainer's own metrics need (Fast-LLM's, torchtitan's), without a second head pass.
    Not with sampling replay."""
    if call.replay is not None:
        raise ValueError(
            "the per-token log-probs of the fused loss are not available with sampling replay"
        )
    value, metrics, tokens = _fused_loss(call, loss_call, divergence)
    assert tokens is not None  # every path but replay's gives them
    return value, metrics, tokens


def _fused_loss(
    call: HeadCall, loss_call: LossCall, divergence: torch.Tensor | None
) -> tuple[torch.Tensor, dict, LogProbs | None]:
    """The fused loss, its metrics and its rows' log-probs (None with sampling replay)."""
    rows = select_rows(call)
    loss = PolicyRowLoss(loss_call, rows)
    if call.capturable and call.tracked and torch.compiler.is_compiling():
        return _composed_rows(call, rows, loss)
    # The kernels get plain tensors: their gradients reach autograd through _StoredGradients.
    batch = kernel_batch(call, rows).detached()
    needs = (
        rows.hidden.requires_grad,
        call.weight.requires_grad,
        call.bias is not None and call.bias.requires_grad,
    )
    logp = ent = None
    if call.replay is not None:
        value, metrics, grads = replay_policy_loss(
            call, rows, batch, loss, needs if call.tracked else None, loss_call.group
        )
    elif not call.tracked and not _tracked(divergence):
        logp, ent = _no_grad_pass(call, batch)
        value, metrics = loss.evaluate(logp, ent, reduce_metrics=True)
        return value, metrics, _tokens(rows, logp, ent)
    else:
        value, metrics, grads, d_div, (logp, ent) = _fused_rows(
            call, rows, batch, loss, loss_call, needs
        )
    if grads is not None and call.tracked:
        into = call.weight_grad_into
        dw_of = call.weight if into is None else into.buffer  # the scratch joins the buffer
        dtypes = tuple(None if t is None else t.dtype for t in (rows.hidden, dw_of, call.bias))
        store = _GradStore(grads, dtypes, into)
        value = _StoredGradients.apply(value, store, rows.hidden, call.weight, call.bias)
    if call.replay is None:
        value = _through_divergence(value, divergence, d_div)
    return value, metrics, None if logp is None else _tokens(rows, logp, ent)


def _tokens(rows, logp: torch.Tensor, ent: torch.Tensor | None) -> LogProbs:
    """The rows' log-probs (and entropy) in the caller's layout, detached."""
    return LogProbs(
        rows.scatter(logp.detach()), None if ent is None else rows.scatter(ent.detach())
    )


def _composed_rows(call: HeadCall, rows, loss: RowLoss) -> tuple[torch.Tensor, dict, LogProbs]:
    """The capturable call under ``torch.compile``: the composed form, the head's autograd
    function and then the loss through autograd (the numbers the fused form promises; four
    head matmuls instead of three). Dynamo cannot trace the fused form: it takes the loss's
    gradient in forward (``torch.autograd.grad``, a graph break unless Dynamo's
    ``trace_autograd_ops`` is on) and hands it to autograd by a side effect on a store."""
    logp, ent = run_rows(kernel_batch(call, rows), kernel_options(call, rows.labels.numel()))
    value, metrics = loss.evaluate(logp, ent, reduce_metrics=True)
    return value, {k: v.detach() for k, v in metrics.items()}, _tokens(rows, logp, ent)


def _tracked(t: torch.Tensor | None) -> bool:
    return t is not None and t.requires_grad and torch.is_grad_enabled()


def _through_divergence(value, divergence, d_div) -> torch.Tensor:
    """``value`` with the distillation term's gradient routed into ``divergence``'s history:
    ``+ Σ D·g - sg(Σ D·g)`` (``g`` = d loss / d D) adds nothing to the value."""
    if not _tracked(divergence) or d_div is None:
        return value
    term = (divergence.reshape(-1).to(d_div.dtype) * d_div.reshape(-1)).sum()
    return value + (term - term.detach()).to(value.dtype)


def _no_grad_pass(call: HeadCall, batch: RowBatch):
    """The valid rows' log-probs and entropy, no gradient (one head matmul)."""
    opts = kernel_options(call, batch.hidden.shape[0])
    with torch.no_grad():
        stats = backend_for(opts).forward_rows(batch, opts)
    return stats.logp, stats.entropy


def _fused_rows(call: HeadCall, rows, batch: RowBatch, loss: RowLoss, loss_call, needs):
    """Loss, metrics and head gradients with the gradient taken inside the head's passes."""
    grouped = loss_call.group is not None
    if loss_call.config.is_token_local:
        # Each chunk's gradient comes from the loss with the other rows at any finite value
        # (old log-probs: ratio 1); token-locality makes it exact, and the document statistics
        # of a token-local loss do not depend on log π_θ, so the placeholder gives the right
        # ones (summed over the context group once, here).
        placeholder = rows.gather(loss_call.old_logprobs).detach().float()  # [M]
        placeholder_ent = torch.zeros_like(placeholder) if call.with_entropy else None
        stats = loss.stats(placeholder) if grouped else None
        grad_fn = chunk_grad_fn(loss, placeholder, placeholder_ent, stats)
    else:
        # Sequence-level statistics need every row: a no-grad pass gives the exact log-probs,
        # and one evaluation of the loss gives every row's gradient.
        prefill, prefill_ent = _no_grad_pass(call, batch)
        stats = loss.stats(prefill) if grouped else None
        grad_fn = all_rows_grad_fn(loss, prefill, prefill_ent, stats)
    # The gradients wait for the loss's upstream scale (see KernelOptions.grad_dtype).
    opts = dataclasses.replace(
        kernel_options(call, batch.hidden.shape[0], fused=True), held_grads=True
    )
    if opts.weight_grad_into is not None and needs[1]:
        # The loss's upstream gradient is not known yet: dW waits in a scratch of the buffer's
        # dtype (the kernels add into it), and _StoredGradients adds it, scaled, in backward.
        scratch = WeightGradInto(torch.zeros_like(opts.weight_grad_into.buffer))
        opts = dataclasses.replace(opts, weight_grad_into=scratch)
    if call.tracked:
        logp, ent, grads = backend_for(opts).fused_rows(batch, opts, grad_fn, needs)
        if opts.weight_grad_into is not None and needs[1]:
            grads = (grads[0], opts.weight_grad_into.buffer, grads[2])  # the scratch
    else:  # only the divergence needs a gradient
        (logp, ent), grads = _no_grad_pass(call, batch), None
    with torch.no_grad():
        value, metrics = loss.evaluate(logp, ent, stats, reduce_metrics=True)
    return value, metrics, grads, loss.divergence_grad(logp, ent, stats), (logp, ent)


class _GradStore:
    """Gradients computed in forward, handed to autograd once by the first backward.

    ``dtypes``: those of hidden, weight (of ``into``'s buffer with one) and bias (None where
    absent), the dtypes the gradients are handed on in; ``into``: the call's
    :class:`WeightGradInto`; the weight's gradient (then an fp32 scratch) is added into its
    buffer instead of handed to autograd."""

    def __init__(self, grads: tuple, dtypes: tuple, into: WeightGradInto | None = None) -> None:
        self.grads: tuple | None = grads
        self.dtypes = dtypes
        self.into = into


# Elements scaled at once by _scaled: a 16-bit gradient is widened to fp32 a slice at a time
# (64 MiB of fp32), so the scale costs no full-size fp32 copy of dW.
_SCALE_SLICE = 1 << 24


def _scaled(g: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``g · scale`` in ``dtype``, the product taken in fp32 (float64 for a float64 ``g``).

    ``scale`` is the loss's upstream gradient (fp32: gradient accumulation's 1/k, Megatron's
    token count, a gradient scaler's 2^16). Rounded to 16 bits first, it would bias every
    gradient by the same factor (bf16(1/3) = 0.33398); taken in fp32, each gradient is rounded
    to ``dtype`` once more at most, without bias (not at all for a power-of-two scale).
    ``g`` is scaled in place where it already has ``dtype``."""
    wide = torch.promote_types(g.dtype, torch.float32)
    s = scale.to(wide)
    if g.dtype == wide:
        return g.mul_(s).to(dtype)
    flat = g.view(-1) if g.is_contiguous() else None
    if flat is None:
        return g.copy_(g.to(wide).mul_(s))
    for start in range(0, flat.numel(), _SCALE_SLICE):
        part = flat[start : start + _SCALE_SLICE]
        part.copy_(part.to(wide).mul_(s))
    return g


class _StoredGradients(torch.autograd.Function):
    """Returns the loss value; its backward returns the stored gradients × the upstream scale."""

    @staticmethod
    def forward(ctx, loss, store: _GradStore, hidden, weight, bias):
        ctx.store = store
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_double_backward("fused_policy_loss")
        grads, ctx.store.grads = ctx.store.grads, None
        if grads is None:
            raise RuntimeError(
                "fused_policy_loss: backward was already called on this loss. Its gradients "
                "are computed in the forward pass and released by the first backward; compute "
                "the loss again to backpropagate again."
            )
        dh, dw, db = (
            None if g is None else _scaled(g, grad_loss, dtype)
            for g, dtype in zip(grads, ctx.store.dtypes, strict=True)
        )
        into = ctx.store.into
        if into is not None and dw is not None:
            into.buffer.add_(dw)
            into.added()
            dw = None
        return None, None, dh, dw, db
