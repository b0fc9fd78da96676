"""Megatron's logits path vs logitless inside output_layer: per-rank peak memory and time, CPU.

    python benchmarks/megatron_head.py --seq 8192 --hidden 1024 --vocab 151936 --tp 2

The head of a megatron-core GPTModel on ``tp`` gloo ranks, fp32: the decoder's hidden states
``[S, 1, H]`` and a real ``ColumnParallelLinear`` output layer (``gather_output=False``, this
rank's ``[V/tp, H]`` rows). Forward + backward of the per-token log-probs (random upstream
gradient) two ways:

- ``megatron``: ``output_layer(hidden)`` → ``[S, 1, V/tp]`` logits →
  ``vocab_parallel_cross_entropy`` (Megatron's own path; with ``--entropy`` also the entropy
  of the tensor-parallel-gathered logits);
- ``logitless``: the head run as ``output_layer``'s forward (what
  ``logitless.integrations.megatron.logprobs`` does inside ``GPTModel``), never the logits.

Each method runs in fresh processes (one per rank, file:// rendezvous). Every rank reports its
peak extra RSS during one step (high-water mark reset before it) and the median time of
``--repeats`` steps; a row is the maximum over ranks. The machine's cores are split between the
ranks. Prints both rows and the ratios logitless / megatron; appends them to a CSV.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

METHODS = ("megatron", "logitless")


def _rank(rank: int, method: str, args, tmp: str) -> None:
    warnings.filterwarnings("ignore")
    tp = args.tp
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=tp)
    try:
        torch.save(_measure(method, args), f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _measure(method: str, args) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        gather_from_tensor_model_parallel_region,
        vocab_parallel_cross_entropy,
    )
    from megatron.core.transformer import TransformerConfig

    from logitless.apps.memory import CpuPeakMemory
    from logitless.integrations import seam

    if not torch.cuda.is_available():  # Megatron's gathers allocate on the current CUDA device
        torch.cuda.current_device = lambda: "cpu"
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    s, h, v = args.seq, args.hidden, args.vocab
    config = TransformerConfig(
        num_layers=1,
        hidden_size=h,
        num_attention_heads=args.tp,
        tensor_model_parallel_size=args.tp,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    layer = ColumnParallelLinear(
        h, v, config=config, init_method=None, bias=False, gather_output=False
    )
    g = torch.Generator().manual_seed(ps.get_tensor_model_parallel_rank())
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) / h**0.5)
    g = torch.Generator().manual_seed(0)  # the same tokens on every rank
    hidden = torch.randn(s, 1, h, generator=g).requires_grad_()
    labels = torch.randint(0, v, (1, s), generator=g)
    up = torch.randn(2, 1, s, generator=g)
    rows = layer.output_size_per_partition
    start = ps.get_tensor_model_parallel_rank() * rows
    vp = None
    if args.tp > 1:
        import logitless

        vp = logitless.VocabParallel(ps.get_tensor_model_parallel_group(), start, start + rows)
    parallel = seam.Parallelism(vocab=vp)

    def megatron_step() -> None:
        logits, _ = layer(hidden)  # [S, 1, V/tp]
        logp = -vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous())
        loss = (logp.transpose(0, 1) * up[0]).sum()
        if args.entropy:
            full = gather_from_tensor_model_parallel_region(logits)
            ent = -(full.softmax(-1) * full.log_softmax(-1)).sum(-1)
            loss = loss + (ent.transpose(0, 1) * up[1]).sum()
        loss.backward()

    def logitless_step() -> None:
        def head(x, weight=None, **_):
            tokens = seam.Tokens(x, labels, sequence_first=True)
            w = seam.Head(layer.weight if weight is None else weight)
            return seam.logprobs(tokens, w, parallel, with_entropy=args.entropy)

        _, out = seam.run_as_forward(layer, head, lambda: layer(hidden))
        loss = (out.logprobs * up[0]).sum()
        if args.entropy:
            loss = loss + (out.entropy * up[1]).sum()
        loss.backward()

    step = megatron_step if method == "megatron" else logitless_step

    def clear() -> None:
        hidden.grad = layer.weight.grad = None
        if hasattr(layer.weight, "main_grad"):
            del layer.weight.main_grad

    step()  # warm-up
    clear()
    mem = CpuPeakMemory()
    mem.start()
    step()
    peak = mem.peak_extra_bytes()
    times = []
    for _ in range(args.repeats):
        clear()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"peak": peak, "time": statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--entropy", action="store_true", help="also the entropy, both ways")
    p.add_argument("--csv", default="bench-results/megatron_head.csv")
    args = p.parse_args()
    rows = {}
    for method in METHODS:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank, args=(method, args, tmp), nprocs=args.tp, join=True)
            res = [torch.load(f"{tmp}/rank{r}.pt") for r in range(args.tp)]
        rows[method] = {
            "method": method,
            "tp": args.tp,
            "seq": args.seq,
            "hidden": args.hidden,
            "vocab": args.vocab,
            "entropy": args.entropy,
            "peak_mb_per_rank": round(max(r["peak"] for r in res) / 2**20, 1),
            "median_s": round(max(r["time"] for r in res), 4),
        }
        r = rows[method]
        print(
            f"{method}: peak extra memory per rank {r['peak_mb_per_rank']:.1f} MB, "
            f"step {r['median_s']:.3f} s",
            flush=True,
        )
    ours, theirs = rows["logitless"], rows["megatron"]
    mem = ours["peak_mb_per_rank"] / max(theirs["peak_mb_per_rank"], 1e-9)
    speed = ours["median_s"] / max(theirs["median_s"], 1e-9)
    print(f"ratio logitless/megatron: memory {mem:.3f}x, time {speed:.3f}x", flush=True)
    path = Path(args.csv)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(ours))
        if new:
            w.writeheader()
        w.writerows(rows.values())


if __name__ == "__main__":
    main()
