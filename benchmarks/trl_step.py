"""One GRPO loss step in TRL, stock ``GRPOTrainer`` vs ``LogitlessGRPOTrainer``, side by side.

    python benchmarks/trl_step.py            # the CPU shape of TRL's own tests
    python benchmarks/trl_step.py --hidden 64 --repeats 5 --csv bench-results/trl_step.csv

The shape is that of TRL's CPU tests: a tiny Qwen2 (TRL's tiny-model recipe: hidden 8, 2
layers, 4 heads, 2 KV heads, MLP 32) with Qwen's vocabulary V = 151936, one micro-batch of
8 sequences x 512 tokens (``--prompt`` prompt tokens + the rest completion), fp32. One step is
``trainer.compute_loss(model, inputs)`` and ``loss.backward()`` on the same batch: the part
of a training step the two trainers compute differently (generation and scoring are TRL's in
both). Defaults: TRL's ``loss_type="dapo"``, on-policy (no old log-probs), no KL.

Each trainer runs in a fresh subprocess: build, one warm-up step, then ``--repeats`` timed
steps. Memory is the RSS high-water mark over the timed steps (reset through
/proc/self/clear_refs) minus the RSS before them, as ``logitless bench`` measures it; the
table also gives the process's absolute high-water mark. On CPU, TRL's fused head scores every
position of the batch through ``[4096, 32768]`` fp32 tiles (its Triton path, which keeps only
the completion rows, needs a GPU); logitless keeps one ``[chunk, V]`` tile of the completion
rows within a 256 MiB budget.
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

RESULT = "TRL_STEP_RESULT "
VARIANTS = ("trl", "logitless")


def _trainer(variant: str, args: argparse.Namespace):
    import tempfile

    import torch
    import transformers
    import trl
    from datasets import Dataset

    from logitless.integrations.trl import LogitlessGRPOTrainer

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    model = transformers.Qwen2ForCausalLM(config)
    grpo = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=args.batch,
        num_generations=args.batch,
        max_completion_length=args.seq - args.prompt,
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to=[],
        loss_type=args.loss_type,
    )
    cls = trl.GRPOTrainer if variant == "trl" else LogitlessGRPOTrainer
    trainer = cls(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=grpo,
        train_dataset=Dataset.from_dict({"prompt": ["<bos>"] * args.batch}),
        processing_class=tokenizer(),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def tokenizer():
    """The trainers' processing class: a word-level tokenizer of <pad>, <eos>, <bos> (the
    batches are made of token ids)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )


def grpo_inputs(vocab: int, batch: int, prompt: int, completion: int, *, seed: int, items=None):
    """A GRPO micro-batch as TRL's ``compute_loss`` takes it: random prompt and completion ids,
    full masks, random advantages; ``num_items_in_batch`` = ``items`` (default: this batch's
    completion tokens)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    completion_mask = torch.ones(batch, completion, dtype=torch.long)
    return {
        "prompt_ids": torch.randint(3, vocab, (batch, prompt), generator=g),
        "prompt_mask": torch.ones(batch, prompt, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (batch, completion), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.randn(batch, generator=g),
        "num_items_in_batch": completion_mask.sum() if items is None else torch.tensor(items),
    }


def _worker(variant: str, args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    trainer = _trainer(variant, args)
    inputs = grpo_inputs(args.vocab, args.batch, args.prompt, args.seq - args.prompt, seed=1)

    def step() -> float:
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, dict(inputs))
        loss.backward()
        return float(loss)

    return time_step(variant, step, lambda: trainer.model.zero_grad(set_to_none=True), args.repeats)


def _run(variant: str, argv: list[str]) -> dict:
    return run_worker(__file__, RESULT, variant, argv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="sequences in the micro-batch")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence")
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--csv", type=Path, default=None, help="append the rows to this CSV")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.stdout.write(RESULT + json.dumps(_worker(args.worker, args)) + "\n")
        return
    argv = [a for a in sys.argv[1:]]
    rows = []
    for variant in VARIANTS:
        print(f"running {variant} ...", file=sys.stderr, flush=True)
        rows.append(_run(variant, argv))
    base = rows[0]
    print(
        f"V={args.vocab} H={args.hidden} {args.batch} x {args.seq} tokens "
        f"(prompt {args.prompt}), loss_type={args.loss_type}, fp32, {args.threads} threads, "
        f"{args.repeats} timed steps"
    )
    print(
        f"{'trainer':<10} {'median s':>9} {'peak extra MB':>14} {'RSS HWM MB':>11} "
        f"{'time/TRL':>9} {'mem/TRL':>8} {'loss':>11}"
    )
    for r in rows:
        print(
            f"{r['variant']:<10} {r['time_median_s']:>9.3f} {r['peak_extra_mb']:>14.1f} "
            f"{r['hwm_mb']:>11.1f} {r['time_median_s'] / base['time_median_s']:>9.2f} "
            f"{r['peak_extra_mb'] / base['peak_extra_mb']:>8.3f} {r['loss']:>11.4g}"
        )
    if args.csv:
        import torch
        import trl

        new = not args.csv.exists()
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(
                    [
                        "timestamp",
                        "variant",
                        "vocab",
                        "hidden",
                        "batch",
                        "seq",
                        "prompt",
                        "loss_type",
                        "threads",
                        "repeats",
                        "time_median_s",
                        "peak_extra_mb",
                        "hwm_mb",
                        "machine",
                        "torch",
                        "trl",
                    ]
                )
            stamp = dt.datetime.now().isoformat(timespec="seconds")
            for r in rows:
                w.writerow(
                    [
                        stamp,
                        r["variant"],
                        args.vocab,
                        args.hidden,
                        args.batch,
                        args.seq,
                        args.prompt,
                        args.loss_type,
                        args.threads,
                        args.repeats,
                        f"{r['time_median_s']:.4f}",
                        f"{r['peak_extra_mb']:.1f}",
                        f"{r['hwm_mb']:.1f}",
                        platform.processor() or platform.machine(),
                        torch.__version__,
                        trl.__version__,
                    ]
                )


if __name__ == "__main__":
    main()
