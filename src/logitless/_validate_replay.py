"""Input checks of sampling replay (``sampling_mask=``, ``top_k=``, ``top_p=``, ``min_p=``).

Like :mod:`logitless._validate`, every check runs before any FLOP and raises ``ValueError``
naming the argument, what was expected and what was given. The tensor values (offsets order,
id range, duplicates, per-row parameters) are read on the host in one transfer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import check_flag
from ._checks import fmt_shape as _shape
from ._validate import HeadArgs
from .sampling import SamplingMask

_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class ReplayArgs:
    """Validated replay arguments over the call's ``N`` label positions (row-major).

    Either ``mask_ids`` / ``mask_offsets`` (the sampler's kept ids, global: ``[nnz]`` and
    ``[N + 1]`` int64), or per-position sampler parameters: ``top_k`` ``[N]`` int64 (values
    ``>= vocab_size`` mean no top-k), ``top_p`` ``[N]`` float64 in (0, 1], ``min_p`` ``[N]``
    float64 in [0, 1); an absent one is None. ``vocab_size``: the global vocabulary.
    ``kernels.replay.restrict`` gives the same arguments over the call's valid rows only.
    """

    vocab_size: int
    mask_ids: torch.Tensor | None = None
    mask_offsets: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None

    @property
    def is_mask(self) -> bool:
        return self.mask_offsets is not None

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


def _per_position(
    name: str,
    value: object,
    batch_shape: torch.Size,
    device: torch.device,
    *,
    integer: bool,
    cap: int = 0,
) -> torch.Tensor:
    """A scalar or a tensor broadcastable to ``batch_shape`` -> ``[N]`` (int64 or float64).

    ``cap``: an integer scalar above it is stored as ``cap`` (the vocabulary size: any
    ``top_k >= V`` means "not truncated", however large)."""
    n = math.prod(batch_shape)
    if isinstance(value, torch.Tensor):
        if integer and value.dtype not in _INT_DTYPES:
            raise ValueError(f"{name} must be an int or an integer tensor, got dtype {value.dtype}")
        if not integer and not value.is_floating_point():
            raise ValueError(
                f"{name} must be a float or a floating tensor, got dtype {value.dtype}"
            )
        if value.requires_grad:
            raise ValueError(
                f"{name} must not require grad: the sampler's parameters are constants "
                "(detach it first)"
            )
        if value.device != device:
            raise ValueError(f"{name} must be on labels' device {device}, got {value.device}")
        try:
            torch.broadcast_shapes(value.shape, batch_shape)
            out = value.expand(batch_shape).reshape(n)
        except RuntimeError:
            raise ValueError(
                f"{name} of shape {_shape(value)} is not broadcastable to labels' shape "
                f"{list(batch_shape)}"
            ) from None
        return out.long() if integer else out.double()
    if isinstance(value, bool):
        raise ValueError(f"{name} must be {'an int' if integer else 'a float'}, got {value!r}")
    if integer:
        if not isinstance(value, int):
            raise ValueError(f"{name} must be an int or an integer tensor, got {value!r}")
        if value < 1:
            raise ValueError(
                f"{name} must be >= 1 (use a value >= the vocabulary size for no top-k), got "
                f"{value}"
            )
        # Any k >= V keeps the whole row: clamp, so a k beyond int64 means the same.
        return torch.full((n,), min(value, cap), dtype=torch.int64, device=device)
    if not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a float or a floating tensor, got {value!r}")
    return torch.full((n,), float(value), dtype=torch.float64, device=device)


def _mask_of(sampling_mask: object, batch_shape: torch.Size, device: torch.device):
    """``sampling_mask`` (a SamplingMask, or padded ``[*labels.shape, K]`` ids, negative =
    unused) -> (token_ids [nnz] int64, offsets [N + 1] int64), shape checks only."""
    n = math.prod(batch_shape)
    if isinstance(sampling_mask, torch.Tensor):
        if sampling_mask.dtype not in _INT_DTYPES:
            raise ValueError(
                f"sampling_mask as a padded tensor must hold integer ids, got dtype "
                f"{sampling_mask.dtype}"
            )
        if sampling_mask.dim() != len(batch_shape) + 1 or sampling_mask.shape[:-1] != batch_shape:
            raise ValueError(
                f"sampling_mask as a padded tensor must have shape [*labels.shape, K] = "
                f"[{', '.join(map(str, batch_shape))}, K], got {_shape(sampling_mask)}; or pass "
                "a logitless.SamplingMask(token_ids, offsets)"
            )
        if sampling_mask.device != device:
            raise ValueError(
                f"sampling_mask must be on labels' device {device}, got {sampling_mask.device}"
            )
        ids = sampling_mask.reshape(n, sampling_mask.shape[-1]).long()
        used = ids >= 0
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
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in _INT_DTYPES:
            got = (
                f"dtype {t.dtype} and shape {_shape(t)}"
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


def check_replay_args(
    args: HeadArgs,
    ignore_index: int,
    *,
    sampling_mask: object = None,
    top_k: object = None,
    top_p: object = None,
    min_p: object = None,
    vocab_size: int,
) -> ReplayArgs | None:
    """Validate the replay arguments of a head call; None when none is given.

    ``args``: the call's checked head arguments (labels flattened, their shape, the valid-row
    count); ``vocab_size``: the global vocabulary (mask ids must lie in ``[0, vocab_size)``).
    Raises ``ValueError`` naming the argument on a bad value, before any work.
    """
    samplers = {"top_k": top_k, "top_p": top_p, "min_p": min_p}
    given = [k for k, v in samplers.items() if v is not None]
    if sampling_mask is None and not given:
        return None
    if sampling_mask is not None and given:
        raise ValueError(
            f"give sampling_mask or the sampler's parameters ({', '.join(given)}), not both: a "
            "mask is the kept set itself; top_k / top_p / min_p replay the sampler to find it"
        )
    labels = args.labels
    device, shape = labels.device, args.batch_shape
    valid = labels != ignore_index  # [N]
    checks: list[torch.Tensor] = []
    if sampling_mask is not None:
        ids, offsets = _mask_of(sampling_mask, shape, device)
        counts = offsets[1:] - offsets[:-1]
        n_ids = torch.tensor(ids.numel(), device=device)
        # Duplicates within a position: sort (position, id) keys; equal neighbours repeat.
        if ids.numel():
            pos = torch.repeat_interleave(
                torch.arange(counts.numel(), device=device), counts.clamp(min=0)
            )
            same_len = pos.numel() == ids.numel()
        else:
            same_len = True
        checks += [
            offsets[0] != 0 if offsets.numel() else torch.tensor(False, device=device),
            (counts < 0).sum(),
            offsets[-1] != n_ids if offsets.numel() else torch.tensor(False, device=device),
            ((ids < 0) | (ids >= vocab_size)).sum(),
        ]
        names = ["offsets0", "decreasing", "end", "range"]
        values = torch.stack([c.long() for c in checks]).tolist() if checks else []
        bad = dict(zip(names, values, strict=True))
        if bad["offsets0"]:
            raise ValueError(
                f"sampling_mask.offsets must start at 0, got {int(offsets[0])} (CSR row pointers "
                "over the label positions)"
            )
        if bad["decreasing"]:
            first = int(torch.nonzero(counts < 0)[0, 0])
            raise ValueError(
                f"sampling_mask.offsets must be non-decreasing, but offsets[{first + 1}] = "
                f"{int(offsets[first + 1])} < offsets[{first}] = {int(offsets[first])}"
            )
        if bad["end"]:
            raise ValueError(
                f"sampling_mask.offsets must end at token_ids.numel() = {ids.numel()}, got "
                f"{int(offsets[-1])}"
            )
        if bad["range"]:
            first = int(ids[(ids < 0) | (ids >= vocab_size)][0])
            raise ValueError(
                f"sampling_mask token ids must be in [0, {vocab_size}) (global vocabulary ids), "
                f"{bad['range']} are not, e.g. {first}"
            )
        if ids.numel() and same_len:
            key = pos * vocab_size + ids
            srt = key.sort().values
            dup = srt[1:] == srt[:-1]
            if bool(dup.any()):
                k = int(srt[1:][dup][0])
                raise ValueError(
                    f"sampling_mask has a duplicate id: position {k // vocab_size} keeps id "
                    f"{k % vocab_size} more than once (each kept id must appear once)"
                )
        return ReplayArgs(vocab_size=vocab_size, mask_ids=ids, mask_offsets=offsets)

    k = (
        None
        if top_k is None
        else _per_position("top_k", top_k, shape, device, integer=True, cap=vocab_size)
    )
    p = None if top_p is None else _per_position("top_p", top_p, shape, device, integer=False)
    mp = None if min_p is None else _per_position("min_p", min_p, shape, device, integer=False)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    counts = [
        zero if k is None else (valid & (k < 1)).sum(),
        zero if p is None else (valid & ~((p > 0) & (p <= 1))).sum(),
        zero if mp is None else (valid & ~((mp >= 0) & (mp < 1))).sum(),
    ]
    bad_k, bad_p, bad_mp = torch.stack(counts).tolist()
    if bad_k:
        first = int(k[valid & (k < 1)][0])
        raise ValueError(
            f"top_k must be >= 1 (use a value >= the vocabulary size, {vocab_size}, for no "
            f"top-k), got {first}"
        )
    if bad_p:
        first = float(p[valid & ~((p > 0) & (p <= 1))][0])
        raise ValueError(f"top_p must be in (0, 1] (1: no top-p), got {first}")
    if bad_mp:
        first = float(mp[valid & ~((mp >= 0) & (mp < 1))][0])
        raise ValueError(f"min_p must be in [0, 1) (0: no min-p), got {first}")
    return ReplayArgs(vocab_size=vocab_size, top_k=k, top_p=p, min_p=mp)


def check_replay_call(
    args: HeadArgs,
    ignore_index: int,
    *,
    vocab_parallel,
    with_kept_mass: object = False,
    **replay,
) -> ReplayArgs | None:
    """The replay contract of one call (op, fused loss, modules, HF integration, reference):
    :func:`check_replay_args` and the ``with_kept_mass`` flag, made collective when the head is
    vocab-parallel: every rank joins one agreement all-reduce, so a bad mask on one rank raises
    on all of them. None when the call does no replay."""
    check_flag("with_kept_mass", with_kept_mass)
    if vocab_parallel is None:
        vocab = args.weight.shape[0]
        result = check_replay_args(args, ignore_index, vocab_size=vocab, **replay)
    elif all(v is None for v in replay.values()):
        result = None
    else:
        result, error = None, None
        try:
            result = check_replay_args(
                args, ignore_index, vocab_size=vocab_parallel.vocab_size, **replay
            )
        except ValueError as e:
            error = e
        vocab_parallel.agree(args.labels, error)
    if with_kept_mass and result is None:
        raise ValueError("with_kept_mass=True needs sampling_mask= or top_k= / top_p= / min_p=")
    return result
