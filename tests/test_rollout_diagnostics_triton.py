"""The rollout-mismatch diagnostics on the Triton kernels (in Triton's interpreter without a
GPU, as tests/test_triton.py runs them): against the float64 truth and the naive reference,
the log-probs / entropy / gradients the same bits as without the option, the ids' logits the
tile's own (an id that is the label gets the label's log-prob bits), several ids in one tile,
several row passes, the batch-invariant schedule."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _rollout import problem, run
from test_rollout_diagnostics import check_against_truth

import logitless
from logitless import RolloutTopK
from logitless.types import RolloutMismatch

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="triton is not installed"
    ),
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="a CUDA device is present: tests/test_cuda.py runs the kernels there",
    ),
]

CASES = [
    dict(dtype=torch.float32),
    dict(dtype=torch.bfloat16, bias=True, temperature=0.8),
    dict(dtype=torch.float32, softcap=3.0, temperature="tensor", chunk_size=7),
]


@pytest.mark.parametrize("case", CASES, ids=["fp32", "bf16-bias-T", "fp32-softcap-Trow-chunk"])
def test_matches_float64(case):
    case = dict(case)
    dtype = case.pop("dtype")
    p = problem(shape=(2, 17), V=333, bias=case.pop("bias", False))
    if case.get("temperature") == "tensor":
        case["temperature"] = torch.rand(p.labels.shape) + 0.5
    check_against_truth(p, dtype, case, backend="triton")


def test_the_option_changes_no_bit_of_the_rest():
    p = problem(shape=(29,), V=200)
    hidden = p.hidden.to(torch.bfloat16).requires_grad_()
    weight = p.weight.to(torch.bfloat16).requires_grad_()
    g, e = torch.randn(29), torch.randn(29)
    results = []
    for topk in (None, p.topk):
        out = logitless.linear_logprobs(
            hidden, weight, p.labels, with_entropy=True, backend="triton", rollout_topk=topk
        )
        grads = torch.autograd.grad((out.logprobs * g + out.entropy * e).sum(), (hidden, weight))
        results.append((out, *grads))
    (off, gh0, gw0), (on, gh1, gw1) = results
    assert torch.equal(off.logprobs, on.logprobs) and torch.equal(off.entropy, on.entropy)
    assert torch.equal(gh0, gh1) and torch.equal(gw0, gw1)
    ids = p.topk.token_ids
    is_label = (ids == p.labels[:, None]) & on.mismatch.compared[:, None]
    assert is_label.sum() >= 15
    label_lp = on.logprobs[:, None].expand_as(ids)
    assert torch.equal(on.mismatch.logprobs[is_label], label_lp[is_label])


def test_many_ids_in_one_tile_and_empty_splits():
    """Consecutive ids (one tile holds all of a row's: the kernel's loop runs once per id),
    ids at both ends of the vocabulary, a vocabulary of fewer blocks than splits; the two
    backends agree to rounding and exactly on the booleans."""
    for vocab, ids in ((300, [[10, 11, 12, 13, 14, 15]]), (37, [[0, 36, 1, 35, -1, 2]])):
        p = problem(shape=(21,), V=vocab, k=5)
        block = torch.tensor(ids).expand(21, -1).clone()
        block[5] = torch.tensor([3, 2, 1, 0, -1, -1])
        lps = torch.log_softmax(torch.randn(21, 6), -1) - 0.5
        topk = RolloutTopK(block, lps)
        a = logitless.linear_logprobs(p.hidden, p.weight, p.labels, rollout_topk=topk,
                                      backend="triton").mismatch  # fmt: skip
        b = logitless.linear_logprobs(p.hidden, p.weight, p.labels, rollout_topk=topk).mismatch
        for name in RolloutMismatch._fields:
            x, y = getattr(a, name), getattr(b, name)
            if x.dtype == torch.bool:
                assert torch.equal(x, y), name
            else:
                torch.testing.assert_close(x, y, rtol=2e-5, atol=2e-6, msg=name)


def test_batch_invariant_schedule():
    """The batch-invariant launches (padded row blocks, the pinned configuration) with the
    probe: the same numbers as the default schedule up to rounding, every id found."""
    p = problem(shape=(23,), V=150)
    a = run(p, torch.float32, backend="triton", batch_invariant=True).mismatch
    b = run(p, torch.float32, backend="triton").mismatch
    for name in ("logprobs", "kl_rollout_trainer", "topk_mass"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=2e-5, atol=2e-6)
    assert torch.equal(a.top1_agree, b.top1_agree)
