"""A detector of host reads for the capturable mode's tests, on real (CPU) tensors.

``FakeTensorMode`` proves a call needs no data, but cannot run collectives or Triton's
interpreter. Inside :func:`no_host_reads`, every operator that moves a value to the host or
makes a shape from data raises ``HostRead`` instead: ``aten._local_scalar_dense`` (``.item()``,
``int(t)``, ``bool(t)``, ``if t:``), the operators tagged ``data_dependent_output`` or
``dynamic_output_shape`` (``nonzero``, a boolean-mask index, ``unique``, ...), and
``Tensor.tolist`` (which reads memory without dispatching an operator). A device-side
assertion (``torch._assert_async``) is allowed: it is the capturable mode's check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


class HostRead(RuntimeError):
    """An operator read device data on the host, or made a shape from it."""


def _mask_index(func, args) -> bool:
    """An indexing operator is tagged dynamic because a boolean index makes its shape from
    data; with integer indices its shape is static."""
    if func.name().split("::")[-1].split(".")[0] not in ("index", "index_put", "index_put_"):
        return True
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


class _Detector(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default or (
            any(tag in func.tags for tag in _TAGS) and _mask_index(func, args)
        ):
            raise HostRead(f"host read or data-dependent shape: {func}")
        return func(*args, **(kwargs or {}))


def _tolist(self, *args, **kwargs):
    raise HostRead("host read: Tensor.tolist")


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Raise :class:`HostRead` on any host read in the block (see the module docstring)."""
    original = torch.Tensor.tolist
    torch.Tensor.tolist = _tolist
    try:
        with _Detector():
            yield
    finally:
        torch.Tensor.tolist = original
