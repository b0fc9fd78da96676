"""Peak memory per rank of one GRPO step under DeepSpeed ZeRO-3: stock ``GRPOTrainer`` vs
``LogitlessGRPOTrainer``, 2 gloo ranks on DeepSpeed's CPU accelerator.

    flock /work/bench.lock python benchmarks/deepspeed_grpo_step.py --completion 512

A tiny Qwen2 (hidden 64, 1 layer) with Qwen's vocabulary V = 151936, fp32, every parameter
partitioned (``stage3_param_persistence_threshold=0``); each rank holds ``--batch`` sequences
of ``--prompt`` + ``--completion`` tokens. The trainer is prepared by accelerate as in
``train()`` (``accelerator.prepare`` of the model and optimizer: a ``DeepSpeedEngine``), then
one step is ``trainer.compute_loss(engine, inputs)`` and ``accelerator.backward(loss)`` (the
part of a training step the two trainers compute differently), after one warm-up step.
Memory is the rank's RSS high-water mark over the timed step (reset through
/proc/self/clear_refs) minus its RSS before it, as ``logitless bench`` measures it. Each
trainer runs in fresh processes of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

MARK = "DS_GRPO_RESULT "


def _rank(rank: int, world: int, variant: str, args: argparse.Namespace, tmp: str) -> None:
    os.environ.update(
        DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port),
    )  # fmt: skip
    os.environ.setdefault(
        "TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/logitless-ds")
    )  # the communication op DeepSpeed JIT-builds
    import time

    import deepspeed
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from trl_step import grpo_inputs, tokenizer

    from logitless.apps.memory import CpuPeakMemory, _proc_status_kib
    from logitless.integrations.trl import LogitlessGRPOTrainer

    torch.set_num_threads(args.threads)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=128,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
        eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    grpo = trl.GRPOConfig(
        output_dir=tmp, per_device_train_batch_size=args.batch, num_generations=args.batch,
        max_completion_length=args.completion, bf16=False, use_cpu=True, report_to=[],
        loss_type="dapo", optim="sgd", learning_rate=0.0, deepspeed=ds, save_strategy="no",
    )  # fmt: skip
    cls = trl.GRPOTrainer if variant == "trl" else LogitlessGRPOTrainer
    trainer = cls(
        model=transformers.Qwen2ForCausalLM(config),
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=grpo,
        train_dataset=Dataset.from_dict({"prompt": ["<bos>"] * args.batch}),
        processing_class=tokenizer(),
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    engine, _ = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
    assert type(engine).__name__ == "DeepSpeedEngine", type(engine)
    assert trainer.model.lm_head.weight.data.numel() == 0  # partitioned
    engine.train()
    trainer.current_gradient_accumulation_steps = 1

    b, c = args.batch, args.completion
    inputs = grpo_inputs(args.vocab, b, args.prompt, c, seed=1 + rank, items=b * c * world)

    def step() -> float:
        loss = trainer.compute_loss(engine, dict(inputs))
        trainer.accelerator.backward(loss)
        engine.zero_grad()
        return float(loss.detach())

    loss = step()  # warm-up
    probe = CpuPeakMemory()
    probe.start()
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    result = {
        "variant": variant, "rank": rank, "loss": loss, "seconds": seconds,
        "peak_extra_mb": probe.peak_extra_bytes() / 2**20,
        "hwm_mb": (_proc_status_kib("VmHWM") or 0) / 1024, "note": probe.note,
    }  # fmt: skip
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _variant(variant: str, args: argparse.Namespace) -> list[dict]:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_main, args=(2, variant, args, tmp), nprocs=2, join=True)
        out = []
        for r in range(2):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                out.append(json.load(f))
    del dist
    return out


def _main(rank: int, world: int, variant: str, args: argparse.Namespace, tmp: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=rank, world_size=world
    )
    try:
        _rank(rank, world, variant, args, tmp)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence")
    parser.add_argument("--completion", type=int, default=1024, help="completion tokens")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--port", type=int, default=29561)
    parser.add_argument("--variants", default="trl,logitless")
    args = parser.parse_args()
    rows = []
    for variant in args.variants.split(","):
        print(f"running {variant} ...", file=sys.stderr, flush=True)
        rows += _variant(variant, args)
    print(
        f"ZeRO-3, 2 ranks; per rank: V={args.vocab} H={args.hidden} {args.batch} x "
        f"({args.prompt} + {args.completion}) tokens = {args.batch * args.completion} "
        f"completion tokens, fp32, {args.threads} thread(s)"
    )
    print(f"{'trainer':<10} {'rank':>4} {'step s':>8} {'peak extra MB':>14} {'RSS HWM MB':>11}")
    for r in rows:
        print(
            f"{r['variant']:<10} {r['rank']:>4} {r['seconds']:>8.2f} "
            f"{r['peak_extra_mb']:>14.1f} {r['hwm_mb']:>11.1f}   loss {r['loss']:.6g}"
        )
    print(MARK + json.dumps(rows))


if __name__ == "__main__":
    main()
