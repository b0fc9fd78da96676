"""prime-rl's LM head against logitless as that head: time and peak memory, on CPU.

    .venv-prime-rl/bin/python benchmarks/prime_rl_head.py      # N=8192, H=1024, V=151936, fp32
    .venv-prime-rl/bin/python benchmarks/prime_rl_head.py --tokens 64 --hidden 16 --vocab 300 \\
        --chunk 32 --repeats 1                                   # a smoke run

Needs prime-rl's vendored source (``../shared/peers/prime-rl``, loaded as tests/prime_rl/_prime.py
loads it) and the venv ``.ci/prime_rl.sh`` makes. The shape is prime-rl's default fused head:
``model.fused_lm_head_token_chunk_size`` 8192 tokens in one micro-batch (``[1, N]``, prime-rl's
packed layout), Qwen's V=151936, H=1024, per-token temperatures in [0.6, 1.6).

One step is what prime-rl's trainer asks of its head: prime-rl's model forward (the one
``inject_prime_lm_head`` sets: a pass-through backbone, then ``lm_head(hidden_states, labels,
temperature)``), then ``backward()``:

- ``prime_fused``: prime-rl's ``FusedOutputLinear``; the objective ``Σ g·logprobs`` (its
  backward refuses an entropy gradient; the entropy is computed, as prime-rl's trainer logs it);
- ``logitless``: the same model after ``logitless.integrations.prime_rl.adopt``; the objective
  ``Σ g·logprobs + Σ e·entropy``: it also returns the entropy's gradient.

Each variant runs in a fresh subprocess: build, one warm-up step, then ``--repeats`` timed
steps (``benchmarks/_step_timing.py``). Memory is the RSS high-water mark over the timed steps
minus the RSS before them, each step starting with the gradients freed: so it holds the
gradients of the hidden states and of the head weight (``[V, H]`` fp32: 594 MiB at the default
shape) for both. Ratios are against ``prime_fused`` from the same run; ``--csv`` appends one row
per variant with the command.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path

from _step_timing import run_worker, time_step

RESULT = "PRIME_RL_HEAD_RESULT "
VARIANTS = ("prime_fused", "logitless")
ROOT = Path(__file__).resolve().parents[1]


def _model(args: argparse.Namespace, prime):
    """A model with a pass-through backbone (the hidden states come in as ``inputs_embeds``)
    and prime-rl's head and forward injected."""
    import types

    import torch
    import transformers

    class Backbone(torch.nn.Module):
        def forward(self, input_ids=None, position_ids=None, inputs_embeds=None):
            return types.SimpleNamespace(last_hidden_state=inputs_embeds)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = transformers.PretrainedConfig()
            self.model = Backbone()
            self.lm_head = torch.nn.Linear(args.hidden, args.vocab, bias=False)

    torch.manual_seed(0)
    model = Model().to(_dtype(args))
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 3.0 / args.hidden**0.5)  # logits of std ~3
    prime.lm_head.inject_prime_lm_head(model, chunk_size=args.chunk)
    return model


def _dtype(args: argparse.Namespace):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]


def _step(variant: str, args: argparse.Namespace):
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "prime_rl"))
    from _prime import load

    prime = load()
    model = _model(args, prime)
    if variant == "logitless":
        from logitless.integrations import prime_rl

        prime_rl.adopt(model)
    g = torch.Generator().manual_seed(1)
    n = args.tokens
    hidden = torch.randn(1, n, args.hidden, generator=g).to(_dtype(args)).requires_grad_()
    labels = torch.randint(0, args.vocab, (1, n), generator=g)
    temperature = 0.6 + torch.rand(1, n, generator=g)
    up_logp, up_ent = torch.randn(1, n, generator=g), torch.randn(1, n, generator=g)
    position_ids = torch.arange(n)[None]

    def step() -> float:
        out = model(
            inputs_embeds=hidden, position_ids=position_ids, labels=labels, temperature=temperature
        )
        objective = (out["logprobs"] * up_logp).sum()
        if variant == "logitless":
            objective = objective + (out["entropy"] * up_ent).sum()
        objective.backward()
        return float(out["logprobs"].detach().double().sum())

    def zero_grad() -> None:
        hidden.grad = None
        model.zero_grad(set_to_none=True)

    return step, zero_grad


def _worker(variant: str, args: argparse.Namespace) -> None:
    step, zero_grad = _step(variant, args)
    print(RESULT + json.dumps(time_step(variant, step, zero_grad, args.repeats)), flush=True)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=8192, help="prime-rl's token chunk")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--csv", type=Path, default=None, help="append one row per variant")
    p.add_argument("--worker", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str]) -> None:
    args = _parse(argv)
    if args.worker:
        _worker(args.worker, args)
        return
    forwarded = [a for a in argv if a != "--worker"]
    results = [run_worker(__file__, RESULT, v, forwarded) for v in args.variants]
    base = next((r for r in results if r["variant"] == "prime_fused"), results[0])
    command = " ".join(["python", "benchmarks/prime_rl_head.py", *argv])
    print(f"N={args.tokens} H={args.hidden} V={args.vocab} chunk={args.chunk} {args.dtype}")
    print(f"{'variant':<12} {'time_s':>8} {'x':>6} {'peak_MB':>9} {'x':>6} {'sum_logp':>14}")
    for r in results:
        t_ratio = r["time_median_s"] / base["time_median_s"]
        m_ratio = r["peak_extra_mb"] / max(base["peak_extra_mb"], 1e-9)
        r.update(time_ratio=t_ratio, memory_ratio=m_ratio)
        print(
            f"{r['variant']:<12} {r['time_median_s']:8.3f} {t_ratio:6.2f} "
            f"{r['peak_extra_mb']:9.1f} {m_ratio:6.2f} {r['loss']:14.4f}"
        )
    if args.csv:
        _append_csv(args, results, command)


FIELDS = [
    "date", "variant", "tokens", "hidden", "vocab", "chunk", "dtype", "time_median_s",
    "time_ratio", "peak_extra_mb", "memory_ratio", "machine", "threads", "command",
]  # fmt: skip


def _append_csv(args: argparse.Namespace, results: list[dict], command: str) -> None:
    new = not args.csv.exists()
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        for r in results:
            shape = {k: getattr(args, k) for k in ("tokens", "hidden", "vocab", "chunk", "dtype")}
            w.writerow({
                "date": dt.date.today().isoformat(), "variant": r["variant"], **shape,
                "time_median_s": f"{r['time_median_s']:.4f}",
                "time_ratio": f"{r['time_ratio']:.3f}",
                "peak_extra_mb": f"{r['peak_extra_mb']:.1f}",
                "memory_ratio": f"{r['memory_ratio']:.3f}",
                "machine": platform.processor() or platform.machine(),
                "threads": os.cpu_count(), "command": command,
            })  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
