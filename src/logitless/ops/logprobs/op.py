"""The LM-head op: per-token log-probs and entropy without ``[tokens, vocab]`` logits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...contract.head import HeadCall, check_head_call
from ...contract.options import (
    IGNORE_INDEX,
    Backend,
    HeadOptions,
    SamplerOptions,
    WeightGradInto,
    given_arguments,
)
from ...contract.rollout import RolloutTopK
from ...contract.vocab import VocabParallel
from ...sampling import SamplingMask
from ...types import LogProbs
from ..rows import kernel_batch, kernel_options, select_rows
from .function import run_rows


@given_arguments
def linear_logprobs(
    given: Mapping[str, Any],
    /,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    logit_scale: float | None = None,
    with_entropy: bool = False,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
    vocab_parallel: VocabParallel | None = None,
    backend: Backend = "auto",
    sampling_mask: SamplingMask | torch.Tensor | None = None,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    with_kept_mass: bool = False,
    capturable: bool = False,
    row_capacity: int | None = None,
    batch_invariant: bool = False,
    weight_grad_into: WeightGradInto | None = None,
    rollout_topk: RolloutTopK | None = None,
) -> LogProbs:
    """Log-probability of each label (and the entropy of each row) straight from hidden states.

    Computes what this plain PyTorch computes, without allocating the ``[..., V]`` logits::

        logits = F.linear(hidden, weight, bias).float()       # head_dtype matmul, fp32 softmax
        logits = logits * logit_scale                         # if logit_scale is given
        logits = softcap * tanh(logits / softcap)             # if softcap is given
        logits = logits / temperature
        logprobs = logits.log_softmax(-1).gather(-1, labels[..., None])[..., 0]
        entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)

    Rows whose label equals ``ignore_index`` are removed before the projection (no FLOPs, no
    memory) and get 0.0 with a zero gradient. The logits are processed in tiles of
    ``[chunk_size, vocab_block]``; backward recomputes each tile, so only ``[rows]``-sized
    statistics live between forward and backward.

    Args:
        hidden: ``[..., H]`` final hidden states, fp32 / bf16 / fp16 (float64: computed in
            float64).
        weight: ``[V, H]`` LM-head (or tied embedding) weight.
        labels: ``[...]`` integer target ids in ``[0, V)``, or ``ignore_index``.
        bias: ``[V]`` head bias, or None.
        temperature: sampling temperature, a float or a tensor broadcastable to ``labels``
            (per token); treated as a constant (no gradient).
        softcap: final-logit soft-capping constant ``c`` (Gemma-2): ``c·tanh(z / c)``, applied
            before the temperature.
        logit_scale: a constant the logits are multiplied by, after the bias and before softcap
            and temperature (Cohere's ``logit_scale``; Granite divides by ``logits_scaling``:
            pass its inverse). None: 1.
        with_entropy: also return the entropy of each row's distribution (differentiable).
        ignore_index: label value that marks rows to skip.
        chunk_size: rows per tile; None picks it from a memory budget (8 MiB fp32 tiles on CPU,
            256 MiB on accelerators). The result does not depend on it beyond float rounding.
        head_dtype: dtype the projection runs in, e.g. ``torch.float32`` for a bf16 model
            (vLLM's fp32 LM head). None: the inputs' dtype.
        vocab_parallel: a :class:`~logitless.VocabParallel` when the head is split over a
            tensor-parallel group: ``weight``/``bias`` are then this rank's rows of the
            vocabulary, labels stay global ids, and every rank gets the same outputs (a
            collective call; see :mod:`logitless.parallel`).
        backend: which kernels run the call: ``"torch"`` (bounded fp32 tiles and torch
            matmuls; any device), ``"triton"`` (Triton kernels that keep the logits in
            registers; CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"auto"`` (Triton for
            16-bit heads on CUDA when it is installed, the torch tiles otherwise). Both meet
            the same numerical contract. Rows truncated by sampling replay run torch code on
            every backend (see ``docs/sampling-replay.md``).
        sampling_mask: sampling replay from the engine's kept sets: a
            :class:`~logitless.SamplingMask` ``(token_ids [nnz], offsets [N + 1])`` in CSR over
            the label positions (row-major, ``N = labels.numel()``, global ids), or padded ids
            ``[*labels.shape, K]`` with negative values as padding. Each row's log-prob and
            entropy are then over its kept set ``K`` (plus the label):
            ``logp = z[y] - logsumexp(z[K])``, gradients through ``z[K]`` only; a row with no
            kept id is not truncated (full vocabulary). Only the kept weight rows are read.
        top_k, top_p, min_p: sampling replay by the sampler's parameters instead (an int /
            float, or a tensor broadcastable to ``labels``): the kept set is recomputed from
            these logits as vLLM's sampler builds it (temperature, min-p, top-k keeping ties
            at the k-th value, then top-p over the renormalized rest, at least one token), by
            a streaming top-k over vocabulary tiles. ``top_k >= V``, ``top_p = 1`` and
            ``min_p = 0`` mean "not truncated". Not together with ``sampling_mask``.
        with_kept_mass: with replay, also report ``log_kept_mass`` (the log of each row's kept
            mass under the full softmax); with a ``sampling_mask`` it costs one more pass over
            the vocabulary (no gradient), with top-k / top-p it is free.
        capturable: no host read and output / work shapes that depend on the input shapes only
            (for CUDA graphs and ``torch.compile(fullgraph=True)``): every row is projected and
            the ignored rows masked, and the value checks (label range, temperature) become
            device-side assertions (docs/capturable.md). Not with sampling replay; under vocab
            parallelism the ranks' agreement is not checked.
        row_capacity: with ``capturable``, project only this many rows, the valid rows first in
            their order (a caller who knows the responses fit saves the prompt rows' work);
            more valid rows than this is a device-side error, never rows dropped.
        batch_invariant: each token's outputs are the same bits whatever else is in the call
            (how many rows, their values and order, how many are ignored), whatever the
            caller's chunking, with or without gradients, and the same as inside
            :func:`~logitless.fused_policy_loss` and :func:`~logitless.linear_divergence` (so a
            PPO ratio on unchanged weights is exactly 1.0); each row's hidden gradient is the
            same bits for the same upstream gradient and the weight gradient is deterministic.
            For one device, dtype and head (docs/head.md, "Batch invariance"). Fixed row blocks
            of the torch tiles (the last one padded); refused with a ``ValueError`` where the
            device's matmul gives a row different bits at another place in a block (checked
            once, on the first call). Composes with ``capturable``.
        weight_grad_into: gradient-accumulation fusion: a
            :class:`~logitless.contract.options.WeightGradInto` whose ``buffer`` (``[V, H]``
            like ``weight``, in the compute dtype: fp32 for fp32 / bf16 / fp16 heads) the
            backward adds the weight gradient into, tile by tile, instead of returning it:
            no ``[V, H]`` gradient tensor is allocated and ``weight`` gets no gradient through
            autograd (Megatron DDP's ``main_grad``; see docs/megatron.md). Not with sampling
            replay or under ``torch.compile``.
        rollout_topk: the rollout engine's top-k log-probs per label position, a
            :class:`~logitless.RolloutTopK` (``token_ids`` / ``logprobs`` ``[..., k]``, unused
            slots ``pad_id``), as vLLM (``logprobs=k``) or SGLang (``top_logprobs_num``)
            return them: the result's ``mismatch`` (a :class:`~logitless.types
            .RolloutMismatch`) then compares the trainer's distribution (this call's: with
            sampling replay, over the kept set) with the engine's at every position: the
            trainer's log-probs of the engine's ids, KL both ways and the total variation on
            the partition {each id, the rest} (lower bounds of their full-vocabulary values),
            the trainer's mass on the ids, whether the two top-1 tokens agree. Computed in the
            same forward (no ``[N, V]`` tensor, no second pass over the vocabulary); the
            log-probs, entropy and gradients are the same bits as without it
            (docs/rollout-mismatch.md). Not with ``capturable``.

    Returns:
        :class:`LogProbs` ``(logprobs, entropy)``: fp32 tensors of ``labels.shape`` (float64
        for a float64 head); entropy is None unless ``with_entropy``. Gradients flow to hidden,
        weight and bias in their own dtypes, from both outputs. With replay, a
        :class:`~logitless.types.ReplayLogProbs` (unpacks the same way) that also carries
        ``label_added`` (bool: the label was not in its kept set and was added),
        ``kept_size`` (int64 ``|K|``) and ``log_kept_mass``. With ``rollout_topk``, a
        :class:`~logitless.types.RolloutLogProbs` (or the ``ReplayLogProbs``) whose
        ``mismatch`` holds the diagnostics.

    Raises:
        ValueError: on any shape, dtype, device or value problem, before any work.

    Example:
        >>> import torch, logitless
        >>> hidden = torch.randn(2, 5, 16, requires_grad=True)
        >>> weight = torch.randn(100, 16, requires_grad=True)
        >>> labels = torch.randint(0, 100, (2, 5))
        >>> labels[:, :2] = -100                                  # prompt tokens
        >>> out = logitless.linear_logprobs(hidden, weight, labels, with_entropy=True)
        >>> out.logprobs.shape, out.logprobs.dtype
        (torch.Size([2, 5]), torch.float32)
        >>> (out.logprobs.sum() + 0.01 * out.entropy.sum()).backward()
    """
    return logprobs_of(
        hidden, weight, labels, bias, HeadOptions.pick(given), SamplerOptions.pick(given)
    )


def logprobs_of(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    options: HeadOptions,
    sampler: SamplerOptions,
) -> LogProbs:
    """:func:`linear_logprobs` with its options as objects (the modules' entry)."""
    compiling = torch.compiler.is_compiling()
    if compiling and options.weight_grad_into is not None:
        raise ValueError(
            "weight_grad_into is not supported under torch.compile: the compiled op returns "
            "the weight gradient to autograd"
        )
    plain = not sampler.replaying and sampler.rollout_topk is None
    if options.vocab_parallel is None and plain and compiling:
        # Compiled code calls the op as one opaque custom op (same checks and kernels inside):
        # the checks' host read and the data-dependent row selection cannot be traced.
        from .compiled import linear_logprobs_op

        return linear_logprobs_op(hidden, weight, labels, bias, options)
    return logprobs_of_call(check_head_call(hidden, weight, labels, bias, options, sampler))


def logprobs_of_call(call: HeadCall) -> LogProbs:
    """The log-prob op on a checked call (the HF integration checks before its backbone runs,
    then calls this: one check, one sync)."""
    rows = select_rows(call)
    if call.replay is not None:
        from ..replay.op import replay_logprobs

        return replay_logprobs(call, rows)
    if call.rollout is not None:
        from ..rollout.mismatch import rollout_logprobs

        return rollout_logprobs(call, rows)
    logp, ent = run_rows(kernel_batch(call, rows), kernel_options(call, rows.labels.numel()))
    return LogProbs(rows.scatter(logp), None if ent is None else rows.scatter(ent))
