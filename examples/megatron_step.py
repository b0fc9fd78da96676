"""Megatron's schedule drives logitless's fused policy loss: a GPTModel on 2 tensor-parallel ranks.

    python examples/megatron_step.py     # 2 gloo ranks on the CPU; needs megatron-core 0.16

A tiny megatron-core GPTModel, its vocabulary split over both ranks, trains one step of two
micro-batches through ``get_forward_backward_func()``. The loss comes from
``logitless.integrations.megatron.policy_loss_step``, never the logits. The step's gradients
are checked against the composed ``policy_loss`` on Megatron's own logits
(``vocab_parallel_cross_entropy``) with the same step normalizer. The lines between the
``recipe`` markers are docs/megatron.md's recipe (tests/test_docs.py checks that they match;
tests/test_megatron.py runs them under sequence parallelism and the per-token loss mode too).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import types
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import logitless
from logitless.integrations import megatron as lm
from logitless.integrations.seam import LossInputs

config = logitless.PolicyLossConfig(clip_high=0.28, aggregation="seq_mean_token_mean")


# [recipe]
def train_step(model, micro_batches, per_token=False):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    # The tokens each micro-batch trains on and its documents (read from packed_seq_params),
    # on every pipeline stage (the last one scores them):
    layouts = [
        lm.token_layout(model, mb["labels"], mb["loss_mask"], mb["packed_seq_params"])
        for mb in micro_batches
    ]
    normalizer = lm.step_normalizer(  # collective over the DP and CP groups
        [mask for mask, _ in layouts],
        [doc for _, doc in layouts],
        calculate_per_token_loss=per_token,
    )

    def forward_step(data_iterator, model):
        mb = next(data_iterator)  # this rank's shard: tokens, labels, loss_mask [B, S/cp]
        inputs = LossInputs(
            old_logprobs=mb["old_logprobs"],  # [B, S/cp], aligned like the labels
            advantages=mb["advantages"],  # [B, S/cp], or [D]: one per packed sequence
            document_ids=mb.get("document_ids"),  # None: the packed sequences
            ref_logprobs=mb.get("ref_logprobs"),
        )
        return lm.policy_loss_step(
            model, mb["tokens"], mb["position_ids"], mb["attention_mask"], mb["labels"],
            inputs,
            config=config,
            normalizer=normalizer,
            num_microbatches=len(micro_batches),
            calculate_per_token_loss=per_token,
            loss_mask=mb["loss_mask"],
            packed_seq_params=mb["packed_seq_params"],
        )  # fmt: skip

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=model,
        num_microbatches=len(micro_batches),
        seq_length=micro_batches[0]["tokens"].shape[1],
        micro_batch_size=micro_batches[0]["tokens"].shape[0],
        forward_only=False,
    )


# [/recipe]


def megatron_on_cpu() -> None:
    """megatron-core 0.16 puts a few buffers on the current CUDA device and forks CUDA RNG
    states around dropout; on a CPU-only machine, point those at the CPU. Not for GPUs."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as megatron_random

    torch.cuda.current_device = lambda: "cpu"

    class Tracker:  # the RNG tracker's fork (dropout regions) as a no-op
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

        def add(self, *args, **kwargs):
            pass

    megatron_random._CUDA_RNG_STATE_TRACKER = Tracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    cpu_torch = types.ModuleType("torch")  # the schedule's token counter: device="cuda"
    cpu_torch.__dict__.update(vars(torch))
    cpu_torch.zeros = lambda *args, device=None, **kwargs: torch.zeros(*args, **kwargs)
    schedules.torch = cpu_torch


def micro_batch(seed: int, vocab: int, batch: int = 2, seq: int = 16) -> dict:
    """Two rollouts of ``seq`` tokens: labels next-token aligned, a 4-token prompt masked."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    loss_mask = torch.ones(batch, seq)
    loss_mask[:, :4] = 0
    loss_mask[:, -1] = 0
    return dict(
        tokens=tokens,
        position_ids=torch.arange(seq).expand(batch, seq),
        attention_mask=torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1),  # True: masked
        labels=torch.cat([tokens[:, 1:], tokens[:, :1]], 1),
        loss_mask=loss_mask,
        packed_seq_params=None,
        old_logprobs=-7.0 + 0.1 * torch.randn(batch, seq, generator=g),
        advantages=torch.randn(batch, 1, generator=g).expand(batch, seq),
        document_ids=torch.arange(batch)[:, None].expand(batch, seq),
    )


def composed_grads(model, micro_batches) -> dict[str, torch.Tensor]:
    """The same step from Megatron's logits: vocab_parallel_cross_entropy, then policy_loss."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    head = lm.megatron_head(model)
    masks = [lm.token_layout(head, mb["labels"], mb["loss_mask"])[0] for mb in micro_batches]
    norm = lm.step_normalizer(masks, [mb["document_ids"] for mb in micro_batches])
    for mb, mask in zip(micro_batches, masks, strict=True):
        logits = model(mb["tokens"], mb["position_ids"], mb["attention_mask"])  # [B, S, V/tp]
        logits = logits.transpose(0, 1).contiguous()
        logp = -vocab_parallel_cross_entropy(logits, mb["labels"].T.contiguous()).T
        loss, _ = logitless.policy_loss(
            torch.where(mask, logp, 0.0), mb["old_logprobs"], mb["advantages"], mask,
            config=config, document_ids=mb["document_ids"], normalizer=norm,
        )  # fmt: skip
        loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def main(rank: int, world: int, init_file: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig

        megatron_on_cpu()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        vocab = 1000
        model_config = TransformerConfig(
            num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
            tensor_model_parallel_size=world, hidden_dropout=0.0, attention_dropout=0.0,
        )  # fmt: skip
        torch.manual_seed(0)
        model = GPTModel(
            model_config, get_gpt_layer_local_spec(), vocab_size=vocab, max_sequence_length=64
        )
        micro_batches = [micro_batch(seed, vocab) for seed in (1, 2)]
        train_step(model, micro_batches)
        ours = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        theirs = composed_grads(model, micro_batches)
        for name, grad in theirs.items():
            torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-6, msg=name)
        if rank == 0:
            print(f"{len(ours)} parameters: the schedule's gradients match Megatron's logits path")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(main, args=(2, os.path.join(tmp, "init")), nprocs=2, join=True)
