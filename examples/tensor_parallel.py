"""A vocab-parallel (tensor-parallel) head on 2 processes, checked against one process.

    python examples/tensor_parallel.py          # spawns 2 gloo ranks on the CPU (a few seconds)

Each rank holds rows [vocab_start, vocab_end) of the head weight; labels stay global ids. Every
rank gets the same log-probs and entropy; its shard of the weight gets its own gradient and the
hidden-state gradient is summed over the group. The lines between the ``recipe`` markers are the
README's tensor-parallel recipe (tests/test_docs.py checks that they match).
"""

from __future__ import annotations

import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import logitless


def main(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # every rank builds the same full problem
        vocab_size, dim, rows, length = 1000, 32, 3, 4
        full_weight = torch.randn(vocab_size, dim) * 0.1
        hidden = torch.randn(rows, length, dim, requires_grad=True)
        labels = torch.randint(0, vocab_size, (rows, length))
        labels[:, 0] = -100  # prompt tokens
        old = torch.where(labels != -100, -6.9, 0.0)
        advantages = torch.randn(rows)
        config = logitless.PolicyLossConfig(clip_low=0.2, clip_high=0.28)
        tp_group = dist.group.WORLD
        # [recipe]
        vp = logitless.VocabParallel.even(vocab_size, tp_group)  # collective; every rank calls it
        weight = vp.shard(full_weight).clone().requires_grad_()  # this rank's [V / tp, H] rows
        out = logitless.linear_logprobs(
            hidden, weight, labels, vocab_parallel=vp, with_entropy=True
        )
        loss, metrics = logitless.fused_policy_loss(
            hidden, weight, labels, old, advantages, config=config, vocab_parallel=vp
        )
        loss.backward()  # weight.grad: this shard's rows; hidden.grad: summed over tp_group
        # [/recipe]
        full = full_weight.clone().requires_grad_()
        ref = logitless.linear_logprobs(hidden.detach(), full, labels, with_entropy=True)
        torch.testing.assert_close(out.logprobs, ref.logprobs)
        torch.testing.assert_close(out.entropy, ref.entropy)
        ref_loss, _ = logitless.fused_policy_loss(
            hidden.detach(), full, labels, old, advantages, config=config
        )
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(weight.grad, full.grad[vp.vocab_start : vp.vocab_end])
        if rank == 0:
            print(f"tensor parallel over {world} ranks: loss {loss.item():.6f} = one process")
    finally:
        # Free what holds gloo work (FSDP2's and DDP's state, in reference cycles) while every
        # rank is alive, then leave together: destroying the group under live work aborts a
        # rank at exit now and then ("terminate called without an active exception").
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(main, args=(2, os.path.join(tmp, "init")), nprocs=2, join=True)
