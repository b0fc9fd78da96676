"""Ignored rows contribute exactly zero, whatever their hidden states hold.

Padding rows with NaN or inf hidden states are real (some models' attention gives NaN on a
fully masked, left-padded row). A row labelled ``ignore_index`` must then still give a log-prob
of 0, a hidden gradient of exactly 0, and nothing at all to the weight and bias gradients:
each op on poisoned padding must return what it returns on finite padding, in every mode
(default, ``capturable=True``, a ``row_capacity`` that includes ignored rows), on every
backend, in the log-prob op (eager and its compiled custom op), the fused loss and the
divergence op (the student's and the teacher's hidden states).

The comparison is exact on purpose: the ignored rows are dropped (default mode) or zeroed
(capturable mode) before any FLOP, so the poisoned call and the finite one run the same
arithmetic on the same numbers and the same row count.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import pytest
import torch

import logitless
from logitless import PolicyLossConfig, fused_policy_loss, linear_divergence, linear_logprobs
from logitless.contract.options import HeadOptions
from logitless.ops.logprobs.compiled import linear_logprobs_op

B, T, H, V = 2, 6, 8, 24
IGNORED = [(0, 0), (0, 1), (0, 2), (1, 5)]  # a prompt and one padding position: 8 valid rows
BAD = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
MODES = {
    "default": {},
    "capturable": {"capturable": True},
    "capacity": {"capturable": True, "row_capacity": 10},  # 8 valid + 2 ignored rows projected
}
_TRITON = importlib.util.find_spec("triton") is not None and not torch.cuda.is_available()
BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=[
            pytest.mark.slow,  # Triton's interpreter
            pytest.mark.skipif(not _TRITON, reason="Triton's interpreter runs without a GPU"),
        ],
    ),
]


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    bias = torch.randn(V, generator=g) * 0.1
    labels = torch.randint(0, V, (B, T), generator=g)
    for b, t in IGNORED:
        labels[b, t] = -100
    up = torch.randn(2, B, T, generator=g)
    return hidden, weight, bias, labels, up


def _poison(hidden: torch.Tensor, value: float) -> torch.Tensor:
    """``hidden`` with ``value`` in every ignored row: one entry of each, all of the last."""
    out = hidden.clone()
    for b, t in IGNORED[:-1]:
        out[b, t, 3] = value
    b, t = IGNORED[-1]
    out[b, t, :] = value
    return out


def _ignored_mask(labels: torch.Tensor) -> torch.Tensor:
    return labels == -100


def _run(fn, hidden, weight, bias, up):
    """fn's outputs and the gradients of (hidden, weight, bias) under random upstream."""
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    outs = fn(h, w, b)
    sum(((o * u).sum() for o, u in zip(outs, up, strict=False)), torch.zeros(())).backward()
    return [o.detach() for o in outs], [h.grad, w.grad, b.grad]


def _assert_padding_contributes_nothing(fn, hidden, weight, bias, labels, up, value):
    got_out, got_grads = _run(fn, _poison(hidden, value), weight, bias, up)
    want_out, want_grads = _run(fn, hidden, weight, bias, up)
    for name, g in zip(("hidden.grad", "weight.grad", "bias.grad"), got_grads, strict=True):
        assert torch.isfinite(g).all(), f"{name} is not finite"
    ignored = _ignored_mask(labels)
    assert (got_grads[0][ignored] == 0).all(), "an ignored row's hidden.grad is not exactly 0"
    for got, want in zip(got_out + got_grads, want_out + want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for out in got_out:
        assert (out[ignored] == 0).all(), "an ignored row's output is not 0"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("bad", list(BAD))
def test_logprobs(bad, mode, backend):
    hidden, weight, bias, labels, up = _inputs()

    def fn(h, w, b):
        out = linear_logprobs(
            h, w, labels, bias=b, with_entropy=True, backend=backend, **MODES[mode],
        )  # fmt: skip
        return out.logprobs, out.entropy

    _assert_padding_contributes_nothing(fn, hidden, weight, bias, labels, up, BAD[bad])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_logprobs_custom_op(bad, mode):
    """The custom op that compiled code calls (run eagerly here: same kernels, own backward)."""
    hidden, weight, bias, labels, up = _inputs(1)
    options = HeadOptions(with_entropy=True, backend="torch", **MODES[mode])

    def fn(h, w, b):
        return tuple(linear_logprobs_op(h, w, labels, b, options))

    _assert_padding_contributes_nothing(fn, hidden, weight, bias, labels, up, BAD[bad])


_LOSSES = {
    "token_local": PolicyLossConfig(clip_high=0.28, aggregation="token_mean", entropy_coef=0.01),
    "sequence_level": PolicyLossConfig(ratio_level="sequence", aggregation="seq_mean_token_mean"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("loss", list(_LOSSES))
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_fused_policy_loss(bad, loss, mode, backend):
    hidden, weight, bias, labels, up = _inputs(2)
    g = torch.Generator().manual_seed(3)
    old = torch.where(labels != -100, -torch.rand(B, T, generator=g) * 3, 0.0)
    adv = torch.randn(B, generator=g)

    def fn(h, w, b):
        value, _ = fused_policy_loss(
            h, w, labels, old, adv, config=_LOSSES[loss], bias=b, backend=backend,
            **MODES[mode],
        )  # fmt: skip
        return (value,)

    got_out, got_grads = _run(fn, _poison(hidden, BAD[bad]), weight, bias, up[0, 0, :1])
    want_out, want_grads = _run(fn, hidden, weight, bias, up[0, 0, :1])
    assert all(torch.isfinite(g).all() for g in got_grads), "a gradient is not finite"
    assert (got_grads[0][_ignored_mask(labels)] == 0).all()
    for got, want in zip(got_out + got_grads, want_out + want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", [0.0, 0.5])
@pytest.mark.parametrize("poisoned", ["student", "teacher", "both"])
def test_divergence(poisoned, beta, backend):
    """The divergence op has no capturable mode (it refuses it): its default mode drops the
    ignored rows of both heads."""
    hidden, weight, bias, labels, up = _inputs(4)
    g = torch.Generator().manual_seed(5)
    t_hidden, t_weight = torch.randn(B, T, 12, generator=g), torch.randn(V, 12, generator=g)

    def fn(h, w, b, teacher):
        out = linear_divergence(
            h, w, labels, teacher, t_weight, bias=b, beta=beta, with_logprobs=True,
            backend=backend,
        )  # fmt: skip
        return out.divergence, out.logprobs

    bad_student = _poison(hidden, math.nan) if poisoned != "teacher" else hidden
    bad_teacher = _poison(t_hidden, math.inf) if poisoned != "student" else t_hidden
    got_out, got_grads = _run(functools.partial(fn, teacher=bad_teacher), bad_student, weight,
                              bias, up)  # fmt: skip
    want_out, want_grads = _run(functools.partial(fn, teacher=t_hidden), hidden, weight, bias, up)
    assert all(torch.isfinite(g).all() for g in got_grads), "a gradient is not finite"
    assert (got_grads[0][_ignored_mask(labels)] == 0).all()
    for got, want in zip(got_out + got_grads, want_out + want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_check_can_fail():
    """The comparison catches a padding row that leaks: an ignored row made valid."""
    hidden, weight, bias, labels, up = _inputs()
    leaky = labels.clone()
    leaky[0, 0] = 1

    def fn(h, w, b):
        return (logitless.reference.linear_logprobs(h, w, leaky, bias=b).logprobs,)

    with pytest.raises(AssertionError):
        _assert_padding_contributes_nothing(fn, hidden, weight, bias, labels, up, math.nan)
