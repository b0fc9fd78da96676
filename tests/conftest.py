"""Test-wide fixtures: a fixed seed, and NaN-filled ``torch.empty`` (flash-linear-attention habit).

An op that allocates an accumulator with ``torch.empty`` and forgets to initialize it usually
passes on CPU, where fresh pages happen to be zero. Filling every floating ``torch.empty`` /
``torch.empty_like`` / ``Tensor.new_empty`` result with NaN makes such a bug fail loudly.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import pytest
import torch

# tests/verl_backend/ runs in a venv of its own (.ci/verl.sh): verl 0.9 pins transformers<5.11,
# older than the main suite's. Without verl installed, that folder is not collected at all.
collect_ignore = [] if importlib.util.find_spec("verl") else ["verl_backend"]


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
    ``logitless.backends.triton_kernels``. With a GPU the kernels compile, and tests/test_cuda.py
    runs the same cases on it."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_use_triton_interpreter()


# The test files that start processes (gloo groups, the bench's workers, the CLI), run Triton's
# interpreter, compile peers or train small models: ``-m "not slow"`` leaves them out for a
# first check. Outside them, a test is slow when it runs Triton's interpreter (``triton`` in its
# name or parameters) or is marked ``@pytest.mark.slow`` itself (a float64 gradcheck).
SLOW_FILES = {
    "test_accumulation.py",
    "test_bench.py",
    "test_bench_plot.py",
    "test_benchmark_scripts.py",
    "test_compile.py",
    "test_deepspeed.py",
    "test_demo.py",
    "test_distill_loss.py",
    "test_divergence_head.py",
    "test_divergence_triton.py",
    "test_docs.py",
    "test_fsdp.py",
    "test_fused_parallel.py",
    "test_hf_distributed.py",
    "test_losses_cp.py",
    "test_megatron.py",
    "test_normalizer_distributed.py",
    "test_peers.py",
    "test_replay_parallel.py",
    "test_rollout_diagnostics_integrations.py",
    "test_rollout_diagnostics_parallel.py",
    "test_rollout_diagnostics_scripts.py",
    "test_rollout_diagnostics_triton.py",
    "test_triton.py",
    "test_trl.py",
    "test_trl_distill.py",
    "test_trl_deepspeed.py",
    "test_trl_distributed.py",
    "test_vocab_parallel.py",
}


def pytest_configure(config):
    here = Path(__file__).parent
    missing = sorted(f for f in SLOW_FILES if not (here / f).exists())
    if missing:  # a renamed file would silently join the fast subset
        raise pytest.UsageError(f"tests/conftest.py SLOW_FILES names missing files: {missing}")
    config.addinivalue_line(
        "markers", "slow: processes, Triton's interpreter or training runs (see SLOW_FILES)"
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES or "triton" in item.name:
            item.add_marker(pytest.mark.slow)
