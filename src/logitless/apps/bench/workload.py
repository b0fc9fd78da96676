"""The benchmark workload: its configuration and the seeded inputs each worker builds.

Everything here runs inside a worker subprocess, so one method's allocations, caches and
compiled kernels never leak into another method's measurement.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ...contract.options import IGNORE_INDEX  # noqa: F401  (the workloads' ignored label)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class Workload:
    """One point of the benchmark: shapes, dtype, device and how to repeat it.

    ``valid_frac`` is the fraction of the ``tokens`` rows whose label is not ``ignore_index``;
    the ignored rows are spread at random, like prompt tokens in an RL batch.
    """

    task: str
    tokens: int
    hidden: int
    vocab: int
    valid_frac: float
    dtype: str
    device: str
    threads: int
    repeats: int
    seed: int = 0

    @property
    def valid_rows(self) -> int:
        """Number of rows with a real label (at least one)."""
        return max(1, round(self.valid_frac * self.tokens))

    @property
    def element_size(self) -> int:
        """Bytes per element of ``dtype``."""
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    def memory_floor_bytes(self) -> int:
        """Analytic extra-memory floor: the gradient buffers dW ``[V, H]`` and dh ``[N, H]``."""
        return (self.vocab + self.tokens) * self.hidden * self.element_size

    def to_dict(self) -> dict[str, object]:
        """Plain-JSON form, to hand to a worker subprocess."""
        return asdict(self)


@dataclass
class Inputs:
    """Seeded tensors of one workload.

    hidden ``[N, H]`` and weight ``[V, H]`` require grad; labels ``[N]`` hold
    ``IGNORE_INDEX`` on ``N - valid_rows`` random rows; ``grad_logprobs`` / ``grad_entropy``
    ``[N]`` are the random upstream gradients; ``valid_idx`` ``[M]`` lists the valid rows.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    grad_logprobs: torch.Tensor
    grad_entropy: torch.Tensor
    valid_idx: torch.Tensor

    def clear_grads(self) -> None:
        """Drop accumulated gradients (set to None, so the next backward allocates afresh)."""
        self.hidden.grad = None
        self.weight.grad = None


def make_inputs(work: Workload) -> Inputs:
    """Build the seeded inputs of ``work`` on its device, in its dtype.

    The weight is scaled by 0.02 (a typical LM-head init), so logits have a realistic spread.
    """
    gen = torch.Generator().manual_seed(work.seed)
    dtype, device = DTYPES[work.dtype], torch.device(work.device)
    n, h, v = work.tokens, work.hidden, work.vocab
    hidden = torch.randn(n, h, generator=gen).to(device, dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=gen) * 0.02).to(device, dtype).requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=gen)
    order = torch.randperm(n, generator=gen)
    labels[order[work.valid_rows :]] = IGNORE_INDEX
    valid_idx = order[: work.valid_rows].sort().values
    grad_logprobs = torch.randn(n, generator=gen).to(device)
    grad_entropy = torch.randn(n, generator=gen).to(device)
    return Inputs(
        hidden=hidden,
        weight=weight,
        labels=labels.to(device),
        grad_logprobs=grad_logprobs,
        grad_entropy=grad_entropy,
        valid_idx=valid_idx.to(device),
    )
