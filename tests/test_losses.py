"""Surrogates, KL estimators, mismatch corrections and config checks: hand-worked values.

Each value below is worked out on paper; ratios are given as ``r`` and passed as ``log r``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from logitless.losses import (
    PolicyLossConfig,
    cispo_surrogate,
    dppo_surrogate,
    gmpo_surrogate,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_k3_k2_grad,
    ppo_clip_surrogate,
    reinforce_surrogate,
    sapo_surrogate,
    sequence_mask,
    token_band_mask,
    truncated_is_sequence,
    truncated_is_token,
)

D = torch.float64


def t(*v):
    return torch.tensor(v, dtype=D)


def log_r(*ratios):
    return torch.tensor(ratios, dtype=D).log().requires_grad_(True)


def grad_of(loss_vec, x):
    (g,) = torch.autograd.grad(loss_vec.sum(), x)
    return g


# ---------------------------------------------------------------------------------------------
# PPO clip: every boundary, A > 0, A < 0, A = 0, dual clip


def test_ppo_clip_hand_worked_every_region():
    # ratio:    inside   above    below    above   below   inside  any
    # A:        +2       +1       +1       -1      -1      -1      0
    x = log_r(1.1, 1.5, 0.5, 1.5, 0.5, 0.9, 1.7)
    a = t(2.0, 1.0, 1.0, -1.0, -1.0, -1.0, 0.0)
    out = ppo_clip_surrogate(x, a, clip_low=0.2, clip_high=0.2)
    # max(-A r, -A clip(r)):
    expected = t(-2.2, -1.2, -0.5, 1.5, 0.8, 0.9, 0.0)
    assert_close(out.loss, expected, rtol=0, atol=1e-12)
    # d loss / d log r = -A r where the unclipped branch is active, else 0
    assert_close(grad_of(out.loss, x), t(-2.2, 0.0, -0.5, 1.5, 0.0, 0.9, 0.0), rtol=0, atol=1e-12)
    assert out.clipped_high.tolist() == [False, True, False, False, False, False, False]
    assert out.clipped_low.tolist() == [False, False, False, False, True, False, False]
    assert out.clipped_dual is None


def test_ppo_clip_asymmetric_clip_higher():
    # DAPO: eps_low=0.2, eps_high=0.28; r=1.25 is inside for A>0, r=1.3 is clipped at 1.28
    x = log_r(1.25, 1.3, 0.75)
    a = t(1.0, 1.0, -1.0)
    out = ppo_clip_surrogate(x, a, clip_low=0.2, clip_high=0.28)
    assert_close(out.loss, t(-1.25, -1.28, 0.8), rtol=0, atol=1e-12)
    assert_close(grad_of(out.loss, x), t(-1.25, 0.0, 0.0), rtol=0, atol=1e-12)


def test_ppo_dual_clip_caps_negative_advantage_loss():
    # c = 3: for A<0, loss = min(max(-A r, -A clip(r)), -A c)
    x = log_r(4.0, 2.0, 4.0, 0.5)
    a = t(-1.0, -1.0, 1.0, -2.0)
    out = ppo_clip_surrogate(x, a, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    assert_close(out.loss, t(3.0, 2.0, -1.2, 1.6), rtol=0, atol=1e-12)
    # the dual-clipped token and the clipped ones carry no gradient
    assert_close(grad_of(out.loss, x), t(0.0, 2.0, 0.0, 0.0), rtol=0, atol=1e-12)
    assert out.clipped_dual.tolist() == [True, False, False, False]


# ---------------------------------------------------------------------------------------------
# the other surrogates


def test_cispo_hand_worked():
    # weight = sg(clip(r, 0.8, 1.2)); loss = -w A logp ; grad wrt logp = -w A, none via ratio
    x = log_r(1.5, 0.5, 1.0)
    lp = t(-2.0, -1.0, -0.5).requires_grad_(True)
    a = t(1.0, -1.0, 2.0)
    out = cispo_surrogate(x, lp, a, clip_low=0.2, clip_high=0.2)
    assert_close(out.loss, t(2.4, -0.8, 1.0), rtol=0, atol=1e-12)
    assert_close(grad_of(out.loss, lp), t(-1.2, 0.8, -2.0), rtol=0, atol=1e-12)
    # no gradient reaches the ratio: the clipped weight is a constant
    (g_ratio,) = torch.autograd.grad(out.loss.sum(), x, allow_unused=True)
    assert g_ratio is None
    assert out.clipped_high.tolist() == [True, False, False]
    assert out.clipped_low.tolist() == [False, True, False]


def test_sapo_hand_worked():
    # r = 1: gate = (4/tau) * 0.5 -> loss = -2A/tau, gradient = -A (like the plain one)
    x = log_r(1.0, 1.0, 2.0)
    a = t(1.0, -1.0, -1.0)
    out = sapo_surrogate(x, a, tau_pos=1.0, tau_neg=1.05)
    s = 1.0 / (1.0 + math.exp(-1.05))  # sigma(1.05 * (2 - 1))
    assert_close(out.loss, t(-2.0, 2.0 / 1.05, 4.0 / 1.05 * s), rtol=0, atol=1e-12)
    # d/dlog r = -A * 4 sigma (1 - sigma) * r
    assert_close(grad_of(out.loss, x), t(-1.0, 1.0, 4.0 * s * (1 - s) * 2.0), rtol=0, atol=1e-12)


def test_gmpo_hand_worked_geometric_mean_of_log_clipped_ratios():
    # one document of three tokens, A = 1, eps = 0.4 in log space: c = [0.1, 0.4, -0.5]
    # (A > 0 clips only from above); R = exp(mean c) = exp(0) = 1
    x = torch.tensor([0.1, 0.6, -0.5], dtype=D, requires_grad=True)
    a = t(1.0, 1.0, 1.0)
    seg = (torch.zeros(3, dtype=torch.long), 1)
    valid = torch.ones(3, dtype=torch.bool)
    out = gmpo_surrogate(x, a, valid, *seg, clip_low=0.4, clip_high=0.4)
    assert_close(out.loss, t(-1.0, -1.0, -1.0), rtol=0, atol=1e-12)
    # each token: -A R dc_t/dx_t; the clipped token has no gradient
    assert_close(grad_of(out.loss, x), t(-1.0, 0.0, -1.0), rtol=0, atol=1e-12)
    assert out.clipped_high.tolist() == [False, True, False]
    # A < 0 clips from below: c = [0.6, -0.4]; R = exp(0.1); loss = +R
    x2 = torch.tensor([0.6, -0.7], dtype=D)
    out2 = gmpo_surrogate(
        x2,
        t(-1.0, -1.0),
        torch.ones(2, dtype=torch.bool),
        torch.zeros(2, dtype=torch.long),
        1,
        0.4,
        0.4,
    )
    assert_close(out2.loss, t(math.exp(0.1), math.exp(0.1)), rtol=0, atol=1e-12)
    assert out2.clipped_low.tolist() == [False, True]


def test_reinforce_hand_worked():
    x = log_r(1.0, 2.0, 0.5)
    a = t(1.0, -1.0, 0.0)
    out = reinforce_surrogate(x, a)
    assert_close(out.loss, t(-1.0, 2.0, 0.0), rtol=0, atol=1e-12)
    assert_close(grad_of(out.loss, x), t(-1.0, 2.0, 0.0), rtol=0, atol=1e-12)


def test_dppo_binary_tv_mask():
    # p_old = 0.5 everywhere; delta = 0.2
    old = torch.full((4,), math.log(0.5), dtype=D)
    p = t(0.8, 0.6, 0.2, 0.4)
    lp = p.log().requires_grad_(True)
    a = t(1.0, 1.0, -1.0, -1.0)
    out = dppo_surrogate(lp - old, lp, old, a, delta_low=0.2, delta_high=0.2, ratio_cap=20.0)
    # token 0: p - p_old = 0.3 > 0.2 with A>0 -> masked; token 2: -0.3 < -0.2 with A<0 -> masked
    r = p / 0.5
    expected = t(0.0, -1.0 * r[1] * math.log(0.6), 0.0, 1.0 * r[3] * math.log(0.4))
    assert_close(out.loss, expected, rtol=0, atol=1e-12)
    assert_close(grad_of(out.loss, lp), t(0.0, -r[1], 0.0, r[3]), rtol=0, atol=1e-12)
    assert out.clipped_high.tolist() == [True, False, False, False]
    assert out.clipped_low.tolist() == [False, False, True, False]


def _gradcheck_inputs(n=6):
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(n, generator=g, dtype=D) - 0.5) * 0.6  # log r in (-0.3, 0.3)
    a = torch.randn(n, generator=g, dtype=D)
    return x.requires_grad_(True), a


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, a: ppo_clip_surrogate(x, a, 0.1, 0.15, dual_clip=1.2).loss,
        lambda x, a: sapo_surrogate(x, a, 1.0, 1.05).loss,
        lambda x, a: reinforce_surrogate(x, a).loss,
    ],
    ids=["ppo_clip_dual", "sapo", "reinforce"],
)
def test_surrogate_gradcheck(fn):
    """Surrogates whose gradient is the gradient of their value: plain float64 gradcheck."""
    x, a = _gradcheck_inputs()
    assert torch.autograd.gradcheck(lambda x: fn(x, a), (x,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", ["cispo", "dppo"])
def test_stop_gradient_surrogate_gradcheck(name):
    """CISPO / DPPO differentiate only through log π_θ; their weights are constants.

    So their gradient is checked against finite differences of the loss as a function of
    ``logprobs`` with the (detached) log-ratio held fixed.
    """
    x, a = _gradcheck_inputs()
    x = x.detach()
    lp = (x - 1.0).requires_grad_(True)
    old = torch.full_like(x, -1.0)
    if name == "cispo":
        fn = lambda lp: cispo_surrogate(x, lp, a, 0.1, 0.1).loss  # noqa: E731
    else:
        fn = lambda lp: dppo_surrogate(x, lp, old, a, 0.05, 0.05, 20.0).loss  # noqa: E731
    assert torch.autograd.gradcheck(fn, (lp,), eps=1e-6, atol=1e-8)


def test_gmpo_gradcheck_against_sequence_objective():
    """GMPO's token form, averaged per document, has the gradient of ``mean_d −A_d R_d``."""
    x, _ = _gradcheck_inputs()
    ids = torch.tensor([0, 0, 0, 1, 1, -1])
    a = t(0.7, 0.7, 0.7, -1.3, -1.3, 0.0)  # one advantage per document
    seg = (ids, 2)
    valid = ids >= 0

    def seq_mean(x):
        loss = gmpo_surrogate(x, a, valid, *seg, 0.1, 0.2).loss
        return (loss[:3].mean() + loss[3:5].mean()) / 2

    assert torch.autograd.gradcheck(seq_mean, (x,), eps=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# KL estimators


def test_kl_estimators_hand_worked():
    lp = t(-1.0, -3.0).requires_grad_(True)
    ref = t(-2.0, -3.0)
    # x = ref - lp = [-1, 0]
    assert_close(kl_k1(lp, ref), t(1.0, 0.0), rtol=0, atol=1e-12)
    assert_close(kl_k2(lp, ref), t(0.5, 0.0), rtol=0, atol=1e-12)
    k3 = kl_k3(lp, ref)
    assert_close(k3, t(math.exp(-1.0), 0.0), rtol=0, atol=1e-12)
    # d k3 / d lp = 1 - exp(x)
    assert_close(grad_of(k3, lp), t(1 - math.exp(-1.0), 0.0), rtol=0, atol=1e-12)
    k3p = kl_k3_k2_grad(lp, ref)
    assert_close(k3p, k3.detach(), rtol=0, atol=0)
    # k2 gradient: lp - ref
    assert_close(grad_of(k3p, lp), t(1.0, 0.0), rtol=0, atol=1e-12)


def test_kl_k3_clamps_like_the_anchors():
    lp = t(-40.0, 0.0)
    ref = t(0.0, -40.0)  # x = +40 -> clamped to 20 before exp, then value to 10
    assert_close(kl_k3(lp, ref, 20.0, 10.0), t(10.0, 10.0), rtol=0, atol=0)
    assert_close(kl_k3(lp, ref, 20.0, None)[1], t(math.exp(-20.0) - 1 + 20.0)[0])


# ---------------------------------------------------------------------------------------------
# mismatch corrections


def test_truncated_is_token_and_sequence():
    log_rho = t(0.5, 3.0, 1.2, 5.0, 1.0).log()
    assert_close(truncated_is_token(log_rho, 2.0), t(0.5, 2.0, 1.2, 2.0, 1.0), rtol=0, atol=1e-12)
    seg = (torch.tensor([0, 0, 1, 1, -1]), 2)
    valid = torch.tensor([True, True, True, False, True])
    # doc 0: 0.5 * 3 = 1.5 -> capped at 1.4; doc 1: only token 2 valid -> 1.2; padding -> 0
    w = truncated_is_sequence(log_rho, valid, *seg, 1.4)
    assert_close(w, t(1.4, 1.4, 1.2, 1.2, 0.0), rtol=0, atol=1e-12)


def test_token_band_mask_icepop():
    log_rho = t(0.4, 0.5, 1.0, 2.0, 2.5).log()
    assert_close(token_band_mask(log_rho, 0.5, 2.0), t(0.0, 1.0, 1.0, 1.0, 0.0), rtol=0, atol=0)


def test_sequence_masks_geometric_and_product():
    # doc 0: rho = [4, 0.5] -> geometric sqrt(2) = 1.41, product 2; doc 1: [1.1, 1.1, 1.1]
    log_rho = t(4.0, 0.5, 1.1, 1.1, 1.1).log()
    seg = (torch.tensor([0, 0, 1, 1, 1]), 2)
    valid = torch.ones(5, dtype=torch.bool)
    geo = sequence_mask(log_rho, valid, *seg, "geometric", 0.5, 1.2)
    assert_close(geo, t(0.0, 0.0, 1.0, 1.0, 1.0), rtol=0, atol=0)
    prod = sequence_mask(log_rho, valid, *seg, "product", 0.5, 1.5)
    # doc 1 product 1.331 inside, doc 0 product 2 outside
    assert_close(prod, t(0.0, 0.0, 1.0, 1.0, 1.0), rtol=0, atol=0)
    prod_wide = sequence_mask(log_rho, valid, *seg, "product", 0.5, 2.5)
    assert_close(prod_wide, torch.ones(5, dtype=D), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# config validation


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_high": -1.0}, "clip_high"),
        ({"clip_high": float("nan")}, "clip_high"),
        ({"dual_clip": 0.5}, "dual_clip"),
        ({"surrogate": "cispo", "dual_clip": 3.0}, "dual_clip"),
        ({"surrogate": "ppo"}, "surrogate"),
        ({"ratio_level": "seq"}, "ratio_level"),
        ({"surrogate": "gmpo", "ratio_level": "sequence"}, "ratio_level"),
        ({"aggregation": "seq-mean-token-mean"}, "aggregation"),
        ({"kl_estimator": "low_var_kl"}, "kl_estimator"),
        ({"kl_coef": -0.1}, "kl_coef"),
        ({"kl_value_clamp": 0.0}, "kl_value_clamp"),
        ({"norm_length": 0}, "norm_length"),
        ({"sapo_tau_neg": 0.0}, "sapo_tau_neg"),
        ({"mismatch_is": "tok"}, "mismatch_is"),
        ({"mismatch_is_cap": 0.0}, "mismatch_is_cap"),
        ({"mismatch_token_mask": (2.0, 0.5)}, "mismatch_token_mask"),
        ({"mismatch_seq_mask": "mean"}, "mismatch_seq_mask"),
        ({"mismatch_seq_mask_range": (1.0,)}, "mismatch_seq_mask_range"),
        ({"entropy_coef": float("inf")}, "entropy_coef"),
    ],
)
def test_bad_config_raises_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PolicyLossConfig(**kwargs)


def test_config_is_frozen_and_reports_rollout_need():
    cfg = PolicyLossConfig()
    with pytest.raises(AttributeError):
        cfg.clip_low = 0.3  # type: ignore[misc]
    assert not cfg.uses_rollout
    assert PolicyLossConfig(mismatch_token_mask=(0.5, 2.0)).uses_rollout
    assert PolicyLossConfig(mismatch_is="sequence").uses_rollout
