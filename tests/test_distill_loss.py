"""The distillation term of the policy loss: ``+ distill_coef · D`` per token.

policy_loss with ``divergence=``: the term equals the coefficient times the divergence
aggregated like the loss (or with ``distill_aggregation``), its gradient reaches the
divergence, and ``distill_divergence`` is reported. fused_policy_loss with ``teacher=`` (a
TeacherHead or a TeacherTopK): the same loss, metrics and gradients (hidden, weight, bias) as
the composed ``policy_loss(linear_logprobs(...), divergence=linear_divergence(...))``, held to
the composed fp32 path's own error against the composed float64 path (tests/_tolerance.py);
token-local and sequence-level configs, a normalizer, ignored rows, a scaled upstream.
"""

from __future__ import annotations

import pytest
import torch
from _tolerance import assert_no_worse_than_reference

from logitless import (
    LossNormalizer,
    PolicyLossConfig,
    TeacherHead,
    TeacherTopK,
    fused_policy_loss,
    linear_divergence,
    linear_logprobs,
    policy_loss,
)

V, H, HT, B, T = 97, 16, 24, 3, 7


def _batch(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    bias = (0.3 * torch.randn(V, generator=g)).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, :2] = -100
    labels[1, 5:] = -100
    t_hidden = torch.randn(B, T, HT, generator=g, dtype=dtype)
    t_weight = (torch.randn(V, HT, generator=g) / HT**0.5).to(dtype)
    old = -3.0 + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    return hidden, weight, bias, labels, (t_hidden, t_weight), old, adv


def test_policy_loss_term_and_its_gradient():
    hidden, weight, bias, labels, _, old, adv = _batch()
    mask = labels != -100
    lp = old + 0.05
    d = torch.rand(B, T, requires_grad=True)
    base = PolicyLossConfig(aggregation="seq_mean_token_mean")
    plain, _ = policy_loss(lp, old, adv, mask, config=base)
    for agg, expected in [
        (None, (d * mask).sum(1) / mask.sum(1)),  # like the loss: per-sequence token means
        ("token_mean", (d * mask).sum() / mask.sum()),
    ]:
        cfg = PolicyLossConfig(
            aggregation="seq_mean_token_mean", distill_coef=0.7, distill_aggregation=agg
        )
        loss, metrics = policy_loss(lp, old, adv, mask, config=cfg, divergence=d)
        want = 0.7 * (expected.mean() if agg is None else expected)
        torch.testing.assert_close(loss - plain, want, rtol=1e-6, atol=1e-7)
        assert "distill_divergence" in metrics
        (g,) = torch.autograd.grad(loss, d)
        (w,) = torch.autograd.grad(want, d)
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-8)
    with pytest.raises(ValueError, match="divergence is required"):
        policy_loss(lp, old, adv, mask, config=PolicyLossConfig(distill_coef=0.1))


CONFIGS = {
    "dapo": PolicyLossConfig(clip_high=0.28, distill_coef=0.5, distill_beta=0.0),
    "grpo_jsd_entropy": PolicyLossConfig(
        aggregation="seq_mean_token_mean", distill_coef=1.5, distill_beta=0.3, entropy_coef=0.01
    ),
    "gspo_reverse": PolicyLossConfig(
        ratio_level="sequence", clip_low=3e-3, clip_high=4e-3, distill_coef=0.2, distill_beta=1.0,
        aggregation="seq_mean_token_mean", distill_aggregation="token_mean",
    ),
}  # fmt: skip


def _composed(batch, cfg, dtype, normalizer, topk=None):
    hidden, weight, bias, labels, (t_hidden, t_weight), old, adv = batch
    h, w, b = (x.detach().to(dtype).requires_grad_() for x in (hidden, weight, bias))
    out = linear_logprobs(h, w, labels, bias=b, temperature=0.9, with_entropy=True)
    teacher = dict(teacher_topk=topk) if topk is not None else {}
    if topk is None:
        teacher = dict(teacher_hidden=t_hidden.to(dtype), teacher_weight=t_weight.to(dtype))
    div = linear_divergence(
        h, w, labels, bias=b, beta=cfg.distill_beta, temperature=0.9, **teacher
    ).divergence
    loss, metrics = policy_loss(
        out.logprobs, old.to(dtype), adv.to(dtype), labels != -100, config=cfg,
        entropy=out.entropy if cfg.entropy_coef else None, divergence=div,
        normalizer=normalizer,
    )  # fmt: skip
    (1.7 * loss).backward()
    return loss.detach(), metrics, (h.grad, w.grad, b.grad)


def _fused(batch, cfg, normalizer, topk=None):
    hidden, weight, bias, labels, (t_hidden, t_weight), old, adv = batch
    h, w, b = (x.detach().requires_grad_() for x in (hidden, weight, bias))
    teacher = topk if topk is not None else TeacherHead(t_hidden, t_weight)
    loss, metrics = fused_policy_loss(
        h, w, labels, old, adv, config=cfg, bias=b, temperature=0.9, teacher=teacher,
        normalizer=normalizer, chunk_size=4,
    )  # fmt: skip
    (1.7 * loss).backward()
    return loss.detach(), metrics, (h.grad, w.grad, b.grad)


def _topk(batch):
    g = torch.Generator().manual_seed(5)
    lp = torch.randn(B * T, V, generator=g).mul(2).log_softmax(-1).topk(6)
    return TeacherTopK(lp.indices.reshape(-1), lp.values.reshape(-1), torch.arange(B * T + 1) * 6)


@pytest.mark.parametrize("teacher", ["head", "topk"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("normalized", [False, True], ids=["own_counts", "normalizer"])
def test_fused_with_teacher_matches_composed(name, teacher, normalized):
    cfg = CONFIGS[name]  # every config's distill_beta, with a sparse teacher too
    batch = _batch(1)
    topk = _topk(batch) if teacher == "topk" else None
    normalizer = LossNormalizer(num_tokens=40.0, num_sequences=5.0) if normalized else None
    op = _fused(batch, cfg, normalizer, topk)
    ref = _composed(batch, cfg, torch.float32, normalizer, topk)
    truth = _composed(batch, cfg, torch.float64, normalizer, topk)
    floor = 40 * torch.finfo(torch.float32).eps
    assert_no_worse_than_reference(op[0], ref[0], truth[0], "loss", floor=floor)
    assert set(op[1]) == set(ref[1]) and "distill_divergence" in op[1]
    for key in truth[1]:
        assert_no_worse_than_reference(op[1][key], ref[1][key], truth[1][key], key, floor=floor)
    for name_, a, r, t in zip(("hidden", "weight", "bias"), op[2], ref[2], truth[2], strict=True):
        assert_no_worse_than_reference(a, r, t, f"{name_}.grad", floor=floor)


def test_the_term_changes_the_gradient():
    """With distill_coef the gradient is not the plain loss's (so the test above would catch
    a divergence whose gradient is dropped)."""
    batch = _batch(2)
    with_term = _fused(batch, CONFIGS["dapo"], None)
    without = _fused(batch, PolicyLossConfig(clip_high=0.28), None)
    assert not torch.allclose(with_term[2][1], without[2][1], rtol=1e-3, atol=1e-6)


def test_no_grad_and_refusals():
    hidden, weight, bias, labels, (t_hidden, t_weight), old, adv = _batch(3)
    teacher = TeacherHead(t_hidden, t_weight)
    cfg = CONFIGS["dapo"]
    with torch.no_grad():
        loss, metrics = fused_policy_loss(hidden, weight, labels, old, adv, config=cfg,
                                          teacher=teacher)  # fmt: skip
    assert torch.isfinite(loss) and "distill_divergence" in metrics
    with pytest.raises(ValueError, match="teacher must be"):
        fused_policy_loss(hidden, weight, labels, old, adv, config=cfg, teacher=(t_hidden,))
    with pytest.raises(ValueError, match="sampling replay or capturable"):
        fused_policy_loss(hidden, weight, labels, old, adv, config=cfg, teacher=teacher, top_k=5)
    with pytest.raises(ValueError, match="distill_beta must be in"):
        PolicyLossConfig(distill_beta=1.5)


# --------------------------------------------------------------------------------------------
# the distillation loss alone, and context parallelism


def test_distillation_loss_aggregations():
    from logitless.losses import distillation_loss

    g = torch.Generator().manual_seed(4)
    d = torch.rand(10, generator=g, requires_grad=True)
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, -1])
    mask = torch.ones(10, dtype=torch.bool)
    mask[1] = False
    valid = mask & (ids >= 0)
    per_doc = [d[(ids == k) & valid] for k in range(3)]
    cases = {
        "token_mean": d[valid].sum() / valid.sum(),
        "seq_mean_token_mean": sum(x.mean() for x in per_doc) / 3,
        "seq_mean_token_sum": sum(x.sum() for x in per_doc) / 3,
    }
    for agg, want in cases.items():
        loss, metrics = distillation_loss(d, mask, aggregation=agg, document_ids=ids)
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
        assert set(metrics) == {"loss", "distill_divergence", "num_tokens", "num_sequences"}
        torch.testing.assert_close(
            torch.autograd.grad(loss, d)[0],
            torch.autograd.grad(want, d, retain_graph=True)[0],
            rtol=1e-6,
            atol=0,
        )
    norm = LossNormalizer(num_tokens=20.0, num_sequences=4.0)
    loss, _ = distillation_loss(d, mask, document_ids=ids, normalizer=norm)
    torch.testing.assert_close(loss, d[valid].sum() / 20.0, rtol=1e-6, atol=1e-7)


def _cp_worker(rank: int, world: int):
    import torch.distributed as dist

    from logitless import parallel

    group = dist.group.WORLD
    hidden, weight, bias, labels, (t_hidden, t_weight), old, adv = _batch(6)
    n = B * T
    ids = torch.arange(B).repeat_interleave(T)  # each row one document, packed
    split = lambda x, pad: parallel.context_parallel_split(x, rank, world, pad_value=pad)  # noqa: E731
    flat = lambda x: x.reshape(n, *x.shape[2:])  # noqa: E731
    h = split(flat(hidden), 0.0).detach().requires_grad_()
    lab = split(flat(labels), -100)
    w = weight.detach().requires_grad_()
    teacher = TeacherHead(split(flat(t_hidden), 0.0), t_weight)
    loss, metrics = fused_policy_loss(
        h, w, lab, split(flat(old), 0.0), adv, config=CONFIGS["grpo_jsd_entropy"],
        document_ids=split(ids, -1), context_group=group, teacher=teacher, temperature=0.9,
    )  # fmt: skip
    loss.backward()
    dist.all_reduce(w.grad)
    return loss.detach(), metrics["distill_divergence"], w.grad, h.grad


def test_context_parallel_fused_loss_with_teacher():
    """2 ranks, each a shard of one packed stream: the shares sum to one process's loss, the
    metrics are its, the weight gradients sum to its."""
    from _dist import spawn

    results = spawn(_cp_worker, 2, threads=1)
    hidden, weight, bias, labels, (t_hidden, t_weight), old, adv = _batch(6)
    n = B * T
    h = hidden.reshape(n, H).detach().requires_grad_()
    w = weight.detach().requires_grad_()
    loss, metrics = fused_policy_loss(
        h, w, labels.reshape(n), old.reshape(n), adv, config=CONFIGS["grpo_jsd_entropy"],
        document_ids=torch.arange(B).repeat_interleave(T), temperature=0.9,
        teacher=TeacherHead(t_hidden.reshape(n, HT), t_weight),
    )  # fmt: skip
    loss.backward()
    torch.testing.assert_close(sum(r[0] for r in results), loss.detach(), rtol=1e-5, atol=1e-7)
    for r in results:
        torch.testing.assert_close(r[1], metrics["distill_divergence"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(r[2], w.grad, rtol=1e-5, atol=1e-6)
    got_h = torch.cat([results[0][3], results[1][3]])[:n]  # contiguous: rank 0 first, padded
    torch.testing.assert_close(got_h, h.grad, rtol=1e-5, atol=1e-6)
