"""linear_divergence on the Triton backend, in Triton's interpreter, against the naive reference,
the float64 truth and the torch tiles.

The cases and the truth are tests/test_divergence.py's (outputs and gradients of the student's
hidden, weight and bias under random upstream gradients of the divergence, log-probs and
entropy), run with ``backend="triton"``: beta 0 / 1 / in between, scalar and per-token
temperature, softcap / bias / logit scale on either head, a wider or narrower teacher, ignored
and all-ignored rows, padded vocabularies, bf16, row passes (``chunk_size``) and narrow backward
chunks, V never a multiple of the kernels' 128-column block. Without a GPU, conftest.py sets
``TRITON_INTERPRET=1``; the shapes stay small so the interpreter stays fast.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import pytest
import torch
from test_divergence import (
    CASES,
    LARGE_CASES,
    LARGE_SHIFTS,
    Case,
    compare,
    large_logit_inputs,
    make_inputs,
    run,
    run_truth,
)

import logitless
from logitless import TeacherTopK, reference
from logitless.contract import backend as backend_registry

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="triton is not installed"
    ),
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="a CUDA device is present: the interpreter is off"
    ),
]

triton_op = functools.partial(logitless.linear_divergence, backend="triton")


@pytest.fixture
def narrow_chunks(monkeypatch):
    """Cut backward into many narrow vocabulary chunks (several workspace refills)."""
    from logitless.backends import triton_launch as triton_head

    monkeypatch.setattr(triton_head, "_WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(triton_head, "_MIN_VOCAB_CHUNK", 96)
    monkeypatch.setattr(triton_head, "_CHUNK_ALIGN", 32)


# Every dense case of test_divergence (its small_tiles flag here cuts the Triton workspace),
# chunk_size=1 left out (a one-row pass is the code of a seven-row one, and slow in the
# interpreter), plus what only the kernels can get wrong.
TRITON_CASES = [c for c in CASES if c.topk is None and c.chunk != 1] + [
    Case(beta=0.3, temperature="scalar", softcap=2.5, t_bias=True, extras=True),
    Case(beta=0.3, temperature="tensor", t_softcap=3.0, scale=1.2, bias=True, chunk=10),
    Case(beta=0.0, H=64, Ht=32, temperature="tensor", softcap=2.0, extras=True),  # even K
    Case(beta=1.0, H=32, Ht=64, bias=True, t_scale=0.7, extras=True, small_tiles=True),
    Case(beta=0.3, V=37, shape=(19,), bias=True, t_bias=True),  # fewer blocks than splits
    Case(beta=0.3, V=128, shape=(16,), ignore="none", extras=True),  # exactly one block
    Case(beta=0.3, dtype="bf16", shape=(29,), V=389, extras=True, temperature="tensor"),
]


def _ids(cases):
    return [c.id for c in cases]


@pytest.mark.parametrize("case", TRITON_CASES, ids=_ids(TRITON_CASES))
def test_matches_reference_and_float64(case, request):
    if case.small_tiles:
        request.getfixturevalue("narrow_chunks")
    d = make_inputs(case)
    op = run(triton_op, case, d, chunk_size=case.chunk)
    ref = run(reference.linear_divergence, case, d)
    compare(op, ref, run_truth(case, d), d["labels"])


LARGE_DENSE = [c for c in LARGE_CASES if c.topk is None]


@pytest.mark.parametrize("shift", LARGE_SHIFTS, ids=[f"{a:g},{b:g}" for a, b in LARGE_SHIFTS])
@pytest.mark.parametrize("case", LARGE_DENSE, ids=_ids(LARGE_DENSE))
def test_large_logits_keep_the_naive_accuracy(case, shift):
    """test_divergence's large-logit cases on the kernels: the cross sum centred on the
    running maxima in the kernel and in the merge of its vocabulary splits."""
    d = large_logit_inputs(case, *shift)
    op = run(triton_op, case, d, chunk_size=16)
    ref = run(reference.linear_divergence, case, d)
    compare(op, ref, run_truth(case, d), d["labels"])


AGREE = [
    Case(beta=0.0, bias=True, t_softcap=2.0, temperature="tensor", extras=True, chunk=11),
    Case(beta=1.0, softcap=3.0, t_bias=True, t_scale=1.4, Ht=24, extras=True),
    Case(beta=0.3, scale=0.8, t_softcap=4.0, temperature="scalar", Ht=56, extras=True),
]


@pytest.mark.parametrize("case", AGREE, ids=_ids(AGREE))
def test_backends_agree_beyond_rounding(case, narrow_chunks):
    """The torch tiles and the kernels give the same numbers up to fp32 rounding."""
    d = make_inputs(case)
    a = run(triton_op, case, d, chunk_size=case.chunk)
    b = run(logitless.linear_divergence, case, d, chunk_size=case.chunk, backend="torch")
    for k, v in b.items():
        scale = max(1.0, float(v.abs().max()))
        torch.testing.assert_close(a[k], v, rtol=0, atol=2e-5 * scale, msg=lambda m, k=k: k + m)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_gradients_without_the_divergence(beta):
    """Only the log-probs and the entropy carry a gradient: the kernel skips the teacher's
    tile, and the result still matches the float64 truth."""
    case = Case(beta=beta, extras=True, bias=True, temperature="tensor", shape=(23,), V=301)
    d = make_inputs(case)
    d["up"][0] = torch.zeros_like(d["up"][0])  # the divergence's gradient: none at all
    op = _run_without_divergence(triton_op, case, d)
    ref = _run_without_divergence(reference.linear_divergence, case, d)
    truth = run_truth(case, d)
    compare(op, ref, truth, d["labels"])


def _run_without_divergence(fn, case: Case, d: dict) -> dict:
    """Like test_divergence.run, but the loss never touches ``divergence``."""
    leaf = [None if t is None else t.detach().clone().requires_grad_() for t in
            (d["hidden"], d["weight"], d["bias"])]  # fmt: skip
    h, w, b = leaf
    out = fn(h, w, d["labels"], d["t_hidden"], d["t_weight"], bias=b, beta=case.beta,
             temperature=d["temperature"], with_logprobs=True, with_entropy=True)  # fmt: skip
    ((out.logprobs * d["up"][1]).sum() + (out.entropy * d["up"][2]).sum()).backward()
    return {
        "divergence": out.divergence.detach(), "logprobs": out.logprobs.detach(),
        "entropy": out.entropy.detach(), "grad_hidden": h.grad, "grad_weight": w.grad,
        "grad_bias": b.grad,
    }  # fmt: skip


def test_no_grad_forward_matches_the_torch_tiles():
    case = Case(beta=0.3, extras=True, temperature="tensor", Ht=24)
    d = make_inputs(case)
    args = (d["hidden"], d["weight"], d["labels"], d["t_hidden"], d["t_weight"])
    kw = dict(beta=0.3, temperature=d["temperature"], with_logprobs=True, with_entropy=True)
    with torch.no_grad():
        a = triton_op(*args, **kw)
    b = logitless.linear_divergence(*args, **kw, backend="torch")
    assert a.divergence.grad_fn is None
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=2e-5)


def test_a_bf16_student_with_an_fp32_teacher():
    """Each head in its own dtype (each tile rounds its own inputs)."""
    case = Case(beta=0.6, shape=(29,), V=389, extras=True, bias=True)
    d = make_inputs(case)
    for k in ("hidden", "weight", "bias"):
        d[k] = d[k].bfloat16()
    op = run(triton_op, case, d)
    compare(op, run(reference.linear_divergence, case, d), run_truth(case, d), d["labels"])


# --------------------------------------------------------------------------------------------
# Which backend runs a call
# --------------------------------------------------------------------------------------------


def _call_backend(student_dtype: torch.dtype = torch.float32, **kw) -> str:
    """The backend a checked call over small inputs resolves (both heads must agree)."""
    from logitless.contract.divergence import DivergenceOptions, check_divergence_call
    from logitless.contract.options import HeadOptions

    h, w = torch.randn(4, 8, dtype=student_dtype), torch.randn(11, 8, dtype=student_dtype)
    y = torch.tensor([0, 3, -100, 10])
    teacher = (None, None, None) if "topk" in kw else (torch.randn(4, 6), torch.randn(11, 6), None)
    topk = kw.pop("topk", None)
    call = check_divergence_call(
        h, w, y, None, teacher, topk, HeadOptions(**kw), DivergenceOptions()
    )
    assert call.teacher is None or call.teacher.backend == call.student.backend
    return call.student.backend


def _sparse() -> TeacherTopK:
    return TeacherTopK(
        torch.tensor([1, 2]), torch.tensor([-0.5, -1.0]), torch.tensor([0, 2, 2, 2, 2])
    )


def test_backend_resolution(monkeypatch):
    """ "triton" runs the kernels; "auto" picks them where the log-prob op would (CUDA
    tensors; here: an auto rule that accepts CPU) except for a sparse teacher, which keeps the
    torch tiles; "auto" never picks Triton on CPU."""
    assert _call_backend(backend="triton") == "triton"
    assert _call_backend(backend="auto") == "torch"
    assert _call_backend(backend="torch") == "torch"
    spec = backend_registry.BACKENDS["triton"]
    everywhere = dataclasses.replace(spec, auto=lambda device, dtype: True)
    monkeypatch.setitem(backend_registry.BACKENDS, "triton", everywhere)
    assert _call_backend(backend="auto") == "triton"
    assert _call_backend(backend="auto", topk=_sparse()) == "torch"


def test_auto_on_heads_of_two_dtypes_keeps_one_backend(monkeypatch):
    """ "auto" picking Triton for one head only (its dtype) runs both on the torch tiles."""
    spec = backend_registry.BACKENDS["triton"]
    bf16_only = dataclasses.replace(spec, auto=lambda device, dtype: dtype == torch.bfloat16)
    monkeypatch.setitem(backend_registry.BACKENDS, "triton", bf16_only)
    assert _call_backend(torch.bfloat16, backend="auto") == "torch"  # an fp32 teacher
    assert _call_backend(torch.bfloat16, backend="triton") == "triton"


def test_sparse_teacher_is_refused_by_name():
    with pytest.raises(ValueError, match="teacher_topk .* runs on the torch tiles"):
        _call_backend(backend="triton", topk=_sparse())


def test_float64_heads_are_refused_under_triton():
    h, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="runs fp32, bf16 and fp16 heads"):
        triton_op(h, w, torch.tensor([0, 1, 2]), h, w)
