"""``logit_scale``: the logits are multiplied by ``s`` after the bias, before softcap and
temperature (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``), on every path.

Without softcap the scale is a reparametrization: ``s·(h·Wᵀ + b) = h·(sW)ᵀ + sb``, so every path
with ``logit_scale=s`` must give the outputs of the same path on ``(sW, sb)`` without it, and
gradients ``s·∂/∂(sW)`` for the weight and bias (the same for the hidden states). That identity
needs no reference; the reference and float64 comparisons with softcap are in test_head.py,
test_vocab_parallel.py (and test_hf.py for Cohere and Granite).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import logitless
from logitless import PolicyLossConfig, reference
from logitless.modules import LinearLogprobs, LogprobHead, PolicyLossHead

S = 0.37
BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])


def _problem(seed: int = 0, n: int = 29, h: int = 16, v: int = 203):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    bias = torch.randn(v, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100
    upstream = torch.randn(2, n, generator=g, dtype=torch.float64)
    return hidden, weight, bias, labels, upstream


def _grads(fn, hidden, weight, bias, scale_params: float):
    """Outputs of ``fn(h, W, b)`` and its gradients, on fp32 leaves of ``(W·k, b·k)``."""
    h = hidden.float().requires_grad_()
    w = (weight * scale_params).float().requires_grad_()
    b = (bias * scale_params).float().requires_grad_()
    outs = fn(h, w, b)
    outs[-1].backward()  # the last output is the objective
    return [o.detach() for o in outs], h.grad, w.grad, b.grad


REPLAYS = {
    "none": {},
    "mask": {  # 4 distinct kept ids per row, row 3 not truncated
        "sampling_mask": torch.stack(
            [torch.randperm(203, generator=torch.Generator().manual_seed(i))[:4] for i in range(29)]
        ).index_fill_(0, torch.tensor([3]), -1)
    },
    "topk_topp": {"top_k": 9, "top_p": 0.8},
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("replay", list(REPLAYS))
def test_op_is_the_op_on_scaled_parameters(backend, replay):
    hidden, weight, bias, labels, up = _problem()
    kw = dict(labels=labels, with_entropy=True, temperature=0.8, backend=backend, chunk_size=7)
    kw |= REPLAYS[replay]

    def run(logit_scale):
        def fn(h, w, b):
            out = logitless.linear_logprobs(h, w, bias=b, logit_scale=logit_scale, **kw)
            obj = (out.logprobs * up[0].float()).sum() + (out.entropy * up[1].float()).sum()
            return [out.logprobs, out.entropy, obj]

        return fn

    scaled = _grads(run(S), hidden, weight, bias, 1.0)
    plain = _grads(run(None), hidden, weight, bias, S)
    for a, b in zip(scaled[0], plain[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(scaled[1], plain[1], rtol=1e-4, atol=1e-5)  # hidden
    torch.testing.assert_close(scaled[2], S * plain[2], rtol=1e-4, atol=1e-5)  # weight
    torch.testing.assert_close(scaled[3], S * plain[3], rtol=1e-4, atol=1e-5)  # bias
    ref = reference.linear_logprobs(
        hidden.float(), weight.float(), bias=bias.float(), logit_scale=S,
        **{k: v for k, v in kw.items() if k != "backend"},
    )  # fmt: skip
    torch.testing.assert_close(ref.logprobs, scaled[0][0], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", ["dapo", "gspo"])
def test_fused_loss_is_the_loss_on_scaled_parameters(backend, config):
    hidden, weight, bias, labels, _ = _problem(1)
    cfg = {
        "dapo": PolicyLossConfig(clip_high=0.28, entropy_coef=0.01),
        "gspo": PolicyLossConfig(ratio_level="sequence", aggregation="seq_mean_token_mean"),
    }[config]
    docs = torch.arange(29) // 10
    with torch.no_grad():
        old = reference.linear_logprobs(
            hidden.float(), weight.float(), labels, bias=bias.float(), logit_scale=S
        ).logprobs + 0.2 * torch.randn(29, generator=torch.Generator().manual_seed(3))
    adv = torch.tensor([1.0, -0.5, 0.3])

    def run(logit_scale):
        def fn(h, w, b):
            loss, _ = logitless.fused_policy_loss(
                h, w, labels, old, adv, config=cfg, bias=b, logit_scale=logit_scale,
                document_ids=docs, backend=backend, chunk_size=7,
            )  # fmt: skip
            return [loss]

        return fn

    scaled = _grads(run(S), hidden, weight, bias, 1.0)
    plain = _grads(run(None), hidden, weight, bias, S)
    torch.testing.assert_close(scaled[0][0], plain[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scaled[1], plain[1], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(scaled[2], S * plain[2], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(scaled[3], S * plain[3], rtol=1e-4, atol=1e-6)


def test_modules_store_it_and_check_it_at_construction():
    hidden, weight, bias, labels, _ = _problem(2)
    h, w, b = hidden.float(), weight.float(), bias.float()
    lin = torch.nn.Linear(16, 203)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    want = logitless.linear_logprobs(h, w, labels, bias=b, logit_scale=2.0, with_entropy=True)
    got = LinearLogprobs(logit_scale=2.0, with_entropy=True)(h, w, labels, b)
    head = LogprobHead(lin, logit_scale=2.0, with_entropy=True)
    for out in (got, head(h, labels)):
        torch.testing.assert_close(out.logprobs, want.logprobs)
        torch.testing.assert_close(out.entropy, want.entropy)
    assert "logit_scale=2.0" in repr(head)
    old, adv = want.logprobs.detach(), torch.ones(29)
    cfg = PolicyLossConfig()
    docs = torch.zeros(29, dtype=torch.long)
    loss, _ = PolicyLossHead(lin, config=cfg, logit_scale=2.0)(
        h, labels, old, adv[:1], document_ids=docs
    )
    want_loss, _ = logitless.fused_policy_loss(
        h, w, labels, old, adv[:1], config=cfg, bias=b, logit_scale=2.0, document_ids=docs
    )
    torch.testing.assert_close(loss, want_loss)
    for bad in (0.0, -1.0, float("nan"), float("inf"), "2"):
        with pytest.raises(ValueError, match="logit_scale must be a positive finite float"):
            LogprobHead(lin, logit_scale=bad)
        with pytest.raises(ValueError, match="logit_scale must be a positive finite float"):
            logitless.linear_logprobs(h, w, labels, logit_scale=bad)
