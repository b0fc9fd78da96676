"""GPU probe of the Triton backend: correctness at a mid-size shape, then a time / memory
breakdown at the Qwen2.5-7B head shape, against the torch tiles and bare cuBLAS matmuls.

    python benchmarks/triton_probe.py [--tokens 16384] [--quick]

Prints one line per measurement (median of --repeats CUDA-event timings after warm-up) and
writes nothing. ``logitless bench`` is the reference benchmark; this script exists to see
where the time of each backend goes (kernel by kernel) while tuning.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import logitless
from logitless import reference


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def peak_extra_mb(fn, *params) -> float:
    """Peak memory of one call of ``fn`` above what was allocated before it, the gradients of
    ``params`` cleared first (so dW and dh count as extra, as in ``logitless bench``)."""
    fn()
    for p in params:
        p.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def print_gaps(prof, tag: str) -> None:
    """GPU idle time between kernels of a profiled step, and the largest gaps."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace_file:
            trace = json.load(trace_file)
    ks = sorted(
        (e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    if not ks:
        return
    busy = sum(e["dur"] for e in ks)
    span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
    gaps = []
    for a, b in zip(ks, ks[1:], strict=False):
        gaps.append((b["ts"] - (a["ts"] + a["dur"]), a["name"][:40], b["name"][:40]))
    gaps.sort(reverse=True)
    print(f"{tag}: GPU span {span / 1e3:.1f} ms, kernels {busy / 1e3:.1f} ms, {len(ks)} kernels")
    for g, a, b in gaps[:6]:
        print(f"    gap {g / 1e3:.2f} ms after {a} before {b}")


def correctness(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    n, h_dim, vocab = 1531, 1000, 32003
    hidden = torch.randn(n, h_dim, device="cuda").to(dtype)
    weight = (torch.randn(vocab, h_dim, device="cuda") * (3 / h_dim**0.5)).to(dtype)
    bias = torch.randn(vocab, device="cuda").to(dtype)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[::7] = -100
    temp = torch.rand(n, device="cuda") + 0.5
    g, e = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")

    def run(fn, cast=None, **kw):
        h = (hidden if cast is None else hidden.to(cast)).clone().requires_grad_()
        w = (weight if cast is None else weight.to(cast)).clone().requires_grad_()
        b = (bias if cast is None else bias.to(cast)).clone().requires_grad_()
        out = fn(h, w, labels, bias=b, temperature=temp, softcap=20.0, with_entropy=True, **kw)
        ((out.logprobs * g).sum() + (out.entropy * e).sum()).backward()
        return [out.logprobs, out.entropy, h.grad, w.grad, b.grad]

    tri = run(logitless.linear_logprobs, backend="triton")
    tor = run(logitless.linear_logprobs, backend="torch")
    ref = run(reference.linear_logprobs)
    truth = run(reference.linear_logprobs, cast=torch.float64)
    for name, a, b, r, t in zip(
        ("logp", "ent", "dh", "dW", "db"), tri, tor, ref, truth, strict=True
    ):
        err = lambda x, t=t: float((x.detach().double() - t.double()).abs().max())  # noqa: E731
        print(
            f"correctness {str(dtype):15s} {name:5s} max|err| triton {err(a):.3e} "
            f"torch {err(b):.3e} reference {err(r):.3e}"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="bf16 shape, triton backend only")
    ap.add_argument("--skip-correctness", action="store_true")
    args = ap.parse_args()
    print("torch", torch.__version__, "| device", torch.cuda.get_device_name())
    import triton

    print("triton", triton.__version__)
    from logitless.backends.base import _has_fp32_out_mm

    print("addmm out_dtype fp32:", _has_fp32_out_mm(torch.device("cuda")))
    t0 = time.time()
    for dt in () if args.skip_correctness else (torch.bfloat16, torch.float32):
        correctness(dt)
    print(f"correctness took {time.time() - t0:.1f} s")

    shapes = [(args.tokens, 3584, 152064, torch.bfloat16)]
    if not args.quick:
        shapes.append((8192, 896, 151936, torch.float32))
    for n, h_dim, vocab, dtype in shapes:
        torch.manual_seed(0)
        hidden = torch.randn(n, h_dim, device="cuda", dtype=dtype, requires_grad=True)
        weight = (torch.randn(vocab, h_dim, device="cuda") * 0.02).to(dtype).requires_grad_()
        labels = torch.randint(0, vocab, (n,), device="cuda")
        g, e = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
        tag = f"N={n} H={h_dim} V={vocab} {dtype}"
        hd, wd = hidden.detach(), weight.detach()
        mm = timed(lambda hd=hd, wd=wd: hd @ wd.t(), args.repeats)
        print(f"{tag}: one bare matmul {mm:.2f} ms (floor4 {4 * mm:.1f}, floor3 {3 * mm:.1f})")

        for backend in ("triton", "torch"):

            def fwd(backend=backend):
                with torch.no_grad():
                    logitless.linear_logprobs(
                        hidden, weight, labels, with_entropy=True, backend=backend
                    )

            def step(backend=backend, ent=True):
                hidden.grad = weight.grad = None
                out = logitless.linear_logprobs(
                    hidden, weight, labels, with_entropy=ent, backend=backend
                )
                obj = (out.logprobs * g).sum()
                if ent:
                    obj = obj + (out.entropy * e).sum()
                obj.backward()

            tf = timed(fwd, args.repeats)
            ts = timed(step, args.repeats)
            tn = timed(lambda b=backend: step(b, False), args.repeats)
            mem = peak_extra_mb(step, hidden, weight)
            print(
                f"{tag} {backend:6s}: no-grad fwd {tf:.2f} ms ({tf / mm:.2f}x mm) | fwd+bwd "
                f"logp+ent {ts:.1f} ms ({ts / (4 * mm):.2f}x floor4) | logp only {tn:.1f} ms"
                f" | peak extra {mem:.0f} MB"
            )

            cfg = logitless.PolicyLossConfig(clip_high=0.28, aggregation="token_mean")
            rows2d = (16, n // 16)
            old = torch.randn(rows2d, device="cuda") * 0.1 - 5
            adv = torch.randn(16, device="cuda")

            def fused(backend=backend):
                hidden.grad = weight.grad = None
                loss, _ = logitless.fused_policy_loss(
                    hidden.view(*rows2d, -1),
                    weight,
                    labels.view(rows2d),
                    old,
                    adv,
                    config=cfg,
                    backend=backend,
                )
                loss.backward()

            tl_ = timed(fused, args.repeats)
            mem = peak_extra_mb(fused, hidden, weight)
            print(
                f"{tag} {backend:6s}: fused DAPO {tl_:.1f} ms ({tl_ / (3 * mm):.2f}x floor3)"
                f" | peak extra {mem:.0f} MB"
            )
            if args.quick:
                break

        # Where the time goes: CUDA kernels of one triton fwd+bwd step.
        from torch.profiler import ProfilerActivity, profile

        step("triton")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step("triton")
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
        print_gaps(prof, tag)
        # Memory by phase: after forward (saved state), and the peak of backward alone.
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        out = logitless.linear_logprobs(hidden, weight, labels, with_entropy=True, backend="triton")
        obj = (out.logprobs * g).sum() + (out.entropy * e).sum()
        torch.cuda.synchronize()
        after_fwd = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        obj.backward()
        torch.cuda.synchronize()
        print(
            f"{tag}: memory after forward +{(after_fwd - base) / 2**20:.1f} MB, backward peak "
            f"+{(torch.cuda.max_memory_allocated() - base) / 2**20:.1f} MB, grads "
            f"{(torch.cuda.memory_allocated() - base) / 2**20:.1f} MB"
        )
        del out, obj

        # Host synchronizations of one call (the valid-row count is the only one expected).
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step("triton")
            torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message).splitlines()[0] for w in caught if "synchron" in str(w.message)]
        print(f"{tag}: host syncs in one triton fwd+bwd: {len(syncs)}")
        for s in syncs:
            print("   ", s)
    from logitless.backends.triton_launch import KERNELS

    for name in ("stats", "dz"):
        k = KERNELS[name].tuned
        for key, cfg in getattr(k, "cache", {}).items():
            print(f"autotuned {name} {key}: {cfg}")
        for cfg, t in sorted(getattr(k, "configs_timings", {}).items(), key=lambda x: x[1]):
            print(f"   last tuning {name}: {t} {cfg}")


if __name__ == "__main__":
    main()
