"""The verl table of docs/trl.md, each row against a short reference of verl's formula.

verl is not installed here: each reference below restates, in plain torch, what verl's
``compute_policy_loss_<mode>`` (``verl/trainer/ppo/core_algos.py``), ``agg_loss``,
``kl_penalty("low_var_kl")`` and the rollout correction (``rollout_corr_helper.py``:
truncated IS weights, ``rollout_rs="token_k1"`` rejection) compute, as of verl's early-2026
sources. logitless gets the options the docs table names; loss and gradient must match in
float64 (``1e-7`` relative where verl adds its ``1e-8`` to a denominator).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from logitless import PolicyLossConfig, policy_loss

D = torch.float64


def _batch(seed=0, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate((7, 3, 5, 6, 2)[:B]):
        mask[b, :n] = True
    lp = -torch.rand(B, T, generator=g, dtype=D) * 2 - 0.05
    old = lp + (torch.rand(B, T, generator=g, dtype=D) - 0.5) * 0.9
    ref = lp + (torch.rand(B, T, generator=g, dtype=D) - 0.5) * 0.6
    rollout = old + (torch.rand(B, T, generator=g, dtype=D) - 0.5) * 1.2
    adv = torch.randn(B, 1, generator=g, dtype=D).expand(B, T)  # one per sequence, as GRPO
    return dict(lp=lp, old=old, ref=ref, rollout=rollout, adv=adv, mask=mask)


# --------------------------------------------------------------------------------------------
# verl, restated


def verl_agg(loss_mat, mask, mode, scale=None):
    m = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * m).sum() / m.sum()
    seq = (loss_mat * m).sum(-1)
    counts = m.sum(-1)
    nonempty = (counts > 0).to(loss_mat.dtype)
    if mode == "seq-mean-token-mean":
        return (seq / (counts + 1e-8) * nonempty).sum() / nonempty.sum()
    out = (seq * nonempty).sum() / nonempty.sum()
    if mode == "seq-mean-token-sum-norm":
        out = out / (mask.shape[-1] if scale is None else scale)
    return out


def _ratio(lp, old):
    return torch.exp(torch.clamp(lp - old, -20.0, 20.0))


def verl_vanilla(b, lp, low, high, c, mode, scale=None, is_weights=None):
    A, r = b["adv"], _ratio(lp, b["old"])
    clipped = torch.maximum(-A * r, -A * r.clamp(1 - low, 1 + high))
    losses = torch.where(A < 0, torch.minimum(-A * c, clipped), clipped)
    if is_weights is not None:
        losses = losses * is_weights
    return verl_agg(losses, b["mask"], mode, scale)


def verl_gspo(b, lp, low, high):
    m = b["mask"].to(D)
    seq = ((lp - b["old"]) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    s = torch.exp(torch.clamp(lp - lp.detach() + seq.detach(), max=10.0))
    A = b["adv"]
    return verl_agg(
        torch.maximum(-A * s, -A * s.clamp(1 - low, 1 + high)), b["mask"], "seq-mean-token-mean"
    )


def verl_geo_mean(b, lp, low, high):
    m = b["mask"].to(D)
    A, lr = b["adv"], lp - b["old"]
    sgn = torch.sign(A)
    clipped = sgn * torch.minimum(sgn * lr, sgn * lr.clamp(-low, high))
    n = m.sum(-1)
    ratio = torch.exp((clipped * m).sum(-1) / (n + 1e-8))
    adv = (A * m).sum(-1) / (n + 1e-8)
    return torch.mean(-adv * ratio)


def verl_dppo_tv(b, lp, low, high, c, mode):
    A, old = b["adv"], b["old"]
    weight = _ratio(lp, old).clamp(max=c).detach()
    diff = lp.exp() - old.exp()
    valid = torch.where(A > 0, diff <= high, diff >= -low).to(D).detach()
    return verl_agg(-A * weight * lp * valid, b["mask"], mode)


def verl_cispo(b, lp, low, high, mode):
    w = _ratio(lp, b["old"]).clamp(1 - low, 1 + high).detach()
    return verl_agg(-w * b["adv"] * lp, b["mask"], mode)


def verl_sapo(b, lp, tau_pos, tau_neg):
    A, r = b["adv"], _ratio(lp, b["old"])
    tau = torch.where(A > 0, torch.full_like(r, tau_pos), torch.full_like(r, tau_neg))
    gates = torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau)
    return verl_agg(-gates * A, b["mask"], "seq-mean-token-mean")


def verl_low_var_kl(b, lp, mode, mask=None):
    x = torch.clamp(b["ref"] - lp, -20, 20)
    kld = torch.clamp(torch.exp(x) - x - 1, -10, 10)
    return verl_agg(kld, b["mask"] if mask is None else mask, mode)


def verl_is_weights(b, level, threshold):
    m = b["mask"].to(D)
    log_rho = b["old"] - b["rollout"]
    if level == "sequence":
        log_rho = (log_rho * m).sum(-1, keepdim=True).clamp(-20, 20).expand_as(log_rho)
    return (torch.exp(log_rho.clamp(-20, 20)) * m).clamp(max=threshold)


def verl_token_k1_keep(b, lower, upper):
    """rollout_rs="token_k1", rollout_rs_threshold=f"{lower}_{upper}": k1 = -log ρ kept in
    [log lower, log upper], i.e. ρ in [1 / upper, 1 / lower]."""
    k1 = -torch.clamp(b["old"] - b["rollout"], -20, 20)
    return b["mask"] & (k1 >= math.log(lower)) & (k1 <= math.log(upper))


# --------------------------------------------------------------------------------------------
# the table: verl options -> (reference, PolicyLossConfig, how the logitless call differs)

BETA = 0.001
CASES = {
    # policy_loss.loss_mode=vanilla (defaults), use_kl_loss=True, kl_loss_type=low_var_kl
    "vanilla_dual_clip_low_var_kl": (
        lambda b, lp: (
            verl_vanilla(b, lp, 0.2, 0.2, 3.0, "token-mean")
            + BETA * verl_low_var_kl(b, lp, "token-mean")
        ),
        PolicyLossConfig(dual_clip=3.0, aggregation="token_mean", kl_coef=BETA),
        {"ref": True},
    ),
    "vanilla_clip_higher_seq_mean_token_sum_norm": (
        lambda b, lp: verl_vanilla(b, lp, 0.2, 0.28, 3.0, "seq-mean-token-sum-norm", scale=16),
        PolicyLossConfig(
            clip_high=0.28, dual_clip=3.0, aggregation="seq_mean_token_sum_norm", norm_length=16
        ),
        {},
    ),
    "vanilla_seq_mean_token_sum": (
        lambda b, lp: verl_vanilla(b, lp, 0.2, 0.2, 3.0, "seq-mean-token-sum"),
        PolicyLossConfig(dual_clip=3.0, aggregation="seq_mean_token_sum"),
        {},
    ),
    "gspo": (
        lambda b, lp: verl_gspo(b, lp, 3e-4, 4e-4),
        PolicyLossConfig(
            ratio_level="sequence", clip_low=3e-4, clip_high=4e-4, aggregation="seq_mean_token_mean"
        ),
        {},
    ),
    "geo_mean": (
        lambda b, lp: verl_geo_mean(b, lp, 0.4, 0.4),
        PolicyLossConfig(
            surrogate="gmpo", clip_low=0.4, clip_high=0.4, aggregation="seq_mean_token_mean"
        ),
        {},
    ),
    "dppo_tv": (  # clip_ratio_low/high are the TV thresholds; clip_ratio_c (3.0) the ratio cap
        lambda b, lp: verl_dppo_tv(b, lp, 0.15, 0.2, 3.0, "token-mean"),
        PolicyLossConfig(
            surrogate="dppo",
            clip_low=0.15,
            clip_high=0.2,
            dppo_ratio_cap=3.0,
            aggregation="token_mean",
        ),
        {},
    ),
    "cispo": (
        lambda b, lp: verl_cispo(b, lp, 1.0, 0.3, "token-mean"),
        PolicyLossConfig(surrogate="cispo", clip_low=1.0, clip_high=0.3, aggregation="token_mean"),
        {},
    ),
    "sapo": (
        lambda b, lp: verl_sapo(b, lp, 1.0, 1.05),
        PolicyLossConfig(surrogate="sapo", aggregation="seq_mean_token_mean"),
        {},
    ),
    # algorithm.rollout_correction.rollout_is=token|sequence, rollout_is_threshold=2.0
    "rollout_is_token": (
        lambda b, lp: verl_vanilla(
            b, lp, 0.2, 0.2, 3.0, "token-mean", is_weights=verl_is_weights(b, "token", 2.0)
        ),
        PolicyLossConfig(dual_clip=3.0, mismatch_is="token", mismatch_is_cap=2.0),
        {"rollout": True},
    ),
    "rollout_is_sequence": (
        lambda b, lp: verl_vanilla(
            b, lp, 0.2, 0.2, 3.0, "token-mean", is_weights=verl_is_weights(b, "sequence", 2.0)
        ),
        PolicyLossConfig(dual_clip=3.0, mismatch_is="sequence", mismatch_is_cap=2.0),
        {"rollout": True},
    ),
    # IcePop band, rollout_rs="token_k1", rollout_rs_threshold="0.6_1.8": verl drops the tokens
    # with ρ outside [1/1.8, 1/0.6] from response_mask (denominators and KL term included), so
    # in logitless they leave the loss mask.
    "icepop_token_k1": (
        lambda b, lp: _icepop_reference(b, lp, 0.6, 1.8),
        PolicyLossConfig(dual_clip=3.0, aggregation="token_mean", kl_coef=BETA),
        {"ref": True, "keep": (0.6, 1.8)},
    ),
}


def _icepop_reference(b, lp, lower, upper):
    kept = dict(b, mask=verl_token_k1_keep(b, lower, upper))
    return verl_vanilla(kept, lp, 0.2, 0.2, 3.0, "token-mean") + BETA * verl_low_var_kl(
        kept, lp, "token-mean"
    )


def _logitless(b, lp, config, how):
    mask = b["mask"]
    if "keep" in how:
        mask = verl_token_k1_keep(b, *how["keep"])
    return policy_loss(
        lp,
        b["old"],
        b["adv"],
        mask,
        config=config,
        ref_logprobs=b["ref"] if how.get("ref") else None,
        rollout_logprobs=b["rollout"] if how.get("rollout") else None,
    )[0]


@pytest.mark.parametrize("name", list(CASES))
def test_verl_mapping(name):
    reference, config, how = CASES[name]
    b = _batch(seed=len(name))
    lp_ref = b["lp"].clone().requires_grad_(True)
    expected = reference(b, lp_ref)
    lp = b["lp"].clone().requires_grad_(True)
    got = _logitless(b, lp, config, how)
    assert_close(got, expected, rtol=1e-7, atol=1e-12)
    (g,), (g_ref,) = torch.autograd.grad(got, lp), torch.autograd.grad(expected, lp_ref)
    g_ref = torch.where(b["mask"], g_ref, 0.0)
    assert_close(g, g_ref, rtol=1e-7, atol=1e-12)
    assert g.abs().sum() > 0


def test_icepop_band_as_mismatch_mask_keeps_the_denominator():
    """``mismatch_token_mask=(1/upper, 1/lower)`` drops the same tokens from the policy term
    but keeps them in the token count (and the KL term): verl's numbers come back when the count
    is that of the kept tokens and there is no KL."""
    b = _batch(seed=3)
    keep = verl_token_k1_keep(b, 0.6, 1.8)
    assert 0 < keep.sum() < b["mask"].sum()  # the band drops some tokens
    cfg = PolicyLossConfig(
        dual_clip=3.0, aggregation="token_mean", mismatch_token_mask=(1 / 1.8, 1 / 0.6)
    )
    lp = b["lp"].clone().requires_grad_(True)
    # verl's numbers: its band removes the tokens from the loss mask (denominator included), so
    # the loss mask is the band's keep mask; the mismatch mask then drops nothing more
    got, _ = policy_loss(lp, b["old"], b["adv"], keep, config=cfg, rollout_logprobs=b["rollout"])
    # with the whole mask, mismatch_token_mask drops the same policy terms but keeps the tokens
    # in the denominator: the loss is verl's scaled by kept / valid tokens
    kept_denominator, _ = policy_loss(
        lp.detach(), b["old"], b["adv"], b["mask"], config=cfg, rollout_logprobs=b["rollout"]
    )
    kept = dict(b, mask=keep)
    lp_ref = b["lp"].clone().requires_grad_(True)
    expected = verl_vanilla(kept, lp_ref, 0.2, 0.2, 3.0, "token-mean")
    assert_close(got, expected, rtol=1e-12, atol=1e-14)
    scale = float(keep.sum()) / float(b["mask"].sum())
    assert_close(kept_denominator, expected.detach() * scale, rtol=1e-12, atol=1e-14)
    assert_close(
        torch.autograd.grad(got, lp)[0],
        torch.where(b["mask"], torch.autograd.grad(expected, lp_ref)[0], 0.0),
        rtol=1e-12,
        atol=1e-14,
    )


def test_wrong_mappings_fail():
    """The comparison can fail: the dppo cap at verl's loss-side default (20) instead of the
    config's clip_ratio_c (3.0), and the IcePop band without inverting the thresholds."""
    b = _batch(seed=4)
    b["old"] = b["lp"] - 1.5  # ratios e^1.5 ≈ 4.5 > 3: the cap binds
    b["adv"] = -b["adv"].abs()  # A < 0: the TV mask keeps every token (π rose)
    lp = b["lp"].clone().requires_grad_(True)
    wrong = PolicyLossConfig(
        surrogate="dppo",
        clip_low=0.15,
        clip_high=0.2,
        dppo_ratio_cap=20.0,
        aggregation="token_mean",
    )
    right = CASES["dppo_tv"][0](b, lp)
    assert not torch.allclose(_logitless(b, lp, wrong, {}), right)
    b = _batch(seed=4)
    inverted = verl_token_k1_keep(b, 0.6, 1.8)
    rho = torch.exp(b["old"] - b["rollout"])
    naive = b["mask"] & (rho >= 0.6) & (rho <= 1.8)
    assert not torch.equal(inverted, naive)
