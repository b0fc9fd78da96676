"""Fast-LLM's language-model head: its logits path vs ``head: {type: logitless}``, on CPU.

    .venv-fastllm/bin/python benchmarks/fast_llm_head.py       # 8192 tokens, H=1024, V=151936
    .venv-fastllm/bin/python benchmarks/fast_llm_head.py --tokens 64 --hidden 16 --vocab 50 \\
        --repeats 1 --no-compile                                # a quick check

Needs the Fast-LLM peer (``../shared/peers/fast-llm``, put on ``sys.path`` here) and Python
3.12: the venv ``.ci/fast_llm.sh`` makes. One step is what Fast-LLM's schedule runs on the head
of a training micro-batch: ``preprocess`` (the logitless head checks its calls there), then the
head's ``Stage`` forward and backward (Fast-LLM computes the head's gradients inside its
forward): the final norm, the loss (``--loss``: ``grpo`` with Fast-LLM's default ``metrics:
auto``, i.e. its basic metric family; or ``label``, the cross-entropy), the hidden and weight
gradients into Fast-LLM's buffers. The variants are the head config's ``type``: Fast-LLM's own
(``fast_llm``: the ``[tokens, vocab]`` logits, its default ``loss_implementation: auto``, which
on a CPU is its ``torch.compile``d shared-softmax path; ``--no-compile`` runs it eagerly) and
``logitless``.

Each variant runs in a fresh process: build, one warm-up step (Fast-LLM's compilation happens
there), then ``--repeats`` timed steps. Memory is the RSS high-water mark over the timed steps
minus the RSS before them (as ``logitless bench`` measures it): the head's parameters and
Fast-LLM's gradient buffers exist before, so it is what one step adds; the least it can be is
the input's gradient (``[tokens, H]``, ``grad floor MB``). Ratios are against Fast-LLM's head
from the same run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path

from _step_timing import append_rows, run_worker, time_step

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT.parent / "shared" / "peers" / "fast-llm"
RESULT = "FAST_LLM_HEAD_RESULT "
VARIANTS = ("fast_llm", "logitless")


def _head_step(variant: str, args: argparse.Namespace):
    """The head's step (``step()`` returns the loss) and its gradient reset."""
    sys.path[:0] = [str(PEER), str(ROOT / "src")]
    import collections

    import torch
    from fast_llm.engine.distributed.distributed import Distributed
    from fast_llm.engine.multi_stage.config import StageConfig
    from fast_llm.engine.multi_stage.stage import Stage
    from fast_llm.models.gpt.config import GPTModelConfig

    import logitless.integrations.fast_llm  # noqa: F401  (registers head type logitless)

    losses = {"grpo": {"type": "grpo"}} if args.loss == "grpo" else {"ce": {"type": "label"}}
    head = {"normalization": {"type": "rms_norm"}, "losses": losses}
    if variant == "logitless":
        head["type"] = "logitless"
    base_model = {
        "decoder": {"num_blocks": 0},
        "embeddings": {"vocab_size": args.vocab},
        "head": head,
        "hidden_size": args.hidden,
    }
    config = GPTModelConfig.from_dict(
        {"base_model": base_model, "distributed": {"use_cuda": False, "seed": 1}}
    )
    model_class = config.get_base_model_config_class()
    base = model_class.get_base_model(config.base_model, config.distributed)
    dist = Distributed(config.distributed)
    base.setup(dist)
    stage = Stage(
        config=StageConfig(), layers=[base.head], distributed_config=dist.config, index=0,
        tied_parameter_duplicates=(),
    )  # fmt: skip
    stage.setup(distributed=dist, tied_parameter_duplicate_buffers={})
    stage.initialize_weights()
    stage.restore_parameters()
    stage.reset_gradients()
    x, kwargs = _batch(args)

    def step() -> float:
        kw = dict(kwargs)
        if variant == "logitless":
            base.head.preprocess(kw)  # Fast-LLM's preprocess_batch calls it
        registered = collections.defaultdict(list)
        out, context = stage.forward(x.detach().requires_grad_(), kw, registered)
        stage.backward(torch.tensor(float("nan")), context)
        return float(out)

    return step, stage.reset_gradients


def _batch(args: argparse.Namespace):
    """The head's input and Fast-LLM's kwargs of one packed micro-batch of 8 documents."""
    import torch
    from fast_llm.layers.block.config import BlockKwargs
    from fast_llm.layers.language_model.config import LanguageModelKwargs as K

    g = torch.Generator().manual_seed(0)
    n = args.tokens
    labels = torch.randint(0, args.vocab, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.1] = -100
    doc = torch.arange(n) * 8 // n
    counts = torch.zeros(8).index_add_(0, doc, (labels >= 0).float())[doc]
    kw = {
        BlockKwargs.grad_output: 1.0,
        K.labels: [labels],
        K.num_labels_in_batch: [int((labels >= 0).sum())],
        K.num_documents_in_batch: 8,
        K.documents_seen: 100,
        K.advantages: [torch.randn(8, generator=g)[doc]],
        K.old_log_probabilities: [-12.0 + torch.randn(n, generator=g) * 0.1],
        K.label_counts: [counts],
        K.reward: [torch.randn(n, generator=g)],
        K.model_version: [torch.randint(90, 100, (n,), generator=g)],
    }
    return torch.randn(n, args.hidden, generator=g), kw


def _worker(variant: str, args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    if not args.compile:
        import torch._dynamo

        torch._dynamo.config.disable = True
    step, zero_grad = _head_step(variant, args)
    return time_step(variant, step, zero_grad, args.repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--loss", choices=("grpo", "label"), default="grpo")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument(
        "--no-compile", dest="compile", action="store_false",
        help="run Fast-LLM's torch.compile'd losses eagerly (its CPU compilation takes minutes)",
    )  # fmt: skip
    parser.add_argument("--csv", type=Path, default=None, help="append the rows to this CSV")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.stdout.write(RESULT + json.dumps(_worker(args.worker, args)) + "\n")
        return
    if not PEER.is_dir():
        raise SystemExit(f"the Fast-LLM peer is not at {PEER}")
    rows = []
    for variant in VARIANTS:
        print(f"running {variant} ...", file=sys.stderr, flush=True)
        rows.append(run_worker(__file__, RESULT, variant, sys.argv[1:]))
    _report(rows, args)


def _report(rows: list[dict], args: argparse.Namespace) -> None:
    base = rows[0]
    print(
        f"Fast-LLM head step, loss {args.loss}: {args.tokens} tokens, H={args.hidden} "
        f"V={args.vocab}, fp32, {args.threads} threads, {args.repeats} timed steps, "
        f"Fast-LLM {'compiled' if args.compile else 'eager'}"
    )
    print(f"{'head type':<10} {'median s':>9} {'peak extra MB':>14} {'time/fast_llm':>13} "
          f"{'mem/fast_llm':>12} {'loss':>11}")  # fmt: skip
    for r in rows:
        print(
            f"{r['variant']:<10} {r['time_median_s']:>9.3f} {r['peak_extra_mb']:>14.1f} "
            f"{r['time_median_s'] / base['time_median_s']:>13.3f} "
            f"{r['peak_extra_mb'] / max(base['peak_extra_mb'], 1e-9):>12.3f} {r['loss']:>11.5g}"
        )
    print(f"grad floor MB (the head input's gradient): {_floor_mb(args):.1f}")
    if args.csv:
        _append_csv(args.csv, rows, args)


def _floor_mb(args: argparse.Namespace) -> float:
    return args.tokens * args.hidden * 4 / 2**20


HEADER = [
    "timestamp", "variant", "loss", "tokens", "hidden", "vocab", "dtype", "threads", "repeats",
    "fast_llm_compiled", "time_median_s", "peak_extra_mb", "grad_floor_mb", "hwm_mb", "machine",
    "torch",
]  # fmt: skip


def _append_csv(path: Path, rows: list[dict], args: argparse.Namespace) -> None:
    import torch

    stamp = dt.datetime.now().isoformat(timespec="seconds")
    append_rows(path, HEADER, [
        [
            stamp, r["variant"], args.loss, args.tokens, args.hidden, args.vocab,
            "float32", args.threads, args.repeats, args.compile,
            f"{r['time_median_s']:.4f}", f"{r['peak_extra_mb']:.1f}",
            f"{_floor_mb(args):.1f}", f"{r['hwm_mb']:.1f}",
            platform.processor() or platform.machine(), torch.__version__,
        ]
        for r in rows
    ])  # fmt: skip


if __name__ == "__main__":
    main()
