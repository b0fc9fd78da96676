"""The Triton backend against the reference and a float64 truth, in Triton's interpreter.

Without a GPU, ``TRITON_INTERPRET=1`` (set by conftest.py) runs the kernels on CPU tensors, so
every kernel path is checked in CI: the same cases as tests/test_head.py (odd shapes, ignored
and all-ignored rows, bias, scalar and per-token temperature, softcap, entropy on and off,
fp32 / bf16 / fp16, fp32 heads on bf16 models), labels 0 and V-1, several vocabulary splits and
backward chunks, row passes, and the fused loss. With a GPU the kernels compile instead and
tests/test_cuda.py runs these cases on it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from test_fused_loss import CONFIGS, _compare, _problem, _run
from test_head import CASES, Case, _ids, check_against_reference, make_inputs, run_case

import logitless
from logitless.contract.backend import resolve_backend

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="triton is not installed"
    ),
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="a CUDA device is present: the kernels compile there (tests/test_cuda.py)",
    ),
]

triton_op = functools.partial(logitless.linear_logprobs, backend="triton")


@pytest.fixture
def narrow_chunks(monkeypatch):
    """Cut backward into many narrow vocabulary chunks (several workspace refills)."""
    from logitless.backends import triton_launch as triton_head

    monkeypatch.setattr(triton_head, "_WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(triton_head, "_MIN_VOCAB_CHUNK", 96)
    monkeypatch.setattr(triton_head, "_CHUNK_ALIGN", 32)


# test_head's small_tiles cases shrink the torch tiles; here they shrink the Triton workspace.
# chunk_size=1 (one row per pass) is left out: a pass of one row is the same code as a pass of
# seven (chunk=7 cases), and in the interpreter it costs a minute per case.
TRITON_CASES = [c for c in CASES if c.dtype != "fp64" and c.chunk != 1] + [
    Case(V=37, shape=(19,), bias=True),  # fewer vocab blocks than splits: empty splits
    Case(V=32, shape=(16,), ignore="none"),  # V and rows exactly one block
    Case(H=64, temperature="tensor", softcap=2.0),  # H a multiple of BLOCK_K (unmasked K)
]


@pytest.mark.parametrize("case", TRITON_CASES, ids=_ids(TRITON_CASES))
def test_matches_reference(case, request):
    if case.small_tiles:
        request.getfixturevalue("narrow_chunks")
    check_against_reference(case, make_inputs(case), triton_op)


@pytest.mark.parametrize("chunk", [None, 5, 40])
def test_labels_at_both_ends_of_the_vocabulary(chunk, narrow_chunks):
    case = Case(shape=(41,), bias=True, temperature="tensor", chunk=chunk, small_tiles=True)
    inp = make_inputs(case)
    inp["labels"][:10] = 0
    inp["labels"][10:20] = case.V - 1
    check_against_reference(case, inp, triton_op)


def test_backends_agree_beyond_rounding(narrow_chunks):
    """The torch tiles and the Triton kernels give the same numbers up to fp32 rounding."""
    case = Case(shape=(3, 29), bias=True, temperature="tensor", softcap=3.0, chunk=11)
    inp = make_inputs(case)
    a = run_case(triton_op, case, inp)
    b = run_case(functools.partial(logitless.linear_logprobs, backend="torch"), case, inp)
    for k, v in b.items():
        scale = max(1.0, float(v.abs().max()))
        torch.testing.assert_close(a[k], v, rtol=0, atol=2e-5 * scale, msg=lambda m, k=k: k + m)


@pytest.mark.parametrize("name", ["dapo", "gspo", "token_sum_kl_k3_entropy", "cispo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_loss_matches_composed(name, dtype):
    cfg = CONFIGS[name]
    p = _problem(dtype == torch.float32, dtype, seed=3)
    n = int((p["labels"] != -100).sum())
    fused = _run("fused", p, cfg, chunk_size=None, temperature=0.9, backend="triton", scale=1.5)
    naive = _run("naive", p, cfg, temperature=0.9, scale=1.5)
    truth = _run("truth", p, cfg, temperature=0.9, scale=1.5)
    _compare(fused, naive, truth, n)


def test_fused_loss_row_passes(narrow_chunks):
    cfg = CONFIGS["dapo"]
    p = _problem(True, torch.float32, seed=4)
    n = int((p["labels"] != -100).sum())
    fused = _run("fused", p, cfg, chunk_size=6, backend="triton")
    _compare(fused, _run("naive", p, cfg), _run("truth", p, cfg), n)


def test_no_grad_forward_saves_nothing_and_matches():
    case = replace(Case(), with_entropy=True)
    inp = make_inputs(case)
    with torch.no_grad():
        a = triton_op(inp["hidden"], inp["weight"], inp["labels"], with_entropy=True)
    b = logitless.linear_logprobs(inp["hidden"], inp["weight"], inp["labels"], with_entropy=True)
    assert a.logprobs.grad_fn is None
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(a.entropy, b.entropy, rtol=0, atol=1e-5)


def test_auto_never_picks_triton_on_cpu():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert resolve_backend("auto", torch.device("cpu"), dtype) == "torch"
    assert resolve_backend("triton", torch.device("cpu"), torch.float32) == "triton"


@pytest.mark.parametrize("bad", ["cuda", "Triton", None, 1])
def test_unknown_backend_raises(bad):
    h, w = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match="backend must be one of"):
        logitless.linear_logprobs(h, w, torch.tensor([0, 1, 2]), backend=bad)


@pytest.mark.parametrize("value", ["1", "true", "On", "YES", "y", "0", "false", "off", "", "2"])
def test_the_interpreter_switch_is_read_as_triton_reads_it(monkeypatch, value):
    """``contract.backend.interpreting`` (the one reader of TRITON_INTERPRET in logitless) says
    what Triton says: a value Triton takes for "on" (it then builds interpreted kernels) is on
    here too, anything else is off. Before, only "1" was."""
    import triton

    from logitless.contract.backend import interpreting

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() == triton.knobs.runtime.interpret


def test_triton_on_cpu_without_the_interpreter_names_the_fix():
    """backend='triton' on CPU tensors with the interpreter off: a ValueError naming
    TRITON_INTERPRET, before any work (run in a fresh process without the variable)."""
    code = (
        "import torch, logitless\n"
        "try:\n"
        "    logitless.linear_logprobs(torch.randn(3, 4), torch.randn(5, 4),"
        " torch.tensor([0, 1, 2]), backend='triton')\n"
        "except ValueError as e:\n"
        "    print('ValueError:', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert "ValueError:" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stderr
