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

import importlib
from typing import cast

from ..contract.backend import BACKENDS
from .base import KernelBackend, KernelOptions


def backend_for(opts: KernelOptions) -> KernelBackend:
    """The module implementing ``opts.backend`` (imported on first use)."""
    return cast(KernelBackend, importlib.import_module(BACKENDS[opts.backend].module))


__all__ = ["backend_for"]
