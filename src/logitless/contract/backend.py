"""Which kernels run a call: the backend registry and the rule that picks one, for every op.

A backend is, for each op of :data:`OPS`, a module implementing that op's protocol in
:mod:`logitless.backends.base`: ``"logprobs"``, :class:`~logitless.backends.base.KernelBackend`
(row forward, row backward, fused rows: the log-prob op, replay and the fused loss run on it);
``"divergence"``, :class:`~logitless.backends.base.DivergenceBackend` (the divergence to a
teacher head). Adding a backend is those modules, one line in :data:`BACKENDS` (its modules and
when it can run) and each module's loader in :data:`logitless.backends.LOADERS` (a plain
``import`` statement, which compiled code can trace; tests/test_capturable.py checks that every
module named here has one). ``backend="auto"`` takes the first registered backend whose
``auto`` rule accepts the call, the torch tiles otherwise. The ops load the resolved backend's
module with :func:`logitless.backends.backend_for` (log-probs) and
:func:`logitless.backends.divergence_backend_for`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

# The values of TRITON_INTERPRET that turn Triton's interpreter on (Triton's own reading of a
# boolean variable, ``triton.knobs``: case-insensitive; anything else is off).
_ON = ("1", "true", "on", "yes", "y")


def interpreting() -> bool:
    """Triton's interpreter is on (``TRITON_INTERPRET=1``): its kernels run on CPU tensors.

    The one place logitless reads the variable (the registry's rules, the Triton launcher, the
    compile check). Triton reads it too, when it defines each ``@triton.jit`` function (on
    import of the kernel modules): set it before the first call with ``backend="triton"``
    imports them, as the tests' ``conftest.py`` does.
    """
    return os.environ.get("TRITON_INTERPRET", "").lower() in _ON


@functools.cache
def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


#: The ops a backend implements, each by a module of its own (:attr:`BackendSpec.modules`).
OPS = ("logprobs", "divergence")


@dataclass(frozen=True)
class BackendSpec:
    """One registry line.

    modules: op (:data:`OPS`) -> the module implementing it (imported on first use, by its
        loader in :data:`logitless.backends.LOADERS`).
    refuse: ``(device, head_dtype) -> reason`` it cannot run a call (None: it can).
    auto: ``(device, head_dtype) -> bool``: ``backend="auto"`` picks it for such a call.
    """

    modules: dict[str, str]
    refuse: Callable[[torch.device, torch.dtype], str | None]
    auto: Callable[[torch.device, torch.dtype], bool]


def _torch_refuses(device: torch.device, dtype: torch.dtype) -> str | None:
    return None  # any device, any floating dtype


def _triton_refuses(device: torch.device, dtype: torch.dtype) -> str | None:
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return (
            f"backend='triton' runs fp32, bf16 and fp16 heads; a {dtype} head runs on "
            "backend='torch' (or 'auto')"
        )
    if not _installed("triton"):
        return (
            "backend='triton' needs the triton package (pip install triton; CUDA builds of "
            "torch ship it), or use backend='torch'"
        )
    if device.type == "cuda" and not interpreting():
        return None
    if device.type == "cpu":
        if interpreting():
            return None
        return (
            "backend='triton' on CPU tensors runs the kernels in Triton's interpreter, which "
            "is off: set the environment variable TRITON_INTERPRET=1 before the first call "
            "(slow; meant for tests), move the tensors to a CUDA device, or use "
            "backend='torch'"
        )
    return (
        f"backend='triton' runs on CUDA tensors (or CPU ones under TRITON_INTERPRET=1), got "
        f"tensors on {device}; use backend='torch'"
    )


def _triton_auto(device: torch.device, dtype: torch.dtype) -> bool:
    """16-bit heads on CUDA, where it was measured faster (docs/benchmarks.md); fp32 keeps the
    torch tiles (cuBLAS SGEMM beats an IEEE ``tl.dot``)."""
    fast = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    return fast and _triton_refuses(device, dtype) is None


#: The backends, in the order ``"auto"`` tries them (the torch tiles take what none takes).
BACKENDS: dict[str, BackendSpec] = {
    "triton": BackendSpec(
        {
            "logprobs": "logitless.backends.triton_kernels",
            "divergence": "logitless.backends.triton_divergence",
        },
        _triton_refuses,
        _triton_auto,
    ),
    "torch": BackendSpec(
        {
            "logprobs": "logitless.backends.torch_tiles",
            "divergence": "logitless.backends.torch_divergence",
        },
        _torch_refuses,
        lambda d, t: True,
    ),
}


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The registered backend that runs a call on ``device`` whose head projects in ``dtype``
    (the call's resolved head dtype: ``HeadOptions.head_dtype``, else the inputs').

    ``"auto"`` picks the first backend whose ``auto`` rule accepts the call (Triton for 16-bit
    heads on CUDA when it is installed, the torch tiles otherwise; never Triton on CPU). A
    named backend that cannot run the call raises ``ValueError`` saying why.
    """
    if backend == "auto":
        return next(name for name, spec in BACKENDS.items() if spec.auto(device, dtype))
    reason = BACKENDS[backend].refuse(device, dtype)
    if reason is not None:
        raise ValueError(reason)
    return backend
