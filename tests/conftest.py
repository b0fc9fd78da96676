"""Test-wide fixtures: a fixed seed, and NaN-filled ``torch.empty`` (flash-linear-attention habit).

An op that allocates an accumulator with ``torch.empty`` and forgets to initialize it usually
passes on CPU, where fresh pages happen to be zero. Filling every floating ``torch.empty`` /
``torch.empty_like`` / ``Tensor.new_empty`` result with NaN makes such a bug fail loudly.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch


def _nan_filling(make):
    """Wrap an ``empty`` factory so its floating (or complex) results start as NaN."""

    @functools.wraps(make)
    def wrapper(*args, **kwargs):
        out = make(*args, **kwargs)
        if (
            isinstance(out, torch.Tensor)
            and (out.is_floating_point() or out.is_complex())
            and out.device.type != "meta"
            and out.numel() > 0
        ):
            # no_grad: the fill must not enter the graph of a requires_grad=True result.
            with torch.no_grad():
                out.fill_(float("nan"))
        return out

    wrapper.__wrapped_empty__ = make
    return wrapper


@pytest.fixture(autouse=True)
def _seed_torch():
    """Every test starts from the same RNG state, whatever ran before it."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def nan_empty(monkeypatch):
    """Floating ``torch.empty`` / ``torch.empty_like`` / ``Tensor.new_empty`` results are NaN.

    Only Python-level calls are affected (the op's own allocations); torch's C++ internals keep
    their allocator. Integer/bool results are left alone (index buffers are always written).
    """
    monkeypatch.setattr(torch, "empty", _nan_filling(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _nan_filling(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", _nan_filling(torch.Tensor.new_empty))


def _use_triton_interpreter() -> None:
    """Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. Triton reads
    the variable when a kernel is defined, so it is set here, before any test imports
    ``logitless.kernels.triton_head``. With a GPU the kernels compile, and tests/test_cuda.py
    runs the same cases on it."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_use_triton_interpreter()
