"""Megatron's logits path vs logitless inside output_layer: per-rank peak memory and time.

    python benchmarks/megatron_head.py --seq 8192 --hidden 1024 --vocab 151936 --tp 2
    python benchmarks/megatron_head.py --task loss --entropy --main-grad
    python benchmarks/megatron_head.py --task loss --entropy --distributed-optimizer
    python benchmarks/megatron_head.py --distributed-optimizer --dtype bfloat16 --seq 4096
    python benchmarks/megatron_head.py --device cuda --tp 1 --distributed-optimizer \
        --dtype bfloat16 --seq 16384 --hidden 3584 --vocab 152064

The head of a megatron-core GPTModel on ``tp`` gloo ranks, fp32 (or ``--dtype bfloat16``): the
decoder's hidden states ``[S, 1, H]`` and a real ``ColumnParallelLinear`` output layer
(``gather_output=False``, this rank's ``[V/tp, H]`` rows). The weight is drawn from seed
1000 + rank, the tokens and hidden states from seed 0 on every rank (the logits about N(0, 1),
the mean max-probability over the vocabulary 3.7e-4). Forward + backward, two ways, of one of
two tasks:

``--task logprobs`` (the default): the per-token log-probs (random upstream gradient):

- ``megatron``: ``output_layer(hidden)`` → ``[S, 1, V/tp]`` logits →
  ``vocab_parallel_cross_entropy`` (Megatron's own path; with ``--entropy`` also the entropy
  of the tensor-parallel-gathered logits);
- ``logitless``: the head run as ``output_layer``'s forward (what
  ``logitless.integrations.megatron.logprobs`` does inside ``GPTModel``), never the logits.

``--task loss``: a GRPO-style step (PPO-clip ε = 0.2, token mean; with ``--entropy`` an entropy
bonus of 0.01) on the same old log-probs and advantages:

- ``megatron``: the logits → ``vocab_parallel_cross_entropy`` (on a copy of the logits when
  the entropy is also taken: it writes its input) → with ``--entropy`` the vocab-parallel
  entropy as verl's and slime's Megatron actors compute it (``_VocabParallelEntropy``:
  all-reduced max, Σexp and Σp·z; saves the logits and the softmax) → the clipped surrogate
  in plain torch → backward;
- ``logitless``: the fused policy loss inside ``output_layer``'s forward
  (``logitless.integrations.megatron.policy_loss``'s head: the gradient taken in the forward
  pass, three matmuls) → backward; ``--loss-path composed``: the log-prob op inside
  ``output_layer`` (its backward recomputes the logits: four matmuls, and with
  ``--main-grad`` no weight-gradient buffer), then ``logitless.policy_loss`` → backward.

``--main-grad``: the weight carries a preallocated fp32 ``main_grad`` and a backward hook that
adds its ``.grad`` into it unless ``grad_added_to_main_grad`` (Megatron DDP's); logitless then
adds its weight gradient straight into ``main_grad`` (gradient-accumulation fusion, its
default under Megatron's DDP). The buffer is allocated before the measurement, outside the
"extra" of both.

``--distributed-optimizer``: a training step as Megatron-LM runs it with its distributed
optimizer. The output layer is wrapped in megatron-core's ``DistributedDataParallel``
(``use_distributed_optimizer``, ``overlap_grad_reduce``, ``overlap_param_gather``,
``grad_reduce_in_fp32``), whose fp32 ``main_grad`` buffer and backward hook replace
``--main-grad``'s, and a step is: ``zero_grad_buffer``, the forward (DDP's forward pre-hook
finishes the weight's all-gather), the backward, ``finish_grad_sync`` and the
``DistributedOptimizer``'s (Adam) step, both ways. On ``tp`` ranks the data-parallel size is 1:
the optimizer's shard is the whole of this rank's weight. megatron-core on a CPU needs the
test suite's shims (``tests/_megatron_shim.py``: the optimizer dispatches on ``param.type()``,
makes its scalars on ``"cuda"``, ...); the Adam states are allocated in the warm-up step,
outside the measured "extra".

``--dtype bfloat16``: a bf16 model as Megatron-LM sets one up for training: bf16 hidden states,
the output layer built with ``TransformerConfig(bf16=True, params_dtype=torch.bfloat16)`` and
wrapped in ``Float16Module`` (called with ``fp32_output=False``: Megatron's path takes the bf16
logits into ``vocab_parallel_cross_entropy``, which upcasts them itself, as a GPTModel's own loss
does; with ``--entropy`` the entropy is taken of the fp32 logits, as verl's actor gets them from
``Float16Module``). Under ``--distributed-optimizer`` DDP keeps an fp32 ``main_grad``
(``grad_reduce_in_fp32``) and the optimizer fp32 main parameters (``OptimizerConfig(bf16=True)``);
logitless adds its weight gradient into the fp32 ``main_grad`` as in fp32. On a CPU without
native bf16 matmuls (``avx512_bf16``, AMX) they are several times slower than fp32 ones:
measure at a smaller ``--seq`` there.

``--device cuda``: one GPU per rank (NCCL; megatron-core as it runs there, no CPU shims), the
peak extra memory from ``torch.cuda.max_memory_allocated`` and each step timed between two
``torch.cuda.synchronize`` calls. Not yet run: no GPU was lent since it was written.

Each method runs in fresh processes (one per rank, file:// rendezvous). Every rank reports its
peak extra memory during one step (RSS high-water mark reset before it on a CPU) and the
median time of ``--repeats`` steps; a row is the maximum over ranks. The machine's cores are
split between the ranks. Prints both rows and the ratios logitless / megatron; appends them to
a CSV (columns added over time go to the end; an older file gets them, empty, in its old rows).
"""

from __future__ import annotations

import argparse
import csv
import math
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
    cuda = args.device == "cuda"
    if args.distributed_optimizer and not cuda:  # megatron-core's CUDA hard-codings, on CPU
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import _megatron_shim

        _megatron_shim.install()
    if cuda:
        torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp}/init", rank=rank, world_size=tp)
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

    import logitless
    from logitless.apps.memory import peak_memory_meter
    from logitless.contract.options import HeadOptions
    from logitless.integrations import megatron, seam

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else None
    if device is None:  # Megatron's gathers allocate on the current CUDA device
        torch.cuda.current_device = lambda: "cpu"
        device = torch.device("cpu")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, create_gloo_process_groups=args.distributed_optimizer
    )
    s, h, v = args.seq, args.hidden, args.vocab
    bf16 = args.dtype == "bfloat16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    layer_config = TransformerConfig(
        num_layers=1,
        hidden_size=h,
        num_attention_heads=args.tp,
        tensor_model_parallel_size=args.tp,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,
        **({"bf16": True, "params_dtype": torch.bfloat16} if bf16 else {}),
    )
    layer = ColumnParallelLinear(
        h, v, config=layer_config, init_method=None, bias=False, gather_output=False
    )
    module = layer
    if bf16:  # as Megatron-LM wraps a bf16 model (its parameters are bf16 already)
        from megatron.core.transformer.module import Float16Module

        module = Float16Module(layer_config, layer)
    # the weight from a seed of its own: drawn from the hidden states' seed, rank 0's first
    # rows were its first hidden rows (scaled), a near one-hot softmax no model has
    g = torch.Generator().manual_seed(1000 + ps.get_tensor_model_parallel_rank())
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=g).to(device) / h**0.5)
    g = torch.Generator().manual_seed(0)  # the same tokens on every rank (drawn on the CPU)
    hidden = torch.randn(s, 1, h, generator=g).to(device, dtype).requires_grad_()
    labels = torch.randint(0, v, (1, s), generator=g).to(device)
    up = torch.randn(2, 1, s, generator=g).to(device)
    # the loss task's rollout data: old log-probs near the model's, advantages per token
    old = (-math.log(v) - 0.5 + 0.1 * torch.randn(1, s, generator=g)).to(device)
    adv = torch.randn(1, s, generator=g).to(device)
    rows = layer.output_size_per_partition
    start = ps.get_tensor_model_parallel_rank() * rows
    vp = None
    if args.tp > 1:
        vp = logitless.VocabParallel(ps.get_tensor_model_parallel_group(), start, start + rows)
    parallel = seam.Parallelism(vocab=vp)
    config = logitless.PolicyLossConfig(entropy_coef=ENTROPY_COEF if args.entropy else 0.0)
    ddp = opt = None
    norms: list[float] = []  # the head weight's gradient norm per optimizer step
    if args.distributed_optimizer:  # DDP's main_grad and hook; the weight moves to its buffer
        ddp, opt = _distributed_optimizer(module, layer_config)
        assert layer.weight.dtype == dtype and layer.weight.main_grad.dtype == torch.float32
    weight = layer.weight
    if args.main_grad and not args.distributed_optimizer:
        # what Megatron's DDP gives the parameter, and its backward hook
        weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=device)
        weight.grad_added_to_main_grad = False
        node = weight.expand_as(weight).grad_fn.next_functions[0][0]
        node.register_hook(_ddp_hook(weight))

    def into():
        fused = args.main_grad or args.distributed_optimizer
        return megatron.main_grad_into(weight) if fused else None

    def run_layer():
        # Float16Module's bf16 logits as they are (Megatron-LM's loss takes them inside the
        # model; its fp32 upcast of the outputs is for callers outside it)
        return module(hidden, fp32_output=False) if bf16 else layer(hidden)

    def megatron_logprobs() -> None:
        logits, _ = run_layer()  # [S, 1, V/tp]
        ent = None
        if args.entropy:  # before vocab_parallel_cross_entropy, which turns its input into p
            full = gather_from_tensor_model_parallel_region(logits)
            ent = -(full.softmax(-1) * full.log_softmax(-1)).sum(-1)
        logp = -vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous())
        loss = (logp.transpose(0, 1) * up[0]).sum()
        if ent is not None:
            loss = loss + (ent.transpose(0, 1) * up[1]).sum()
        loss.backward()

    def megatron_loss() -> None:
        logits, _ = run_layer()  # [S, 1, V/tp]
        target = labels.transpose(0, 1).contiguous()
        ent = None
        if args.entropy:
            # verl's actor gets the logits in fp32 (Float16Module's upcast), then the entropy;
            # vocab_parallel_cross_entropy writes its input, and only in fp32 is that the logits
            z = logits.float()
            ent = _VocabParallelEntropy.apply(z, ps.get_tensor_model_parallel_group())
            logits = logits.clone() if logits.dtype == torch.float32 else logits
        logp = -vocab_parallel_cross_entropy(logits, target)  # [S, 1]
        loss = _grpo_loss(logp.transpose(0, 1), old, adv, ent)
        loss.backward()
        return loss

    def in_output_layer(fn):
        def head(x, weight=None, **_):
            tokens = seam.Tokens(x, labels, sequence_first=True)
            return fn(tokens, seam.Head(layer.weight if weight is None else weight))

        return seam.run_as_forward(layer, head, run_layer)[1]

    def prepared(**options) -> seam.Prepared:
        """The seam's first phase, as the integrations run it before the model."""
        options = HeadOptions(weight_grad_into=into(), **options)
        return seam.prepare(labels, seam.Head(layer.weight), options, parallel=parallel)

    def logitless_logprobs() -> None:
        prep = prepared(with_entropy=args.entropy)
        out = in_output_layer(lambda t, w: seam.logprobs(prep, t, w))
        loss = (out.logprobs * up[0]).sum()
        if args.entropy:
            loss = loss + (out.entropy * up[1]).sum()
        loss.backward()

    def logitless_loss() -> None:
        if args.loss_path == "composed":  # the log-prob op (recompute), then the loss
            prep = prepared(with_entropy=args.entropy)
            out = in_output_layer(lambda t, w: seam.logprobs(prep, t, w))
            loss, _ = logitless.policy_loss(
                out.logprobs, old, adv, torch.ones_like(old, dtype=torch.bool),
                config=config, entropy=out.entropy,
            )  # fmt: skip
        else:
            inputs = seam.LossInputs(old_logprobs=old, advantages=adv)
            prep = prepared().with_loss(inputs, config)
            loss, _ = in_output_layer(lambda t, w: seam.policy_loss(prep, t, w))
        loss.backward()
        return loss

    steps = {
        ("megatron", "logprobs"): megatron_logprobs,
        ("megatron", "loss"): megatron_loss,
        ("logitless", "logprobs"): logitless_logprobs,
        ("logitless", "loss"): logitless_loss,
    }
    step = steps[method, args.task]
    mem = peak_memory_meter(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    head_peaks: list[int] = []  # per step: the peak before the optimizer's step
    if args.distributed_optimizer:
        step = _optimizer_step(
            step, ddp, opt, norms, lambda: head_peaks.append(mem.peak_extra_bytes())
        )

    def clear() -> None:
        hidden.grad = weight.grad = None
        if args.distributed_optimizer:
            ddp.zero_grad_buffer()
            opt.zero_grad()
        elif args.main_grad:
            weight.main_grad.zero_()
            weight.grad_added_to_main_grad = False

    value = step()  # warm-up; the loss task's loss, to compare the two ways
    clear()
    mem.start()
    step()
    peak = mem.peak_extra_bytes()
    times = []
    for _ in range(args.repeats):
        clear()
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    loss = None if value is None else float(value)
    norm = norms[0] if norms else None  # the warm-up step's: the same weights both ways
    head_peak = head_peaks[1] if head_peaks else None  # the measured step's
    return {"peak": peak, "time": statistics.median(times), "loss": loss, "grad_norm": norm,
            "head_peak": head_peak}  # fmt: skip


ENTROPY_COEF = 0.01
CLIP = 0.2


def _ddp_hook(weight):
    """Megatron DDP's backward hook on the parameter's gradient accumulator
    (``_make_backward_post_hook``): add ``.grad`` into ``main_grad`` unless the layer already
    did (``grad_added_to_main_grad``), then drop ``.grad``."""

    def hook(*_):
        if weight.grad is not None and not weight.grad_added_to_main_grad:
            weight.main_grad.add_(weight.grad)
        weight.grad = None

    return hook


def _distributed_optimizer(module, config):
    """megatron-core's DDP for the distributed optimizer, both overlaps, around ``module``; its
    ``DistributedOptimizer`` (Adam: the only one it takes; in bf16, with fp32 main parameters,
    as ``config.bf16`` makes Megatron-LM's)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True,
        overlap_param_gather=True,
    )  # fmt: skip
    ddp = DistributedDataParallel(config, ddp_config, module=module)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-6, weight_decay=0.0, clip_grad=1.0,
                        use_distributed_optimizer=True, bf16=config.bf16,
                        params_dtype=config.params_dtype),
        [ddp],
    )  # fmt: skip
    if config.bf16:  # Adam steps fp32 copies of the bf16 weight's shard
        inner = getattr(opt, "chained_optimizers", [opt])
        mains = [p for o in inner for g in o.shard_fp32_from_float16_groups for p in g]
        assert mains and all(p.dtype == torch.float32 for p in mains), "no fp32 main parameters"
    return ddp, opt


def _optimizer_step(step, ddp, opt, norms: list, before_optimizer):
    """``step`` (forward + backward), then the gradient sync and the optimizer's step (its
    gradient-norm clipping at 1.0, Megatron-LM's default); each step's gradient norm is
    appended to ``norms``; ``before_optimizer()`` is called before the optimizer's step."""

    def train_step():
        value = step()
        ddp.finish_grad_sync()
        before_optimizer()
        ok, norm, _ = opt.step()
        assert ok, "the optimizer skipped its step"
        norms.append(float(norm))
        return value

    return train_step


def _grpo_loss(logp, old, adv, ent):
    """The PPO-clip surrogate (ε = 0.2), token mean over ``[1, S]`` tokens, minus the entropy
    bonus: what ``logitless.PolicyLossConfig(entropy_coef=...)`` computes, in plain torch."""
    ratio = (logp - old).exp()
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    loss = -surrogate.mean()
    if ent is not None:
        loss = loss - ENTROPY_COEF * ent.transpose(0, 1).mean()
    return loss


class _VocabParallelEntropy(torch.autograd.Function):
    """The entropy of vocab-parallel logits ``[..., V/tp]`` as verl's and slime's Megatron
    actors compute it: the max, Σexp and Σp·z all-reduced over the tensor-parallel group; the
    logits and the softmax saved for backward, ``dH/dz = p·(Σp·z − z)``."""

    @staticmethod
    def forward(ctx, logits, group):
        m = logits.max(dim=-1, keepdim=True).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - m).exp_()
        sum_exp = exp.sum(dim=-1, keepdim=True)
        dist.all_reduce(sum_exp, group=group)
        softmax = exp.div_(sum_exp)
        pz = (softmax * logits).sum(dim=-1, keepdim=True)
        dist.all_reduce(pz, group=group)
        ctx.save_for_backward(logits, softmax, pz)
        return (m + sum_exp.log() - pz).squeeze(-1)

    @staticmethod
    def backward(ctx, grad):
        logits, softmax, pz = ctx.saved_tensors
        return softmax * (pz - logits) * grad.unsqueeze(-1), None


def _append_csv(path: Path, rows: list[dict]) -> None:
    """Append ``rows``; an existing file whose header lacks some of their columns is rewritten
    with them added at the end (empty in its old rows)."""
    fields = list(rows[0])
    old_rows: list[dict] = []
    if path.exists():
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            old_rows = list(reader)
        fields = header + [c for c in fields if c not in header]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(old_rows + rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--entropy", action="store_true", help="also the entropy, both ways")
    p.add_argument(
        "--task",
        choices=("logprobs", "loss"),
        default="logprobs",
        help="per-token log-probs, or a GRPO-style policy-loss step (see the module docstring)",
    )
    p.add_argument(
        "--main-grad",
        action="store_true",
        help="a preallocated fp32 main_grad and Megatron DDP's hook on the weight",
    )
    p.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="a training step under megatron-core's DDP and DistributedOptimizer (both "
        "overlaps; implies DDP's main_grad, see the module docstring)",
    )
    p.add_argument(
        "--loss-path",
        choices=("fused", "composed"),
        default="fused",
        help="--task loss, logitless: the fused policy loss (gradient in the forward pass, "
        "three matmuls) or the log-prob op then logitless.policy_loss (four matmuls)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the hidden states' and the output layer's dtype; bfloat16 as Megatron-LM runs a "
        "bf16 model (Float16Module, fp32 main_grad and main parameters; see the docstring)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo ranks; cuda: one GPU per rank, NCCL (see the docstring)",
    )
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
            "task": args.task,
            "main_grad": args.main_grad or args.distributed_optimizer,
            "loss_path": args.loss_path if args.task == "loss" else "",
            "dtype": args.dtype,
            "weight_seed": "1000+rank",
            "device": args.device,
        }
        if args.distributed_optimizer:  # its columns, only in its rows (empty in the others)
            head = max(r["head_peak"] for r in res)
            rows[method]["distributed_optimizer"] = True
            rows[method]["peak_mb_per_rank_before_optimizer"] = round(head / 2**20, 1)
        r = rows[method]
        value = "" if res[0]["loss"] is None else f", loss {res[0]['loss']:.6f}"
        if res[0]["grad_norm"] is not None:
            value += f", weight gradient norm {res[0]['grad_norm']:.6g}"
        composed = method == "logitless" and r["loss_path"] == "composed"
        how = args.task + (", composed" if composed else "")
        how += ", main_grad" if args.main_grad else ""
        how += ", distributed optimizer" if args.distributed_optimizer else ""
        how += ", bf16" if args.dtype == "bfloat16" else ""
        peak = f"{r['peak_mb_per_rank']:.1f} MB"
        if args.distributed_optimizer:
            peak += f" ({r['peak_mb_per_rank_before_optimizer']:.1f} MB before the optimizer)"
        print(
            f"{method} ({how}): peak extra memory per rank {peak}, "
            f"step {r['median_s']:.3f} s{value}",
            flush=True,
        )
    ours, theirs = rows["logitless"], rows["megatron"]
    mem = ours["peak_mb_per_rank"] / max(theirs["peak_mb_per_rank"], 1e-9)
    speed = ours["median_s"] / max(theirs["median_s"], 1e-9)
    print(f"ratio logitless/megatron: memory {mem:.3f}x, time {speed:.3f}x", flush=True)
    path = Path(args.csv)
    path.parent.mkdir(parents=True, exist_ok=True)
    _append_csv(path, list(rows.values()))


if __name__ == "__main__":
    main()
