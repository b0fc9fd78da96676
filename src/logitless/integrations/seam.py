"""The seam every trainer integration answers through (DESIGN.md, "Integrations: one seam").

Every trainer integration answers the same questions; this module holds the typed answers and
the code that acts on them, so an integration only says how *its* model answers. It is the
one module of :mod:`logitless.integrations` that imports the ops
(tests/test_integration_layout.py holds that).

**The call, described once.**

- :class:`Tokens`: the final hidden states in the model's own layout (batch-first
  ``[B, T, H]`` or sequence-first ``[S, B, H]``, possibly scattered along the sequence) and the
  labels in the trainer's alignment (``[B, T]``, the ignore index where there is no target).
  Outputs come back in the labels' shape: that is how rows map back.
- :class:`Head`: the full weight or this rank's vocabulary shard, with its bias, logit scale
  and softcap.
- :class:`Parallelism`: how the head's work is split (vocabulary, sequence, context).
- :class:`LossInputs`: the loss's per-token inputs (old / reference / rollout log-probs,
  advantages, document ids, the teacher), once.

**Two phases.**

1. :func:`prepare`, *before the backbone runs*: the labels, the :class:`Head` (its parameters
   or stand-ins with their shape, dtype and device), the options and the parallelism are
   checked as one head call on a placeholder of the hidden states (label range, temperature,
   dtypes, devices, backend, sampler: :func:`~logitless.contract.head.check_head_call`, one
   host read, collective under vocabulary parallelism); :meth:`Prepared.with_loss` adds the
   loss's contract. A bad option costs no forward.
2. After the backbone, on the real hidden states and the head's parameters as its owner's
   forward sees them: :func:`logprobs`, :func:`policy_loss`, :func:`divergence`. The hidden
   states are gathered under sequence parallelism (their gradient reduce-scattered back), laid
   out like the labels, checked against the prepared call (shape, dtype, device: no second
   host read) and handed to the op.

**Where the head runs.** :func:`run_head` runs the head as the forward of the module that owns
its weight (FSDP2's ``lm_head`` unit, Megatron's ``output_layer``), so that module's forward
hooks (parameter gathers, gradient-reducer arming) run around it, and holds a DeepSpeed ZeRO-3
weight whole for as long as the head needs it. :func:`run_as_forward` is the instance-forward
swap underneath (also used by :mod:`~logitless.integrations.wrappers` for a whole step), and
:func:`class_forward` sets an instance-level forward aside.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from ..contract.divergence import DivergenceOptions, TeacherTopK, check_divergence_call
from ..contract.head import HeadCall, check_head_call, with_hidden
from ..contract.options import HeadOptions, SamplerOptions
from ..contract.vocab import VocabParallel
from ..losses import LossNormalizer, PolicyLossConfig
from ..losses.call import LossCall
from ..ops.divergence.op import divergence_of_call
from ..ops.fused_loss.op import (
    check_loss_of_head,
    fused_loss_and_logprobs_of_call,
    fused_loss_of_call,
    teacher_divergence,
)
from ..ops.logprobs.op import logprobs_of_call
from ..parallel.context import CP_LAYOUTS
from ..types import Divergence, LogProbs, TeacherHead
from . import deepspeed

try:  # FSDP2 (torch >= 2.6 exports it here)
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch builds without distributed
    FSDPModule = ()  # type: ignore[assignment,misc]

__all__ = [
    "ContextParallel",
    "FSDPModule",
    "Head",
    "LossInputs",
    "Parallelism",
    "Prepared",
    "SequenceParallel",
    "Tokens",
    "class_forward",
    "divergence",
    "logprobs",
    "policy_loss",
    "policy_loss_and_logprobs",
    "prepare",
    "run_as_forward",
    "run_head",
]

T = TypeVar("T")
R = TypeVar("R")


# --- where the head runs ------------------------------------------------------------------


def _put_back(module: nn.Module, own: Callable[..., Any] | None) -> None:
    """Restore ``module``'s instance-level forward (``own``), or remove the one set here."""
    if own is None:
        vars(module).pop("forward", None)
    else:
        module.forward = own


@contextlib.contextmanager
def class_forward(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` with its class's forward for the duration: an instance-level ``forward`` (one
    a library gave this instance: accelerate's autocast wrapper, verl's fused forward) is set
    aside and put back afterwards, also when the body raises. For code that runs as that
    instance forward and calls the model again."""
    own = vars(module).pop("forward", None)
    try:
        yield module
    finally:
        if own is not None:
            module.forward = own


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

    def forward(*args: Any, **kwargs: Any) -> T:
        _put_back(module, own)
        result.append(fn(*args, **kwargs))
        return result[-1]

    module.forward = forward
    try:
        out = call()
    finally:
        _put_back(module, own)
    if not result:
        raise RuntimeError(
            f"{caller} did not call {type(module).__name__}'s forward; logitless cannot run "
            "inside it"
        )
    return out, result[-1]


def run_head(
    owner: nn.Module,
    fn: Callable[..., T],
    *args: Any,
    reach: Callable[[], Any] | None = None,
    gather: Iterable[torch.Tensor | None] = (),
    caller: str = "the call",
) -> T:
    """``fn(*args, *forward_args, **forward_kwargs)``, the head, run as the forward of
    ``owner``, the module that owns the head's weight, so its forward hooks run around it.

    ``reach``: what makes the model call ``owner`` itself (Megatron: the ``GPTModel``'s own
    forward, which calls ``output_layer(hidden, weight=...)``); ``fn`` then also gets the
    arguments of that call, and ``reach``'s own result is dropped. None: the head is called
    from here, through ``owner()`` (no arguments: ``fn``'s travel in the closure, so a hook
    that casts its module's inputs never touches them) when ``owner`` is an FSDP2 unit of its
    own (its parameters exist whole only inside its forward; their gradients are
    reduce-scattered after backward), else directly.

    ``gather``: DeepSpeed ZeRO-3 parameters to hold whole for as long as the head needs them:
    gathered before ``fn`` runs and released when its backward has reached ``args`` or the
    parameters' gradients have been accumulated
    (:func:`~logitless.integrations.deepspeed.run_gathered`); a no-op for other parameters.

    >>> lin = torch.nn.Linear(2, 3)
    >>> run_head(lin, lambda x: x * 2, torch.ones(1))
    tensor([2.])
    """
    params = list(gather)

    def head(*forward_args: Any, **forward_kwargs: Any) -> T:
        def whole(*tensors: Any) -> T:
            return fn(*tensors, *forward_args, **forward_kwargs)

        return deepspeed.run_gathered(params, whole, *args)

    if reach is None:
        if not isinstance(owner, FSDPModule):
            return head()
        reach = owner
    _, out = run_as_forward(owner, head, reach, caller=caller)
    return out


# --- parallelism, one description ------------------------------------------------------


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


# --- the call: tokens, head, loss inputs -----------------------------------------------------


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
    ``bias``, ``logit_scale`` and ``softcap``. Before the backbone runs (:func:`prepare`) the
    parameters may be stand-ins with their shape, dtype and device (a sharded FSDP2 or ZeRO-3
    weight's)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    logit_scale: float | None = None
    softcap: float | None = None

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
        return dataclasses.replace(self, **changes)

    def per_token(self) -> dict[str, torch.Tensor | None]:
        """The per-token tensors the loss checks against the labels, by argument name."""
        return {
            "old_logprobs": self.old_logprobs,
            "advantages": self.advantages,
            "ref_logprobs": self.ref_logprobs,
            "rollout_logprobs": self.rollout_logprobs,
        }


# --- phase 1: prepare, before the backbone -----------------------------------------------


@dataclass(frozen=True)
class Prepared:
    """A head call checked before the backbone ran (:func:`prepare`).

    call: the checked call, on a placeholder of the hidden states (swapped for the real ones
    by :meth:`on`). options: the options it was checked with (the head's transform and the
    vocabulary split in them). parallel: the split. loss: the loss's checked contract
    (:meth:`with_loss`), or None. teacher: the distillation term's teacher, or None.
    """

    call: HeadCall
    options: HeadOptions
    parallel: Parallelism = Parallelism()
    loss: LossCall | None = None
    teacher: TeacherHead | TeacherTopK | None = None

    @property
    def labels(self) -> torch.Tensor:
        """The labels, in the call's shape."""
        return self.call.labels.reshape(self.call.batch_shape)

    def flat(self) -> Prepared:
        """The call over the flat ``[N]`` token stream (outputs ``[N]``; hidden states
        ``[N, H]``): a packed batch's loss sees documents, not rows."""
        return dataclasses.replace(
            self, call=self.call.replace(batch_shape=torch.Size([self.call.labels.numel()]))
        )

    def with_entropy(self, with_entropy: bool) -> Prepared:
        """The call asking (or not) for the entropy."""
        options = dataclasses.replace(self.options, with_entropy=with_entropy)
        return dataclasses.replace(
            self, call=self.call.replace(with_entropy=with_entropy), options=options
        )

    def with_loss(
        self,
        inputs: LossInputs,
        config: PolicyLossConfig | None = None,
        normalizer: LossNormalizer | None = None,
        *,
        distillation: bool | None = None,
    ) -> Prepared:
        """The call with the fused policy loss's contract checked (the per-token inputs against
        the labels, the config, the normalizer; one collective under context parallelism);
        the entropy is computed when ``config.entropy_coef`` asks for it. ``distillation``:
        whether the loss has a distillation term (None: whether ``inputs.teacher`` is given;
        True with no teacher yet: it is set later, :meth:`with_teacher`, once the teacher's
        model has run)."""
        prepared = self.with_entropy(
            isinstance(config, PolicyLossConfig) and config.entropy_coef != 0
        )
        per_token = inputs.per_token()
        distills = inputs.teacher is not None if distillation is None else distillation
        if distills:  # its shape stands in until the head computes it
            call = prepared.call
            per_token["divergence"] = torch.zeros(
                call.batch_shape, dtype=torch.float32, device=call.labels.device
            )
        loss = check_loss_of_head(
            prepared.call, config=config, document_ids=inputs.document_ids,
            normalizer=normalizer, context_group=self.parallel.context_group, **per_token,
        )  # fmt: skip
        return dataclasses.replace(prepared, loss=loss, teacher=inputs.teacher)

    def with_teacher(self, teacher: TeacherHead | TeacherTopK) -> Prepared:
        """The loss's distillation term against ``teacher`` (the student's positions)."""
        return dataclasses.replace(self, teacher=teacher)

    def on(self, tokens: Tokens, head: Head) -> HeadCall:
        """The call on the real hidden states and head parameters (gathered, under FSDP2 or
        ZeRO-3): the hidden states checked against it (shape, dtype, device), no value read."""
        call = self.call.replace(weight=head.weight, bias=head.bias)
        return with_hidden(call, tokens.aligned(self.parallel), self.options)


def prepare(
    labels: torch.Tensor,
    head: Head,
    options: HeadOptions | None = None,
    sampler: SamplerOptions | None = None,
    parallel: Parallelism = Parallelism(),
) -> Prepared:
    """Phase 1: the head call of ``labels`` checked before any hidden state exists.

    ``head``'s transform (softcap, logit scale) and ``parallel``'s vocabulary split go into
    the options; the call is checked on a placeholder ``[*labels.shape, H]`` of the hidden
    states in the weight's dtype (a different dtype of the real ones needs
    ``options.head_dtype``, as for the op). Raises ``ValueError`` for any bad label, option or
    parameter, on every rank of the vocabulary group together. ``options`` / ``sampler``:
    None for the defaults.
    """
    options = dataclasses.replace(
        HeadOptions() if options is None else options,
        softcap=head.softcap,
        logit_scale=head.logit_scale,
        vocab_parallel=parallel.head_vocab(),
    )
    weight = head.weight
    placeholder = weight.new_zeros(()).detach().expand(*labels.shape, weight.shape[-1])
    call = check_head_call(placeholder, weight, labels, head.bias, options, sampler)
    return Prepared(call, options, parallel)


# --- phase 2: the head on the prepared call ------------------------------------------------


def _unautocast(hidden: torch.Tensor) -> contextlib.AbstractContextManager:
    """The head runs in the call's own dtypes (``head_dtype``), never under autocast."""
    return torch.autocast(hidden.device.type, enabled=False)


def logprobs(prepared: Prepared, tokens: Tokens, head: Head) -> LogProbs:
    """:func:`logitless.linear_logprobs` of the prepared call on ``tokens`` and ``head``:
    outputs in the labels' shape, the same on every rank of the vocabulary group."""
    with _unautocast(tokens.hidden):
        return logprobs_of_call(prepared.on(tokens, head))


def policy_loss(
    prepared: Prepared, tokens: Tokens, head: Head
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`logitless.fused_policy_loss` of a call prepared :meth:`~Prepared.with_loss`:
    ``(loss, metrics)``; its context group sums the documents' statistics, and a teacher adds
    the distillation term on the same rows."""
    return _policy_loss(fused_loss_of_call, prepared, tokens, head)


def policy_loss_and_logprobs(
    prepared: Prepared, tokens: Tokens, head: Head
) -> tuple[torch.Tensor, dict[str, torch.Tensor], LogProbs]:
    """:func:`policy_loss`, and the per-token log-probs (and entropy, when the call asks for
    it: :meth:`Prepared.with_entropy`) its pass computed, detached, in the labels' shape (0 at
    ignored tokens): a trainer's own per-token metrics without a second head pass. Not with
    sampling replay."""
    return _policy_loss(fused_loss_and_logprobs_of_call, prepared, tokens, head)


def _policy_loss(run: Callable[..., T], prepared: Prepared, tokens: Tokens, head: Head) -> T:
    if prepared.loss is None:
        raise ValueError("policy_loss needs a call prepared with its loss (Prepared.with_loss)")
    with _unautocast(tokens.hidden):
        call = prepared.on(tokens, head)
        loss_call, divergence = prepared.loss, None
        if prepared.teacher is not None:
            divergence = _distillation_term(prepared, call, head)
            loss_call = dataclasses.replace(loss_call, divergence=divergence.detach())
        return run(call, loss_call, divergence)


def _distillation_term(prepared: Prepared, call: HeadCall, head: Head) -> torch.Tensor:
    """The distillation term's ``D`` ``[*batch_shape]`` of a policy-loss call: the student's
    rows against the teacher (its options: the call's), differentiable."""
    shape, options, teacher = call.batch_shape, prepared.options, prepared.teacher
    temperature = options.temperature
    if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
        temperature = temperature.reshape(shape)
    if isinstance(teacher, TeacherHead):
        t_hidden = teacher.hidden
        teacher = teacher._replace(hidden=t_hidden.reshape(*shape, t_hidden.shape[-1]))
    hidden = call.hidden.reshape(*shape, call.hidden.shape[-1])
    options = dataclasses.replace(options, temperature=temperature)
    labels = call.labels.reshape(shape)
    term = teacher_divergence(call, hidden, head.weight, labels, head.bias, options, teacher)
    return term(prepared.loss.config if prepared.loss is not None else None)


def divergence(
    prepared: Prepared,
    tokens: Tokens,
    head: Head,
    teacher: Tokens,
    teacher_head: Head,
    options: DivergenceOptions | None = None,
) -> Divergence:
    """:func:`logitless.linear_divergence` from ``teacher`` (its hidden states in its model's
    layout, the same labels; frozen) to the prepared call's ``tokens``; the two heads split
    the vocabulary the same way. ``options``: beta, vocab_size, with_logprobs (the teacher's
    transform comes from ``teacher_head``). The divergence's own rules (the two heads'
    vocabularies, the teacher frozen) are checked here, where the teacher's hidden states
    first exist; the student's call was checked by :func:`prepare`."""
    parallel = prepared.parallel
    with torch.no_grad():
        t_hidden = teacher.aligned(parallel)
    div = dataclasses.replace(
        DivergenceOptions() if options is None else options,
        teacher_softcap=teacher_head.softcap,
        teacher_logit_scale=teacher_head.logit_scale,
    )
    t_bias = None if teacher_head.bias is None else teacher_head.bias.detach()
    frozen = (t_hidden, teacher_head.weight.detach(), t_bias)  # a teacher may require grad
    with _unautocast(tokens.hidden):
        call = check_divergence_call(
            tokens.aligned(parallel), head.weight, prepared.labels, head.bias, frozen, None,
            prepared.options, div,
        )  # fmt: skip
        return divergence_of_call(call)
