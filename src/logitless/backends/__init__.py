"""The kernel backends behind one interface (:class:`~.base.KernelBackend`).

- ``torch`` (:mod:`.torch_tiles`): bounded fp32 tiles and torch matmuls; the CPU path and the
  fallback on any device.
- ``triton`` (:mod:`.triton_kernels`): Triton kernels that keep the logits in registers in
  forward and write the logit gradient once, in the compute dtype, into a bounded workspace
  that cuBLAS multiplies out in backward. CUDA; on CPU tensors only under Triton's interpreter
  (``TRITON_INTERPRET=1``), which is how the test suite checks the kernels without a GPU.

A call picks one with ``backend="auto" | "triton" | "torch"``
(:func:`logitless.contract.backend.resolve_backend`, whose registry lists them);
:func:`backend_for` loads it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from ..contract.backend import BACKENDS
from .base import KernelBackend, KernelOptions

# Each registered backend's module is imported by a plain ``import`` statement on first use
# (Triton's, which imports triton, only when a call picks it). Not by ``importlib``: Dynamo
# cannot trace ``importlib.import_module`` (a graph break, an error under fullgraph=True),
# while it runs an ``import`` statement as it traces, so a compiled step reaches the kernels.


def _torch_tiles() -> ModuleType:
    from . import torch_tiles

    return torch_tiles


def _triton_kernels() -> ModuleType:
    from . import triton_kernels

    return triton_kernels


#: How each module that :data:`~logitless.contract.backend.BACKENDS` names is imported.
LOADERS: dict[str, Callable[[], ModuleType]] = {
    "logitless.backends.torch_tiles": _torch_tiles,
    "logitless.backends.triton_kernels": _triton_kernels,
}


def backend_for(opts: KernelOptions) -> KernelBackend:
    """The module implementing ``opts.backend`` (imported on first use)."""
    module: KernelBackend = LOADERS[BACKENDS[opts.backend].module]()  # type: ignore[assignment]
    return module


__all__ = ["LOADERS", "backend_for"]
