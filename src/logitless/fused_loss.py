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

import torch

from ._validate import HeadArgs, check_chunk_size, check_head_call
from ._validate_replay import ReplayArgs, check_replay_call
from .fused_replay import replay_policy_loss
from .kernels import (
    Backend,
    Rows,
    backend_module,
    head_options,
    kernel_labels,
    refuse_double_backward,
    select_rows,
)
from .losses import LossNormalizer, PolicyLossConfig
from .losses.checks import LossCall, check_config, check_policy_loss
from .losses.policy import compute_policy_loss
from .losses.stats import DocumentStats, compute_document_stats
from .parallel.vocab import VocabParallel
from .sampling import SamplingMask


def fused_policy_loss(
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
    check_config(config)
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
        backend=backend,
    )
    replay = check_replay_call(
        args,
        ignore_index,
        vocab_parallel=vocab_parallel,
        sampling_mask=sampling_mask,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        with_kept_mass=with_kept_mass,
    )
    if len(args.batch_shape) not in (1, 2):
        raise ValueError(
            f"labels must have shape [N] or [B, T] (hidden [N, H] or [B, T, H]), got "
            f"{list(args.batch_shape)}"
        )
    with_entropy = config.entropy_coef != 0
    mask = (args.labels != ignore_index).reshape(args.batch_shape)
    # The loss contract, checked once before any head FLOP (one collective under context
    # parallelism); the log-probs only lend their shape here.
    like = torch.zeros(args.batch_shape, device=labels.device)
    call = check_policy_loss(
        like,
        old_logprobs,
        advantages,
        mask,
        config=config,
        document_ids=document_ids,
        ref_logprobs=ref_logprobs,
        rollout_logprobs=rollout_logprobs,
        entropy=like if with_entropy else None,
        normalizer=normalizer,
        context_group=context_group,
    )
    return fused_loss_of_checked(
        args,
        call,
        config=config,
        old_logprobs=old_logprobs,
        advantages=advantages,
        ref_logprobs=ref_logprobs,
        rollout_logprobs=rollout_logprobs,
        normalizer=normalizer,
        ignore_index=ignore_index,
        chunk_size=chunk_size,
        vocab_parallel=vocab_parallel,
        replay=replay,
        with_kept_mass=with_kept_mass,
    )


def fused_loss_of_checked(
    args: HeadArgs,
    call: LossCall,
    *,
    config: PolicyLossConfig,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    rollout_logprobs: torch.Tensor | None,
    normalizer: LossNormalizer | None,
    ignore_index: int,
    chunk_size: int | None,
    vocab_parallel: VocabParallel | None,
    replay: ReplayArgs | None = None,
    with_kept_mass: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`fused_policy_loss` of arguments already checked (``check_head_call``,
    ``check_replay_call`` and ``check_policy_loss``): the HF integration checks before its
    backbone runs, then calls this, so each contract is checked once per call."""
    with_entropy = config.entropy_coef != 0
    mask = (args.labels != ignore_index).reshape(args.batch_shape)
    rows = select_rows(args, ignore_index)
    weight, bias = args.weight, args.bias
    loss_fn = _RowLoss(
        call,
        rows,
        mask,
        config,
        old_logprobs,
        advantages,
        ref_logprobs,
        rollout_logprobs,
        normalizer,
    )

    def options(fused: bool):
        return head_options(
            args,
            rows,
            with_entropy,
            chunk_size=chunk_size,
            vocab_parallel=vocab_parallel,
            fused=fused,
        )

    # The kernels get plain tensors: their gradients reach autograd through _StoredGradients.
    kernel_inputs = (
        rows.hidden.detach(),
        weight.detach(),
        None if bias is None else bias.detach(),
        kernel_labels(rows, vocab_parallel),
        rows.temperature,
    )

    def no_grad_pass() -> tuple[torch.Tensor, torch.Tensor | None]:
        opts = options(fused=False)
        with torch.no_grad():
            logp, _, ent, _ = backend_module(opts).forward_rows(*kernel_inputs, opts)
        return logp, ent

    tracked = (args.hidden, weight) if bias is None else (args.hidden, weight, bias)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tracked)
    needs = (
        rows.hidden.requires_grad,
        weight.requires_grad,
        bias is not None and bias.requires_grad,
    )
    if replay is not None:
        loss, metrics, grads = replay_policy_loss(
            rows,
            weight,
            bias,
            kernel_inputs[3],
            options(fused=False),
            replay,
            with_kept_mass=with_kept_mass,
            needs=needs if grad else None,
            loss_fn=loss_fn,
            context_group=call.group,
        )
        if grads is not None:
            loss = _StoredGradients.apply(loss, _GradStore(grads), rows.hidden, weight, bias)
        return loss, metrics
    if not grad:
        return loss_fn.evaluate(*no_grad_pass(), reduce_metrics=True)

    grouped = call.group is not None
    if config.is_token_local:
        # Each chunk's gradient comes from the loss with the other rows at any finite value
        # (old log-probs: ratio 1); token-locality makes it exact, and the document statistics
        # of a token-local loss do not depend on log π_θ, so the placeholder gives the right
        # ones (summed over the context group once, here).
        placeholder = rows.gather(old_logprobs).detach().float()  # [M]
        placeholder_ent = torch.zeros_like(placeholder) if with_entropy else None
        stats = loss_fn.stats(placeholder) if grouped else None
        grad_fn = loss_fn.chunk_grad_fn(placeholder, placeholder_ent, stats)
    else:
        # Sequence-level statistics need every row: a no-grad pass gives the exact log-probs,
        # and one evaluation of the loss gives every row's gradient.
        prefill, prefill_ent = no_grad_pass()
        stats = loss_fn.stats(prefill) if grouped else None
        g_all, e_all = loss_fn.grads(prefill, prefill_ent, stats)

        def grad_fn(r0: int, r1: int, logp_c: torch.Tensor, ent_c: torch.Tensor | None):
            return g_all[r0:r1], None if e_all is None else e_all[r0:r1]

    opts = options(fused=True)
    logp, ent, grads = backend_module(opts).fused_rows(*kernel_inputs, opts, grad_fn, needs)
    with torch.no_grad():
        loss, metrics = loss_fn.evaluate(logp, ent, stats, reduce_metrics=True)
    loss = _StoredGradients.apply(loss, _GradStore(grads), rows.hidden, weight, bias)
    return loss, metrics


class _RowLoss:
    """The policy loss of a checked call as a function of the valid rows' log-probs ``[M]``
    (and entropy ``[M]``): what the head's gradient pass needs of the loss."""

    def __init__(
        self, call, rows: Rows, mask, config, old, advantages, ref, rollout, normalizer
    ) -> None:
        self.call, self.rows, self.mask, self.config = call, rows, mask, config
        self.old, self.advantages, self.ref, self.rollout = old, advantages, ref, rollout
        self.normalizer = normalizer

    def evaluate(
        self,
        logp: torch.Tensor,
        ent: torch.Tensor | None,
        stats: DocumentStats | None = None,
        reduce_metrics: bool = False,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, metrics)``; collectives only with ``reduce_metrics`` (and no ``stats``)."""
        return compute_policy_loss(
            self.call,
            self.rows.scatter(logp),
            self.old,
            self.advantages,
            self.mask,
            config=self.config,
            ref_logprobs=self.ref,
            rollout_logprobs=self.rollout,
            entropy=None if ent is None else self.rows.scatter(ent),
            normalizer=self.normalizer,
            document_stats=stats,
            reduce_metrics=reduce_metrics,
        )

    def stats(self, logp: torch.Tensor) -> DocumentStats:
        """The call's document statistics at these log-probs (summed over the context group)."""
        with torch.no_grad():
            return compute_document_stats(
                self.call,
                self.config,
                self.rows.scatter(logp),
                self.old,
                self.advantages,
                self.mask,
                self.rollout,
            )

    def grads(self, logp: torch.Tensor, ent: torch.Tensor | None, stats=None):
        """d loss / d logp [M] and d loss / d entropy [M] (None without entropy)."""
        with torch.enable_grad():
            lp = logp.detach().requires_grad_()
            en = None if ent is None else ent.detach().requires_grad_()
            loss, _ = self.evaluate(lp, en, stats)
            inputs = [lp] if en is None else [lp, en]
            grads = torch.autograd.grad(loss, inputs, allow_unused=True)
        g = grads[0] if grads[0] is not None else torch.zeros_like(lp)
        e = None
        if en is not None:
            e = grads[1] if grads[1] is not None else torch.zeros_like(en)
        return g, e

    def chunk_grad_fn(self, placeholder, placeholder_ent, stats):
        """``grad_fn(r0, r1, logp_c, ent_c)`` of a token-local loss: the gradient of rows
        ``[r0, r1)`` with every other row held at the placeholder."""

        def grad_fn(r0: int, r1: int, logp_c: torch.Tensor, ent_c: torch.Tensor | None):
            full_lp = torch.cat([placeholder[:r0], logp_c, placeholder[r1:]])
            full_ent = None
            if ent_c is not None:
                full_ent = torch.cat([placeholder_ent[:r0], ent_c, placeholder_ent[r1:]])
            g, e = self.grads(full_lp, full_ent, stats)
            return g[r0:r1], None if e is None else e[r0:r1]

        return grad_fn


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
    def backward(ctx, grad_loss):
        refuse_double_backward("fused_policy_loss")
        grads, ctx.store.grads = ctx.store.grads, None
        if grads is None:
            raise RuntimeError(
                "fused_policy_loss: backward was already called on this loss. Its gradients "
                "are computed in the forward pass and released by the first backward; compute "
                "the loss again to backpropagate again."
            )
        dh, dw, db = (None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads)
        return None, None, dh, dw, db
