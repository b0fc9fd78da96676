"""Bad input on the loss side and in the corners of the op: a clear error naming the argument,
or a documented result equal to a plain-torch reference; never a silently wrong number.

One test per class of mistake (each failed before its fix), then a property-based test that
generates valid and subtly invalid loss inputs.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import logitless
from logitless import LossNormalizer, PolicyLossConfig, loss_normalizer, policy_loss
from logitless.advantages import grpo_advantages
from logitless.modules import LogprobHead

CFG = PolicyLossConfig()


def _packed(n_docs: int = 3, length: int = 4, seed: int = 0):
    """A packed stream of ``n_docs`` documents of ``length`` tokens, all valid, fp32."""
    g = torch.Generator().manual_seed(seed)
    n = n_docs * length
    lp = -torch.rand(n, generator=g) * 3 - 0.1
    return dict(
        logprobs=lp.requires_grad_(),
        old_logprobs=lp.detach() - 0.05 * torch.randn(n, generator=g).abs(),
        advantages=torch.randn(n_docs, generator=g),
        mask=torch.ones(n, dtype=torch.bool),
        document_ids=torch.arange(n_docs).repeat_interleave(length),
    )


def _call(p, **change):
    p = dict(p, **change)
    return policy_loss(
        p.pop("logprobs"),
        p.pop("old_logprobs"),
        p.pop("advantages"),
        p.pop("mask"),
        config=p.pop("config", CFG),
        **p,
    )


# --------------------------------------------------------------------------------------------
# document ids and advantages


def test_row_restarting_document_ids_are_refused():
    """[B, T] with ids restarting in every row would pool rows' documents together."""
    lp = -torch.rand(2, 6)
    ids = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1]])
    mask = torch.ones(2, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match="contiguous.*offset each row's ids"):
        policy_loss(lp, lp, torch.randn(2), mask, config=CFG, document_ids=ids)


def test_documents_that_resume_are_refused():
    p = _packed(2, 3)
    ids = torch.tensor([0, 0, 1, 1, 0, 0])
    with pytest.raises(ValueError, match="contiguous"):
        _call(p, document_ids=ids)


def test_bool_document_ids_are_refused():
    p = _packed(2, 3)
    with pytest.raises(ValueError, match="document_ids must be an int64 tensor"):
        _call(p, document_ids=p["mask"])


def test_one_rule_for_per_sequence_advantages_with_global_ids():
    """[B, T] with global document ids takes one advantage per document, like the HF wrapper;
    the loss equals the per-token form."""
    lp = -torch.rand(2, 6) - 0.1
    ids = torch.tensor([[0, 0, 0, 1, 1, 1], [2, 2, 3, 3, 3, 3]])
    mask = torch.ones(2, 6, dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 0.25, 2.0])
    old = lp - 0.1
    per_doc, _ = policy_loss(lp, old, adv, mask, config=CFG, document_ids=ids)
    per_token, _ = policy_loss(lp, old, adv[ids], mask, config=CFG, document_ids=ids)
    torch.testing.assert_close(per_doc, per_token)
    with pytest.raises(ValueError, match="one per row"):  # without ids: rows are the documents
        policy_loss(lp, old, adv, mask, config=CFG)


@pytest.mark.parametrize("count", [2, 4])
def test_advantage_count_must_match_the_documents(count):
    """More advantages than documents is the usual "forgot to slice the micro-batch" mistake;
    fewer cannot be used: both are refused, naming both counts."""
    p = _packed(3, 4)
    with pytest.raises(ValueError, match=f"{count} per-sequence values for 3 documents"):
        _call(p, advantages=torch.randn(count))


# --------------------------------------------------------------------------------------------
# the normalizer


def test_normalizer_that_disagrees_with_the_call_is_refused():
    p = _packed(3, 4)  # 12 valid tokens, 3 documents
    for tokens, seqs, what in ((0, 3, "num_tokens"), (1, 3, "num_tokens"), (12, 2, "sequences")):
        with pytest.raises(ValueError, match=f"normalizer.*{what}.*smaller than this call"):
            _call(p, normalizer=LossNormalizer(num_tokens=tokens, num_sequences=seqs))
    bad = LossNormalizer(num_tokens=torch.tensor(float("nan")), num_sequences=3)
    with pytest.raises(ValueError, match="normalizer.num_tokens must be finite"):
        _call(p, normalizer=bad)
    for v in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="num_tokens must be a finite number >= 0"):
            LossNormalizer(num_tokens=v, num_sequences=3)
    # the whole step's counts (larger than the call's) are what it is for
    loss, _ = _call(p, normalizer=LossNormalizer(num_tokens=24, num_sequences=6))
    assert bool(torch.isfinite(loss))


def test_loss_normalizer_takes_bool_masks_only():
    with pytest.raises(ValueError, match=r"masks\[0\] must be a bool tensor"):
        loss_normalizer([torch.ones(3, 4, dtype=torch.long)])


# --------------------------------------------------------------------------------------------
# values: what is an error, what is data


def test_tensors_on_another_device_are_named():
    p = _packed()
    with pytest.raises(ValueError, match="old_logprobs must be on logprobs' device"):
        _call(p, old_logprobs=p["old_logprobs"].to("meta"))


@pytest.mark.parametrize("name", ["old_logprobs", "advantages"])
def test_nan_at_a_valid_token_is_refused(name):
    p = _packed()
    bad = p[name].clone()
    bad[1] = float("nan")
    with pytest.raises(ValueError, match=name):
        _call(p, **{name: bad})


def test_nan_at_an_ignored_token_is_data():
    p = _packed()
    mask = p["mask"].clone()
    mask[1] = False
    old = p["old_logprobs"].clone()
    old[1] = float("nan")
    loss, metrics = _call(p, old_logprobs=old, mask=mask)
    assert bool(torch.isfinite(loss)) and all(bool(torch.isfinite(v)) for v in metrics.values())


def test_probabilities_passed_as_log_probs_are_refused():
    p = _packed()
    with pytest.raises(ValueError, match="old_logprobs look like probabilities"):
        _call(p, old_logprobs=p["old_logprobs"].exp())
    # a stray positive value among log-probs (noise) is data
    old = p["old_logprobs"].clone()
    old[0] = 0.01
    assert bool(torch.isfinite(_call(p, old_logprobs=old)[0]))


def test_rollout_log_prob_of_minus_inf_keeps_everything_finite():
    """A rollout engine's log-prob of -inf (probability 0) or far from the old one: the loss,
    its gradient and every metric stay finite (mismatch_kl included)."""
    p = _packed()
    rollout = p["old_logprobs"].clone()
    rollout[0] = float("-inf")
    rollout[1] = rollout[1] - 100.0
    cfg = PolicyLossConfig(mismatch_is="token")
    loss, metrics = _call(p, rollout_logprobs=rollout, config=cfg)
    loss.backward()
    assert bool(torch.isfinite(loss)) and bool(torch.isfinite(p["logprobs"].grad).all())
    for k, v in metrics.items():
        assert bool(torch.isfinite(v)), k


@pytest.mark.parametrize("fused", [False, True], ids=["policy_loss", "fused"])
def test_nan_advantage_of_a_sequence_with_no_trained_token_is_data(fused):
    """A trainer masks out a sample whose reward failed (NaN): its per-sequence advantage is
    NaN but reaches nothing, so the call proceeds (issue 21), with finite loss, gradients and
    metrics equal to the call without that sample; a NaN that reaches the loss still raises."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 5, 8, generator=g)
    weight = torch.randn(30, 8, generator=g)
    labels = torch.randint(0, 30, (3, 5), generator=g)
    labels[1] = -100  # sample 1: no trained token
    old = torch.full((3, 5), -3.0)
    cfg = PolicyLossConfig(entropy_coef=0.01)

    def run(adv: torch.Tensor, labels: torch.Tensor):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            loss, metrics = logitless.fused_policy_loss(h, w, labels, old, adv, config=cfg)
        else:
            out = logitless.linear_logprobs(h, w, labels, with_entropy=True)
            loss, metrics = logitless.policy_loss(
                out.logprobs, old, adv, labels != -100, config=cfg, entropy=out.entropy
            )
        loss.backward()
        return loss, metrics, h.grad, w.grad

    nan_adv = torch.tensor([1.0, float("nan"), -0.5])
    got = run(nan_adv, labels)
    want = run(torch.tensor([1.0, 0.0, -0.5]), labels)
    torch.testing.assert_close(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for k in got[1]:
        torch.testing.assert_close(got[1][k], want[1][k], msg=k)
    torch.testing.assert_close(got[2], want[2])
    torch.testing.assert_close(got[3], want[3])
    used = labels.clone()
    used[1, 2] = 4  # one trained token: the NaN now reaches the loss
    with pytest.raises(ValueError, match="advantages must be finite; 1 value"):
        run(nan_adv, used)


def test_missing_config_says_how_to_get_the_defaults():
    """Without config= every loss entry point raises a ValueError naming PolicyLossConfig()
    (not Python's bare TypeError about a missing keyword argument)."""
    from logitless.modules import PolicyLossHead

    lp, mask = torch.full((2, 3), -1.0), torch.ones(2, 3, dtype=torch.bool)
    match = r"config= is required: pass config=logitless\.PolicyLossConfig\(\)"
    with pytest.raises(ValueError, match=match):
        logitless.policy_loss(lp, lp, torch.zeros(2), mask)
    hidden, weight, labels = torch.randn(2, 3, 4), torch.randn(7, 4), torch.zeros(2, 3).long()
    with pytest.raises(ValueError, match=match):
        logitless.fused_policy_loss(hidden, weight, labels, lp, torch.zeros(2))
    with pytest.raises(ValueError, match=match):
        PolicyLossHead(torch.nn.Linear(4, 7))


def test_nan_reward_is_refused():
    with pytest.raises(ValueError, match="rewards must be finite"):
        grpo_advantages(torch.tensor([1.0, float("nan"), 0.0, 1.0]), group_size=2)


# --------------------------------------------------------------------------------------------
# the op


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_small_integer_labels_are_range_checked(dtype):
    """A Python bound compared with a uint8 / int8 / int16 tensor would wrap: labels are
    compared as int64."""
    hidden, weight = torch.randn(3, 4), torch.randn(100, 4)
    labels = torch.tensor([1, 2, 120], dtype=dtype)  # 120 >= V = 100
    with pytest.raises(ValueError, match=r"labels must be in \[0, 100\)"):
        logitless.linear_logprobs(hidden, weight, labels)


def test_uint8_label_156_is_not_mistaken_for_ignore_index():
    """-100 wraps to 156 in uint8: a real label 156 must be a label, not ignored."""
    hidden, weight = torch.randn(2, 4), torch.randn(200, 4)
    labels = torch.tensor([156, 3], dtype=torch.uint8)
    out = logitless.linear_logprobs(hidden, weight, labels)
    ref = logitless.reference.linear_logprobs(hidden, weight, labels.long())
    torch.testing.assert_close(out.logprobs, ref.logprobs)
    assert float(out.logprobs[0]) != 0.0


def test_float64_head_returns_float64():
    hidden = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64)
    out = logitless.linear_logprobs(hidden, weight, torch.tensor([1, 2, 3]), with_entropy=True)
    assert out.logprobs.dtype == out.entropy.dtype == torch.float64
    with pytest.raises(ValueError, match="float64 head runs on backend='torch'"):
        logitless.linear_logprobs(hidden, weight, torch.tensor([1, 2, 3]), backend="triton")


def test_meta_tensors_are_refused_clearly():
    meta = torch.device("meta")
    with pytest.raises(ValueError, match="meta tensors"):
        logitless.linear_logprobs(
            torch.empty(3, 4, device=meta),
            torch.empty(9, 4, device=meta),
            torch.empty(3, dtype=torch.long, device=meta),
        )


# --------------------------------------------------------------------------------------------
# configs and modules


def test_config_round_trips_through_json():
    cfg = PolicyLossConfig(
        mismatch_token_mask=(0.5, 2.0), ratio_token_mask=(0.8, 1.25), mismatch_is="token"
    )
    back = PolicyLossConfig(**json.loads(json.dumps(asdict(cfg))))
    assert back == cfg and hash(back) == hash(cfg)
    assert isinstance(back.mismatch_token_mask, tuple)


def test_tied_head_after_load_state_dict_assign_is_refused():
    embed = torch.nn.Embedding(20, 8)
    head = LogprobHead(embed)
    hidden, labels = torch.randn(2, 8), torch.tensor([1, 2])
    head(hidden, labels)  # tied: fine
    head.load_state_dict({"weight": torch.randn(20, 8)}, strict=False, assign=True)
    with pytest.raises(ValueError, match="tie is broken"):
        head(hidden, labels)


# --------------------------------------------------------------------------------------------
# property: valid input gives the plain-torch result, subtly invalid input a named error

MISTAKES = [
    None,  # valid
    "adv_extra",
    "adv_short",
    "ids_resume",
    "ids_bool",
    "old_nan",
    "adv_nan",
    "old_probs",
    "normalizer_small",
    "mask_int",
]
EXPECTED = {
    "adv_extra": "per-sequence values",
    "adv_short": "per-sequence values",
    "ids_resume": "contiguous",
    "ids_bool": "document_ids must be",
    "old_nan": "old_logprobs",
    "adv_nan": "advantages must be finite",
    "old_probs": "old_logprobs look like probabilities",
    "normalizer_small": "normalizer.num_tokens",
    "mask_int": "mask must be a bool tensor",
}


def _plain_grpo(lp, old, adv_tok, valid, clip=0.2):
    """PPO-clip, token mean over valid tokens: the plain-torch reference (float64)."""
    r = (lp - old).exp()
    per = -torch.minimum(r * adv_tok, r.clamp(1 - clip, 1 + clip) * adv_tok)
    return (per * valid).sum() / valid.sum().clamp(min=1)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    masked=st.lists(st.booleans(), min_size=20, max_size=20),
    mistake=st.sampled_from(MISTAKES),
    seed=st.integers(0, 2**16),
)
def test_property_valid_or_named_error(lengths, masked, mistake, seed):
    g = torch.Generator().manual_seed(seed)
    n_docs, n = len(lengths), sum(lengths)
    ids = torch.arange(n_docs).repeat_interleave(torch.tensor(lengths))
    mask = torch.tensor(masked[:n])
    lp = (-torch.rand(n, generator=g, dtype=torch.float64) * 4).requires_grad_()
    old = (lp.detach() + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=0)
    adv = torch.randn(n_docs, generator=g, dtype=torch.float64)
    kw: dict = {"document_ids": ids}
    if mistake == "adv_extra":
        if n_docs + 1 == n:
            return  # [N] advantages are read per token
        adv = torch.randn(n_docs + 1, dtype=torch.float64)
    elif mistake == "adv_short":
        adv = adv[:-1]
    elif mistake == "ids_resume":
        if n_docs < 2:
            return
        ids = torch.cat([ids, ids[:1]])  # document 0 resumes after the last one
        mask = torch.cat([mask, mask[:1]])
        lp = torch.cat([lp, lp[:1]])
        old = torch.cat([old, old[:1]])
        kw["document_ids"] = ids
    elif mistake == "ids_bool":
        kw["document_ids"] = ids >= 0
    elif mistake == "old_nan":
        if not mask.any():
            return
        old = old.clone()
        old[mask.nonzero()[0, 0]] = float("nan")
    elif mistake == "adv_nan":
        if not bool(mask[ids == 0].any()):
            return  # document 0 has no token that counts: its advantage is never used, data
        adv = adv.clone()
        adv[0] = float("nan")
    elif mistake == "old_probs":
        if not mask.any() or old[mask].exp().max() <= 1e-3:
            return
        old = old.exp()
    elif mistake == "normalizer_small":
        if int(mask.sum()) < 2:
            return
        kw["normalizer"] = LossNormalizer(num_tokens=1.0, num_sequences=float(n_docs))
    elif mistake == "mask_int":
        mask = mask.long()
    if mistake is not None:
        with pytest.raises(ValueError, match=EXPECTED[mistake]):
            policy_loss(lp, old, adv, mask, config=CFG, **kw)
        return
    loss, metrics = policy_loss(lp, old, adv, mask, config=CFG, **kw)
    want = _plain_grpo(lp, old, adv[ids], mask.double())
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    for k, v in metrics.items():
        assert math.isfinite(float(v)), k


def test_module_forward_refuses_an_unknown_keyword():
    """The modules' per-call sampler arguments are one typed ``**sampler``: any other keyword
    raises ``TypeError`` naming it, as a plain signature would."""
    from torch import nn

    head = logitless.LogprobHead(nn.Linear(4, 7, bias=False))
    h, y = torch.randn(3, 4), torch.tensor([1, 2, 3])
    assert head(h, y, top_k=3).logprobs.shape == (3,)
    with pytest.raises(TypeError, match="'topk'"):
        head(h, y, topk=3)
    with pytest.raises(TypeError, match="LinearLogprobs.forward.*'sampling'"):
        logitless.LinearLogprobs()(h, torch.randn(7, 4), y, sampling=None)
