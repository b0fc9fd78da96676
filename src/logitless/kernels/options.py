"""Options shared by every kernel backend: what one head call asks for and how work is cut."""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

import torch

from ..parallel.vocab import VocabParallel

Backend = Literal["auto", "triton", "torch"]

_BACKENDS = ("auto", "triton", "torch")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: object, device: torch.device, head_dtype: torch.dtype) -> str:
    """The backend that runs a call: ``"torch"`` or ``"triton"``.

    ``"auto"`` picks Triton on CUDA when it is installed and the head runs in 16 bits (where it
    was measured faster, see the README's GPU section), the torch tiles otherwise; it never
    picks Triton on CPU. ``"triton"`` on a CPU tensor needs Triton's interpreter
    (``TRITON_INTERPRET=1`` set before the first call); anything else raises ``ValueError``.
    """
    if not isinstance(backend, str) or backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if head_dtype == torch.float64:
        if backend == "auto":
            return "torch"
        raise ValueError(
            "backend='triton' runs fp32, bf16 and fp16 heads; a float64 head runs on "
            "backend='torch' (or 'auto')"
        )
    if backend == "auto":
        fast = device.type == "cuda" and head_dtype in (torch.bfloat16, torch.float16)
        return "triton" if fast and _triton_installed() else "torch"
    if not _triton_installed():
        raise ValueError(
            "backend='triton' needs the triton package (pip install triton; CUDA builds of "
            "torch ship it), or use backend='torch'"
        )
    if device.type == "cuda" and not _interpreting():
        return "triton"
    if device.type == "cpu":
        if _interpreting():
            return "triton"
        raise ValueError(
            "backend='triton' on CPU tensors runs the kernels in Triton's interpreter, which "
            "is off: set the environment variable TRITON_INTERPRET=1 before the first call "
            "(slow; meant for tests), move the tensors to a CUDA device, or use "
            "backend='torch'"
        )
    raise ValueError(
        f"backend='triton' runs on CUDA tensors (or CPU ones under TRITON_INTERPRET=1), got "
        f"tensors on {device}; use backend='torch'"
    )


# Elements of one fp32 logits tile. CPU: ~8 MiB, so the elementwise passes run out of L2/L3
# instead of DRAM (measured: 2.3 s vs 3.2 s for a 2048 x 151936 x 512 forward with 134 MB
# tiles). CUDA: larger tiles amortize kernel launches; the tile is still bounded, never [N, V].
_TILE_ELEMS = {"cpu": 1 << 21}
_TILE_ELEMS_DEFAULT = 1 << 26
_MAX_ROWS = {"cpu": 2048}
_MAX_ROWS_DEFAULT = 8192
_MIN_VOCAB_BLOCK = 256
_BLOCK_ALIGN = 64
# Elements of the [rows, V] fp32 buffer of the gradient-in-forward (fused) path: 256 MiB on CPU
# (the weight gradient of a 150k x 512 head is another 300 MiB), 1 GiB on accelerators.
_CHUNK_ELEMS = {"cpu": 64 << 20}
_CHUNK_ELEMS_DEFAULT = 1 << 28


@dataclass(frozen=True)
class Schedule:
    """How the ``[M, V]`` logits are cut into tiles of ``[rows, vocab_block]``."""

    rows: int
    vocab_block: int

    @staticmethod
    def choose(num_rows: int, vocab: int, device: torch.device, chunk_size: int | None) -> Schedule:
        tile = _TILE_ELEMS.get(device.type, _TILE_ELEMS_DEFAULT)
        if chunk_size is None:
            rows = max(1, min(num_rows, _MAX_ROWS.get(device.type, _MAX_ROWS_DEFAULT)))
        else:
            rows = chunk_size
        # A multiple of 64 columns keeps every tile row 256-byte aligned: an odd width (e.g.
        # 4755 for 441 rows) measured ~10% slower in the projection matmuls on CPU.
        block = min(vocab, max(_MIN_VOCAB_BLOCK, tile // rows // _BLOCK_ALIGN * _BLOCK_ALIGN))
        return Schedule(rows=rows, vocab_block=max(1, block))

    @staticmethod
    def choose_fused(
        num_rows: int, vocab: int, device: torch.device, chunk_size: int | None
    ) -> Schedule:
        """Schedule for the gradient-in-forward path, whose row chunk keeps all V logits."""
        if chunk_size is None:
            budget = _CHUNK_ELEMS.get(device.type, _CHUNK_ELEMS_DEFAULT)
            chunk_size = max(1, min(num_rows, budget // vocab))
        return Schedule.choose(num_rows, vocab, device, chunk_size)

    def row_chunks(self, num_rows: int) -> list[tuple[int, int]]:
        """[(start, stop)] of the row chunks."""
        return [(r, min(r + self.rows, num_rows)) for r in range(0, num_rows, self.rows)]

    def vocab_blocks(self, vocab: int) -> list[tuple[int, int]]:
        """[(start, stop)] of the vocab blocks."""
        step = self.vocab_block
        return [(v, min(v + step, vocab)) for v in range(0, vocab, step)]

    def num_tiles(self, num_rows: int, vocab: int) -> int:
        return -(-num_rows // self.rows) * -(-vocab // self.vocab_block)


@dataclass(frozen=True)
class HeadOptions:
    """Non-tensor options of one head call (kept out of the autograd signature)."""

    softcap: float | None
    temperature: float | None  # scalar temperature; None when a per-row tensor is passed
    with_entropy: bool
    head_dtype: torch.dtype
    schedule: Schedule  # the torch tiles' cut of the work
    # This rank's vocabulary shard; labels given to the kernels are then shard-local
    # (global id - vocab_start), out of [0, V_local) when another rank owns them.
    vocab_parallel: VocabParallel | None = None
    backend: Literal["torch", "triton"] = "torch"  # resolved: never "auto" here
    chunk_size: int | None = None  # the caller's rows per pass (None: the backend's choice)

    @property
    def compute_dtype(self) -> torch.dtype:
        """Softmax statistics, outputs and gradient accumulators: see :func:`compute_dtype`."""
        return compute_dtype(self.head_dtype)


def compute_dtype(head_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a head's softmax statistics, outputs and gradient accumulators: fp32, or
    float64 for a float64 head (so ``gradcheck`` holds at float64 accuracy)."""
    return torch.float64 if head_dtype == torch.float64 else torch.float32


def finish_stats(
    m: torch.Tensor,
    s: torch.Tensor,
    q: torch.Tensor | None,
    zy: torch.Tensor,
    vp: VocabParallel | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logp [R], lse [R], entropy [R] or None from online statistics of R rows.

    m: running max; s = Σ exp(z - m); q = Σ exp(z - m)·(z - m) (None without entropy); zy: the
    label logit. With ``vp`` the shards' statistics are first combined over its group (a
    collective call), so the results cover the whole vocabulary:

        lse = m + log s        H = log s - q / s        logp = zy - lse
    """
    if vp is not None:
        m, s, q, zy = vp.combine(m, s, q, zy)
    log_s = s.log()
    lse = m + log_s
    ent = None if q is None else log_s - q / s
    return zy - lse, lse, ent
