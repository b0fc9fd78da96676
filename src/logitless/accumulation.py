"""Gradient accumulation with a document or token budget per optimizer step, across ranks.

A fixed number of micro-batches per step gives steps of varying size when micro-batches hold
varying numbers of documents (packed RL rollouts). :class:`StepAccumulator` can instead draw
micro-batches until the step holds a target number of documents (``docs_per_step``) or valid
tokens (``tokens_per_step``), counted over all data-parallel ranks, and hands every micro-batch
of the step the same :class:`~logitless.LossNormalizer`, so the micro-batch losses sum to the
loss of the whole step (and so do their gradients).

Budget mode, per round (one micro-batch per rank)::

    each rank draws its next micro-batch (or none, if its iterator is exhausted)
    all_reduce(SUM, [valid tokens, documents, micro-batches])   # one small collective
    stop when the global total of the budgeted count >= the target, or no rank drew one

Every rank sees the same sums, so all ranks stop after the same round: no rank waits in a
collective the others skipped. This module imports only the losses' normalizer, never the head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from .contract.collectives import check_group, comm_device, sum_or_raise
from .losses.normalizer import LossNormalizer, loss_normalizer

__all__ = ["AccumulatedStep", "StepAccumulator"]

T = TypeVar("T")

_END = object()  # sentinel for an exhausted iterator


@dataclass(frozen=True)
class AccumulatedStep(Generic[T]):
    """One optimizer step: this rank's micro-batches and the step's global counts.

    Attributes:
        micro_batches: this rank's micro-batches, in the order drawn. Empty on a rank whose
            iterator ran out while others still had data (see :class:`StepAccumulator`).
        normalizer: the step's :class:`~logitless.LossNormalizer` (0-dim float64 tensors,
            counts summed over all micro-batches and ranks); pass it to every micro-batch's
            :func:`~logitless.policy_loss` / :func:`~logitless.fused_policy_loss`.
        complete: the budget was met (every rank drew ``micro_batches_per_step`` in fixed
            mode). ``False`` only for a last step cut short because the data ran out.
        index: 0-based number of this step in the accumulator's life.
        num_documents: documents with at least one valid token in the step, all ranks
            (``normalizer.num_sequences``).
        num_tokens: valid tokens in the step, all ranks (``normalizer.num_tokens``).
        num_micro_batches: micro-batches in the step, summed over ranks.
        documents_seen, tokens_seen: cumulative ``num_documents`` / ``num_tokens`` over all
            steps handed out so far, this one included.
    """

    micro_batches: list[T]
    normalizer: LossNormalizer
    complete: bool
    index: int
    num_documents: int
    num_tokens: int
    num_micro_batches: int
    documents_seen: int
    tokens_seen: int

    @property
    def metrics(self) -> dict[str, int]:
        """The step's counts as a dict for a metrics logger (the same on every rank)."""
        return {
            "num_documents": self.num_documents,
            "documents_seen": self.documents_seen,
            "num_tokens": self.num_tokens,
            "tokens_seen": self.tokens_seen,
            "num_micro_batches": self.num_micro_batches,
        }


def _check_budget(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    return value


class StepAccumulator(Generic[T]):
    """Groups micro-batches into optimizer steps by count, documents or tokens.

    Exactly one budget applies:

    - ``micro_batches_per_step`` (the default, 1 when no budget is given): each rank takes that
      many micro-batches; the counts then cost one all-reduce per step, the one
      :func:`~logitless.loss_normalizer` would do.
    - ``docs_per_step``: draw until the step holds at least this many documents, all ranks.
      A document counts when it has at least one valid token (mask true, not padding): a
      document with none contributes nothing to the loss, and this is the count
      ``LossNormalizer.num_sequences`` holds, so the budget and the denominator agree.
    - ``tokens_per_step``: draw until the step holds at least this many valid tokens.

    In a budget mode each round draws one micro-batch on every rank and costs one all-reduce
    of four numbers (on the CPU, or on the current CUDA device for an NCCL group) and one host
    sync. The round that reaches or passes the target is taken whole (micro-batches are never
    split), so a step may overshoot by up to one round: one micro-batch per rank.

    Exhaustion: a rank whose iterator ends keeps taking part in the rounds with zero counts.
    The step ends when the budget is met or when no rank drew a micro-batch in a round; a last
    step that falls short of its budget is returned with ``complete=False`` (nothing is
    dropped), and when no rank has anything left, :meth:`next_step` returns ``None`` on every
    rank. Ranks whose data ran out earlier get fewer (possibly zero) micro-batches in these
    last steps; if your gradient reduction is a collective run per backward (DDP, FSDP), such
    a rank must still run it (e.g. a backward of a zero loss).

    Bad micro-batch content (a mask that is not bool, document ids of the wrong shape) raises
    ``ValueError`` on every rank of ``process_group``, not only on the rank that drew it: that
    rank still takes part in the round's all-reduce, so no rank is left waiting.

    Documents must not be split across micro-batches or data-parallel ranks (as for
    :func:`~logitless.loss_normalizer`).

    Args:
        mask_of: ``micro_batch -> mask``, the bool loss mask ``[N]`` or ``[B, T]`` (e.g.
            ``labels != -100``).
        document_ids_of: ``micro_batch -> document_ids`` (int64, the mask's shape, ``-1`` for
            padding); ``None``: each row of a ``[B, T]`` mask is one document.
        micro_batches_per_step, docs_per_step, tokens_per_step: the budget; at most one, each
            an int >= 1.
        process_group: the data-parallel group whose ranks share a step; counts are summed
            over it. ``None``: one process, no collective.
        context_group: the context-parallel group, passed on to
            :func:`~logitless.loss_normalizer`: its ranks hold shards of the *same*
            micro-batches (global document ids) and must draw them in the same order; a
            document split across them counts once. Leave these peers out of
            ``process_group``.
        loss_scale: stored in the step's normalizer: the number of ranks your DDP/FSDP
            gradient reduction averages over, or 1 when it sums (see
            :class:`~logitless.LossNormalizer`).

    Raises:
        ValueError: a budget that is not an int >= 1, more than one budget, a group that is
            not a ``ProcessGroup`` of an initialized ``torch.distributed``, a ``loss_scale``
            that is not a finite number > 0.

    >>> mbs = [torch.tensor([[True, True]]), torch.tensor([[True], [True]]), torch.ones(3, 1).bool()]
    >>> acc = StepAccumulator(mask_of=lambda m: m, docs_per_step=2)
    >>> [(len(s.micro_batches), s.num_documents, s.complete) for s in acc.steps(mbs)]
    [(2, 3, True), (1, 3, True)]
    >>> acc.documents_seen
    6
    """  # noqa: E501

    def __init__(
        self,
        mask_of: Callable[[T], torch.Tensor],
        document_ids_of: Callable[[T], torch.Tensor | None] | None = None,
        *,
        micro_batches_per_step: int | None = None,
        docs_per_step: int | None = None,
        tokens_per_step: int | None = None,
        process_group: object | None = None,
        context_group: object | None = None,
        loss_scale: float = 1.0,
    ) -> None:
        if not callable(mask_of):
            raise ValueError(f"mask_of must be a callable micro_batch -> mask, got {mask_of!r}")
        if document_ids_of is not None and not callable(document_ids_of):
            raise ValueError(
                "document_ids_of must be a callable micro_batch -> document_ids or None, "
                f"got {document_ids_of!r}"
            )
        budgets = {
            "micro_batches_per_step": _check_budget(
                "micro_batches_per_step", micro_batches_per_step
            ),
            "docs_per_step": _check_budget("docs_per_step", docs_per_step),
            "tokens_per_step": _check_budget("tokens_per_step", tokens_per_step),
        }
        given = {k: v for k, v in budgets.items() if v is not None}
        if len(given) > 1:
            raise ValueError(f"give at most one of {list(budgets)}, got {given}")
        for name, group in (("process_group", process_group), ("context_group", context_group)):
            check_group(group, name)
        LossNormalizer(0.0, 0.0, loss_scale=loss_scale)  # checks loss_scale
        self.mask_of = mask_of
        self.document_ids_of = document_ids_of
        self.budget, self.target = next(iter(given.items()), ("micro_batches_per_step", 1))
        self.process_group = process_group
        self.context_group = context_group
        self.loss_scale = loss_scale
        self.documents_seen = 0
        self.tokens_seen = 0
        self.num_steps = 0
        self._device: torch.device | None = None  # of the last mask; for ranks without one

    # -----------------------------------------------------------------------------------------
    # public

    def next_step(self, micro_batches: Iterator[T]) -> AccumulatedStep[T] | None:
        """Draw the next step's micro-batches from ``micro_batches``; ``None`` once none is left.

        With a ``process_group`` this is a collective: every rank of the group must call it,
        each with its own iterator, and every rank gets ``None`` at the same call.
        """
        if not isinstance(micro_batches, Iterator):
            raise ValueError(
                "micro_batches must be an iterator (it is consumed across calls; pass "
                f"iter(...)), got {type(micro_batches).__name__}"
            )
        if self.budget == "micro_batches_per_step":
            return self._fixed_step(micro_batches)
        return self._budget_step(micro_batches)

    def steps(self, micro_batches: Iterable[T]) -> Iterator[AccumulatedStep[T]]:
        """All steps of ``micro_batches``: ``next_step`` until it returns ``None``."""
        it = iter(micro_batches)
        while (step := self.next_step(it)) is not None:
            yield step

    def state_dict(self) -> dict[str, int]:
        """Cumulative counters, for checkpoints (``documents_seen`` as a cross-run x-axis)."""
        return {
            "documents_seen": self.documents_seen,
            "tokens_seen": self.tokens_seen,
            "num_steps": self.num_steps,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the counters saved by :meth:`state_dict`."""
        keys = ("documents_seen", "tokens_seen", "num_steps")
        if not isinstance(state, dict) or sorted(state) != sorted(keys):
            got = sorted(state) if isinstance(state, dict) else repr(state)
            raise ValueError(f"state must be a dict with keys {list(keys)}, got {got}")
        for k in keys:
            v = state[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"state[{k!r}] must be an int >= 0, got {v!r}")
        self.documents_seen, self.tokens_seen, self.num_steps = (state[k] for k in keys)

    # -----------------------------------------------------------------------------------------
    # internals

    def _local_counts(self, micro_batches: list[T]) -> tuple[torch.Tensor, ValueError | None]:
        """``[valid tokens, documents]`` float64 over this rank's ``micro_batches``.

        A ``ValueError`` from bad micro-batch content is returned, not raised, so that this
        rank still takes part in the round's all-reduce and every rank raises.
        """
        if not micro_batches:
            return torch.zeros(2, dtype=torch.float64), None
        try:
            masks = [self.mask_of(mb) for mb in micro_batches]
            for mask in masks:
                if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                    got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
                    raise ValueError(f"mask_of must return a bool tensor, got {got}")
            ids = [
                None if self.document_ids_of is None else self.document_ids_of(mb)
                for mb in micro_batches
            ]
            extra = {} if self.context_group is None else {"context_group": self.context_group}
            norm = loss_normalizer(masks, ids, **extra)
        except ValueError as error:
            return torch.zeros(2, dtype=torch.float64), error
        self._device = masks[0].device
        counts = [torch.as_tensor(norm.num_tokens), torch.as_tensor(norm.num_sequences)]
        return torch.stack(counts).double().cpu(), None

    def _count_device(self) -> torch.device:
        """Where the round's counts live: the group's control device, else the CPU."""
        if self.process_group is not None:
            return comm_device(self.process_group)
        return torch.device("cpu")

    def _sum_over_ranks(
        self, local: torch.Tensor, extra: list[float], error: ValueError | None
    ) -> list[float]:
        """``[tokens, documents, *extra]`` summed over the group (one all-reduce, one sync)."""
        values = torch.cat([local, local.new_tensor(extra)])
        if self.process_group is None:
            if error is not None:
                raise error
            return values.tolist()
        group = self.process_group
        return sum_or_raise(group, values, error, "StepAccumulator", "process_group").tolist()

    def _fixed_step(self, it: Iterator[T]) -> AccumulatedStep[T] | None:
        taken: list[T] = []
        while len(taken) < self.target and (mb := next(it, _END)) is not _END:
            taken.append(mb)
        local, error = self._local_counts(taken)
        extra = [len(taken), float(len(taken) < self.target)]
        tokens, docs, n_mb, n_short = self._sum_over_ranks(local, extra, error)
        if n_mb == 0:
            return None
        return self._finish(taken, tokens, docs, n_mb, complete=n_short == 0)

    def _budget_step(self, it: Iterator[T]) -> AccumulatedStep[T] | None:
        taken: list[T] = []
        tokens = docs = n_mb = 0.0
        exhausted = complete = False
        while True:
            mb = _END if exhausted else next(it, _END)
            exhausted = mb is _END
            batch = [] if exhausted else [mb]
            local, error = self._local_counts(batch)
            r_tokens, r_docs, r_mb = self._sum_over_ranks(local, [len(batch)], error)
            if r_mb == 0:  # no rank had a micro-batch left
                break
            taken += batch
            tokens, docs, n_mb = tokens + r_tokens, docs + r_docs, n_mb + r_mb
            if (docs if self.budget == "docs_per_step" else tokens) >= self.target:
                complete = True
                break
        if n_mb == 0:
            return None
        return self._finish(taken, tokens, docs, n_mb, complete=complete)

    def _finish(
        self, taken: list[T], tokens: float, docs: float, n_mb: float, *, complete: bool
    ) -> AccumulatedStep[T]:
        device = self._device if self._device is not None else self._count_device()
        normalizer = LossNormalizer(
            num_tokens=torch.tensor(tokens, dtype=torch.float64, device=device),
            num_sequences=torch.tensor(docs, dtype=torch.float64, device=device),
            loss_scale=self.loss_scale,
        )
        self.documents_seen += int(docs)
        self.tokens_seen += int(tokens)
        step = AccumulatedStep(
            micro_batches=taken,
            normalizer=normalizer,
            complete=complete,
            index=self.num_steps,
            num_documents=int(docs),
            num_tokens=int(tokens),
            num_micro_batches=int(n_mb),
            documents_seen=self.documents_seen,
            tokens_seen=self.tokens_seen,
        )
        self.num_steps += 1
        return step
