"""One GRPO step on a tiny vision-language model: the model's own logits path vs logitless.

    python benchmarks/hf_vlm_step.py               # Qwen2-VL, Qwen's vocabulary, 4 x 512 tokens
    python benchmarks/hf_vlm_step.py --vocab 512 --seq 64 --repeats 1   # a smoke run

A tiny random Qwen2-VL (text: hidden ``--hidden``, 2 layers; vision tower: 2 blocks) with
Qwen's vocabulary V = 151936, one micro-batch of ``--batch`` rows x ``--seq`` tokens, each
row's prompt holding one image (a 16 x 16 patch grid: 64 image tokens after the 2 x 2 merge)
and the last ``--seq - --prompt`` tokens the response; fp32. One step is the DAPO loss
(token mean, clip 0.2 / 0.28) on the response tokens and ``backward()`` through the language
model, the projector and the vision tower:

- ``logits``: ``model(input_ids, pixel_values=..., image_grid_thw=..., mm_token_type_ids=...,
  attention_mask=...).logits`` -> float -> log_softmax -> gather -> ``logitless.policy_loss``
  (what a trainer that reads the model's logits runs);
- ``logitless``: ``hf.causal_lm_policy_loss`` on the same inputs (the backbone with the image
  inputs, then the fused head + loss on the response rows only).

Each variant runs in a fresh subprocess: build, one warm-up step, then ``--repeats`` timed
steps; memory is the RSS high-water mark over the timed steps minus the RSS before them
(benchmarks/_step_timing.py), and the process's absolute high-water mark.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from _step_timing import run_worker, time_step

RESULT = "HF_VLM_STEP_RESULT "
VARIANTS = ("logits", "logitless")
IMAGE, VISION_START = 3, 4  # token ids of the image placeholder and the vision start


def _model(args: argparse.Namespace):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2VLConfig(
        text_config=dict(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            rope_scaling=dict(type="mrope", mrope_section=[2, 3, 3]),
        ),
        vision_config=dict(
            depth=2, embed_dim=64, hidden_size=args.hidden, num_heads=4, mlp_ratio=2,
            patch_size=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
        ),
        image_token_id=IMAGE, video_token_id=5, vision_start_token_id=VISION_START,
    )  # fmt: skip
    return transformers.Qwen2VLForConditionalGeneration(config).train()


def _inputs(args: argparse.Namespace):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(8, args.vocab, (args.batch, args.seq), generator=g)
    ids[:, 1] = VISION_START
    ids[:, 2 : 2 + 64] = IMAGE  # one 16 x 16 patch image per row: 64 tokens after the merge
    grid = torch.tensor([[1, 16, 16]] * args.batch)
    response = torch.zeros(args.batch, args.seq, dtype=torch.bool)
    response[:, args.prompt :] = True
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(int(grid.prod(-1).sum()), 24, generator=g),
        "image_grid_thw": grid,
        "mm_token_type_ids": (ids == IMAGE).int(),
        "response_mask": response,
        "advantages": torch.randn(args.batch, generator=g),
    }


def _worker(variant: str, args: argparse.Namespace) -> dict:
    import torch

    import logitless
    from logitless.integrations import hf

    torch.set_num_threads(args.threads)
    model = _model(args)
    inputs = _inputs(args)
    config = logitless.PolicyLossConfig(clip_high=0.28, aggregation="token_mean")
    model_kw = {k: inputs[k] for k in ("attention_mask", "pixel_values", "image_grid_thw")}
    model_kw["mm_token_type_ids"] = inputs["mm_token_type_ids"]
    ids, response, advantages = inputs["input_ids"], inputs["response_mask"], inputs["advantages"]
    labels = hf.causal_lm_labels(ids, attention_mask=model_kw["attention_mask"],
                                 response_mask=response)  # fmt: skip
    with torch.no_grad():  # the behaviour policy: the same weights (on-policy)
        old = hf.causal_lm_logprobs(model, ids, response_mask=response, **model_kw).logprobs

    def step() -> float:
        model.zero_grad(set_to_none=True)
        if variant == "logitless":
            loss, _ = hf.causal_lm_policy_loss(
                model, ids, old, advantages, config=config, response_mask=response, **model_kw
            )
        else:
            logits = model(ids, use_cache=False, **model_kw).logits.float()
            logp = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
            valid = labels != -100
            loss, _ = logitless.policy_loss(
                torch.where(valid, logp, 0.0), old, advantages, valid, config=config
            )
        loss.backward()
        return float(loss)

    return time_step(variant, step, lambda: model.zero_grad(set_to_none=True), args.repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="rows in the micro-batch")
    parser.add_argument("--seq", type=int, default=512, help="tokens per row")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prompt < 70 or args.prompt >= args.seq:
        parser.error("--prompt must hold the image (>= 70 tokens) and leave a response")
    if args.worker:
        sys.stdout.write(RESULT + json.dumps(_worker(args.worker, args)) + "\n")
        return
    rows = []
    for variant in VARIANTS:
        print(f"running {variant} ...", file=sys.stderr, flush=True)
        rows.append(run_worker(__file__, RESULT, variant, sys.argv[1:]))
    base = rows[0]
    print(
        f"Qwen2-VL V={args.vocab} H={args.hidden}, {args.batch} x {args.seq} tokens (prompt "
        f"{args.prompt} with a 64-token image), DAPO, fp32, {args.threads} threads, "
        f"{args.repeats} timed steps"
    )
    print(
        f"{'path':<10} {'median s':>9} {'peak extra MB':>14} {'RSS HWM MB':>11} "
        f"{'time/logits':>12} {'mem/logits':>11} {'loss':>11}"
    )
    for r in rows:
        print(
            f"{r['variant']:<10} {r['time_median_s']:>9.3f} {r['peak_extra_mb']:>14.1f} "
            f"{r['hwm_mb']:>11.1f} {r['time_median_s'] / base['time_median_s']:>12.2f} "
            f"{r['peak_extra_mb'] / base['peak_extra_mb']:>11.3f} {r['loss']:>11.4g}"
        )


if __name__ == "__main__":
    main()
