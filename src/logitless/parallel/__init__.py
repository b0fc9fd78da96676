"""Parallelism over torch.distributed, in one place.

- :class:`VocabParallel` (defined in :mod:`logitless.contract.vocab`, with the call's other
  types): the vocab-parallel (tensor-parallel) head, the statistics combine of a split
  vocabulary.
- :mod:`.context`: context parallelism: split / merge a packed stream along its tokens; the
  losses' ``context_group=`` sums per-document statistics over the group.
- :mod:`logitless.contract.collectives`: the one "fail together" protocol every collective
  call follows (a bad input on one rank raises on every rank instead of hanging the others).

Data parallelism needs no module of its own: :func:`logitless.loss_normalizer` and
:class:`logitless.StepAccumulator` count a step over their ``process_group`` with the same
protocol.
"""

from ..contract.vocab import VocabParallel, even_vocab_range
from .context import context_parallel_indices, context_parallel_merge, context_parallel_split

__all__ = [
    "VocabParallel",
    "context_parallel_indices",
    "context_parallel_merge",
    "context_parallel_split",
    "even_vocab_range",
]
