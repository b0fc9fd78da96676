"""``weight_grad_into``: the weight's gradient added into a caller's buffer (Megatron DDP's
``main_grad``) instead of returned to autograd, on both backends (Triton in its interpreter).

The reference is plain torch in the weight's dtype, its ``.grad`` accumulated over two
backward passes; the truth the same in float64. The buffer starts at a prior value (what
earlier micro-batches left), so ``buffer - prior`` must be the two passes' weight gradient,
within the tolerance derived from the reference's own error (tests/_tolerance.py). The
upstream gradients are random; the rows span several row chunks (the torch tiles add a chunk
at a time; the Triton backward makes several row passes), so the buffer is added to, never
overwritten.
"""

from __future__ import annotations

import pytest
import torch
from _tolerance import FLOOR, assert_no_worse_than_reference

import logitless
from logitless.contract.options import WeightGradInto

N, H, V = 75, 24, 203
CONFIG = logitless.PolicyLossConfig(entropy_coef=0.01)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    labels = torch.randint(0, V, (1, N), generator=g)
    labels[0, ::5] = -100
    up = torch.randn(2, 1, N, generator=g)
    old = torch.randn(1, N, generator=g) * 0.1 - 5.0
    adv = torch.randn(1, N, generator=g)
    prior = torch.randn(V, H, generator=g)
    return hidden.to(dtype), weight.to(dtype), labels, up, old, adv, prior


def _naive(hidden, weight, labels, up):
    """logp·up[0] + entropy·up[1], from the full logits (fp32 softmax)."""
    logits = hidden.matmul(weight.t()).float() if hidden.dtype != torch.float64 else None
    logits = hidden.matmul(weight.t()).double() if logits is None else logits
    valid = labels != -100
    logp = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    ent = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    return (torch.where(valid, logp * up[0] + ent * up[1], 0.0)).sum()


def _naive_loss(hidden, weight, labels, old, adv):
    logits = hidden.matmul(weight.t())
    logits = logits.double() if hidden.dtype == torch.float64 else logits.float()
    valid = labels != -100
    logp = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    ent = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    loss, _ = logitless.policy_loss(
        torch.where(valid, logp, 0.0), old.to(logp.dtype), adv.to(logp.dtype), valid,
        config=CONFIG, entropy=torch.where(valid, ent, 0.0),
    )  # fmt: skip
    return loss


def _two_passes(fn, hidden, weight):
    """Two backward passes of ``fn(h, w)``; (hidden's, weight's) accumulated gradients."""
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    for scale in (1.0, 0.5):
        (fn(h, w) * scale).backward()
    return h.grad, w.grad


@pytest.mark.parametrize("chunk", [16, None], ids=["chunks", "one_pass"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("op", ["logprobs", "fused_loss"])
def test_weight_gradient_added_into_buffer(op, backend, dtype, chunk):
    """``buffer - prior`` is the weight gradient of both passes; the hidden gradient is the
    ordinary one; the weight gets no ``.grad``; ``on_added`` runs once per backward. ``chunk``:
    several row chunks, or the backend's own cut (one Triton pass, whose plain dW is written
    rather than summed)."""
    hidden, weight, labels, up, old, adv, prior = _inputs(DTYPES[dtype])
    calls = []
    buffer = prior.clone()
    into = WeightGradInto(buffer, lambda: calls.append(1))
    options = dict(chunk_size=chunk, backend=backend, weight_grad_into=into)

    def ours(h, w):
        if op == "logprobs":
            out = logitless.linear_logprobs(h, w, labels, with_entropy=True, **options)
            return (out.logprobs * up[0] + out.entropy * up[1]).sum()
        return logitless.fused_policy_loss(h, w, labels, old, adv, config=CONFIG, **options)[0]

    def naive(h, w):
        return _naive(h, w, labels, up) if op == "logprobs" else _naive_loss(h, w, labels, old, adv)

    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    for scale in (1.0, 0.5):
        (ours(h, w) * scale).backward()
    assert w.grad is None, "the weight's gradient went into the buffer, not to autograd"
    assert len(calls) == 2, calls
    ref_h, ref_w = _two_passes(naive, hidden, weight)
    exact_h, exact_w = _two_passes(naive, hidden.double(), weight.double())
    floor = 2 * N * FLOOR  # a sum over the rows of two passes (cf. tests/test_megatron.py)
    assert_no_worse_than_reference(
        buffer - prior, ref_w, exact_w, f"{op} {backend} {dtype}: dW", floor=floor
    )
    assert_no_worse_than_reference(h.grad, ref_h, exact_h, f"{op} {backend} {dtype}: dh")


def test_buffer_path_is_the_returned_gradient():
    """fp32, torch tiles: the buffer (from zero) holds the bits the op otherwise returns."""
    hidden, weight, labels, up, *_ = _inputs(torch.float32)
    w = weight.clone().requires_grad_()
    out = logitless.linear_logprobs(hidden, w, labels, with_entropy=True, chunk_size=16)
    (out.logprobs * up[0] + out.entropy * up[1]).sum().backward()
    buffer = torch.zeros_like(weight)
    w2 = weight.clone().requires_grad_()
    out = logitless.linear_logprobs(hidden, w2, labels, with_entropy=True, chunk_size=16,
                                    weight_grad_into=WeightGradInto(buffer))  # fmt: skip
    (out.logprobs * up[0] + out.entropy * up[1]).sum().backward()
    assert torch.equal(buffer, w.grad)


def test_no_gradient_wanted_leaves_the_buffer():
    """Under no_grad, or a weight that does not require grad: the buffer is not touched."""
    hidden, weight, labels, *_, prior = _inputs(torch.float32)
    buffer = prior.clone()
    into = WeightGradInto(buffer, lambda: pytest.fail("nothing was added"))
    h = hidden.clone().requires_grad_()
    out = logitless.linear_logprobs(h, weight, labels, weight_grad_into=into)
    out.logprobs.sum().backward()
    with torch.no_grad():
        logitless.linear_logprobs(hidden, weight.requires_grad_(), labels, weight_grad_into=into)
    assert torch.equal(buffer, prior)


@pytest.mark.parametrize(
    ("buffer", "match"),
    [
        (torch.zeros(V, H + 1), "weight_grad_into.buffer must be a torch.float32 tensor"),
        (torch.zeros(V, H, dtype=torch.bfloat16), "must be a torch.float32 tensor"),
        (torch.zeros(H, V).t(), "must be a contiguous tensor"),
        (torch.zeros(V, H, requires_grad=True), "does not require grad"),
    ],
    ids=["shape", "dtype", "strided", "requires_grad"],
)
def test_bad_buffer_is_refused(buffer, match):
    hidden, weight, labels, *_ = _inputs(torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        logitless.linear_logprobs(hidden, weight, labels, weight_grad_into=WeightGradInto(buffer))


def test_refused_with_replay_and_wrong_type():
    hidden, weight, labels, *_ = _inputs(torch.float32)
    into = WeightGradInto(torch.zeros(V, H))
    with pytest.raises(ValueError, match="not supported with sampling replay"):
        logitless.linear_logprobs(hidden, weight, labels, top_k=5, weight_grad_into=into)
    with pytest.raises(ValueError, match="weight_grad_into must be a"):
        logitless.linear_logprobs(hidden, weight, labels, weight_grad_into=torch.zeros(V, H))
