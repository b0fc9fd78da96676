"""One actor step through verl's FSDP engine forward: verl's fused backends vs logitless.

    .venv-verl/bin/python benchmarks/verl_step.py          # 1024 tokens, H=896, V=151936
    .venv-verl/bin/python benchmarks/verl_step.py --tokens 64 --hidden 32 --vocab 500 --repeats 1
    .venv-verl/bin/python benchmarks/verl_step.py --micro-batches 2   # gradient accumulation

Needs verl (0.9.x), so it runs in the venv ``.ci/verl.sh`` makes. The shape is ``logitless
bench``'s default (N=1024 tokens, H=896, Qwen's V=151936, fp32) as one remove-padding
micro-batch of ``--seqs`` sequences: a Qwen2 with that head and ``--layers`` small decoder
layers. One step is verl's ``FSDPEngineWithLMHead.forward_step`` (``prepare_model_inputs`` ->
the model's forward -> ``prepare_model_outputs`` -> the loss function) with the loss
``Σ g·log_probs + Σ e·entropy`` (fixed random g, e), then ``backward()``: what the actor update
asks of the head. The variants are the ``fused_kernel_options.impl_backend`` values, each
patched in by verl's own ``apply_monkey_patch``: ``torch`` (verl's chunked torch backend),
``logitless``, ``logitless_batch_invariant``, and ``unfused`` (``use_fused_kernels=False``: the
logits path).

Each variant runs in a fresh subprocess: build, one warm-up step, then ``--repeats`` timed
steps. Memory is the RSS high-water mark over the timed steps minus the RSS before them (as
``logitless bench`` measures it), each step starting with the gradients freed
(``zero_grad(set_to_none=True)``): so it holds every parameter's gradient, which at the default
shape are mostly the embedding's and the head's (2 x 151936 x 896 fp32, 1039 MiB). Ratios are
against verl's torch backend from the same run.

``--micro-batches K`` (default 1) makes a step what verl's actor update does with
``ppo_micro_batch_size``: K micro-batches of ``--tokens`` each, their gradients accumulated into
``.grad``. With K >= 2 the script also reports ``accum extra MB``: the peak extra RSS of one
micro-batch once the gradients exist (micro-batches 2..K, each from the RSS at its start; the
max over ``--repeats`` steps), measured in a separate pass after the timed steps. That is the
memory a backend adds to a training step whose gradients are already allocated; it still holds
the new weight gradient autograd adds into ``.grad`` (one ``[V, H]`` fp32 tensor for any
backend). The whole-step figure is unchanged.
The engine object is made without its ``__init__`` (which builds FSDP from a checkpoint and
device meshes) and verl's device helpers point at the CPU; everything else is verl's code.
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

RESULT = "VERL_STEP_RESULT "
VARIANTS = ("torch", "logitless", "logitless_batch_invariant", "unfused")


def _engine_step(variant: str, args: argparse.Namespace):
    import torch
    import transformers
    import verl.utils.tensordict_utils as tu
    import verl.workers.engine.fsdp.transformer_impl as impl
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils import torch_functional as verl_F
    from verl.utils.dataset.dataset_utils import DatasetPadMode
    from verl.workers.config.engine import FSDPEngineConfig

    import logitless.integrations.verl  # noqa: F401  (what external_lib does)

    impl.get_device_id = lambda: "cpu"
    impl.get_device_name = lambda: "cpu"
    torch.manual_seed(0)
    heads = max(1, args.hidden // 64)
    config = transformers.Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = transformers.Qwen2ForCausalLM(config)
    fused = variant != "unfused"
    apply_monkey_patch(
        model=model,
        use_remove_padding=True,
        use_fused_kernels=fused,
        fused_kernels_backend=variant if fused else None,
    )
    eng = object.__new__(impl.FSDPEngineWithLMHead)
    eng.module = model
    eng.engine_config = FSDPEngineConfig(use_torch_compile=False)
    eng.use_ulysses_sp, eng.ulysses_sequence_parallel_size = False, 1
    eng.ulysses_device_mesh = eng.ulysses_parallel_group = None
    eng.pad_to_length, eng.pad_to_length_bucket = False, 1
    eng._autocast_dtype = torch.float32
    eng.compute_entropy_from_logits = verl_F.entropy_from_logits

    gen = torch.Generator().manual_seed(1)
    lengths = [args.tokens // args.seqs] * args.seqs
    lengths[-1] += args.tokens - sum(lengths)

    def micro_batch():
        seqs = [torch.randint(0, args.vocab, (n,), generator=gen) for n in lengths]
        return tu.get_tensordict(
            {
                "input_ids": torch.nested.nested_tensor(seqs, layout=torch.jagged),
                "position_ids": torch.nested.nested_tensor(
                    [torch.arange(n) for n in lengths], layout=torch.jagged
                ),
            },
            {
                "temperature": 1.0,
                "use_remove_padding": True,
                "use_fused_kernels": fused,
                "calculate_entropy": True,
                "pad_mode": DatasetPadMode.NO_PADDING,
            },
        )

    batches = [micro_batch() for _ in range(args.micro_batches)]
    g = torch.randn(args.tokens, generator=gen)
    e = torch.randn(args.tokens, generator=gen) * 0.01

    def loss_function(model_output, data, dp_group):
        lp, ent = model_output["log_probs"].values(), model_output["entropy"].values()
        return (lp * g).sum() + (ent * e).sum(), {}

    def micro_step(k: int) -> float:
        """Forward and backward of micro-batch ``k``; gradients accumulate into ``.grad``."""
        loss, _ = eng.forward_step(batches[k], loss_function=loss_function, forward_only=False)
        loss.backward()
        return float(loss)

    return model, micro_step


def _worker(variant: str, args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    model, micro_step = _engine_step(variant, args)

    def zero_grad() -> None:
        model.zero_grad(set_to_none=True)

    def step() -> float:  # one update's worth: gradients freed, then accumulated
        zero_grad()
        return sum(micro_step(k) for k in range(args.micro_batches))

    result = time_step(variant, step, zero_grad, args.repeats)
    result["accum_extra_mb"] = _accumulating_extra_mb(micro_step, zero_grad, args)
    return result


def _accumulating_extra_mb(micro_step, zero_grad, args: argparse.Namespace) -> float | None:
    """The peak extra RSS (MB) of one micro-batch once the parameter gradients exist (the 2nd
    and later micro-batches of an update, gradient accumulation): max over micro-batches 2..K
    of ``--repeats`` steps, each measured from the RSS at its start. None for one micro-batch."""
    from logitless.apps.memory import CpuPeakMemory

    if args.micro_batches < 2:
        return None
    peak = 0
    for _ in range(args.repeats):
        zero_grad()
        micro_step(0)  # allocates every parameter's .grad
        for k in range(1, args.micro_batches):
            probe = CpuPeakMemory()
            probe.start()
            micro_step(k)
            peak = max(peak, probe.peak_extra_bytes())
    zero_grad()
    return peak / 2**20


def _run(variant: str, argv: list[str]) -> dict:
    return run_worker(__file__, RESULT, variant, argv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="packed tokens in the step")
    parser.add_argument("--seqs", type=int, default=8, help="sequences packed into them")
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--layers", type=int, default=1, help="decoder layers of the backbone")
    parser.add_argument("--intermediate", type=int, default=256, help="their MLP width")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--micro-batches", type=int, default=1,
        help="micro-batches per step, gradients accumulated (verl's ppo_micro_batch_size); "
        "with 2 or more, also the peak extra of a micro-batch once the gradients exist",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--csv", type=Path, default=None, help="append the rows to this CSV")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.stdout.write(RESULT + json.dumps(_worker(args.worker, args)) + "\n")
        return
    if "torch" not in args.variants:
        parser.error("--variants must include torch (the ratios' base)")
    if args.micro_batches < 1:
        parser.error("--micro-batches must be >= 1")
    argv = [a for a in sys.argv[1:]]
    rows = []
    for variant in args.variants:
        print(f"running {variant} ...", file=sys.stderr, flush=True)
        rows.append(_run(variant, argv))
    base = next(r for r in rows if r["variant"] == "torch")
    print(
        f"verl FSDP engine step: {args.micro_batches} micro-batch(es) of {args.tokens} tokens in "
        f"{args.seqs} packed sequences, H={args.hidden} V={args.vocab}, {args.layers} layer(s), "
        f"fp32, {args.threads} threads, {args.repeats} timed steps"
    )
    print(
        f"{'impl_backend':<26} {'median s':>9} {'peak extra MB':>14} {'RSS HWM MB':>11} "
        f"{'time/torch':>10} {'mem/torch':>9} {'accum extra MB':>15} {'accum/torch':>11} "
        f"{'loss':>11}"
    )
    for r in rows:
        accum, accum_ratio = "n/a", "n/a"
        if r["accum_extra_mb"] is not None:
            accum = f"{r['accum_extra_mb']:.1f}"
            accum_ratio = f"{r['accum_extra_mb'] / max(base['accum_extra_mb'], 1e-9):.3f}"
        print(
            f"{r['variant']:<26} {r['time_median_s']:>9.3f} {r['peak_extra_mb']:>14.1f} "
            f"{r['hwm_mb']:>11.1f} {r['time_median_s'] / base['time_median_s']:>10.2f} "
            f"{r['peak_extra_mb'] / max(base['peak_extra_mb'], 1e-9):>9.3f} {accum:>15} "
            f"{accum_ratio:>11} {r['loss']:>11.5g}"
        )
    if args.csv:
        import torch
        import verl

        header = [
            "timestamp", "variant", "tokens", "seqs", "hidden", "vocab", "layers", "threads",
            "repeats", "time_median_s", "peak_extra_mb", "hwm_mb", "machine", "torch", "verl",
            "micro_batches", "accum_extra_mb",
        ]  # fmt: skip
        new = not args.csv.exists()
        if not new:
            with args.csv.open(newline="") as f:
                old_header = next(csv.reader(f), [])
            if old_header != header:
                raise SystemExit(f"{args.csv} has other columns ({old_header}); use a new file")
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(header)
            stamp = dt.datetime.now().isoformat(timespec="seconds")
            for r in rows:
                accum = r["accum_extra_mb"]
                w.writerow(
                    [
                        stamp, r["variant"], args.tokens, args.seqs, args.hidden, args.vocab,
                        args.layers, args.threads, args.repeats, f"{r['time_median_s']:.4f}",
                        f"{r['peak_extra_mb']:.1f}", f"{r['hwm_mb']:.1f}",
                        platform.processor() or platform.machine(), torch.__version__,
                        verl.__version__, args.micro_batches,
                        "" if accum is None else f"{accum:.1f}",
                    ]
                )  # fmt: skip


if __name__ == "__main__":
    main()
