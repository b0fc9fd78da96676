"""A whole capturable training step in one CUDA graph: captured once, replayed on new inputs.

The step is what a trainer captures: the step's normalizer (``loss_normalizer``), the head and
the policy loss (composed, ``linear_logprobs`` then ``policy_loss``, or ``fused_policy_loss``),
and ``backward()``, all with ``capturable=True``. It is captured in ``torch.cuda.CUDAGraph``
after warm-up runs on a side stream (PyTorch's recipe for capturing a whole step), then for
several new batches (other labels, other ignored rows, other advantages) the inputs are copied
into the captured tensors and the graph replayed. The loss, a metric and every gradient must
equal an eager run of the same step on the same batch, to within eager's own run-to-run
spread (two eager runs: 0 where every kernel is deterministic; atomics in the per-document
sums may reorder fp32 additions) plus a few units in the last place. The warm-up and every
eager run sit under ``torch.cuda.set_sync_debug_mode("error")``: a host synchronization
anywhere in the step raises (a test shows that the default mode's one host read does). Capture
itself also fails on any synchronization.

Skipped, with that reason, where torch sees no CUDA device (CI has none): these need a GPU
(``bash benchmarks/gpu.sh``, stage ``cuda-tests``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math

import pytest
import torch

from logitless import PolicyLossConfig, fused_policy_loss, linear_logprobs, policy_loss
from logitless.losses import loss_normalizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HAS_TRITON = importlib.util.find_spec("triton") is not None
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton")),
]
B, T, H, V, CAPACITY = 4, 24, 64, 1000, 64  # 96 rows, at most 64 of them trained on
CFG = PolicyLossConfig(clip_high=0.28, kl_coef=0.02, entropy_coef=0.001)


@contextlib.contextmanager
def _no_host_sync():
    """Any synchronizing CUDA call inside raises (``set_sync_debug_mode("error")``)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _batch(seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One batch of ``B`` sequences of ``T`` tokens, a random share of the tokens ignored (at
    most ``CAPACITY`` valid), one advantage per sequence."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (B * T,), generator=g)
    n_valid = int(torch.randint(8, CAPACITY + 1, (1,), generator=g))
    labels[torch.randperm(B * T, generator=g)[n_valid:]] = -100
    batch = {
        "hidden": torch.randn(B, T, H, generator=g).to(dtype),
        "labels": labels.reshape(B, T),
        # near the policy's own log-probs (~ -log V), so that some ratios are clipped
        "old": torch.randn(B, T, generator=g) * 0.5 - math.log(V),
        "ref": torch.randn(B, T, generator=g) * 0.5 - math.log(V),
        "adv": torch.randn(B, generator=g),
    }
    return {k: v.cuda() for k, v in batch.items()}


def _step(b: dict[str, torch.Tensor], weight: torch.Tensor, fused: bool, backend: str, **mode):
    """The normalizer, head, loss and backward of one step; returns ``(loss, clip_frac)``.
    ``mode``: ``batch_invariant``, or ``capturable=False`` for the default mode."""
    cap = mode.pop("capturable", True)
    mask = b["labels"] != -100
    norm = loss_normalizer([mask], capturable=cap)
    head = {"capturable": cap, "backend": backend, **mode}
    if cap:
        head["row_capacity"] = CAPACITY
    if fused:
        loss, metrics = fused_policy_loss(
            b["hidden"], weight, b["labels"], b["old"], b["adv"], config=CFG,
            ref_logprobs=b["ref"], normalizer=norm, **head,
        )  # fmt: skip
    else:
        out = linear_logprobs(b["hidden"], weight, b["labels"], with_entropy=True, **head)
        loss, metrics = policy_loss(
            out.logprobs, b["old"], b["adv"], mask, config=CFG, ref_logprobs=b["ref"],
            entropy=out.entropy, normalizer=norm, capturable=cap,
        )  # fmt: skip
    loss.backward()
    return loss.detach(), metrics["clip_frac_high"]


def _eager(b, weight, fused, backend, **mode):
    """The step run eagerly on its own copies: ``(loss, clip_frac, dh, dW)``."""
    hidden = b["hidden"].detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    with _no_host_sync():
        loss, clip = _step({**b, "hidden": hidden}, w, fused, backend, **mode)
    torch.cuda.synchronize()
    return loss, clip, hidden.grad, w.grad


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("fused", [False, True], ids=["composed", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_captured_step_replays_new_batches_like_eager(backend, dtype, fused, batch_invariant):
    mode = {"batch_invariant": True} if batch_invariant else {}
    weight = (torch.randn(V, H, generator=torch.Generator().manual_seed(7)) * 0.2).to(dtype)
    weight = weight.cuda().requires_grad_(True)
    static = _batch(0, dtype)
    static["hidden"].requires_grad_(True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the first run compiles, the next may not sync
        for i in range(3):
            static["hidden"].grad = weight.grad = None
            with _no_host_sync() if i else contextlib.nullcontext():
                _step(static, weight, fused, backend, **mode)
    torch.cuda.current_stream().wait_stream(side)
    static["hidden"].grad = weight.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, clip = _step(static, weight, fused, backend, **mode)

    for seed in (1, 2, 3):  # new labels, ignored rows, advantages and hidden states
        new = _batch(seed, dtype)
        with torch.no_grad():
            for k, v in new.items():
                static[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        want = _eager(new, weight, fused, backend, **mode)
        again = _eager(new, weight, fused, backend, **mode)
        got = (loss, clip, static["hidden"].grad, weight.grad)
        names = ("loss", "clip_frac_high", "d_hidden", "d_weight")
        for name, g, w, w2 in zip(names, got, want, again, strict=True):
            assert torch.isfinite(g).all(), f"{name}: not finite after replay (seed {seed})"
            spread = (w.float() - w2.float()).abs().max()
            ulps = 4 * torch.finfo(w.dtype).eps * w.float().abs().max()
            err = (g.float() - w.float()).abs().max()
            assert err <= 4 * spread + ulps, (
                f"{name} (seed {seed}): {err} off eager, spread {spread}"
            )


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_sync_guard_catches_the_default_modes_host_read(backend):
    """The guard above can fail: the default mode reads the valid-row count on the host."""
    weight = torch.randn(V, H, device="cuda")
    with pytest.raises(RuntimeError, match="synchroniz"):
        _eager(_batch(0, torch.float32), weight, False, backend, capturable=False)
