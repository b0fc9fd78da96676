"""The seam every trainer integration answers through (DESIGN.md, "Integrations: one seam").

An integration (HF, TRL, Megatron, verl) answers four questions; this module holds the typed
answers and the code that acts on them, so an integration file only says how *its* model
answers:

1. **What the model hands the head.** :class:`Tokens`: the final hidden states in the model's
   own layout (batch-first ``[B, T, H]`` or sequence-first ``[S, B, H]``, possibly scattered
   along the sequence) and the labels in the trainer's alignment (``[B, T]``, the ignore index
   where there is no target). Outputs come back in the labels' shape: that is how rows map
   back.
2. **The weight and its transform.** :class:`Head`: the full weight or this rank's vocabulary
   shard, with its bias, logit scale and softcap.
3. **Where the head runs.** :func:`run_as_forward`: a function run *as* the forward of the
   module that owns the weight (the outermost wrapper, FSDP2's ``lm_head`` unit, Megatron's
   ``output_layer``) for one call, so that module's forward hooks (parameter gathers,
   gradient-reducer arming) run around it.
4. **Parallelism and the loss's inputs.** :class:`Parallelism` is the one description of how
   the head's work is split (vocabulary, sequence, context); :class:`LossInputs` holds the
   loss's per-token inputs (old / reference / rollout log-probs, advantages, mask, document
   ids, the teacher) once, instead of in every signature.

:func:`logprobs`, :func:`policy_loss` and :func:`divergence` run the head on those answers:
gather a sequence-parallel shard (its gradient reduce-scattered back), put the rows in the
labels' alignment, and call :func:`logitless.linear_logprobs`,
:func:`logitless.fused_policy_loss` or :func:`logitless.linear_divergence` with the vocabulary
group and the context group.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from ..contract.divergence import TeacherTopK
from ..contract.vocab import VocabParallel
from ..parallel.context import CP_LAYOUTS
from ..types import Divergence, LogProbs, TeacherHead

__all__ = [
    "ContextParallel",
    "Head",
    "LossInputs",
    "Parallelism",
    "SequenceParallel",
    "Tokens",
    "divergence",
    "logprobs",
    "policy_loss",
    "run_as_forward",
]

T = TypeVar("T")
R = TypeVar("R")


# --- 3. where the head runs ---------------------------------------------------------------


def run_as_forward(
    module: nn.Module, fn: Callable[..., T], call: Callable[[], R], *, caller: str = "the call"
) -> tuple[R, T]:
    """``call()`` with ``module``'s forward replaced by ``fn`` for one call: ``(call's result,
    fn's result)``.

    ``call`` is what makes the model run (``wrapper()``, ``gpt_model(input_ids, ...)``); when it
    reaches ``module(...)``, the module's forward hooks run as usual (FSDP2's unshard,
    Megatron's ``overlap_param_gather`` pre-hook, DDP's reducer) and ``fn`` gets the arguments
    the forward would have got. No class is patched: the instance attribute ``forward`` is set
    for the call and restored before ``fn`` runs (so ``fn`` may call the real forward, and
    later calls of the module run normally) and after ``call`` returns or raises. ``fn``'s
    result is what the module returns to its caller.

    Raises ``RuntimeError`` if ``call`` never called ``module`` (``caller`` names ``call`` in
    the message).

    >>> lin = torch.nn.Linear(2, 3)
    >>> seen = []
    >>> _ = lin.register_forward_pre_hook(lambda m, args: seen.append(len(args)))
    >>> out, mine = run_as_forward(lin, lambda x: x.sum(), lambda: lin(torch.ones(4, 2)) * 2)
    >>> float(out), float(mine), seen
    (16.0, 8.0, [1])
    """
    own = vars(module).get("forward")  # an instance-level forward (accelerate's autocast)
    result: list[T] = []

    def restore() -> None:
        if own is None:
            vars(module).pop("forward", None)
        else:
            module.forward = own

    def forward(*args: Any, **kwargs: Any) -> T:
        restore()
        result.append(fn(*args, **kwargs))
        return result[-1]

    module.forward = forward
    try:
        out = call()
    finally:
        restore()
    if not result:
        raise RuntimeError(
            f"{caller} did not call {type(module).__name__}'s forward; logitless cannot run "
            "inside it"
        )
    return out, result[-1]


# --- 4. parallelism, one description ------------------------------------------------------


@dataclass(frozen=True)
class SequenceParallel:
    """Hidden states scattered along the sequence over ``group`` (Megatron's sequence
    parallelism): each rank holds ``1/size`` of dimension ``dim``, in rank order.

    The head gathers them along ``dim`` on entry and reduce-scatters their gradient on exit
    (the semantics of Megatron's ``gather_from_sequence_parallel_region``); the vocabulary
    group then leaves the hidden gradient unsummed, since the reduce-scatter sums it.
    """

    group: Any
    dim: int = 0

    def gather(self, hidden: torch.Tensor) -> torch.Tensor:
        """The whole sequence on every rank; differentiable (the gradient reduce-scattered)."""
        return _GatherSequence.apply(hidden, self.group, self.dim)


@dataclass(frozen=True)
class ContextParallel:
    """Each document split over ``group`` along its tokens, ``layout`` ``"zigzag"`` (2·cp
    chunks, rank r holding r and 2·cp−1−r: Megatron's and TE's load-balanced split) or
    ``"contiguous"`` (verl's Ulysses slices). The head is token-local, so only the loss's
    per-document statistics cross ranks (``context_group=``)."""

    group: Any
    layout: str = "zigzag"

    def __post_init__(self) -> None:
        if self.layout not in CP_LAYOUTS:
            raise ValueError(f"layout must be one of {list(CP_LAYOUTS)}, got {self.layout!r}")


@dataclass(frozen=True)
class Parallelism:
    """How the head's work is split: the vocabulary (``vocab``, a :class:`VocabParallel` over
    the tensor-parallel group), the sequence of the hidden states (``sequence``) and the
    documents' tokens (``context``). Each is None when not split."""

    vocab: VocabParallel | None = None
    sequence: SequenceParallel | None = None
    context: ContextParallel | None = None

    @property
    def context_group(self) -> Any:
        return None if self.context is None else self.context.group

    def head_vocab(self) -> VocabParallel | None:
        """The vocabulary split the head runs with: under sequence parallelism the gather's
        reduce-scatter sums the hidden gradient over the group, so the head must not."""
        vp = self.vocab
        if vp is None or self.sequence is None or not vp.reduce_hidden_grad:
            return vp
        vp = copy.copy(vp)  # no collective: the ranges were exchanged at construction
        vp.reduce_hidden_grad = False
        return vp


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` in forward, reduce-scatter (sum) along it in backward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group, ctx.dim = group, dim
        size = dist.get_world_size(group)
        if size == 1:
            return hidden.clone()
        local = hidden.movedim(dim, 0).contiguous()
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        _all_gather(out, local, group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        size = dist.get_world_size(ctx.group)
        if size == 1:
            return grad, None, None
        full = grad.movedim(ctx.dim, 0).contiguous()
        out = full.new_empty((full.shape[0] // size, *full.shape[1:]))
        _reduce_scatter(out, full, ctx.group)
        return out.movedim(0, ctx.dim), None, None


def _all_gather(out: torch.Tensor, local: torch.Tensor, group: Any) -> None:
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local, group=group)


def _reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: Any) -> None:
    import torch.distributed as dist

    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, full, group=group)


# --- 1. what the model hands the head; 2. the weight and its transform ---------------------


@dataclass(frozen=True)
class Tokens:
    """The hidden states a model hands the head, and the labels they are scored against.

    hidden: the model's final hidden states in its own layout: ``[B, T, H]``, or ``[S, B, H]``
        with ``sequence_first`` (Megatron); under sequence parallelism this rank's shard of
        the sequence dimension.
    labels: ``[B, T]`` global token ids in the trainer's alignment (what position ``t`` is
        scored on), ``ignore_index`` where nothing is; the outputs come back in this shape.
    """

    hidden: torch.Tensor
    labels: torch.Tensor
    sequence_first: bool = False

    def aligned(self, parallel: Parallelism) -> torch.Tensor:
        """The hidden states gathered (under sequence parallelism) and laid out like the
        labels, ``[B, T, H]``; differentiable."""
        hidden = self.hidden
        if parallel.sequence is not None:
            hidden = parallel.sequence.gather(hidden)
        return hidden.transpose(0, 1) if self.sequence_first else hidden


@dataclass(frozen=True)
class Head:
    """An LM head: ``weight`` ``[V, H]`` (or this rank's ``[V/tp, H]`` vocabulary shard), its
    ``bias``, ``logit_scale`` and ``softcap``."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    logit_scale: float | None = None
    softcap: float | None = None

    def options(self) -> dict[str, Any]:
        return {"bias": self.bias, "logit_scale": self.logit_scale, "softcap": self.softcap}

    def as_teacher(self, hidden: torch.Tensor) -> TeacherHead:
        """This head as the ``teacher=`` of :func:`logitless.fused_policy_loss` (frozen: its
        weight and bias detached)."""
        bias = None if self.bias is None else self.bias.detach()
        return TeacherHead(hidden, self.weight.detach(), bias, self.logit_scale, self.softcap)


@dataclass(frozen=True)
class LossInputs:
    """The per-token inputs of a policy loss, in the labels' alignment (``[B, T]``).

    old_logprobs: the behaviour policy's log-probs. advantages: ``[B, T]`` per token, or
    ``[D]`` per document (with ``document_ids``). mask: the tokens trained on (the composed
    :func:`logitless.policy_loss`; the fused loss reads it from the labels). ref_logprobs,
    rollout_logprobs, document_ids: as :func:`logitless.policy_loss` takes them. teacher: a
    :class:`~logitless.TeacherHead` or :class:`~logitless.TeacherTopK` for the distillation
    term.
    """

    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    teacher: TeacherHead | TeacherTopK | None = field(default=None)

    def replace(self, **changes: Any) -> LossInputs:
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return LossInputs(**(fields | changes))

    def loss_kwargs(self) -> dict[str, Any]:
        """The keyword arguments both loss entries take."""
        return {
            "document_ids": self.document_ids,
            "ref_logprobs": self.ref_logprobs,
            "rollout_logprobs": self.rollout_logprobs,
        }


# --- the head on these answers ------------------------------------------------------------


def logprobs(
    tokens: Tokens, head: Head, parallel: Parallelism = Parallelism(), **options: Any
) -> LogProbs:
    """:func:`logitless.linear_logprobs` of ``tokens`` under ``parallel``: outputs in the
    labels' shape, the same on every rank of the vocabulary group."""
    from ..ops.logprobs.op import linear_logprobs

    return linear_logprobs(
        tokens.aligned(parallel),
        head.weight,
        tokens.labels,
        vocab_parallel=parallel.head_vocab(),
        **head.options(),
        **options,
    )


def policy_loss(
    tokens: Tokens,
    head: Head,
    inputs: LossInputs,
    parallel: Parallelism = Parallelism(),
    **options: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`logitless.fused_policy_loss` of ``tokens`` under ``parallel`` (its context group
    sums the documents' statistics); ``options``: its config, normalizer, temperature, ..."""
    from ..ops.fused_loss.op import fused_policy_loss

    return fused_policy_loss(
        tokens.aligned(parallel),
        head.weight,
        tokens.labels,
        inputs.old_logprobs,
        inputs.advantages,
        vocab_parallel=parallel.head_vocab(),
        context_group=parallel.context_group,
        teacher=inputs.teacher,
        **inputs.loss_kwargs(),
        **head.options(),
        **options,
    )


def divergence(
    tokens: Tokens,
    head: Head,
    teacher: Tokens,
    teacher_head: Head,
    parallel: Parallelism = Parallelism(),
    **options: Any,
) -> Divergence:
    """:func:`logitless.linear_divergence` from ``teacher`` (its hidden states in its model's
    layout, the same labels) to ``tokens``; the two heads split the vocabulary the same way."""
    from ..ops.divergence.op import linear_divergence

    with torch.no_grad():
        teacher_hidden = teacher.aligned(parallel)
    return linear_divergence(
        tokens.aligned(parallel),
        head.weight,
        tokens.labels,
        teacher_hidden,
        teacher_head.weight.detach(),  # frozen: a teacher's parameters may require grad
        teacher_bias=None if teacher_head.bias is None else teacher_head.bias.detach(),
        teacher_logit_scale=teacher_head.logit_scale,
        teacher_softcap=teacher_head.softcap,
        vocab_parallel=parallel.head_vocab(),
        **head.options(),
        **options,
    )
