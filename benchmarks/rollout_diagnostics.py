"""What the rollout-mismatch diagnostics cost: log-probs + entropy with ``rollout_topk`` (k
ids per token) against log-probs + entropy alone, time and peak extra memory.

    python benchmarks/rollout_diagnostics.py     # N=2048..16384, H=1024, V=151936, fp32, CPU
    python benchmarks/rollout_diagnostics.py --tokens 64 --hidden 16 --vocab 500 --repeats 1
    python benchmarks/rollout_diagnostics.py --device cuda --dtype bf16   # on a GPU (Triton)

For each token count ``N`` and each mode, the two variants run in fresh subprocesses of their
own (build, one warm-up call, ``--repeats`` timed calls under a peak-memory probe):

- ``base``: ``linear_logprobs(hidden, weight, labels, with_entropy=True)``;
- ``diagnostics``: the same call with ``rollout_topk=RolloutTopK(ids, logprobs)``: ``k`` ids
  per token (default 20) plus the sampled token when it is not among them (vLLM's
  ``logprobs=k``), from a perturbed copy of the head's distribution (its top-k of noisy logits).

Modes: ``forward`` (no gradient: the old-log-prob pass where a trainer compares with its
rollout) and ``train`` (forward and backward with random upstream gradients of both outputs:
the diagnostics are forward-only, the backward is the same). Memory: the peak over the timed
calls minus what was allocated before them (the inputs, and the engine's top-k, exist before:
``logitless.apps.memory``); on CUDA ``max_memory_allocated``. Ratios are ``diagnostics / base``
of the same run; ``--csv`` appends one row per (N, mode) with the command.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULT = "ROLLOUT_DIAG_RESULT "
VARIANTS = ("base", "diagnostics")
MODES = ("forward", "train")


def _inputs(args: argparse.Namespace, n: int):
    import torch

    from logitless import RolloutTopK

    dev = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, args.hidden, generator=g)
    weight = torch.randn(args.vocab, args.hidden, generator=g) * (3.0 / args.hidden**0.5)
    labels = torch.randint(0, args.vocab, (n,), generator=g)
    # the engine's top-k: noisy logits' top k, chunk by chunk (never [N, V] at once)
    ids = torch.full((n, args.k + 1), -1, dtype=torch.int64)
    lps = torch.zeros(n, args.k + 1)
    for r0 in range(0, n, 256):
        z = hidden[r0 : r0 + 256] @ weight.T
        z = (z + 0.5 * torch.randn(z.shape, generator=g)).log_softmax(-1)
        top = z.topk(args.k)
        ids[r0 : r0 + 256, : args.k], lps[r0 : r0 + 256, : args.k] = top.indices, top.values
        y = labels[r0 : r0 + 256]
        out = ~(top.indices == y[:, None]).any(1)
        ids[r0 : r0 + 256, args.k] = torch.where(out, y, -1)
        lps[r0 : r0 + 256, args.k] = torch.where(out, z.gather(1, y[:, None])[:, 0], 0.0)
    hidden, weight = hidden.to(dev, dtype), weight.to(dev, dtype)
    return hidden, weight, labels.to(dev), RolloutTopK(ids.to(dev), lps.to(dev))


def _worker(variant: str, mode: str, n: int, args: argparse.Namespace) -> dict:
    import torch

    import logitless
    from logitless.apps.memory import peak_memory_meter

    torch.set_num_threads(args.threads or torch.get_num_threads())
    hidden, weight, labels, topk = _inputs(args, n)
    train = mode == "train"
    hidden.requires_grad_(train)
    weight.requires_grad_(train)
    g, e = torch.randn(n, device=hidden.device), torch.randn(n, device=hidden.device)
    extra = {"rollout_topk": topk} if variant == "diagnostics" else {}
    dev = hidden.device

    def call() -> float:
        with torch.set_grad_enabled(train):
            out = logitless.linear_logprobs(hidden, weight, labels, with_entropy=True, **extra)
            if train:
                (out.logprobs * g + out.entropy * e).sum().backward()
                hidden.grad = weight.grad = None
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return float(out.logprobs.detach().double().sum())

    check = call()  # warm-up (and the Triton autotuning on a GPU)
    meter = peak_memory_meter(dev)
    meter.start()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return {
        "variant": variant, "mode": mode, "tokens": n, "sum_logprobs": check,
        "time_median_s": statistics.median(times), "times_s": times,
        "peak_extra_mb": meter.peak_extra_bytes() / 2**20, "note": meter.note,
    }  # fmt: skip


def _run(variant: str, mode: str, n: int, argv: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, mode, str(n), *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"{variant} {mode} N={n} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len(RESULT) :])


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--k", type=int, default=20, help="the engine's top-k per token")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--csv", type=Path, default=None, help="append one row per (N, mode)")
    p.add_argument("--worker", nargs=3, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str]) -> list[dict]:
    args = _parse(argv)
    if args.worker:
        variant, mode, n = args.worker
        print(RESULT + json.dumps(_worker(variant, mode, int(n), args)), flush=True)
        return []
    command = " ".join(["python", "benchmarks/rollout_diagnostics.py", *argv])
    print(f"H={args.hidden} V={args.vocab} k={args.k} {args.dtype} {args.device}")
    print(f"{'N':>6} {'mode':<8} {'base_s':>8} {'diag_s':>8} {'time_x':>7} "
          f"{'base_MB':>9} {'diag_MB':>9} {'mem_x':>6}")  # fmt: skip
    rows = []
    for n in args.tokens:
        for mode in args.modes:
            base, diag = (_run(v, mode, n, argv) for v in VARIANTS)
            row = {
                "tokens": n, "mode": mode, "base_s": base["time_median_s"],
                "diagnostics_s": diag["time_median_s"],
                "time_ratio": diag["time_median_s"] / base["time_median_s"],
                "base_mb": base["peak_extra_mb"], "diagnostics_mb": diag["peak_extra_mb"],
                "memory_ratio": diag["peak_extra_mb"] / max(base["peak_extra_mb"], 1e-9),
                "same_logprobs": base["sum_logprobs"] == diag["sum_logprobs"],
            }  # fmt: skip
            rows.append(row)
            print(
                f"{n:>6} {mode:<8} {row['base_s']:8.3f} {row['diagnostics_s']:8.3f} "
                f"{row['time_ratio']:7.3f} {row['base_mb']:9.1f} {row['diagnostics_mb']:9.1f} "
                f"{row['memory_ratio']:6.3f}",
                flush=True,
            )
    if args.csv:
        _append_csv(args, rows, command)
    return rows


FIELDS = [
    "date", "tokens", "mode", "hidden", "vocab", "k", "dtype", "device", "base_s",
    "diagnostics_s", "time_ratio", "base_mb", "diagnostics_mb", "memory_ratio", "machine",
    "threads", "command",
]  # fmt: skip


def _append_csv(args: argparse.Namespace, rows: list[dict], command: str) -> None:
    new = not args.csv.exists()
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({
                **r, "date": dt.date.today().isoformat(), "hidden": args.hidden,
                "vocab": args.vocab, "k": args.k, "dtype": args.dtype, "device": args.device,
                "machine": platform.processor() or platform.machine(),
                "threads": args.threads or os.cpu_count(), "command": command,
            })  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
