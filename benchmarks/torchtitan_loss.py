"""torchtitan's ChunkedLossWrapper vs logitless's LogitlessLoss: one loss step on CPU.

    .venv-torchtitan/bin/python benchmarks/torchtitan_loss.py     # 8192 tokens, H=1024, V=151936
    .venv-torchtitan/bin/python benchmarks/torchtitan_loss.py --tokens 64 --hidden 16 \\
        --vocab 50 --repeats 1                                     # a quick check

Needs torchtitan 0.3 (the venv ``.ci/torchtitan.sh`` makes). One step is what torchtitan's
trainer does after the model's forward when its ``loss`` is a ``ChunkedLossWrapper`` (the model
skips ``lm_head``): ``loss_fn(hidden, labels, global_valid_tokens, **inputs)`` and
``loss.backward()``, the gradients reaching the hidden states ``[1, tokens, H]`` and
``lm_head.weight`` (``nn.Linear(H, V, bias=False)``, fp32). ``--loss``: ``ce``
(``CrossEntropyLoss``) or ``grpo`` (``GRPOLoss``, with its metrics). The variants: torchtitan's
``ChunkedLossWrapper`` (``--num-chunks``, its configs' default 8) and ``LogitlessLoss``.

Each variant runs in a fresh process: build, one warm-up step, then ``--repeats`` timed steps,
each starting with the gradients freed. Memory is the RSS high-water mark over the timed steps
minus the RSS before them (as ``logitless bench`` measures it). It holds the gradients the step
allocates, the same for both: ``lm_head.weight``'s (``[V, H]`` fp32) and the hidden states'
(``[tokens, H]``), reported as ``grad floor MB`` (the least any implementation needs; docs/
benchmarks.md); ``over floor`` is the peak beyond it. Ratios are against ChunkedLossWrapper
from the same run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import types
from pathlib import Path

from _step_timing import append_rows, run_worker, time_step

ROOT = Path(__file__).resolve().parents[1]
RESULT = "TORCHTITAN_LOSS_RESULT "
VARIANTS = ("chunked", "logitless")


def _rl_losses():
    """torchtitan's RL losses without ``torchtitan.experiments.rl``'s ``__init__`` (it imports
    vLLM, the generator, which a CPU machine does not have)."""
    import torchtitan.experiments

    name = "torchtitan.experiments.rl"
    if name not in sys.modules:
        stand_in = types.ModuleType(name)
        stand_in.__path__ = [str(Path(torchtitan.experiments.__path__[0]) / "rl")]
        sys.modules[name] = stand_in
    from torchtitan.experiments.rl.losses import GRPOLoss

    return GRPOLoss


def _loss_step(variant: str, args: argparse.Namespace):
    sys.path.insert(0, str(ROOT / "src"))
    import torch
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    from logitless.integrations.torchtitan import LogitlessLoss

    inner = CrossEntropyLoss.Config() if args.loss == "ce" else _rl_losses().Config()
    if variant == "chunked":
        loss_fn = ChunkedLossWrapper.Config(num_chunks=args.num_chunks, loss_fn=inner).build()
    else:
        loss_fn = LogitlessLoss.Config(loss_fn=inner, chunk_size=args.chunk_size).build()
    g = torch.Generator().manual_seed(0)
    lm_head = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    with torch.no_grad():
        lm_head.weight.normal_(0, args.hidden**-0.5, generator=g)
    loss_fn.set_lm_head(lm_head)
    n = args.tokens
    hidden = torch.randn(1, n, args.hidden, generator=g).requires_grad_()
    labels = torch.randint(0, args.vocab, (1, n), generator=g)
    labels[torch.rand(1, n, generator=g) < 0.1] = -100
    gvt = torch.tensor(float((labels != -100).sum()))
    inputs = {}
    if args.loss == "grpo":
        inputs = {
            "generator_logprobs": -12.0 + 0.1 * torch.randn(1, n, generator=g),
            "advantages": torch.randn(1, n, generator=g),
            "loss_mask": labels != -100,
        }

    def step() -> float:
        loss, _ = loss_fn(hidden, labels, gvt, **inputs)
        loss.backward()
        return float(loss)

    def zero_grad() -> None:
        hidden.grad = None
        lm_head.weight.grad = None

    return step, zero_grad


def _worker(variant: str, args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    step, zero_grad = _loss_step(variant, args)

    def fresh_step() -> float:
        zero_grad()
        return step()

    return time_step(variant, fresh_step, zero_grad, args.repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--loss", choices=("ce", "grpo"), default="ce")
    parser.add_argument("--num-chunks", type=int, default=8, help="ChunkedLossWrapper's chunks")
    parser.add_argument(
        "--chunk-size", type=int, default=None, help="LogitlessLoss's chunk_size (None: its own)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--csv", type=Path, default=None, help="append the rows to this CSV")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.stdout.write(RESULT + json.dumps(_worker(args.worker, args)) + "\n")
        return
    if args.tokens % args.num_chunks:
        parser.error("--tokens must be a multiple of --num-chunks (ChunkedLossWrapper's rule)")
    rows = []
    for variant in VARIANTS:
        print(f"running {variant} ...", file=sys.stderr, flush=True)
        rows.append(run_worker(__file__, RESULT, variant, sys.argv[1:]))
    _report(rows, args)


def _report(rows: list[dict], args: argparse.Namespace) -> None:
    base = rows[0]
    print(
        f"torchtitan loss step, {args.loss}: {args.tokens} tokens, H={args.hidden} "
        f"V={args.vocab}, fp32, {args.threads} threads, {args.repeats} timed steps, "
        f"ChunkedLossWrapper with {args.num_chunks} chunks"
    )
    floor = _floor_mb(args)
    print(f"{'loss':<10} {'median s':>9} {'peak extra MB':>14} {'time/chunked':>12} "
          f"{'mem/chunked':>11} {'over floor/chunked':>18} {'loss value':>11}")  # fmt: skip
    for r in rows:
        over = max(r["peak_extra_mb"] - floor, 0) / max(base["peak_extra_mb"] - floor, 1e-9)
        print(
            f"{r['variant']:<10} {r['time_median_s']:>9.3f} {r['peak_extra_mb']:>14.1f} "
            f"{r['time_median_s'] / base['time_median_s']:>12.3f} "
            f"{r['peak_extra_mb'] / max(base['peak_extra_mb'], 1e-9):>11.3f} {over:>18.3f} "
            f"{r['loss']:>11.5g}"
        )
    print(f"grad floor MB (lm_head.weight's and the hidden states' gradients): {floor:.1f}")
    if args.csv:
        _append_csv(args.csv, rows, args)


def _floor_mb(args: argparse.Namespace) -> float:
    """The gradients a step allocates whatever computes them: ``[V, H]`` and ``[tokens, H]``."""
    return (args.vocab + args.tokens) * args.hidden * 4 / 2**20


HEADER = [
    "timestamp", "variant", "loss", "tokens", "hidden", "vocab", "dtype", "threads", "repeats",
    "num_chunks", "chunk_size", "time_median_s", "peak_extra_mb", "grad_floor_mb", "hwm_mb",
    "machine", "torch", "torchtitan",
]  # fmt: skip


def _append_csv(path: Path, rows: list[dict], args: argparse.Namespace) -> None:
    import importlib.metadata

    import torch

    stamp = dt.datetime.now().isoformat(timespec="seconds")
    version = importlib.metadata.version("torchtitan")
    append_rows(path, HEADER, [
        [
            stamp, r["variant"], args.loss, args.tokens, args.hidden, args.vocab,
            "float32", args.threads, args.repeats, args.num_chunks,
            "" if args.chunk_size is None else args.chunk_size,
            f"{r['time_median_s']:.4f}", f"{r['peak_extra_mb']:.1f}",
            f"{_floor_mb(args):.1f}", f"{r['hwm_mb']:.1f}",
            platform.processor() or platform.machine(), torch.__version__, version,
        ]
        for r in rows
    ])  # fmt: skip


if __name__ == "__main__":
    main()
