"""LM head + policy loss in one pass: the parameter gradients are computed in the forward pass.

This is the one module where the head and the losses meet. The composed path
``policy_loss(linear_logprobs(...).logprobs, ...)`` recomputes the logits in backward (four
head matmuls). Here, the gradient of the loss with respect to each row's log-prob and entropy
is taken while that row chunk's logits are still in memory, so the head costs three matmuls
and one ``[chunk, V]`` buffer; only the gradients (dW, dh, db) live until ``backward()``.

Which losses allow that: a loss is *token-local* when the gradient for a token depends only on
that token's own log-prob (PPO clip, CISPO, SAPO, REINFORCE, DPPO, KL, entropy bonus, every
aggregation, and the mismatch corrections, whose weights come from old vs rollout log-probs).
Sequence-level ratios (GSPO's ``ratio_level="sequence"``, GMPO) and sequence masks on the
current ratio (``ratio_seq_mask``) need whole-document sums
before any token's gradient is known: they get a cheap no-grad pass first (one matmul), then
the same gradient pass, so documents may span chunks freely.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ._validate import check_chunk_size, check_head_call
from ._validate_replay import check_replay_call
from .distributed import VocabParallel
from .fused_replay import replay_policy_loss
from .kernels import Backend, Rows, backend_module, head_options, kernel_labels, select_rows
from .losses import DocumentStats, LossNormalizer, PolicyLossConfig, document_stats, policy_loss
from .sampling import SamplingMask


def is_token_local(config: PolicyLossConfig) -> bool:
    """True when each token's loss gradient depends on its own log-prob only (see module doc)."""
    return (
        config.ratio_level == "token"
        and config.surrogate != "gmpo"
        and config.ratio_seq_mask is None  # a document's mask depends on all its tokens
    )


def fused_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    config: PolicyLossConfig,
    bias: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    head_dtype: torch.dtype | None = None,
    chunk_size: int | None = None,
    ignore_index: int = -100,
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss straight from hidden states, with the head's gradients taken in forward.

    Returns the same ``(loss, metrics)`` as, and the same gradients for hidden, weight and
    bias as::

        out = linear_logprobs(hidden, weight, labels, bias=bias, temperature=temperature,
                              softcap=softcap, head_dtype=head_dtype,
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
        temperature, softcap, head_dtype, chunk_size, backend: as in
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
            ``replay_log_kept_mass`` (see :mod:`logitless.fused_replay`).

    Returns:
        ``(loss, metrics)``: a 0-dim fp32 loss and a dict of detached 0-dim metrics.
    """
    chunk_size = check_chunk_size(chunk_size)
    if not isinstance(config, PolicyLossConfig):
        raise ValueError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    args = check_head_call(
        hidden,
        weight,
        labels,
        bias=bias,
        temperature=temperature,
        softcap=softcap,
        ignore_index=ignore_index,
        head_dtype=head_dtype,
        vocab_parallel=vocab_parallel,
    )
    replay = check_replay_call(
        args,
        ignore_index,
        vocab_parallel=vocab_parallel,
        sampling_mask=sampling_mask,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
    )
    if not isinstance(with_kept_mass, bool):
        raise ValueError(f"with_kept_mass must be a bool, got {with_kept_mass!r}")
    if with_kept_mass and replay is None:
        raise ValueError("with_kept_mass=True needs sampling_mask= or top_k= / top_p= / min_p=")
    if len(args.batch_shape) not in (1, 2):
        raise ValueError(
            f"labels must have shape [N] or [B, T] (hidden [N, H] or [B, T, H]), got "
            f"{list(args.batch_shape)}"
        )
    _check_loss_precision(
        old_logprobs=old_logprobs,
        advantages=advantages,
        ref_logprobs=ref_logprobs,
        rollout_logprobs=rollout_logprobs,
    )
    with_entropy = config.entropy_coef != 0
    rows = select_rows(args, ignore_index)
    mask = (args.labels != ignore_index).reshape(args.batch_shape)

    def loss_of(
        logp_rows: torch.Tensor,
        ent_rows: torch.Tensor | None,
        stats: DocumentStats | None = None,
        group: object | None = None,
    ):
        """policy_loss of [M] row values; ``group``: a collective call over it."""
        return policy_loss(
            rows.scatter(logp_rows),
            old_logprobs,
            advantages,
            mask,
            config=config,
            document_ids=document_ids,
            ref_logprobs=ref_logprobs,
            rollout_logprobs=rollout_logprobs,
            entropy=None if ent_rows is None else rows.scatter(ent_rows),
            normalizer=normalizer,
            context_group=group,
            document_stats=stats,
        )

    def stats_of(logp_rows: torch.Tensor) -> DocumentStats:
        """The call's document statistics, summed over the context group (collective)."""
        return document_stats(
            rows.scatter(logp_rows),
            old_logprobs,
            advantages,
            mask,
            config=config,
            document_ids=document_ids,
            rollout_logprobs=rollout_logprobs,
            context_group=context_group,
        )

    # Validate the loss's own inputs (shapes, document ids, required tensors) before any head
    # FLOP: one [N]-sized policy_loss evaluation on placeholder log-probs (under context
    # parallelism a collective one, so a bad input on one rank raises on all).
    placeholder = _rows_of(old_logprobs, rows).detach().float()
    placeholder_ent = torch.zeros_like(placeholder) if with_entropy else None
    with torch.no_grad():
        loss_of(placeholder, placeholder_ent, group=context_group)

    tracked = (hidden, weight) if bias is None else (hidden, weight, bias)
    vp = vocab_parallel
    # The kernels get plain tensors: their gradients reach autograd through _StoredGradients.
    kernel_inputs = (
        rows.hidden.detach(),
        weight.detach(),
        None if bias is None else bias.detach(),
        kernel_labels(rows, vp),
        rows.temperature,
    )

    def options(fused: bool):
        return head_options(
            args,
            rows,
            with_entropy,
            chunk_size=chunk_size,
            backend=backend,
            vocab_parallel=vp,
            fused=fused,
        )

    def no_grad_pass() -> tuple[torch.Tensor, torch.Tensor | None]:
        opts = options(fused=False)
        with torch.no_grad():
            logp, _, ent, _ = backend_module(opts).forward_rows(*kernel_inputs, opts)
        return logp, ent

    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tracked)
    if replay is not None:
        needs = (
            rows.hidden.requires_grad,
            weight.requires_grad,
            bias is not None and bias.requires_grad,
        )
        loss, metrics, grads = replay_policy_loss(
            rows,
            weight,
            bias,
            kernel_inputs[3],
            options(fused=False),
            replay,
            with_kept_mass=with_kept_mass,
            needs=needs if grad else None,
            loss_of=loss_of,
            stats_of=stats_of,
            loss_grads=_loss_grads,
            context_group=context_group,
        )
        if grads is not None:
            loss = _StoredGradients.apply(loss, _GradStore(grads), rows.hidden, weight, bias)
        return loss, metrics

    if not grad:
        return loss_of(*no_grad_pass(), group=context_group)

    # Context parallelism: the document statistics are summed over the group once, here;
    # every later evaluation reuses them and issues no collective, whatever the chunk count.
    stats = None
    if is_token_local(config):
        # Each chunk's gradient comes from the loss with the other rows at any finite value
        # (old log-probs: ratio 1); token-locality makes it exact (and the statistics of a
        # token-local loss do not depend on log π_θ, so the placeholder gives the right ones).
        if context_group is not None:
            with torch.no_grad():
                stats = stats_of(placeholder)

        def grad_fn(r0: int, r1: int, logp_c: torch.Tensor, ent_c: torch.Tensor | None):
            """d loss / d (logp, entropy) of rows [r0, r1), the other rows held fixed."""
            full_lp = torch.cat([placeholder[:r0], logp_c, placeholder[r1:]])
            full_ent = None
            if ent_c is not None:
                full_ent = torch.cat([placeholder_ent[:r0], ent_c, placeholder_ent[r1:]])
            g, e = _loss_grads(loss_of, full_lp, full_ent, stats)
            return g[r0:r1], None if e is None else e[r0:r1]
    else:
        # Sequence-level statistics need every row: a no-grad pass gives the exact log-probs,
        # and one evaluation of the loss gives every row's gradient.
        prefill, prefill_ent = no_grad_pass()
        if context_group is not None:
            with torch.no_grad():
                stats = stats_of(prefill)
        g_all, e_all = _loss_grads(loss_of, prefill, prefill_ent, stats)

        def grad_fn(r0: int, r1: int, logp_c: torch.Tensor, ent_c: torch.Tensor | None):
            return g_all[r0:r1], None if e_all is None else e_all[r0:r1]

    needs = (
        rows.hidden.requires_grad,
        weight.requires_grad,
        bias is not None and bias.requires_grad,
    )
    opts = options(fused=True)
    logp, ent, grads = backend_module(opts).fused_rows(*kernel_inputs, opts, grad_fn, needs)
    with torch.no_grad():
        loss, metrics = loss_of(logp, ent, stats, context_group)
    loss = _StoredGradients.apply(loss, _GradStore(grads), rows.hidden, weight, bias)
    return loss, metrics


def _check_loss_precision(**tensors: torch.Tensor | None) -> None:
    """Loss inputs must be fp32/fp64: a bf16 log-prob of -5 is off by up to 0.016, i.e. a 1.6%
    error in the importance ratio (FSDP2's MixedPrecisionPolicy casts forward arguments to
    bf16 unless cast_forward_inputs=False)."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"{name} must be float32 or float64, got {t.dtype}: 16-bit log-probs and "
                "advantages make the importance ratio wrong by percents. Keep them in fp32 (with "
                "FSDP2 mixed precision: MixedPrecisionPolicy(..., cast_forward_inputs=False))"
            )


def _loss_grads(loss_of, logp: torch.Tensor, ent: torch.Tensor | None, stats=None):
    """d loss / d logp [M] and d loss / d entropy [M] (None without entropy); no collective."""
    with torch.enable_grad():
        lp = logp.detach().requires_grad_()
        en = None if ent is None else ent.detach().requires_grad_()
        loss, _ = loss_of(lp, en, stats)
        inputs = [lp] if en is None else [lp, en]
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    g = grads[0] if grads[0] is not None else torch.zeros_like(lp)
    e = None
    if en is not None:
        e = grads[1] if grads[1] is not None else torch.zeros_like(en)
    return g, e


def _rows_of(values: torch.Tensor, rows: Rows) -> torch.Tensor:
    """[M] entries of a per-token tensor shaped like labels, at the valid rows."""
    if not isinstance(values, torch.Tensor) or values.shape != rows.batch_shape:
        got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(
            f"old_logprobs must be a tensor of labels' shape {list(rows.batch_shape)}, got {got}"
        )
    return rows.gather(values)


class _GradStore:
    """Gradients computed in forward, handed to autograd once by the first backward."""

    def __init__(self, grads: tuple) -> None:
        self.grads: tuple | None = grads


class _StoredGradients(torch.autograd.Function):
    """Returns the loss value; its backward returns the stored gradients × the upstream scale."""

    @staticmethod
    def forward(ctx, loss, store: _GradStore, hidden, weight, bias):
        ctx.store = store
        return loss.detach().clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grads, ctx.store.grads = ctx.store.grads, None
        if grads is None:
            raise RuntimeError(
                "fused_policy_loss: backward was already called on this loss. Its gradients "
                "are computed in the forward pass and released by the first backward; compute "
                "the loss again to backpropagate again."
            )
        dh, dw, db = (None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads)
        return None, None, dh, dw, db
