"""Tolerances derived from the reference's own error against a float64 ground truth.

The Cut Cross-Entropy habit: a fused op computed in fp32 / bf16 cannot match a float64 truth
exactly, but it must be no worse than the naive implementation in the same dtype. So for each
compared tensor:

    err_op  = |op  - truth|        err_ref = |ref - truth|
    max(err_op) <= K * max(err_ref) + atol     and     rms(err_op) <= K * rms(err_ref) + atol

with ``atol = FLOOR * max(1, max|truth|)``, a floor of one fp32 ulp of the tensor's scale
(it only matters where the reference happens to be exact, e.g. all-zero ignored rows). The rms
test catches a small systematic bias that hides under the max of the reference's noise.
"""

from __future__ import annotations

import torch

K = 4.0
FLOOR = torch.finfo(torch.float32).eps  # one fp32 ulp of the tensor's scale (~1.2e-7 relative)


def _rms(x: torch.Tensor) -> float:
    return float(x.square().mean().sqrt()) if x.numel() else 0.0


def error_report(actual, ref, truth, *, k: float = K, floor: float = FLOOR) -> dict:
    """Measured errors and the tolerance they are held to (all in float64)."""
    a, r, t = actual.detach().double(), ref.detach().double(), truth.detach().double()
    err_op, err_ref = (a - t).abs(), (r - t).abs()
    scale = max(1.0, float(t.abs().max())) if t.numel() else 1.0
    atol = floor * scale
    empty = a.numel() == 0
    return {
        "max_op": 0.0 if empty else float(err_op.max()),
        "max_ref": 0.0 if empty else float(err_ref.max()),
        "rms_op": _rms(err_op),
        "rms_ref": _rms(err_ref),
        "atol": atol,
        "k": k,
    }


def assert_no_worse_than_reference(
    actual: torch.Tensor,
    ref: torch.Tensor,
    truth: torch.Tensor,
    name: str = "",
    *,
    k: float = K,
    floor: float = FLOOR,
) -> None:
    """Fail unless ``actual`` is within ``k`` times the reference's error of ``truth``."""
    assert actual.shape == truth.shape, f"{name}: shape {tuple(actual.shape)} != {truth.shape}"
    assert ref.shape == truth.shape, f"{name}: reference shape {tuple(ref.shape)}"
    assert bool(torch.isfinite(actual).all()), f"{name}: non-finite values in the op's result"
    rep = error_report(actual, ref, truth, k=k, floor=floor)
    max_tol = k * rep["max_ref"] + rep["atol"]
    rms_tol = k * rep["rms_ref"] + rep["atol"]
    detail = (
        f"{name}: max err {rep['max_op']:.3e} (tol {max_tol:.3e}, reference {rep['max_ref']:.3e}), "
        f"rms err {rep['rms_op']:.3e} (tol {rms_tol:.3e}, reference {rep['rms_ref']:.3e})"
    )
    assert rep["max_op"] <= max_tol, f"max error too large; {detail}"
    assert rep["rms_op"] <= rms_tol, f"rms error too large; {detail}"
