"""Advantage estimators: hand-worked values and a per-group loop reference."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from logitless.advantages import (
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)

D = torch.float64


def test_grpo_hand_worked():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype=D)
    # group 0: [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3)
    a = grpo_advantages(r, group_size=3, eps=0.0)
    s = (1 / 3) ** 0.5
    expected = torch.tensor([(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0.0, 0.0, 0.0], dtype=D)
    assert_close(a, expected, rtol=1e-14, atol=0)
    assert_close(
        dr_grpo_advantages(r, group_size=3),
        torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0], dtype=D),
        rtol=1e-14,
        atol=1e-16,
    )


def test_rloo_hand_worked():
    r = torch.tensor([1.0, 0.0, 2.0, 5.0], dtype=D)
    # group [1, 0, 2]: baselines (0+2)/2, (1+2)/2, (1+0)/2; a lone sample gets 0
    a = rloo_advantages(r, group_ids=torch.tensor([0, 0, 0, 1]))
    assert_close(a, torch.tensor([0.0, -1.5, 1.5, 0.0], dtype=D), rtol=0, atol=1e-15)


def test_reinforce_pp_batch_normalized():
    r = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=D)
    a = reinforce_pp_advantages(r, eps=0.0)
    assert_close(a, (r - 3.0) / r.std(), rtol=1e-14, atol=0)
    assert_close(a.mean(), torch.tensor(0.0, dtype=D), rtol=0, atol=1e-15)
    # with groups: subtract the group mean first, then normalize over the batch
    b = reinforce_pp_advantages(r, group_size=2, eps=0.0)
    x = torch.tensor([-0.5, 0.5, -1.5, 1.5], dtype=D)
    assert_close(b, (x - x.mean()) / x.std(), rtol=1e-14, atol=0)


@pytest.mark.parametrize("scale", [True, False])
def test_grpo_matches_loop_reference_with_shuffled_group_ids(scale):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (40,), generator=g)
    r = torch.randn(40, generator=g, dtype=D)
    got = grpo_advantages(r, group_ids=ids, scale_by_std=scale, eps=1e-6)
    ref = torch.empty_like(r)
    for k in ids.unique():
        sel = ids == k
        x = r[sel] - r[sel].mean()
        ref[sel] = x / (r[sel].std() + 1e-6) if scale else x
    assert_close(got, ref, rtol=1e-12, atol=1e-14)
    got_rloo = rloo_advantages(r, group_ids=ids)
    ref_rloo = torch.empty_like(r)
    for k in ids.unique():
        sel = ids == k
        n = int(sel.sum())
        ref_rloo[sel] = r[sel] - (r[sel].sum() - r[sel]) / (n - 1)
    assert_close(got_rloo, ref_rloo, rtol=1e-12, atol=1e-14)


def test_outputs_are_finite_and_detached():
    r = torch.tensor([1.0, 1.0, 0.5], requires_grad=True)
    for fn in (grpo_advantages, dr_grpo_advantages, rloo_advantages):
        out = fn(r, group_size=1)
        assert not out.requires_grad and torch.isfinite(out).all() and (out == 0).all()
    assert torch.isfinite(reinforce_pp_advantages(r)).all()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rewards": torch.zeros(4)}, "group_size"),
        ({"rewards": torch.zeros(4), "group_size": 3}, "group_size"),
        ({"rewards": torch.zeros(4), "group_size": 0}, "group_size"),
        ({"rewards": torch.zeros(4), "group_ids": torch.tensor([0, 1, 2])}, "group_ids"),
        ({"rewards": torch.zeros(4), "group_ids": torch.tensor([0, 1, 2, 4])}, "group_ids"),
        ({"rewards": torch.zeros(2, 2), "group_size": 2}, "rewards"),
        ({"rewards": torch.zeros(4, dtype=torch.long), "group_size": 2}, "rewards"),
    ],
)
def test_bad_input_raises(kwargs, field):
    rewards = kwargs.pop("rewards")
    with pytest.raises(ValueError, match=field):
        grpo_advantages(rewards, **kwargs)
