"""NeMo RL's log-prob + loss step: its fused path vs logitless, per-rank peak memory and time.

    python benchmarks/nemo_rl_logprobs.py            # in .venv-nemo-rl (.ci/nemo_rl.sh install)
    python benchmarks/nemo_rl_logprobs.py --methods logitless_cp2,logitless_overlap

One GRPO training step of NeMo RL's Megatron worker code on gloo ranks on a CPU: NeMo RL's
``process_microbatch`` and ``megatron_forward_backward`` with its ``LossPostProcessor`` around
``ClippedPGLossFn`` (k3 reference KL), on a megatron-core GPTModel of ``--layers`` layers
(tests/_megatron_shim.py: token-local attention; hidden ``--hidden``, vocabulary ``--vocab``),
fp32, tensor parallelism ``--tp`` with sequence parallelism (NeMo RL's fused forward gathers
the hidden states over the tensor-parallel group: it assumes it), ``--seqs`` sequences of
``--seq`` tokens (``--seqs * --seq`` tokens in all). NeMo RL's code is its vendored source
(``../shared/peers/nemo-rl``) with tests/nemo_rl/_nemo_shim.py's stubs. Methods:

- ``nemo_fused``: ``use_fused_linear_logprobs=true``, NeMo RL's own chunked linear log-prob
  (``fused_linear_logprobs_chunk_size`` ``--nemo-chunk``, 256 in its configs);
- ``logitless``: the same flag with ``fused_linear_logprobs_backend=logitless``;
- ``nemo_logits``: ``use_fused_linear_logprobs=false`` (the ``[B, S, V/tp]`` logits);
- ``logitless_cp2``: logitless with context parallelism 2 (``2 * --tp`` ranks), the sequences
  packed (THD): NeMo RL's fused path refuses both;
- ``logitless_overlap``: logitless under megatron-core's DDP and distributed optimizer with
  ``overlap_grad_reduce`` and ``overlap_param_gather`` (NeMo RL's fused path refuses it), the
  step followed by the optimizer's.

Each method runs in fresh processes; each rank reports its peak extra memory during the step
(RSS high-water mark reset before it: ``logitless.apps.memory``) and the median time of
``--repeats`` steps after a warm-up; a row is the maximum over ranks. Prints the rows and the
ratios logitless / nemo_fused; appends them to ``--csv``.
"""

from __future__ import annotations

import argparse
import csv
import os
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
METHODS = ("nemo_fused", "logitless", "nemo_logits", "logitless_cp2", "logitless_overlap")


def _paths() -> None:
    peer = ROOT.parent / "shared" / "peers" / "nemo-rl"
    for p in (ROOT / "tests" / "nemo_rl", ROOT / "tests", peer, ROOT / "src"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))


def _rank(rank: int, world: int, method: str, args, tmp: str) -> None:
    warnings.filterwarnings("ignore")
    _paths()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    try:
        torch.save(_measure(method, args), f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _model(method: str, args):
    from _megatron_shim import gpt_model, init_parallel
    from test_nemo_rl import _ddp

    cp = 2 if method == "logitless_cp2" else 1
    init_parallel(args.tp, cp, gloo_groups=method == "logitless_overlap")
    model = gpt_model(
        tp=args.tp, cp=cp, sequence_parallel=args.tp > 1, vocab=args.vocab, hidden=args.hidden,
        layers=args.layers, position_embedding_type="none",
    )  # fmt: skip
    if method != "logitless_overlap":
        return model, None, cp
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = _ddp(model, overlap_grad_reduce=True, use_distributed_optimizer=True,
               overlap_param_gather=True)  # fmt: skip
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-6, use_distributed_optimizer=True), [ddp]
    )
    return ddp, opt, cp


def _measure(method: str, args) -> dict:
    import _megatron_shim  # noqa: F401
    import _nemo_shim

    _nemo_shim.install()
    import logitless.integrations.nemo_rl  # noqa: F401  (installs)

    _nemo_shim.cpu_reference_path()
    from nemo_rl.distributed.model_utils import patch_gpt_model_forward_for_linear_ce_fusion
    from test_nemo_rl import Shape, _config, _rollout, _run, _sampling

    from logitless.apps.memory import peak_memory_meter

    patch_gpt_model_forward_for_linear_ce_fusion(chunk_size=args.nemo_chunk)
    model, opt, cp = _model(method, args)
    backend = "nemo" if method.startswith("nemo") else "logitless"
    cfg = _config(args.tp, cp, packed=cp > 1, sp=args.tp > 1, backend=backend)
    fused = method != "nemo_logits"
    shape = Shape(args.seqs, args.seq, (args.seq,) * args.seqs, args.vocab)
    rollout = _rollout(seed=0, shape=shape)

    def step() -> float:
        if opt is not None:
            model.zero_grad_buffer()
            opt.zero_grad()
        out = _run(model, cfg, rollout, _sampling(), "loss", fused)
        if opt is not None:
            opt.step()
        else:
            model.zero_grad(set_to_none=True)
        return float(out["loss"])

    mem = peak_memory_meter(torch.device("cpu"))
    step()  # warm-up: the optimizer's states, the allocator's pools
    times, loss = [], None
    mem.start()
    for _ in range(args.repeats):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    return {"peak": mem.peak_extra_bytes(), "time": statistics.median(times), "loss": loss}


def _run_method(method: str, args) -> dict:
    world = args.tp * (2 if method == "logitless_cp2" else 1)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(world, method, args, tmp), nprocs=world, join=True)
        res = [torch.load(f"{tmp}/rank{r}.pt") for r in range(world)]
    return {
        "method": method, "seqs": args.seqs, "seq": args.seq, "hidden": args.hidden,
        "vocab": args.vocab, "tp": args.tp, "world": world, "layers": args.layers,
        "nemo_chunk": args.nemo_chunk,
        "peak_mb_per_rank": round(max(r["peak"] for r in res) / 2**20, 1),
        "time_s": round(max(r["time"] for r in res), 4),
        "loss": res[0]["loss"],
    }  # fmt: skip


def _append_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--nemo-chunk", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--csv", default="bench-results/nemo_rl_logprobs.csv")
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    unknown = set(methods) - set(METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; choose from {list(METHODS)}")
    rows = [_run_method(m, args) for m in methods]
    for r in rows:
        print(f"{r['method']}: peak extra memory per rank {r['peak_mb_per_rank']:.1f} MB, "
              f"step {r['time_s']:.3f} s, loss {r['loss']:.6f}")  # fmt: skip
    by = {r["method"]: r for r in rows}
    if "nemo_fused" in by and "logitless" in by:
        a, b = by["logitless"], by["nemo_fused"]
        memory = a["peak_mb_per_rank"] / max(b["peak_mb_per_rank"], 1e-9)
        print(f"logitless / nemo_fused: memory {memory:.2f}x, "
              f"time {a['time_s'] / max(b['time_s'], 1e-9):.2f}x")  # fmt: skip
    _append_csv(Path(args.csv), rows)
    return rows


if __name__ == "__main__":
    main()
