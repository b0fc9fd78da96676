"""The kernel backends, each behind one interface per op (:mod:`.base`).

- ``torch``: bounded fp32 tiles and torch matmuls; the CPU path and the fallback on any device.
  :mod:`.torch_tiles` (the log-prob op: :class:`~.base.KernelBackend`) and
  :mod:`.torch_divergence` (the divergence to a teacher head, its sparse teacher in
  :mod:`.torch_divergence_topk`: :class:`~.base.DivergenceBackend`).
- ``triton``: Triton kernels that keep the logits in registers in forward and write the logit
  gradient once, in the compute dtype, into a bounded workspace that cuBLAS multiplies out in
  backward. :mod:`.triton_kernels` (the log-prob op) and :mod:`.triton_divergence` (the
  divergence), the kernel families; the tile code they share is :mod:`.triton_tiles`, their
  configurations and launcher :mod:`.triton_launch`. CUDA; on CPU tensors only under Triton's
  interpreter (``TRITON_INTERPRET=1``), which is how the test suite checks the kernels without a
  GPU.

:mod:`.base` holds the protocols and what the backends share (the rows, the options, the
schedule of the torch tiles, the gradient accumulation rule). A call picks a backend with
``backend="auto" | "triton" | "torch"`` (:func:`logitless.contract.backend.resolve_backend`,
whose registry names each backend's module for each op); :func:`backend_for` and
:func:`divergence_backend_for` load it. The ahead-of-time compile check of the Triton kernels is
an app (:mod:`logitless.apps.aot`): nothing here imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from ..contract.backend import BACKENDS
from .base import DivergenceBackend, DivOptions, KernelBackend, KernelOptions

# Each registered backend's modules are imported by a plain ``import`` statement on first use
# (Triton's, which import triton, only when a call picks them). Not by ``importlib``: Dynamo
# cannot trace ``importlib.import_module`` (a graph break, an error under fullgraph=True),
# while it runs an ``import`` statement as it traces, so a compiled step reaches the kernels.


def _torch_tiles() -> ModuleType:
    from . import torch_tiles

    return torch_tiles


def _torch_divergence() -> ModuleType:
    from . import torch_divergence

    return torch_divergence


def _triton_kernels() -> ModuleType:
    from . import triton_kernels

    return triton_kernels


def _triton_divergence() -> ModuleType:
    from . import triton_divergence

    return triton_divergence


#: How each module that :data:`~logitless.contract.backend.BACKENDS` names is imported.
LOADERS: dict[str, Callable[[], ModuleType]] = {
    "logitless.backends.torch_tiles": _torch_tiles,
    "logitless.backends.torch_divergence": _torch_divergence,
    "logitless.backends.triton_kernels": _triton_kernels,
    "logitless.backends.triton_divergence": _triton_divergence,
}


def _module(backend: str, op: str) -> ModuleType:
    """Backend ``backend``'s module for ``op`` (imported on first use)."""
    return LOADERS[BACKENDS[backend].modules[op]]()


def backend_for(opts: KernelOptions) -> KernelBackend:
    """The module running the log-prob op on ``opts.backend``."""
    return _module(opts.backend, "logprobs")  # type: ignore[return-value]


def divergence_backend_for(opts: DivOptions) -> DivergenceBackend:
    """The module running the divergence on the student's backend (the call resolves one
    backend for both heads)."""
    return _module(opts.student.backend, "divergence")  # type: ignore[return-value]


__all__ = ["LOADERS", "backend_for", "divergence_backend_for"]
