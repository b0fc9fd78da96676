"""Data parallelism with step-level normalization: 2 DDP ranks, 2 micro-batches each.

    python examples/data_parallel.py            # spawns 2 gloo ranks on the CPU (seconds)

Every rank counts the whole step's tokens and sequences once (``loss_normalizer`` with the
data-parallel group), so the micro-batch losses of every rank *sum* to the whole step's loss;
``loss_scale`` undoes DDP's averaging. The gradient after the last micro-batch equals one process
computing the whole step at once. The lines between the ``recipe`` markers are the README's
data-parallel recipe (tests/test_docs.py checks that they match).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import logitless

V, H = 50, 8


def micro_batch(seed: int) -> dict:
    """Two sequences of 6 tokens: inputs, labels (prompt ignored), old log-probs, advantages."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (2, 6), generator=g)
    labels[:, :2] = -100
    return {
        "x": torch.randn(2, 6, H, generator=g),
        "labels": labels,
        "old": torch.where(labels != -100, -3.9 + 0.1 * torch.randn(2, 6, generator=g), 0.0),
        "adv": torch.randn(2, generator=g),
    }


def main(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(H, H)  # stands in for the backbone
        head_weight = torch.nn.Parameter(torch.randn(V, H) * 0.3)
        reference = copy.deepcopy(model), head_weight.detach().clone().requires_grad_()
        ddp_model = DistributedDataParallel(model)
        config = logitless.PolicyLossConfig(aggregation="seq_mean_token_mean")
        everything = [micro_batch(s) for s in range(2 * world)]
        micro_batches = everything[2 * rank : 2 * rank + 2]  # this rank's share of the step
        dp_group = dist.group.WORLD
        # [recipe]
        # every rank: the step's global counts, once; loss_scale undoes DDP's gradient averaging
        norm = logitless.loss_normalizer(
            [mb["labels"] != -100 for mb in micro_batches],
            process_group=dp_group,
            loss_scale=dist.get_world_size(dp_group),
        )
        for i, mb in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else ddp_model.no_sync():
                out = logitless.linear_logprobs(ddp_model(mb["x"]), head_weight, mb["labels"])
                loss, metrics = logitless.policy_loss(
                    out.logprobs, mb["old"], mb["adv"], mb["labels"] != -100,
                    config=config, normalizer=norm,
                )  # fmt: skip
                loss.backward()  # after the last one: the whole step's gradient on every rank
        # [/recipe]
        dist.all_reduce(head_weight.grad)  # the head weight is outside DDP here: sum it
        whole = {k: torch.cat([mb[k] for mb in everything]) for k in everything[0]}
        ref_model, ref_weight = reference
        out = logitless.linear_logprobs(ref_model(whole["x"]), ref_weight, whole["labels"])
        ref_loss, _ = logitless.policy_loss(
            out.logprobs, whole["old"], whole["adv"], whole["labels"] != -100, config=config
        )
        ref_loss.backward()
        torch.testing.assert_close(model.weight.grad, ref_model.weight.grad)
        torch.testing.assert_close(head_weight.grad / world, ref_weight.grad)
        if rank == 0:
            print(f"data parallel over {world} ranks: gradients = one process (whole step)")
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
