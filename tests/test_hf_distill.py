"""hf.causal_lm_divergence against both models' own logits, with float64 tolerances.

op     = hf.causal_lm_divergence(student, teacher, ...)           (two backbones, logitless)
ref    = the divergence of model(...).logits and teacher(...).logits in fp32
truth  = the same on float64 copies of both models

Divergence, entropy, log-probs and the gradient of every student parameter under random
upstream gradients; beta 0, 0.5, 1, a temperature; a teacher of another width with its own
soft-capping (Gemma-2) or bias; the teacher gets no gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _tolerance import assert_no_worse_than_reference
from test_hf import IGNORE, _check_grads, _grads, _labels, _layout, _model

from logitless.integrations import hf

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _teacher(kind: str):
    """A teacher of another width: Gemma-2 (soft-capping) or Qwen2 with an lm_head bias."""
    torch.manual_seed(99)
    small = dict(
        vocab_size=384, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12,
    )  # fmt: skip
    if kind == "gemma2":
        model = transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(**small, final_logit_softcapping=3.0)
        )
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small))
        model.lm_head = torch.nn.Linear(48, 384, bias=True)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
        if model.lm_head.bias is not None:
            model.lm_head.bias.normal_(0.0, 0.5)
    return model.eval()


def _divergence(lp_s, lp_t, beta):
    p_s, p_t = lp_s.exp(), lp_t.exp()
    if beta == 0:
        return (p_t * (lp_t - lp_s)).sum(-1)
    if beta == 1:
        return (p_s * (lp_s - lp_t)).sum(-1)
    log_m = torch.logsumexp(
        torch.stack(
            [lp_s + torch.log1p(torch.tensor(-beta)), lp_t + torch.log(torch.tensor(beta))]
        ),
        0,
    )
    return beta * (p_t * (lp_t - log_m)).sum(-1) + (1 - beta) * (p_s * (lp_s - log_m)).sum(-1)


def _run(kind, student, teacher, lay, labels, beta, temperature, upstream):
    student.zero_grad(set_to_none=True)
    valid = labels != IGNORE
    if kind == "op":
        out = hf.causal_lm_divergence(
            student, teacher, lay["ids"], beta=beta, temperature=temperature,
            with_logprobs=True, with_entropy=True, **lay["kw"],
        )  # fmt: skip
        div, lp, ent = out
    else:
        as_kind = (lambda t: t.double()) if kind == "truth" else (lambda t: t.float())
        z_s = as_kind(student(lay["ids"], use_cache=False, **lay["model_kw"]).logits)
        with torch.no_grad():
            z_t = as_kind(teacher(lay["ids"], use_cache=False, **lay["model_kw"]).logits)
        lp_s, lp_t = (z_s / temperature).log_softmax(-1), (z_t / temperature).log_softmax(-1)
        div = torch.where(valid, _divergence(lp_s, lp_t, beta), 0.0)
        lp = torch.where(valid, lp_s.gather(-1, labels.clamp(min=0)[..., None])[..., 0], 0.0)
        ent = torch.where(valid, -(lp_s.exp() * lp_s).sum(-1), 0.0)
    total = sum((t * g.to(t)).sum() for t, g in zip((div, lp, ent), upstream, strict=True))
    total.backward()
    return div.detach(), lp.detach(), ent.detach(), _grads(student)


@pytest.mark.parametrize(
    ("beta", "temperature", "teacher_kind", "layout"),
    [
        (0.0, 1.0, "qwen2_bias", "right_pad"),
        (0.5, 0.8, "gemma2", "right_pad"),
        (1.0, 1.3, "qwen2_bias", "right_pad"),
        (0.3, 1.0, "gemma2", "right_pad"),
        (0.3, 0.9, "qwen2_bias", "packed"),  # documents restarting in a row (position_ids)
        (0.0, 1.0, "qwen2_bias", "cu_seqlens"),
    ],
)
def test_divergence_matches_both_models_logits(beta, temperature, teacher_kind, layout):
    student = _model("qwen2")
    teacher = _teacher(teacher_kind)
    # right padding: Gemma-2's eager attention gives NaN at a float64 left-padded row's padding
    # queries (see tests/test_hf.py), which would poison the truth's gradients
    lay = _layout(layout, seed=5)
    labels = _labels(lay)
    g = torch.Generator().manual_seed(11)
    upstream = [torch.randn(labels.shape, generator=g) for _ in range(3)]
    args = (lay, labels, beta, temperature, upstream)
    op = _run("op", student, teacher, *args)
    ref = _run("ref", student, teacher, *args)
    truth = _run("truth", copy.deepcopy(student).double(), copy.deepcopy(teacher).double(), *args)
    for i, name in enumerate(("divergence", "logprobs", "entropy")):
        assert_no_worse_than_reference(op[i], ref[i], truth[i], name)
    assert bool((op[0][labels != IGNORE] > 0).all())
    _check_grads(op[3], ref[3], truth[3], labels.numel())
    assert all(p.grad is None for p in teacher.parameters())


def test_mismatched_vocabularies_are_refused():
    student, teacher = _model("qwen2"), _model("llama")  # same V: fine
    ids = torch.randint(3, 384, (1, 6))
    hf.causal_lm_divergence(student, teacher, ids)
    teacher.resize_token_embeddings(390)  # 6 more rows: not the same vocabulary
    with pytest.raises(ValueError, match="vocab"):
        hf.causal_lm_divergence(student, teacher, ids)
    out = hf.causal_lm_divergence(student, teacher, ids, vocab_size=384)
    assert out.divergence.shape == ids.shape


# --------------------------------------------------------------------------------------------
# the policy loss with a distillation term: causal_lm_policy_loss(..., teacher=)


def _policy(kind, student, teacher, lay, labels, cfg, p):
    from logitless import policy_loss

    student.zero_grad(set_to_none=True)
    if kind == "op":
        loss, metrics = hf.causal_lm_policy_loss(
            student, lay["ids"], p["old"], p["adv"], config=cfg, temperature=0.9, teacher=teacher,
            **lay["kw"],
        )  # fmt: skip
    else:
        as_kind = (lambda t: t.double()) if kind == "truth" else (lambda t: t.float())
        valid = labels != IGNORE
        z_s = as_kind(student(lay["ids"], use_cache=False, **lay["model_kw"]).logits) / 0.9
        with torch.no_grad():
            z_t = as_kind(teacher(lay["ids"], use_cache=False, **lay["model_kw"]).logits) / 0.9
        lp_s, lp_t = z_s.log_softmax(-1), z_t.log_softmax(-1)
        div = torch.where(valid, _divergence(lp_s, lp_t, cfg.distill_beta), 0.0)
        lp = torch.where(valid, lp_s.gather(-1, labels.clamp(min=0)[..., None])[..., 0], 0.0)
        loss, metrics = policy_loss(
            lp, as_kind(p["old"]), as_kind(p["adv"]), valid, config=cfg, divergence=div
        )
    (1.3 * loss).backward()
    return loss.detach(), metrics, _grads(student)


@pytest.mark.parametrize("beta", [0.0, 0.4])
def test_policy_loss_with_a_teacher(beta):
    from test_hf import _loss_inputs

    from logitless import PolicyLossConfig

    cfg = PolicyLossConfig(clip_high=0.28, distill_coef=0.6, distill_beta=beta)
    student, teacher = _model("qwen2"), _teacher("qwen2_bias")
    lay = _layout("right_pad", seed=6)
    labels = _labels(lay)
    p = _loss_inputs(student, lay, labels)
    op = _policy("op", student, teacher, lay, labels, cfg, p)
    ref = _policy("ref", student, teacher, lay, labels, cfg, p)
    truth = _policy(
        "truth", copy.deepcopy(student).double(), copy.deepcopy(teacher).double(), lay, labels,
        cfg, p,
    )  # fmt: skip
    floor = int((labels != IGNORE).sum()) * torch.finfo(torch.float32).eps
    assert_no_worse_than_reference(op[0], ref[0], truth[0], "loss", floor=floor)
    assert "distill_divergence" in op[1] and set(op[1]) == set(ref[1])
    for key in truth[1]:
        assert_no_worse_than_reference(op[1][key], ref[1][key], truth[1][key], key, floor=floor)
    _check_grads(op[2], ref[2], truth[2], labels.numel())
    assert all(p.grad is None for p in teacher.parameters())
