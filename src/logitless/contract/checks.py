"""Argument-check primitives (the bottom of the library): one wording for each kind of mistake.

Each helper raises ``ValueError`` naming the argument, what was expected and what was given.
Every check of the library that needs one of these rules calls it here; none restates it.
"""

from __future__ import annotations

import math

import torch

#: Integer dtypes accepted for ids (labels, kept ids, top-k): compared as int64 after reading.
INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
#: Slack allowed on given log-probs above 0 and on a position's mass Σ exp(logprobs) above 1
#: (rounding of a server's log-probs: a sparse teacher's, the rollout engine's top-k).
MASS_SLACK = 1e-3


def fmt_shape(t: torch.Tensor) -> str:
    """``[2, 3]`` for a tensor of shape (2, 3)."""
    return f"[{', '.join(str(s) for s in t.shape)}]"


def is_dtensor(t: object) -> bool:
    """A ``torch.distributed`` DTensor (checked by name: no import of torch.distributed)."""
    return type(t).__name__ == "DTensor"


def is_zero3_partitioned(t: object) -> bool:
    """A DeepSpeed ZeRO-3 parameter whose values are not here (only this rank's partition, in
    ``ds_tensor``; checked by attribute: no import of DeepSpeed)."""
    status = getattr(t, "ds_status", None)
    return hasattr(t, "ds_id") and status is not None and status.name != "AVAILABLE"


def check_gathered(name: str, t: object) -> None:
    """``t`` is not a DeepSpeed ZeRO-3 parameter that is still partitioned (its ``.data`` empty:
    read as a head, a ``[0]`` tensor), or ``ValueError`` naming the fix."""
    if is_zero3_partitioned(t):
        raise ValueError(
            f"{name} is a DeepSpeed ZeRO-3 parameter that is not gathered (shape "
            f"{fmt_shape(t)} here, {list(t.ds_shape)} whole): pass the DeepSpeed engine "
            "or its model to the logitless.integrations.hf functions (they gather the "
            "head weight for as long as the head needs it), or call the head inside "
            "`deepspeed.zero.GatheredParameters([weight, ...])` and run its backward "
            "before the context closes"
        )


def check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_int(name: str, value: object, *, minimum: int = 0) -> int:
    """An int (not a bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_optional_int(name: str, value: object, *, minimum: int) -> int | None:
    """None, or :func:`check_int`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be None or an int >= {minimum}, got {value!r}")
    return value


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def finite_number(value: object) -> bool:
    """A real number (an int or a float, not a bool) that is finite: the one test behind every
    numeric option's check (temperatures, coefficients, bounds, counts)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def positive_finite_float(name: str, value: object) -> float:
    if not finite_number(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite float, got {value!r}")
    return float(value)


def optional_positive_float(name: str, value: object) -> float | None:
    """None, or :func:`positive_finite_float`."""
    return None if value is None else positive_finite_float(name, value)


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


def per_position(
    name: str,
    value: object,
    batch_shape: torch.Size,
    device: torch.device,
    *,
    integer: bool,
) -> torch.Tensor:
    """A per-token tensor argument broadcastable to ``batch_shape`` -> ``[N]`` (int64 or
    float64): integer or floating as asked, no gradient, on ``device``."""
    if integer and value.dtype not in INT_DTYPES:
        raise ValueError(f"{name} must be an int or an integer tensor, got dtype {value.dtype}")
    if not integer and not value.is_floating_point():
        raise ValueError(f"{name} must be a float or a floating tensor, got dtype {value.dtype}")
    if value.requires_grad:
        raise ValueError(
            f"{name} must not require grad: logitless treats it as a constant and returns no "
            "gradient for it (detach it first)"
        )
    if value.device != device:
        raise ValueError(f"{name} must be on labels' device {device}, got {value.device}")
    try:
        out = value.expand(batch_shape).reshape(-1)
    except RuntimeError:
        raise ValueError(
            f"{name} of shape {fmt_shape(value)} is not broadcastable to labels' shape "
            f"{list(batch_shape)}"
        ) from None
    return out.long() if integer else out.double()


def check_topk_values(name: str, lps, bad, mass, rule: str, *more) -> list:
    """The values of an engine's top-k log-probs (a sparse teacher's, the rollout engine's),
    read in one host transfer together with ``more`` (0-dim tensors, returned as numbers):
    ``ValueError`` naming ``name`` where ``bad`` (a mask over ``lps``) holds, saying the values
    must be ``rule``, or where a position's mass (``mass`` ``[N]``) exceeds ``1 +
    MASS_SLACK``."""
    n_bad, n_mass, *rest = torch.stack([bad.sum(), (mass > 1 + MASS_SLACK).sum(), *more]).tolist()
    if n_bad:
        raise ValueError(
            f"{name}.logprobs must be {rule}, {n_bad} are not, e.g. {float(lps[bad][0])}"
        )
    if n_mass:
        i = int(torch.nonzero(mass > 1 + MASS_SLACK)[0, 0])
        raise ValueError(
            f"{name}: the probabilities of a position must sum to at most 1, position {i} "
            f"sums to {float(mass[i]):.6f}"
        )
    return rest
