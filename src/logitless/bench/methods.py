"""Registry of benchmark tasks and the methods that implement each.

A *method* turns a workload's inputs into a ``step``: a zero-argument callable that runs one
timed iteration (forward + backward for real methods, bare matmuls for floors). A *task* is a
named set of methods measured on the same workload; ``logprobs`` is the only task now, and a
fused policy-loss task can be added as another entry of :data:`TASKS` without touching the
harness.

Adapters for peer libraries import them lazily, inside the worker subprocess, and report why
they cannot run instead of raising.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .workload import IGNORE_INDEX, Inputs, Workload

Step = Callable[[], None]


@dataclass(frozen=True)
class Method:
    """One way of computing a task.

    name: CLI / CSV name.
    role: ``"baseline"`` (the naive reference), ``"op"`` (logitless), ``"floor"`` (time floor,
        not a usable implementation) or ``"peer"`` (another library).
    build: inputs -> step; may raise.
    unavailable: workload -> reason this method cannot run here, or None.
    note: caveat shown in the table and the CSV (e.g. "log-probs only").
    """

    name: str
    role: str
    build: Callable[[Workload, Inputs], Step]
    unavailable: Callable[[Workload], str | None] = lambda work: None
    note: Callable[[Workload], str] = lambda work: ""


def _backward(inputs: Inputs, logprobs: torch.Tensor, entropy: torch.Tensor | None) -> None:
    """Backpropagate the random upstream gradients through log-probs (and entropy)."""
    objective = (logprobs * inputs.grad_logprobs).sum()
    if entropy is not None:
        objective = objective + (entropy * inputs.grad_entropy).sum()
    objective.backward()


def _build_naive(work: Workload, inputs: Inputs) -> Step:
    """Full-logits reference: ``logitless.reference.linear_logprobs`` + backward."""
    from logitless.reference import linear_logprobs

    def step() -> None:
        out = linear_logprobs(inputs.hidden, inputs.weight, inputs.labels, with_entropy=True)
        _backward(inputs, out.logprobs, out.entropy)

    return step


def _build_logitless(work: Workload, inputs: Inputs) -> Step:
    """The fused op: ``logitless.linear_logprobs`` + backward."""
    from logitless import linear_logprobs

    def step() -> None:
        out = linear_logprobs(inputs.hidden, inputs.weight, inputs.labels, with_entropy=True)
        _backward(inputs, out.logprobs, out.entropy)

    return step


def _build_floor(num_matmuls: int) -> Callable[[Workload, Inputs], Step]:
    """Bare matmuls of the head's sizes over the valid rows: the time floor, no softmax.

    3 = forward ``h @ W.T``, ``dz @ W`` (dh) and ``dz.T @ h`` (dW) -- the naive / fused-loss
    schedule; 4 adds the recomputed forward of logitless's backward.
    """

    def build(work: Workload, inputs: Inputs) -> Step:
        h = inputs.hidden.detach().index_select(0, inputs.valid_idx)  # [M, H]
        w = inputs.weight.detach()  # [V, H]
        # Outputs are allocated once, outside the timed step: the floor is matmul time alone,
        # not page faults of fresh [M, V] buffers.
        z = h.new_empty(h.shape[0], w.shape[0])  # [M, V]
        dh = torch.empty_like(h)  # [M, H]
        dw = torch.empty_like(w)  # [V, H]

        def step() -> None:
            with torch.no_grad():
                for _ in range(num_matmuls - 2):  # forward (and the recompute, for 4)
                    torch.mm(h, w.T, out=z)
                torch.mm(z, w, out=dh)
                torch.mm(z.T, h, out=dw)

        return step

    return build


def _missing(module: str, package: str) -> str | None:
    """Reason string if ``module`` is not importable."""
    if importlib.util.find_spec(module) is None:
        return f"{package} is not installed (pip install 'logitless[peers]')"
    return None


def _liger_unavailable(work: Workload) -> str | None:
    """Liger-Kernel is Triton-only: it needs an accelerator."""
    missing = _missing("liger_kernel", "liger-kernel")
    if missing:
        return missing
    if not work.device.startswith("cuda"):
        return f"Liger-Kernel runs Triton kernels, which need a GPU (device is {work.device})"
    return None


def _build_liger(work: Workload, inputs: Inputs) -> Step:
    """Liger's fused linear cross-entropy, ``reduction="none"``, negated: log-probs only."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def step() -> None:
        loss = liger_fused_linear_cross_entropy(
            inputs.hidden,
            inputs.weight,
            inputs.labels,
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        _backward(inputs, -loss.float(), None)

    return step


def _cce_impl(work: Workload) -> str:
    """CCE's Triton kernel on GPU; its ``torch_compile`` implementation elsewhere."""
    return "cce" if work.device.startswith("cuda") else "torch_compile"


def _cce_unavailable(work: Workload) -> str | None:
    """CCE must be importable (it imports Triton on Linux)."""
    return _missing("cut_cross_entropy", "cut-cross-entropy")


def _cce_note(work: Workload) -> str:
    """Caveats of the CCE numbers."""
    note = "log-probs only (no entropy)"
    if _cce_impl(work) == "torch_compile":
        note += "; impl=torch_compile, which materializes logits (CCE kernel is GPU-only)"
    return note


def _build_cce(work: Workload, inputs: Inputs) -> Step:
    """Cut Cross-Entropy ``linear_cross_entropy(reduction="none")`` negated: log-probs only."""
    from cut_cross_entropy import linear_cross_entropy

    impl = _cce_impl(work)

    def step() -> None:
        loss = linear_cross_entropy(
            inputs.hidden,
            inputs.weight,
            inputs.labels,
            ignore_index=IGNORE_INDEX,
            reduction="none",
            impl=impl,
        )
        _backward(inputs, -loss.float(), None)

    return step


TASKS: dict[str, dict[str, Method]] = {
    "logprobs": {
        m.name: m
        for m in (
            Method("naive", "baseline", _build_naive),
            Method("logitless", "op", _build_logitless),
            Method("floor3", "floor", _build_floor(3), note=lambda w: "3 bare matmuls"),
            Method("floor4", "floor", _build_floor(4), note=lambda w: "4 bare matmuls"),
            Method(
                "liger",
                "peer",
                _build_liger,
                unavailable=_liger_unavailable,
                note=lambda w: "log-probs only (no entropy)",
            ),
            Method("cce", "peer", _build_cce, unavailable=_cce_unavailable, note=_cce_note),
        )
    },
}


def get_method(task: str, name: str) -> Method:
    """Look up a method; ``KeyError`` with the valid names if it does not exist."""
    methods = TASKS[task]
    if name not in methods:
        raise KeyError(f"unknown method {name!r} for task {task!r}; choose from {list(methods)}")
    return methods[name]
