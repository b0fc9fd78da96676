"""Per-rank peak memory and time of the vocab-parallel head, tp = 1, 2, ... gloo ranks on CPU.

    python benchmarks/vocab_parallel.py --tokens 2048 --hidden 512 --vocab 151936 --tp 1 2

Each tp size runs in fresh processes (one per rank, gloo, file:// rendezvous); every rank runs
forward + backward of ``linear_logprobs(..., with_entropy=True, vocab_parallel=...)`` with its
``[V/tp, H]`` shard and reports its peak extra RSS (high-water mark, reset before the timed
step) and median time. The machine's cores are split between the ranks (``threads = cores //
tp``), so the time compares equal hardware. Rows are appended to a CSV.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import logitless
from logitless.apps.memory import CpuPeakMemory


def _rank(rank: int, tp: int, args, init: str, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    if tp > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=tp)
    try:
        g = torch.Generator().manual_seed(0)
        n, h, v = args.tokens, args.hidden, args.vocab
        hidden = torch.randn(n, h, generator=g).requires_grad_()
        labels = torch.randint(0, v, (n,), generator=g)
        vp = logitless.VocabParallel.even(v) if tp > 1 else None
        rows = v if vp is None else vp.shard_size
        weight = (torch.randn(rows, h, generator=g) / h**0.5).requires_grad_()
        g_logp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)

        def step() -> None:
            hidden.grad = weight.grad = None
            out = logitless.linear_logprobs(
                hidden, weight, labels, with_entropy=True, vocab_parallel=vp
            )
            ((out.logprobs * g_logp).sum() + (out.entropy * g_ent).sum()).backward()

        step()  # warm-up
        hidden.grad = weight.grad = None
        mem = CpuPeakMemory()
        mem.start()
        step()
        peak = mem.peak_extra_bytes()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        torch.save({"peak": peak, "time": statistics.median(times)}, f"{out}/rank{rank}.pt")
    finally:
        if tp > 1:
            dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--csv", default="bench-results/vocab_parallel.csv")
    args = p.parse_args()
    rows = []
    for tp in args.tp:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank, args=(tp, args, f"{tmp}/init", tmp), nprocs=tp, join=True)
            res = [torch.load(f"{tmp}/rank{r}.pt") for r in range(tp)]
        peak = max(r["peak"] for r in res) / 2**20
        t = max(r["time"] for r in res)
        rows.append(
            {
                "tp": tp,
                "tokens": args.tokens,
                "hidden": args.hidden,
                "vocab": args.vocab,
                "peak_mb_per_rank": round(peak, 1),
                "median_s": round(t, 3),
            }
        )
        print(f"tp={tp}: peak extra memory per rank {peak:.0f} MB, step {t:.2f} s", flush=True)
    path = Path(args.csv)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
