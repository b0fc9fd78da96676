"""Parity with PyTorch's own chunked head: ``torch.nn.functional.linear_cross_entropy`` with
``options=torch.nn.LinearCrossEntropyOptions()`` (its chunked path) and ``reduction="none"`` is
the negated per-token log-prob, so it must equal ``logitless.linear_logprobs(...).logprobs``,
outputs and gradients under a random upstream.

Tolerances as in tests/test_peers.py: each within 4x the naive fp32 composition's error against
float64 full logits. The torch this suite installs (2.13) has the function, so the tests run in
CI; an older torch skips them with the reason.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _tolerance import assert_no_worse_than_reference

import logitless

HAS_LCE = hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")
needs_lce = pytest.mark.skipif(
    not HAS_LCE, reason=f"torch {torch.__version__} has no F.linear_cross_entropy"
)
EPS32 = torch.finfo(torch.float32).eps
SHAPE, H, V = (3, 41), 48, 507  # 123 rows, odd sizes


def _problem():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(*SHAPE, H, generator=g)
    weight = torch.randn(V, H, generator=g) * (2.0 / H**0.5)
    bias = torch.randn(V, generator=g)
    labels = torch.randint(0, V, SHAPE, generator=g)
    labels[torch.rand(SHAPE, generator=g) < 0.3] = -100
    labels[1, :7] = -100
    return hidden, weight, bias, labels, torch.randn(SHAPE, generator=g)


def _run(fn, dtype, *leaves, upstream):
    xs = [x.detach().to(dtype).requires_grad_() for x in leaves]
    out = fn(*xs)
    (out * upstream.to(out.dtype)).sum().backward()
    return [out.detach()] + [x.grad for x in xs]


@needs_lce
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
def test_torch_linear_cross_entropy_equals_our_logprobs(with_bias):
    hidden, weight, bias, labels, up = _problem()
    leaves = (hidden, weight, bias) if with_bias else (hidden, weight)

    def torch_lce(h, w, b=None):
        opts = torch.nn.LinearCrossEntropyOptions()
        flat = F.linear_cross_entropy(
            h.flatten(0, -2), w, labels.flatten(), linear_bias=b, reduction="none", options=opts
        )
        return flat.view(labels.shape)

    def ours(h, w, b=None):
        return -logitless.linear_logprobs(h, w, labels, bias=b).logprobs

    def naive(h, w, b=None):
        logits = F.linear(h, w, b)
        flat = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none")
        return flat.view(labels.shape)

    res = {
        "torch_lce": _run(torch_lce, torch.float32, *leaves, upstream=up),
        "ours": _run(ours, torch.float32, *leaves, upstream=up),
    }
    naive32 = _run(naive, torch.float32, *leaves, upstream=up)
    truth = _run(naive, torch.float64, *leaves, upstream=up)
    names = ("-logprobs", "hidden.grad", "weight.grad", "bias.grad")
    for who, got in res.items():
        for name, a, n, t in zip(names, got, naive32, truth, strict=False):
            assert_no_worse_than_reference(a, n, t, f"{who} {name}", floor=EPS32)
    ignored = labels == -100
    for got in res.values():
        assert (got[0][ignored] == 0).all() and (got[1][ignored] == 0).all()


@needs_lce
def test_the_comparison_can_fail():
    """A wrong peer call (no ignore rows masked: labels clamped to 0) is caught."""
    hidden, weight, _, labels, up = _problem()
    clamped = labels.clamp(min=0)

    def wrong(h, w):
        opts = torch.nn.LinearCrossEntropyOptions()
        out = F.linear_cross_entropy(
            h.flatten(0, -2), w, clamped.flatten(), reduction="none", options=opts
        )
        return out.view(labels.shape)

    def naive(h, w):
        flat = F.cross_entropy((h @ w.T).flatten(0, -2), labels.flatten(), reduction="none")
        return flat.view(labels.shape)

    got = _run(wrong, torch.float32, hidden, weight, upstream=up)
    with pytest.raises(AssertionError):
        assert_no_worse_than_reference(
            got[0],
            _run(naive, torch.float32, hidden, weight, upstream=up)[0],
            _run(naive, torch.float64, hidden, weight, upstream=up)[0],
            "-logprobs",
            floor=EPS32,
        )
