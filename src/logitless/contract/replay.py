"""The sampler contract of a head call: :class:`ReplayArgs`, checked by :func:`check_sampler`.

Sampling replay (``sampling_mask=``, ``top_k=``, ``top_p=``, ``min_p=``; see
:mod:`logitless.sampling` and ``docs/sampling-replay.md``). Every check runs before any FLOP and
raises ``ValueError`` naming the argument, what was expected and what was given; the tensor
values (offsets order, id range, duplicates, per-row parameters) are read on the host in one
transfer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .checks import INT_DTYPES, fmt_shape, per_position
from .options import SamplerOptions
from .sampling import SamplingMask


@dataclass(frozen=True)
class ReplayArgs:
    """Checked replay arguments over a call's ``N`` label positions (row-major).

    Either ``mask_ids`` / ``mask_offsets`` (the sampler's kept ids, global: ``[nnz]`` and
    ``[N + 1]`` int64), or per-position sampler parameters: ``top_k`` ``[N]`` int64 (values
    ``>= vocab_size`` mean no top-k), ``top_p`` ``[N]`` float64 in (0, 1], ``min_p`` ``[N]``
    float64 in [0, 1); an absent one is None. ``vocab_size``: the global vocabulary.
    ``with_kept_mass``: also report the log of each row's kept mass.
    """

    vocab_size: int
    mask_ids: torch.Tensor | None = None
    mask_offsets: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    with_kept_mass: bool = False

    @property
    def is_mask(self) -> bool:
        return self.mask_offsets is not None

    def take(self, idx: torch.Tensor | None) -> ReplayArgs:
        """These arguments with the sampler parameters (``top_k``, ``top_p``, ``min_p``) of
        positions ``idx`` only (every position when None)."""
        if idx is None:
            return self
        pick = {k: getattr(self, k) for k in ("top_k", "top_p", "min_p")}
        return dataclasses.replace(
            self, **{k: None if t is None else t.index_select(0, idx) for k, t in pick.items()}
        )

    def truncated(self) -> torch.Tensor:
        """[N] bool: the position has a kept set smaller than the vocabulary (as far as
        stated)."""
        if self.mask_offsets is not None:
            return self.mask_offsets[1:] > self.mask_offsets[:-1]
        given = next(t for t in (self.top_k, self.top_p, self.min_p) if t is not None)
        out = torch.zeros(given.numel(), dtype=torch.bool, device=given.device)
        if self.top_k is not None:
            out |= self.top_k < self.vocab_size
        if self.top_p is not None:
            out |= self.top_p < 1
        if self.min_p is not None:
            out |= self.min_p > 0
        return out


def _parameter(
    name: str, value: object, shape: torch.Size, device: torch.device, vocab_size: int
) -> torch.Tensor | None:
    """A sampler parameter (checked by SamplerOptions if a number) -> ``[N]``: int64 for
    ``top_k`` (any ``k >= V`` stored as ``V``: however large, it keeps the whole row), float64
    for ``top_p`` / ``min_p``."""
    if value is None:
        return None
    integer = name == "top_k"
    if isinstance(value, torch.Tensor):
        return per_position(name, value, shape, device, integer=integer)
    n = math.prod(shape)
    if integer:
        return torch.full((n,), min(int(value), vocab_size), dtype=torch.int64, device=device)
    return torch.full((n,), float(value), dtype=torch.float64, device=device)


def _mask_of(sampling_mask: object, batch_shape: torch.Size, device: torch.device):
    """``sampling_mask`` (a SamplingMask, or padded ``[*labels.shape, K]`` ids, negative =
    unused) -> (token_ids [nnz] int64, offsets [N + 1] int64), shape checks only."""
    n = math.prod(batch_shape)
    if isinstance(sampling_mask, torch.Tensor):
        if sampling_mask.dtype not in INT_DTYPES:
            raise ValueError(
                f"sampling_mask as a padded tensor must hold integer ids, got dtype "
                f"{sampling_mask.dtype}"
            )
        if sampling_mask.dim() != len(batch_shape) + 1 or sampling_mask.shape[:-1] != batch_shape:
            raise ValueError(
                f"sampling_mask as a padded tensor must have shape [*labels.shape, K] = "
                f"[{', '.join(map(str, batch_shape))}, K], got {fmt_shape(sampling_mask)}; or "
                "pass a logitless.SamplingMask(token_ids, offsets)"
            )
        if sampling_mask.device != device:
            raise ValueError(
                f"sampling_mask must be on labels' device {device}, got {sampling_mask.device}"
            )
        ids = sampling_mask.reshape(n, sampling_mask.shape[-1]).long()
        used = ids >= 0  # any negative value is padding
        offsets = torch.zeros(n + 1, dtype=torch.int64, device=device)
        offsets[1:] = used.sum(1).cumsum(0)
        return ids[used], offsets
    if not isinstance(sampling_mask, SamplingMask):
        raise ValueError(
            f"sampling_mask must be a logitless.SamplingMask(token_ids, offsets) or a padded "
            f"[*labels.shape, K] integer tensor, got {type(sampling_mask).__name__}"
        )
    ids, offsets = sampling_mask.token_ids, sampling_mask.offsets
    for name, t in (("token_ids", ids), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in INT_DTYPES:
            got = (
                f"dtype {t.dtype} and shape {fmt_shape(t)}"
                if isinstance(t, torch.Tensor)
                else type(t).__name__
            )
            raise ValueError(f"sampling_mask.{name} must be a 1-D integer tensor, got {got}")
        if t.device != device:
            raise ValueError(
                f"sampling_mask.{name} must be on labels' device {device}, got {t.device}"
            )
    if offsets.numel() != n + 1:
        raise ValueError(
            f"sampling_mask.offsets must have labels.numel() + 1 = {n + 1} entries (one CSR "
            f"row per label position, row-major), got {offsets.numel()}"
        )
    return ids.long(), offsets.long()


def check_csr_ids(
    ids: torch.Tensor, offsets: torch.Tensor, vocab_size: int, name: str = "sampling_mask"
) -> None:
    """CSR offsets start at 0, never decrease, end at ``nnz``; ids in range and distinct
    within a position (one host read for the counts; the duplicate scan reads once more).
    ``name``: the argument named in the errors (a sampling mask, a teacher's top-k)."""
    device = ids.device
    counts = offsets[1:] - offsets[:-1]
    out_of_range = (ids < 0) | (ids >= vocab_size)
    flags = torch.stack(
        [
            (offsets[0] != 0).long(),
            (counts < 0).sum(),
            (offsets[-1] != ids.numel()).long(),
            out_of_range.sum(),
        ]
    ).tolist()
    starts_off, decreasing, end_off, n_range = flags
    if starts_off:
        raise ValueError(
            f"{name}.offsets must start at 0, got {int(offsets[0])} (CSR row pointers "
            "over the label positions)"
        )
    if decreasing:
        first = int(torch.nonzero(counts < 0)[0, 0])
        raise ValueError(
            f"{name}.offsets must be non-decreasing, but offsets[{first + 1}] = "
            f"{int(offsets[first + 1])} < offsets[{first}] = {int(offsets[first])}"
        )
    if end_off:
        raise ValueError(
            f"{name}.offsets must end at token_ids.numel() = {ids.numel()}, got {int(offsets[-1])}"
        )
    if n_range:
        first = int(ids[out_of_range][0])
        raise ValueError(
            f"{name} token ids must be in [0, {vocab_size}) (global vocabulary ids), "
            f"{n_range} are not, e.g. {first}"
        )
    if ids.numel():
        # Duplicates within a position: sort (position, id) keys; equal neighbours repeat.
        pos = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
        srt = (pos * vocab_size + ids).sort().values
        dup = srt[1:] == srt[:-1]
        if bool(dup.any()):
            k = int(srt[1:][dup][0])
            raise ValueError(
                f"{name} has a duplicate id: position {k // vocab_size} keeps id "
                f"{k % vocab_size} more than once (each kept id must appear once)"
            )


def check_sampler(
    sampler: SamplerOptions,
    labels: torch.Tensor,
    batch_shape: torch.Size,
    ignore_index: int,
    vocab_size: int,
) -> ReplayArgs | None:
    """The checked replay arguments of a call (None when it does no replay).

    ``labels``: the call's ``[N]`` int64 labels (``batch_shape`` before flattening);
    ``vocab_size``: the global vocabulary (mask ids lie in ``[0, vocab_size)``). Per-token
    sampler parameters are checked at the rows that count (an ignored row may hold anything).
    """
    if not sampler.replaying:
        if sampler.with_kept_mass:
            raise ValueError("with_kept_mass=True needs sampling_mask= or top_k= / top_p= / min_p=")
        return None
    device = labels.device
    if sampler.sampling_mask is not None:
        ids, offsets = _mask_of(sampler.sampling_mask, batch_shape, device)
        check_csr_ids(ids, offsets, vocab_size)
        return ReplayArgs(vocab_size, ids, offsets, with_kept_mass=sampler.with_kept_mass)
    k, p, mp = (
        _parameter(name, getattr(sampler, name), batch_shape, device, vocab_size)
        for name in ("top_k", "top_p", "min_p")
    )
    valid = labels != ignore_index
    zero = torch.zeros((), dtype=torch.int64, device=device)
    bad_k = zero if k is None else (valid & (k < 1))
    bad_p = zero if p is None else (valid & ~((p > 0) & (p <= 1)))
    bad_mp = zero if mp is None else (valid & ~((mp >= 0) & (mp < 1)))
    n_k, n_p, n_mp = torch.stack([b.sum() for b in (bad_k, bad_p, bad_mp)]).tolist()
    if n_k:
        raise ValueError(
            f"top_k must be >= 1 (use a value >= the vocabulary size, {vocab_size}, for no "
            f"top-k), got {int(k[bad_k][0])}"
        )
    if n_p:
        raise ValueError(f"top_p must be in (0, 1] (1: no top-p), got {float(p[bad_p][0])}")
    if n_mp:
        raise ValueError(f"min_p must be in [0, 1) (0: no min-p), got {float(mp[bad_mp][0])}")
    return ReplayArgs(vocab_size, top_k=k, top_p=p, min_p=mp, with_kept_mass=sampler.with_kept_mass)
