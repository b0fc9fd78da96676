"""slime's policy-loss step, its own logits path vs the logitless switch: per-rank peak memory
and time.

    .venv-slime/bin/python benchmarks/slime_step.py
    .venv-slime/bin/python benchmarks/slime_step.py --slime-args="--entropy-coef 0.01"
    .venv-slime/bin/python benchmarks/slime_step.py --seq 1024 --vocab 32768 --repeats 1

(``bash .ci/slime.sh install`` builds ``.venv-slime``: Python 3.12, megatron-core 0.19, and
slime's source from ``../shared/peers/slime`` with the stubs tests/slime/_slime.py describes.)

What GPTModel's forward does after its decoder, and slime's loss, on ``tp`` gloo ranks (fp32):
the decoder's hidden states ``[S, 1, H]`` (``requires_grad``) and a real megatron-core
``ColumnParallelLinear`` output layer (``gather_output=False``, this rank's ``[V/tp, H]`` rows),
a micro-batch of ``--samples`` samples of ``S / samples`` tokens each (a quarter prompt, the
rest response) packed by slime's ``get_batch``, and slime's ``loss_function`` (the dispatch and
the scaling for Megatron's schedule) on what the model hands it. Forward and backward of one
micro-batch, two ways:

- ``slime``: ``--loss-type policy_loss``: the output layer's ``[S, 1, V/tp]`` logits,
  transposed as ``GPTModel`` returns them, then slime's ``policy_loss_function``
  (``get_log_probs_and_entropy`` on the whole logits: its vocabulary-parallel softmax, the
  entropy, the PPO loss);
- ``logitless``: ``--custom-model-provider-path logitless.integrations.slime.model_provider
  --loss-type custom_loss --custom-loss-function-path
  logitless.integrations.slime.policy_loss``: the model provider's ``output_processor`` hands on
  the hidden states, and the loss runs the head as the output layer's forward with the fused
  policy loss; never the logits.

``--slime-args``: more of slime's loss options, the same both ways (default: slime's defaults,
GRPO with ``--eps-clip 0.2``, entropy as a metric; ``--entropy-coef 0.01`` adds its gradient).
Old log-probs and advantages are drawn near the model's own (seeded); the loss both ways is
printed to compare.

Each method runs in fresh processes (one per rank, file:// rendezvous). Every rank reports its
peak extra memory during one step (the RSS high-water mark reset before it, as
``logitless bench`` measures: ``logitless.apps.memory``) and the median time of ``--repeats``
steps after a warm-up; a row is the maximum over ranks. The machine's cores are split between
the ranks. Prints both rows and the ratios logitless / slime; appends them to a CSV.
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("slime", "logitless")
SWITCH = ["--custom-model-provider-path", "logitless.integrations.slime.model_provider",
          "--loss-type", "custom_loss",
          "--custom-loss-function-path", "logitless.integrations.slime.policy_loss"]  # fmt: skip


def _rank(rank: int, method: str, args, tmp: str) -> None:
    warnings.filterwarnings("ignore")
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "slime")]
    import _megatron_shim
    import _slime

    _megatron_shim.install()  # megatron-core's CUDA hard-codings, on the CPU
    _slime.install()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank,
                            world_size=args.tp)  # fmt: skip
    try:
        torch.save(_measure(method, args), f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _layer(args):
    """This rank's output layer, its weight from seed 1000 + rank (logits about N(0, 1))."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=args.tp,
                               tensor_model_parallel_size=args.tp, use_cpu_initialization=True,
                               perform_initialization=False)  # fmt: skip
    layer = ColumnParallelLinear(args.hidden, args.vocab, config=config, init_method=None,
                                 bias=False, gather_output=False)  # fmt: skip
    g = torch.Generator().manual_seed(1000 + ps.get_tensor_model_parallel_rank())
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) / args.hidden**0.5)
    return layer, config


def _rollout(args) -> dict:
    """``--samples`` samples of ``seq / samples`` tokens, the same on every rank; old
    log-probs about log(1/V) and advantages per sample (GRPO's)."""
    import math

    g = torch.Generator().manual_seed(0)
    total = args.seq // args.samples
    response = total - total // 4
    old = [-math.log(args.vocab) - 0.5 + 0.1 * torch.randn(response, generator=g)
           for _ in range(args.samples)]  # fmt: skip
    return {
        "tokens": [torch.randint(0, args.vocab, (total,), generator=g) for _ in old],
        "total_lengths": [total] * args.samples,
        "response_lengths": [response] * args.samples,
        "loss_masks": [torch.ones(response, dtype=torch.int) for _ in old],
        "rollout_mask_sums": torch.full((args.samples,), float(response)),
        "log_probs": old,
        "advantages": [torch.full((response,), float(torch.randn((), generator=g))) for _ in old],
    }


def _measure(method: str, args) -> dict:
    from functools import partial

    import _slime
    from megatron.core import parallel_state as ps
    from slime.backends.megatron_utils.data import DataIterator, get_batch
    from slime.backends.megatron_utils.loss import loss_function

    from logitless.apps.memory import peak_memory_meter
    from logitless.integrations.slime import output_processor

    torch.cuda.current_device = lambda: "cpu"
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    layer, config = _layer(args)
    cli = shlex.split(args.slime_args) + (SWITCH if method == "logitless" else [])
    slime_args = _slime.slime_args(cli, tp=args.tp, **{"data_pad_size_multiplier": 128})
    data = _rollout(args)
    keys = ["tokens", "total_lengths", "response_lengths", "loss_masks", "rollout_mask_sums",
            "log_probs", "advantages", "multimodal_train_inputs"]  # fmt: skip
    batch = get_batch(DataIterator(data, [list(range(args.samples))]), keys, 128, False)
    g = torch.Generator().manual_seed(1)
    length = batch["tokens"].shape[1]
    hidden = torch.randn(length, 1, args.hidden, generator=g).requires_grad_()
    loss_of = partial(loss_function, slime_args, batch, 1, args.samples)

    def step():
        if method == "slime":  # GPTModel's postprocess without labels, then slime's loss
            logits, _ = layer(hidden)
            output = logits.transpose(0, 1).contiguous()
        else:  # the switch's output_processor, as GPTModel.forward calls it
            output = output_processor(hidden_states=hidden, output_layer=layer, config=config)
        loss, _, _ = loss_of(output)
        loss.backward()
        return float(loss)

    def clear():
        hidden.grad = layer.weight.grad = None

    value = step()  # warm-up; the loss, to compare the two ways
    clear()
    mem = peak_memory_meter(torch.device("cpu"))
    mem.start()
    step()
    peak = mem.peak_extra_bytes()
    times = []
    for _ in range(args.repeats):
        clear()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"peak": peak, "time": statistics.median(times), "loss": value, "tokens": length}


def _append_csv(path: Path, rows: list[dict]) -> None:
    new = not path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192, help="tokens of the micro-batch")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slime-args", default="", help="slime's loss options, both ways")
    p.add_argument("--csv", default="bench-results/slime_step.csv")
    args = p.parse_args(argv)
    rows = {}
    for method in METHODS:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank, args=(method, args, tmp), nprocs=args.tp, join=True)
            res = [torch.load(f"{tmp}/rank{r}.pt") for r in range(args.tp)]
        rows[method] = {
            "method": method, "tp": args.tp, "tokens": res[0]["tokens"], "hidden": args.hidden,
            "vocab": args.vocab, "samples": args.samples, "slime_args": args.slime_args,
            "peak_mb_per_rank": round(max(r["peak"] for r in res) / 2**20, 1),
            "median_s": round(max(r["time"] for r in res), 4), "loss": res[0]["loss"],
            "device": "cpu",
        }  # fmt: skip
        r = rows[method]
        print(f"{method}: peak extra memory per rank {r['peak_mb_per_rank']:.1f} MB, step "
              f"{r['median_s']:.3f} s, loss {r['loss']:.6f}", flush=True)  # fmt: skip
    ours, theirs = rows["logitless"], rows["slime"]
    mem = ours["peak_mb_per_rank"] / max(theirs["peak_mb_per_rank"], 1e-9)
    speed = ours["median_s"] / max(theirs["median_s"], 1e-9)
    print(f"ratio logitless/slime: memory {mem:.3f}x, time {speed:.3f}x", flush=True)
    _append_csv(Path(args.csv), list(rows.values()))


if __name__ == "__main__":
    main()
