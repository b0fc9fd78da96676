"""Argument checks shared by every layer (private): one wording for each kind of mistake.

Each helper raises ``ValueError`` naming the argument, what was expected and what was given.
"""

from __future__ import annotations

import math

import torch


def fmt_shape(t: torch.Tensor) -> str:
    """``[2, 3]`` for a tensor of shape (2, 3)."""
    return f"[{', '.join(str(s) for s in t.shape)}]"


def check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_int(name: str, value: object, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def positive_finite_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a positive finite float, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite float, got {value!r}")
    return value


def check_same_device(**tensors: torch.Tensor | None) -> None:
    given = {k: v.device for k, v in tensors.items() if v is not None}
    if len(set(given.values())) > 1:
        pairs = ", ".join(f"{k} on {d}" for k, d in given.items())
        raise ValueError(f"{', '.join(given)} must be on one device, got {pairs}")


def check_full_precision(**tensors: object) -> None:
    """The one precision rule of loss inputs (old / reference / rollout log-probs, advantages,
    temperature tensors, normalizer counts): a floating tensor must be at least 32-bit.

    In 16 bits they lose two to three significant digits: a bf16 log-prob of -5 is off by up to
    0.016, a 1.6% error in the importance ratio. The usual source is FSDP2's
    ``MixedPrecisionPolicy``, which casts every floating tensor argument of a sharded module's
    forward (recursing into dataclasses such as ``LossNormalizer``) to ``param_dtype``.
    """
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() < 4:
            raise ValueError(
                f"{name} must be float32 or float64, got {t.dtype}: 16-bit (or 8-bit) "
                "log-probs, advantages, counts and temperatures are off in the 3rd digit, which "
                "skews the importance ratio. If FSDP2 cast it: MixedPrecisionPolicy casts every "
                "floating tensor argument of a sharded module's forward to param_dtype; shard "
                "the head (and any module whose forward passes these on) with "
                "MixedPrecisionPolicy(..., cast_forward_inputs=False); head_dtype= sets the "
                "projection's dtype"
            )
