"""fused_policy_loss against the naive composition, with tolerances from a float64 truth.

naive  = policy_loss(reference.linear_logprobs(...))   in the test dtype (full logits)
truth  = the same composition in float64 (logits and softmax in float64)
fused  = logitless.fused_policy_loss(...)

For the loss, every metric and the gradients of hidden, weight and bias: |fused - truth| must
be within 4x |naive - truth| (max and rms) plus one fp32 ulp of scale (tests/_tolerance.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _tolerance import assert_no_worse_than_reference

import logitless
from logitless import PolicyLossConfig, fused_policy_loss, policy_loss, reference

CONFIGS = {
    "grpo": PolicyLossConfig(),
    "dapo": PolicyLossConfig(clip_high=0.28, aggregation="token_mean"),
    "dual_clip_seqmean": PolicyLossConfig(dual_clip=3.0, aggregation="seq_mean_token_mean"),
    "dr_grpo": PolicyLossConfig(aggregation="seq_mean_token_sum_norm", norm_length=20),
    "token_sum_kl_k3_entropy": PolicyLossConfig(
        aggregation="token_sum", kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01
    ),
    "kl_k2": PolicyLossConfig(kl_coef=0.1, kl_estimator="k2"),
    "kl_k1_seq_sum": PolicyLossConfig(
        kl_coef=0.1, kl_estimator="k1", aggregation="seq_mean_token_sum"
    ),
    "cispo": PolicyLossConfig(surrogate="cispo", clip_low=1.0, clip_high=4.0),
    "sapo": PolicyLossConfig(surrogate="sapo", entropy_coef=-0.02),
    "reinforce_tis": PolicyLossConfig(surrogate="reinforce", mismatch_is="token"),
    "dppo_icepop": PolicyLossConfig(surrogate="dppo", mismatch_token_mask=(0.5, 2.0)),
    "seq_tis_geo_mask": PolicyLossConfig(
        mismatch_is="sequence", mismatch_seq_mask="geometric", mismatch_seq_mask_range=(0.8, 1.25)
    ),
    "gspo": PolicyLossConfig(
        ratio_level="sequence", clip_low=3e-4, clip_high=4e-4, aggregation="seq_mean_token_mean"
    ),
    "gspo_entropy_kl": PolicyLossConfig(
        ratio_level="sequence", aggregation="token_mean", kl_coef=0.05, entropy_coef=0.01
    ),
    "gmpo": PolicyLossConfig(surrogate="gmpo"),
    "prime_rl_token_mask": PolicyLossConfig(
        surrogate="cispo", clip_low=1.0, clip_high=1e6, ratio_token_mask=(0.8, 1.25)
    ),
    "prime_rl_seq_mask": PolicyLossConfig(
        surrogate="cispo",
        clip_low=1.0,
        clip_high=1e6,
        ratio_seq_mask="geometric",
        ratio_seq_mask_range=(0.97, 1.03),
    ),
}


def _truth_logprobs(hidden, weight, labels, bias, temperature, with_entropy):
    """float64 logits and softmax: the ground truth the tolerances are measured against."""
    logits = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    valid = labels != -100
    lp = logp_all.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    lp = torch.where(valid, lp, 0.0)
    ent = None
    if with_entropy:
        ent = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)
    return lp, ent


def _problem(packed: bool, dtype: torch.dtype, seed: int = 0):
    """A small RL batch: prompts ignored, ragged responses, a document spanning chunks."""
    g = torch.Generator().manual_seed(seed)
    H, V = 24, 301
    if packed:
        N = 53
        cu = torch.tensor([0, 9, 31, 32, 47])  # docs of 9, 22, 1 and 15 tokens, 6 padding
        doc = torch.full((N,), -1)
        for d in range(4):
            doc[cu[d] : cu[d + 1]] = d
        labels = torch.randint(0, V, (N,), generator=g)
        labels[doc < 0] = -100
        labels[cu[1:] - 1] = -100  # each document's last token
        labels[[0, 1, 9, 10, 11, 33]] = -100  # prompt tokens
        shape, adv = (N,), torch.randn(4, generator=g)
    else:
        B, T = 3, 17
        doc = None
        labels = torch.randint(0, V, (B, T), generator=g)
        labels[:, :4] = -100
        labels[1, -5:] = -100
        shape, adv = (B, T), torch.randn(B, generator=g)
    hidden = torch.randn(*shape, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    bias = (torch.randn(V, generator=g) * 0.1).to(dtype)
    with torch.no_grad():
        base = reference.linear_logprobs(hidden, weight, labels, bias=bias).logprobs
    noise = lambda: 0.15 * torch.randn(shape, generator=g)  # noqa: E731
    valid = labels != -100
    old = torch.where(valid, base + noise(), 0.0)
    ref = torch.where(valid, base + noise(), 0.0)
    rollout = torch.where(valid, old + noise(), 0.0)
    return dict(
        hidden=hidden,
        weight=weight,
        bias=bias,
        labels=labels,
        old=old,
        adv=adv,
        doc=doc,
        ref=ref,
        rollout=rollout,
    )


def _loss_kwargs(p, cfg):
    return dict(
        config=cfg,
        document_ids=p["doc"],
        ref_logprobs=p["ref"] if cfg.kl_coef > 0 else None,
        rollout_logprobs=p["rollout"],
    )


def _run(kind, p, cfg, *, chunk_size=None, scale=1.0, temperature=1.0, backend="auto", **head):
    """loss, metrics and grads of hidden / weight / bias for one implementation; ``head``:
    more options of the fused loss (e.g. ``capturable=True``)."""
    dtype = torch.float64 if kind == "truth" else p["hidden"].dtype
    h = p["hidden"].to(dtype).clone().requires_grad_()
    w = p["weight"].to(dtype).clone().requires_grad_()
    b = p["bias"].to(dtype).clone().requires_grad_()
    with_ent = cfg.entropy_coef != 0
    mask = p["labels"] != -100
    kw = _loss_kwargs(p, cfg)
    if kind == "fused":
        loss, metrics = fused_policy_loss(
            h,
            w,
            p["labels"],
            p["old"],
            p["adv"],
            bias=b,
            temperature=temperature,
            chunk_size=chunk_size,
            backend=backend,
            **kw,
            **head,
        )
    else:
        if kind == "truth":
            lp, ent = _truth_logprobs(h, w, p["labels"], b, temperature, with_ent)
            as_kind = lambda t: None if t is None else t.double()  # noqa: E731
        else:
            out = reference.linear_logprobs(
                h, w, p["labels"], bias=b, temperature=temperature, with_entropy=with_ent
            )
            lp, ent = out.logprobs, out.entropy
            as_kind = lambda t: t  # noqa: E731
        kw.update(
            ref_logprobs=as_kind(kw["ref_logprobs"]),
            rollout_logprobs=as_kind(kw["rollout_logprobs"]),
        )
        loss, metrics = policy_loss(
            lp, as_kind(p["old"]), as_kind(p["adv"]), mask, entropy=ent, **kw
        )
    (loss * scale).backward()
    return loss.detach(), metrics, h.grad, w.grad, b.grad


def _compare(fused, naive, truth, num_tokens):
    """Per-element tensors: the K x reference rule. Scalars (loss, metrics) sum num_tokens
    per-token terms, and one sample of the naive's rounding can cancel to nearly nothing, so
    their floor is the fp32 summation bound num_tokens * eps * |value| instead of one ulp."""
    (lf, mf, *gf), (ln, mn, *gn), (lt, mt, *gt) = fused, naive, truth
    assert set(mf) == set(mn), f"metric names differ: {sorted(set(mf) ^ set(mn))}"
    floor = num_tokens * torch.finfo(torch.float32).eps
    assert_no_worse_than_reference(lf, ln, lt, "loss", floor=floor)
    for key in mt:
        assert_no_worse_than_reference(mf[key], mn[key], mt[key], f"metric {key}", floor=floor)
    for name, a, r, t in zip(("hidden.grad", "weight.grad", "bias.grad"), gf, gn, gt, strict=True):
        assert a.dtype == r.dtype, f"{name} dtype {a.dtype} != {r.dtype}"
        assert_no_worse_than_reference(a, r, t, name)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_composed_fp32(name, packed):
    cfg = CONFIGS[name]
    p = _problem(packed, torch.float32)
    chunk = 5  # documents and rows span several chunks
    fused = _run("fused", p, cfg, chunk_size=chunk, scale=2.5)
    naive = _run("naive", p, cfg, scale=2.5)
    truth = _run("truth", p, cfg, scale=2.5)
    _compare(fused, naive, truth, int((p["labels"] != -100).sum()))


@pytest.mark.parametrize("chunk", [None, 1, 7, 64])
@pytest.mark.parametrize("name", ["dapo", "gspo", "token_sum_kl_k3_entropy"])
def test_chunk_sizes(name, chunk):
    cfg = CONFIGS[name]
    p = _problem(True, torch.float32, seed=1)
    temperature = 0.8
    fused = _run("fused", p, cfg, chunk_size=chunk, temperature=temperature)
    naive = _run("naive", p, cfg, temperature=temperature)
    truth = _run("truth", p, cfg, temperature=temperature)
    _compare(fused, naive, truth, int((p["labels"] != -100).sum()))


@pytest.mark.parametrize("name", ["dapo", "gspo", "token_sum_kl_k3_entropy", "cispo"])
def test_matches_composed_bf16(name):
    cfg = CONFIGS[name]
    p = _problem(False, torch.bfloat16, seed=2)
    n = int((p["labels"] != -100).sum())
    _compare(_run("fused", p, cfg, chunk_size=4), _run("naive", p, cfg), _run("truth", p, cfg), n)


def test_token_locality_classification():
    local = {name: cfg.is_token_local for name, cfg in CONFIGS.items()}
    assert local["dapo"] and local["seq_tis_geo_mask"] and local["prime_rl_token_mask"]
    assert not local["gspo"] and not local["gmpo"] and not local["prime_rl_seq_mask"]


def test_backward_twice_raises():
    p = _problem(False, torch.float32)
    h = p["hidden"].clone().requires_grad_()
    loss, _ = fused_policy_loss(
        h, p["weight"], p["labels"], p["old"], p["adv"], config=CONFIGS["grpo"]
    )
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward was already called"):
        loss.backward()


def test_no_grad_gives_same_loss_and_metrics_and_stores_nothing():
    p = _problem(True, torch.float32)
    cfg = CONFIGS["gspo_entropy_kl"]
    h = p["hidden"].clone().requires_grad_()
    kw = _loss_kwargs(p, cfg)
    with torch.no_grad():
        loss0, m0 = fused_policy_loss(h, p["weight"], p["labels"], p["old"], p["adv"], **kw)
    assert loss0.grad_fn is None
    loss1, m1 = fused_policy_loss(h, p["weight"], p["labels"], p["old"], p["adv"], **kw)
    torch.testing.assert_close(loss0, loss1.detach(), rtol=1e-6, atol=1e-7)
    for k in m1:
        torch.testing.assert_close(m0[k], m1[k], rtol=1e-6, atol=1e-7)


def test_grads_accumulate_into_bf16_parameter_with_fp32_head():
    """head_dtype=float32 on a bf16 model: the gradient still lands in the bf16 .grad."""
    p = _problem(False, torch.bfloat16)
    cfg = CONFIGS["dapo"]
    w = p["weight"].clone().requires_grad_()
    runs = []
    for _ in range(2):
        loss, _ = fused_policy_loss(
            p["hidden"], w, p["labels"], p["old"], p["adv"], config=cfg, head_dtype=torch.float32
        )
        loss.backward()
        runs.append(w.grad.clone())
    assert w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(runs[1], 2 * runs[0], rtol=1e-2, atol=1e-6)
    # and it equals the composed path with the same fp32 head
    w2 = p["weight"].clone().requires_grad_()
    out = logitless.linear_logprobs(p["hidden"], w2, p["labels"], head_dtype=torch.float32)
    loss2, _ = policy_loss(out.logprobs, p["old"], p["adv"], p["labels"] != -100, config=cfg)
    loss2.backward()
    torch.testing.assert_close(runs[0].float(), w2.grad.float(), rtol=2e-2, atol=1e-4)


def test_everything_ignored_gives_zero_loss_and_zero_grads():
    p = _problem(False, torch.float32)
    labels = torch.full_like(p["labels"], -100)
    h = p["hidden"].clone().requires_grad_()
    w = p["weight"].clone().requires_grad_()
    loss, metrics = fused_policy_loss(h, w, labels, p["old"], p["adv"], config=CONFIGS["gspo"])
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(h.grad).all() and h.grad.abs().max() == 0
    assert torch.isfinite(w.grad).all() and w.grad.abs().max() == 0
    assert all(torch.isfinite(v).all() for v in metrics.values())


def test_frozen_weight_only_hidden_gets_gradient():
    p = _problem(False, torch.float32)
    cfg = CONFIGS["dapo"]
    h = p["hidden"].clone().requires_grad_()
    w = p["weight"].clone()
    loss, _ = fused_policy_loss(h, w, p["labels"], p["old"], p["adv"], config=cfg)
    loss.backward()
    assert w.grad is None
    h2 = p["hidden"].clone().requires_grad_()
    out = reference.linear_logprobs(h2, w, p["labels"])
    policy_loss(out.logprobs, p["old"], p["adv"], p["labels"] != -100, config=cfg)[0].backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(config="dapo"), "config must be a PolicyLossConfig"),
        (dict(old_logprobs=torch.zeros(3)), "old_logprobs"),
        (
            dict(labels=torch.zeros(2, 2, 2, dtype=torch.long), hidden=torch.zeros(2, 2, 2, 24)),
            r"\[N\] or \[B, T\]",
        ),
        (dict(chunk_size=0), "chunk_size"),
        (dict(temperature=-1.0), "temperature"),
        # 16-bit loss inputs (e.g. cast by FSDP2 mixed precision) would skew the ratio
        ("old_bf16", "old_logprobs must be float32 or float64"),
        ("adv_fp16", "advantages must be float32 or float64"),
    ],
)
def test_bad_input_raises_value_error(change, match):
    p = _problem(False, torch.float32)
    if change == "old_bf16":
        change = dict(old_logprobs=p["old"].bfloat16())
    elif change == "adv_fp16":
        change = dict(advantages=p["adv"].half())
    args = dict(
        hidden=p["hidden"],
        weight=p["weight"],
        labels=p["labels"],
        old_logprobs=p["old"],
        advantages=p["adv"],
        config=CONFIGS["grpo"],
    )
    args.update(change)
    with pytest.raises(ValueError, match=match):
        fused_policy_loss(
            args.pop("hidden"),
            args.pop("weight"),
            args.pop("labels"),
            args.pop("old_logprobs"),
            args.pop("advantages"),
            **args,
        )


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(document_ids=None), "document_ids is required"),
        (dict(advantages=torch.zeros(3)), "advantages"),  # 4 documents, 3 advantages
        (dict(config=PolicyLossConfig(kl_coef=0.1)), "ref_logprobs is required"),
    ],
)
def test_bad_loss_input_raises_before_any_head_work(monkeypatch, change, match):
    """A packed [N] batch without document_ids, wrong advantages, a missing ref: ValueError
    from the loss's checks before the head kernels run."""
    from logitless.backends import torch_tiles as tiles

    def no_head_work(*args, **kwargs):
        raise AssertionError("the head kernel ran before the loss inputs were validated")

    monkeypatch.setattr(tiles, "fused_rows", no_head_work)
    monkeypatch.setattr(tiles, "forward_rows", no_head_work)
    p = _problem(True, torch.float32)
    kw = dict(config=CONFIGS["grpo"], document_ids=p["doc"], advantages=p["adv"])
    kw.update(change)
    h = p["hidden"].clone().requires_grad_()
    with pytest.raises(ValueError, match=match):
        fused_policy_loss(h, p["weight"], p["labels"], p["old"], kw.pop("advantages"), **kw)
