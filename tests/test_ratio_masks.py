"""Band masks on the current ratio π_θ/π_old (prime-rl's token and sequence masks).

Hand-worked values: masked tokens (or whole documents) drop out of the policy term, keep their
place in the denominators, and get exactly zero gradient from it.
"""

from __future__ import annotations

import math

import pytest
import torch

from logitless import PolicyLossConfig, policy_loss


def _batch():
    """One row of three tokens with current ratios 0.1, 1.0 and 10 (old = 0 for simplicity)."""
    lp = torch.tensor([[math.log(0.1), 0.0, math.log(10.0)]], dtype=torch.float64)
    lp.requires_grad_()
    old = torch.zeros(1, 3, dtype=torch.float64)
    adv = torch.tensor([2.0], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    return lp, old, adv, mask


def test_token_mask_drops_tokens_outside_the_band():
    lp, old, adv, mask = _batch()
    cfg = PolicyLossConfig(surrogate="reinforce", ratio_token_mask=(0.125, 8.0))
    loss, metrics = policy_loss(lp, old, adv, mask, config=cfg)
    loss.backward()
    # only the middle token (r = 1) counts: -A·r / 3 tokens (the masked ones stay in T)
    torch.testing.assert_close(loss.detach(), torch.tensor(-2.0 / 3, dtype=torch.float64))
    # d/d lp of -A·r/3 at r = 1 is -A/3; masked tokens get exactly 0
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -2.0 / 3, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(
        metrics["ratio_masked_frac"], torch.tensor(2.0 / 3, dtype=torch.float64)
    )


@pytest.mark.parametrize(
    "mode, band, kept_docs",
    [
        # doc 0: ratios (0.1, 1, 10): geometric mean 1, product 1; doc 1: ratios (3, 3):
        # geometric mean 3, product 9
        ("geometric", (0.5, 2.0), [0]),
        ("geometric", (0.5, 4.0), [0, 1]),
        ("product", (0.5, 10.0), [0, 1]),
        ("product", (2.0, 10.0), [1]),
    ],
)
def test_sequence_mask_drops_whole_documents(mode, band, kept_docs):
    lp = torch.tensor(
        [math.log(0.1), 0.0, math.log(10.0), math.log(3.0), math.log(3.0)], dtype=torch.float64
    ).requires_grad_()
    old = torch.zeros(5, dtype=torch.float64)
    doc = torch.tensor([0, 0, 0, 1, 1])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(5, dtype=torch.bool)
    cfg = PolicyLossConfig(surrogate="reinforce", ratio_seq_mask=mode, ratio_seq_mask_range=band)
    loss, _ = policy_loss(lp, old, adv, mask, config=cfg, document_ids=doc)
    loss.backward()
    ratio = lp.detach().exp()
    keep = torch.tensor([float(d in kept_docs) for d in doc.tolist()], dtype=torch.float64)
    a_tok = adv[doc]
    want_loss = (-(a_tok * ratio) * keep).sum() / 5  # token_mean over all 5 tokens
    torch.testing.assert_close(loss.detach(), want_loss)
    torch.testing.assert_close(lp.grad, -(a_tok * ratio) * keep / 5)


def test_prime_rl_style_loss_against_a_short_reference():
    """CISPO with an open clip range + current-ratio token mask: -sg(r)·A·log π · M, token mean."""
    g = torch.Generator().manual_seed(0)
    b, t = 3, 6
    lp = (-torch.rand(b, t, generator=g, dtype=torch.float64) * 2).requires_grad_()
    old = lp.detach() + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) > 0.2
    cfg = PolicyLossConfig(
        surrogate="cispo", clip_low=1.0, clip_high=1e6, ratio_token_mask=(0.8, 1.25)
    )
    loss, _ = policy_loss(lp, old, adv, mask, config=cfg)
    r = (lp - old).exp().detach()
    band = (r >= 0.8) & (r <= 1.25)
    assert 0 < int((band & mask).sum()) < int(mask.sum()), "the band should mask some tokens"
    want = torch.where(mask & band, -r * adv[:, None] * lp, 0.0).sum() / mask.sum()
    torch.testing.assert_close(loss, want)
    (g_loss,) = torch.autograd.grad(loss, lp)
    (g_want,) = torch.autograd.grad(want, lp)
    torch.testing.assert_close(g_loss, g_want)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(ratio_token_mask=(2.0, 1.0)), "ratio_token_mask"),
        (dict(ratio_token_mask=(-1.0, 1.0)), "ratio_token_mask"),
        (dict(ratio_seq_mask="mean"), "ratio_seq_mask"),
        (dict(ratio_seq_mask_range=(1.0, float("inf"))), "ratio_seq_mask_range"),
    ],
)
def test_bad_ratio_mask_config_raises(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PolicyLossConfig(**kwargs)
