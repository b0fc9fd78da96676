"""The fused loss's gradients times a loss scale, for 16-bit models: no systematic error.

``fused_policy_loss`` takes the head's gradients in the forward pass and multiplies them by the
loss's upstream gradient in backward. That upstream gradient is a scale the trainer chose
(gradient accumulation's 1/k, a normalizer, Megatron's token count, a gradient scaler's 2^16):
rounded to bf16 before it multiplies, it biases every gradient by bf16(s)/s (+0.2% for 1/3);
held in fp16 before it multiplies, an fp16 gradient underflows where the scaled one would not,
and 2^16 itself is inf in fp16.

For every entry point that runs the fused loss, with 16-bit parameters and a scale s:
- bf16: the gradients of ``loss · s`` are those of ``loss`` times s taken in fp32 and rounded
  to bf16 once (``bf16(fp32(g) · fp32(s))``), bit for bit: no factor but s, one rounding;
- fp16 (held in fp32 until backward): no inf, and no zero where the composed path has a normal
  gradient (2^16, a gradient scaler's scale, is inf in fp16);
- every dtype: the error against a float64 truth within the composed path's own
  (``linear_logprobs`` then ``policy_loss``, the gradient scaled where autograd scales it).
Mutation: the scale rounded to the gradient's dtype first (what ``g.mul_(grad_loss.to(g.dtype))``
did) fails every bf16 case whose s bf16 does not hold (1/3, 1/7, 1e-3) and the fp16 2^16 case.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _tolerance import assert_no_worse_than_reference

import logitless
from logitless import PolicyLossConfig, WeightGradInto, fused_policy_loss, policy_loss
from logitless.modules import PolicyLossHead

SCALES = [1 / 3, 1 / 7, 1e-3, 65536.0]
# (parameter dtype, head_dtype): a bf16 model with its own head, one with an fp32 head (TRL's
# fp32 lm_head under bf16 autocast, Megatron's fp32 logits option), an fp16 model.
DTYPES = [
    (torch.bfloat16, None),
    (torch.bfloat16, torch.float32),
    (torch.float16, None),
]
CONFIG = PolicyLossConfig(clip_high=0.28, entropy_coef=0.01, aggregation="token_mean")


def assert_scaled_once(scaled: torch.Tensor, unscaled: torch.Tensor, s: float, name: str):
    """``scaled`` is ``unscaled · s`` taken in fp32 and rounded once to its dtype, bit for bit."""
    want = (unscaled.float() * torch.tensor(s, dtype=torch.float32)).to(unscaled.dtype)
    assert scaled.dtype == unscaled.dtype, name
    differ = int((scaled != want).sum())
    assert differ == 0, f"{name}: {differ} of {want.numel()} gradients differ from fp32(g)·s"


def _check(fused: dict, composed: dict, truth: dict) -> None:
    assert set(fused) == set(composed) == set(truth)
    for key, f in fused.items():
        c, t = composed[key], truth[key]
        assert f.dtype == c.dtype, f"{key}: {f.dtype} != {c.dtype}"
        assert bool(torch.isfinite(c).all()), f"{key}: the composed path itself overflows"
        assert bool(torch.isfinite(f).all()), f"{key}: non-finite fused gradient"
        # where the composed gradient is a normal number (subnormals: either may round to 0)
        lost = (f == 0) & (c.abs() >= torch.finfo(c.dtype).tiny)
        assert not bool(lost.any()), f"{key}: {int(lost.sum())} gradients flushed to zero"
        assert_no_worse_than_reference(f, c, t, key)


def _problem(dtype: torch.dtype, vocab: int = 700, dim: int = 48):
    torch.manual_seed(7)
    b, t = 4, 37
    hidden = torch.randn(b, t, dim).to(dtype)
    # logits of a few units: p spans many orders of magnitude (tiny dW entries included)
    weight = (torch.randn(vocab, dim) * 0.6).to(dtype)
    labels = torch.randint(0, vocab, (b, t))
    labels[:, :6] = -100
    labels[1, -5:] = -100
    old = -3.0 + 0.5 * torch.randn(b, t)
    adv = torch.randn(b)
    return hidden, weight, labels, old, adv


def _grads(loss: torch.Tensor, scale: float, tensors: dict) -> dict:
    (loss * scale).backward()
    return {k: v.grad for k, v in tensors.items()}


def _fused(path: str, scale: float, hidden, weight, labels, old, adv, head_dtype) -> dict:
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if path == "module":
        lm_head = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        lm_head.weight = nn.Parameter(weight.clone())
        w = lm_head.weight
        loss, _ = PolicyLossHead(lm_head, config=CONFIG, head_dtype=head_dtype)(h, labels, old, adv)
    else:
        loss, _ = fused_policy_loss(
            h, w, labels, old, adv, config=CONFIG, head_dtype=head_dtype, **REPLAY[path]
        )
    return _grads(loss, scale, {"hidden": h, "weight": w})


REPLAY = {"function": {}, "module": {}, "replay": {"top_k": 600}}  # replay: the kept sets


@pytest.mark.parametrize(("dtype", "head_dtype"), DTYPES)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("path", list(REPLAY))
def test_scaled_loss_gradients(path, scale, dtype, head_dtype):
    problem = _problem(dtype)
    hidden, weight, labels, old, adv = problem
    fused = _fused(path, scale, *problem, head_dtype)
    if dtype == torch.bfloat16:
        unscaled = _fused(path, 1.0, *problem, head_dtype)
        for key in fused:
            assert_scaled_once(fused[key], unscaled[key], scale, key)
    # the composed path (over the same kept sets with replay) and its float64 truth
    results = []
    for dt, hd in ((dtype, head_dtype), (torch.float64, None)):
        hh = hidden.detach().to(dt).requires_grad_()
        ww = weight.detach().to(dt).requires_grad_()
        out = logitless.linear_logprobs(
            hh, ww, labels, with_entropy=True, head_dtype=hd, **REPLAY[path]
        )
        loss_c, _ = policy_loss(
            out.logprobs, old.to(out.logprobs.dtype), adv.to(out.logprobs.dtype),
            labels != -100, entropy=out.entropy, config=CONFIG,
        )  # fmt: skip
        results.append(_grads(loss_c, scale, {"hidden": hh, "weight": ww}))
    _check(fused, *results)


@pytest.mark.parametrize("scale", [1 / 3, 1e-3])
def test_weight_grad_into_gets_the_scale_in_fp32(scale):
    """Megatron's gradient-accumulation fusion: the weight gradient waits in an fp32 scratch
    and joins the fp32 buffer times the scale; both stay fp32 (no bf16 round trip)."""
    hidden, weight, labels, old, adv = _problem(torch.bfloat16)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    buffer = torch.zeros(weight.shape, dtype=torch.float32)
    loss, _ = fused_policy_loss(
        h, w, labels, old, adv, config=CONFIG, weight_grad_into=WeightGradInto(buffer)
    )
    (loss * scale).backward()
    unscaled = _fused("function", 1.0, hidden, weight, labels, old, adv, None)
    assert_scaled_once(h.grad, unscaled["hidden"], scale, "hidden")
    # the buffer: fp32 all the way (the scratch summed 16-bit products in fp32, then times the
    # scale in fp32), not a bf16 value anywhere
    assert buffer.dtype == torch.float32
    assert not torch.equal(buffer, buffer.bfloat16().float()), "the buffer holds bf16 values"
    truth = {}
    for dt in (torch.bfloat16, torch.float64):
        hh = hidden.detach().to(dt).requires_grad_()
        ww = weight.detach().to(dt).requires_grad_()
        out = logitless.linear_logprobs(hh, ww, labels, with_entropy=True)
        loss_c, _ = policy_loss(
            out.logprobs, old.to(out.logprobs.dtype), adv.to(out.logprobs.dtype),
            labels != -100, entropy=out.entropy, config=CONFIG,
        )  # fmt: skip
        truth[dt] = _grads(loss_c, scale, {"weight": ww})["weight"]
    assert_no_worse_than_reference(buffer, truth[torch.bfloat16], truth[torch.float64], "buffer")


# --------------------------------------------------------------------------------------------
# the HF path: a bf16 model's every parameter, the loss scaled like gradient accumulation


def _tiny_qwen2(dtype: torch.dtype):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(
        vocab_size=600, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
    return model.to(dtype).eval()


@pytest.mark.parametrize("scale", [1 / 3, 1 / 7])
def test_hf_policy_loss_scaled_gradients(scale):
    """``hf.causal_lm_policy_loss`` on a bf16 model, the loss scaled as gradient accumulation
    scales it: what the head hands the backbone (the hidden states' gradient) and the head's
    weight gradient are the unscaled ones times s rounded once; every parameter's gradient is
    within the composed HF path's error against a float64 model."""
    from logitless.integrations import hf

    base = _tiny_qwen2(torch.float32)
    torch.manual_seed(5)
    ids = torch.randint(3, 600, (3, 29))
    mask = torch.zeros(3, 29, dtype=torch.bool)
    mask[:, 9:] = True
    old = -4.0 + 0.5 * torch.randn(3, 29)
    adv = torch.randn(3)
    labels = hf.causal_lm_labels(ids, response_mask=mask)

    def grads(dtype: torch.dtype, fused: bool, s: float) -> dict:
        model = _tiny_qwen2(torch.float32)
        model.load_state_dict(base.state_dict())
        model = model.to(dtype)
        seen = {}

        def keep_grad(module, args, output):
            output.last_hidden_state.register_hook(lambda g: seen.setdefault("dh", g))

        model.model.register_forward_hook(keep_grad)
        if fused:
            loss, _ = hf.causal_lm_policy_loss(
                model, ids, old, adv, config=CONFIG, response_mask=mask
            )
        else:
            out = hf.causal_lm_logprobs(model, ids, response_mask=mask, with_entropy=True)
            loss, _ = policy_loss(
                out.logprobs, old.to(out.logprobs.dtype), adv.to(out.logprobs.dtype),
                labels != -100, entropy=out.entropy, config=CONFIG,
            )  # fmt: skip
        (loss * s).backward()
        params = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return params | {"hidden states": seen["dh"]}

    fused = grads(torch.bfloat16, True, scale)
    unscaled = grads(torch.bfloat16, True, 1.0)
    for key in ("hidden states", "lm_head.weight"):
        assert_scaled_once(fused[key], unscaled[key], scale, key)
    composed, truth = grads(torch.bfloat16, False, scale), grads(torch.float64, False, scale)
    assert set(fused) == set(composed) == set(truth)
    assert len(fused) > 10  # the decoder's parameters are there
    for key in fused:
        assert_no_worse_than_reference(fused[key], composed[key], truth[key], key)


@pytest.mark.parametrize("op", ["logprobs", "fused"])
def test_weight_gradient_products_accumulate_in_fp32(op):
    """A bf16 head's weight gradient added into an fp32 buffer (Megatron's ``main_grad``):
    the 16-bit products are summed in fp32, not rounded to bf16 each before they are added
    (``add_product``): after one backward (scale 1, one row chunk) most entries are values
    bf16 cannot hold. Mutation: ``acc += a @ b`` in add_product's CPU branch (every entry is
    then a bf16 value) fails this."""
    hidden, weight, labels, old, adv = _problem(torch.bfloat16)
    w = weight.clone().requires_grad_()
    buffer = torch.zeros(weight.shape, dtype=torch.float32)
    into = WeightGradInto(buffer)
    if op == "logprobs":
        out = logitless.linear_logprobs(hidden, w, labels, with_entropy=True, weight_grad_into=into)
        (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
    else:
        loss, _ = fused_policy_loss(
            hidden, w, labels, old, adv, config=CONFIG, weight_grad_into=into
        )
        loss.backward()
    touched = buffer != 0
    wide = touched & (buffer != buffer.bfloat16().float())
    assert int(wide.sum()) > 0.5 * int(touched.sum()), (
        f"{int(wide.sum())} of {int(touched.sum())} entries are not bf16 values"
    )
