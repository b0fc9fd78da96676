"""The CUDA path: the CPU suite's three-way checks (op, naive reference, float64 truth), on a GPU.

Every input is built exactly as in the CPU tests, then moved to the GPU; the op, the reference
and the float64 truth all run there, so the tolerances still come from the reference's own
error on that device (cuBLAS reduction orders, TF32 settings and all). Skipped, with that
reason, where torch sees no CUDA device: CI has none, and these ran on a lent H100 (README,
"GPU").
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import math
import warnings

import pytest
import test_fused_loss as tfl
import test_head as th
import test_hf as thf
import test_replay as trp
import test_triton as ttr
import torch
from _tolerance import assert_no_worse_than_reference

import logitless
from logitless import fused_policy_loss, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEV = torch.device("cuda")


def to_dev(obj):
    """``obj`` with every tensor inside (dicts, lists, tuples) moved to the GPU."""
    if isinstance(obj, torch.Tensor):
        return obj.to(DEV)
    if isinstance(obj, dict):
        return {k: to_dev(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_dev(v) for v in obj)
    return obj


@pytest.fixture
def small_tiles_cuda(monkeypatch):
    """One row chunk spans several vocab blocks on the GPU too."""
    from logitless.backends import base as _chunked

    monkeypatch.setitem(_chunked._TILE_ELEMS, "cuda", 1024)


# --------------------------------------------------------------------------------------------
# linear_logprobs: every case of the CPU matrix


HAS_TRITON = importlib.util.find_spec("triton") is not None
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton")),
]


@pytest.fixture
def narrow_chunks_cuda(monkeypatch):
    """The Triton backward refills its workspace many times (narrow vocabulary chunks)."""
    from logitless.backends import triton_launch as triton_head

    monkeypatch.setattr(triton_head, "_WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(triton_head, "_MIN_VOCAB_CHUNK", 96)
    monkeypatch.setattr(triton_head, "_CHUNK_ALIGN", 32)


@pytest.mark.parametrize("case", th.CASES, ids=th._ids(th.CASES))
def test_head_cases_on_cuda(case, request):
    if case.small_tiles:
        request.getfixturevalue("small_tiles_cuda")
    inp = to_dev(th.make_inputs(case))
    th.check_against_reference(case, inp)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("case", ttr.TRITON_CASES, ids=th._ids(ttr.TRITON_CASES))
def test_triton_cases_on_cuda(case, request):
    """The interpreter's cases (tests/test_triton.py), compiled for the GPU."""
    if case.small_tiles:
        request.getfixturevalue("narrow_chunks_cuda")
    inp = to_dev(th.make_inputs(case))
    th.check_against_reference(case, inp, ttr.triton_op)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_makes_one_host_sync():
    """A forward + backward through the Triton backend synchronizes with the host once: the
    checks read the valid-row count (and the label / temperature checks) in one transfer."""
    N, H, V = 1000, 256, 50257
    hidden = torch.randn(N, H, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(V, H, device=DEV) * 0.05).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (N,), device=DEV)
    labels[::3] = -100
    temp = torch.rand(N, device=DEV) + 0.5

    def step():
        out = ttr.triton_op(hidden, weight, labels, temperature=temp, with_entropy=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()

    step()  # compile and autotune first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchronizing" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_peak_memory_is_gradients_plus_workspace():
    """bf16, Qwen-sized vocabulary: extra memory = dW + dh + an fp32 dh accumulator + the
    backward workspace (128 MiB) + small change, far under the [N, V] logits."""
    from logitless.backends import triton_launch as triton_head

    N, H, V = 4096, 1024, 151936
    hidden = torch.randn(N, H, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(V, H, device=DEV) * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (N,), device=DEV)

    def step():
        out = ttr.triton_op(hidden, weight, labels, with_entropy=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()

    step()
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads = (N + V) * H * 2
    bound = grads + N * H * 4 + triton_head._WORKSPACE_BYTES + (16 << 20)
    assert extra <= bound, f"peak {extra / 2**20:.0f} MiB > bound {bound / 2**20:.0f} MiB"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_at_a_real_vocabulary_size(dtype, backend):
    """A Llama-3-sized odd vocabulary (128257 = not a multiple of 64), thousands of rows, 30 %
    ignored, default chunking: several row chunks, the partial last vocab block, and logits
    large enough (std ~3) that the softmax is peaked."""
    g = torch.Generator().manual_seed(11)
    N, H, V = 3000, 256, 128257
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * (3.0 / math.sqrt(H))
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.rand(N, generator=g) < 0.3] = -100
    up = torch.randn(2, N, generator=g)
    hidden, weight, labels, up = to_dev((hidden.to(dtype), weight.to(dtype), labels, up))

    def run(fn, cast=None):
        h = (hidden if cast is None else hidden.to(cast)).clone().requires_grad_()
        w = (weight if cast is None else weight.to(cast)).clone().requires_grad_()
        if fn is None:  # float64 truth
            logp_all = torch.log_softmax(h @ w.T, dim=-1)
            valid = labels != -100
            lp = logp_all.gather(-1, labels.clamp(min=0)[:, None])[:, 0]
            lp = torch.where(valid, lp, 0.0)
            ent = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)
        else:
            out = fn(h, w, labels, with_entropy=True)
            lp, ent = out.logprobs, out.entropy
        ((lp * up[0].to(lp)).sum() + (ent * up[1].to(ent)).sum()).backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    op = run(functools.partial(logitless.linear_logprobs, backend=backend))
    ref = run(reference.linear_logprobs)
    truth = run(None, torch.float64)
    names = ("logprobs", "entropy", "grad_hidden", "grad_weight")
    for name, a, r, t in zip(names, op, ref, truth, strict=True):
        assert a.device.type == "cuda"
        assert_no_worse_than_reference(a, r, t, name)


def test_peak_memory_is_a_tile_not_the_logits():
    """The torch tiles' extra memory is bounded by its tiles, far under the naive logits."""
    N, H, V = 4096, 512, 151936
    hidden = torch.randn(N, H, device=DEV, requires_grad=True)
    weight = (torch.randn(V, H, device=DEV) * 0.02).requires_grad_()
    labels = torch.randint(0, V, (N,), device=DEV)

    def peak(fn) -> int:
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn(hidden, weight, labels, with_entropy=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    op = functools.partial(logitless.linear_logprobs, backend="torch")
    peak(op)  # warm-up: cuBLAS workspaces are not the op's memory
    ours, naive = peak(op), peak(reference.linear_logprobs)
    logits_bytes = N * V * 4
    grads_bytes = (N + V) * H * 4
    assert naive > logits_bytes, f"naive peak {naive} should hold the fp32 logits"
    # gradients + two fp32 buffers of the default 2**26-element tile (the logits block and its
    # exponentials) + 16 MiB for the per-row statistics and cuBLAS's workspace
    tile_bytes = (1 << 26) * 4
    assert ours < grads_bytes + 2 * tile_bytes + (16 << 20), f"op peak {ours / 2**20:.0f} MiB"


# --------------------------------------------------------------------------------------------
# fused_policy_loss: every config of the CPU matrix, fp32 packed and rows, and bf16


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("name", list(tfl.CONFIGS))
def test_fused_loss_on_cuda(name, packed, backend):
    cfg = tfl.CONFIGS[name]
    p = to_dev(tfl._problem(packed, torch.float32))
    runs = [
        tfl._run(k, p, cfg, chunk_size=5, scale=2.5, backend=backend)
        for k in ("fused", "naive", "truth")
    ]
    assert runs[0][2].device.type == "cuda"
    tfl._compare(*runs, int((p["labels"] != -100).sum()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["dapo", "gspo", "token_sum_kl_k3_entropy", "cispo"])
def test_fused_loss_bf16_on_cuda(name, backend):
    cfg = tfl.CONFIGS[name]
    p = to_dev(tfl._problem(False, torch.bfloat16, seed=2))
    runs = [tfl._run(k, p, cfg, chunk_size=4, backend=backend) for k in ("fused", "naive", "truth")]
    tfl._compare(*runs, int((p["labels"] != -100).sum()))


def test_fused_loss_bf16_model_fp32_head_on_cuda():
    """head_dtype=float32 on bf16 parameters: the gradient lands in the bf16 .grad on GPU."""
    p = to_dev(tfl._problem(False, torch.bfloat16))
    w = p["weight"].clone().requires_grad_()
    loss, _ = fused_policy_loss(
        p["hidden"],
        w,
        p["labels"],
        p["old"],
        p["adv"],
        config=tfl.CONFIGS["dapo"],
        head_dtype=torch.float32,
    )
    loss.backward()
    assert w.grad is not None and w.grad.dtype == torch.bfloat16 and w.grad.device.type == "cuda"
    assert bool(torch.isfinite(w.grad).all()) and float(w.grad.abs().sum()) > 0


# --------------------------------------------------------------------------------------------
# HF transformers models on the GPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["left_pad", "packed", "cu_seqlens"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3"])
def test_hf_logprobs_on_cuda(name, layout, dtype):
    model = thf._model(name, dtype, bias=name == "llama").to(DEV)
    thf._check_logprobs(model, to_dev(thf._layout(layout)), chunk_size=4)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_hf_policy_loss_on_cuda(name):
    cfg = thf.LOSS_CONFIGS["dapo_kl_entropy"]
    model = thf._model(name, torch.float32).to(DEV)
    lay = to_dev(thf._layout("packed", seed=2))
    labels = thf._labels(lay)
    p = thf._loss_inputs(model, lay, labels)
    op = thf._run_loss("op", model, lay, labels, cfg, p, 0.9)
    ref = thf._run_loss("ref", model, lay, labels, cfg, p, 0.9)
    truth = thf._run_loss("truth", copy.deepcopy(model).double(), lay, labels, cfg, p, 0.9)
    floor = int((labels != thf.IGNORE).sum()) * torch.finfo(torch.float32).eps
    assert_no_worse_than_reference(op[0], ref[0], truth[0], "loss", floor=floor)
    thf._check_grads(op[2], ref[2], truth[2], labels.numel())


# --------------------------------------------------------------------------------------------
# Sampling replay: every case of the CPU matrix, on both backends (the kept-set code is torch
# on every backend; the untruncated rows run the backend's kernels)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", trp.CASES, ids=[c.id for c in trp.CASES])
def test_replay_matches_reference(case, backend, request):
    if case.small_tiles:
        request.getfixturevalue("small_tiles_cuda")
    trp.check_case(case, backend=backend, device="cuda")


# --------------------------------------------------------------------------------------------
# linear_divergence: every case of the CPU matrix, on both backends (Triton: dense teachers)

import test_divergence as tdv  # noqa: E402


def _divergence_inputs(case):
    d = tdv.make_inputs(case)
    topk = d.pop("topk", None)
    d = to_dev(d)
    if topk is not None:
        d["topk"] = type(topk)(*(t.to(DEV) for t in topk))
    return d


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", tdv.CASES, ids=[c.id for c in tdv.CASES])
def test_divergence_cuda_matches_reference_and_float64(case, backend):
    if backend == "triton" and (case.topk is not None or case.dtype == "fp64"):
        pytest.skip("the Triton backend takes dense 16/32-bit heads (topk, float64: torch)")
    d = _divergence_inputs(case)
    op = tdv.run(
        functools.partial(logitless.linear_divergence, backend=backend), case, d,
        chunk_size=case.chunk,
    )  # fmt: skip
    ref = tdv.run(reference.linear_divergence, case, d)
    tdv.compare(op, ref, tdv.run_truth(case, d), d["labels"])
