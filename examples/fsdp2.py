"""The fused policy loss under FSDP2 with tied embeddings, on 2 processes, against one process.

    python examples/fsdp2.py                    # spawns 2 gloo ranks on the CPU (seconds)

A tiny decoder (tied embedding, one block, a ``PolicyLossHead`` on the embedding's weight) is
sharded with ``fully_shard``; each rank trains on its own sequences, normalized by the step's
global counts, and the gathered gradient equals one process's. The lines between the ``recipe``
markers are the README's FSDP2 recipe (tests/test_docs.py checks that they match).
"""

from __future__ import annotations

import copy
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import logitless


class TinyDecoder(nn.Module):
    """Embedding, one block, a head tied to the embedding (stands in for a real model)."""

    def __init__(self, vocab: int, dim: int, config: logitless.PolicyLossConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(dim, dim), nn.Tanh())])
        self.head = logitless.PolicyLossHead(self.embed_tokens, config=config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return hidden  # [B, T, H]


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 97, (4, 10), generator=g)
    labels = torch.cat([input_ids[:, 1:], torch.full((4, 1), -100)], dim=1)
    labels[:, :3] = -100  # prompts
    old_logprobs = torch.where(labels != -100, -4.6 + 0.1 * torch.randn(4, 10, generator=g), 0.0)
    return input_ids, labels, old_logprobs, torch.randn(4, generator=g)


def main(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        config = logitless.PolicyLossConfig(clip_low=0.2, clip_high=0.28)
        model = TinyDecoder(97, 16, config)
        single = copy.deepcopy(model)  # the one-process reference
        ids, labels, old, adv = batch()
        mine = slice(2 * rank, 2 * rank + 2)  # each rank: its own two sequences
        input_ids, labels_r = ids[mine], labels[mine]
        old_logprobs, advantages = old[mine], adv[mine]
        # [recipe]
        # fp32 here; on GPUs: MixedPrecisionPolicy(param_dtype=torch.bfloat16, ...)
        keep_inputs = MixedPrecisionPolicy(cast_forward_inputs=False)  # loss inputs stay fp32
        for block in model.blocks:
            fully_shard(block)
        fully_shard([model.embed_tokens, model.head], mp_policy=keep_inputs)  # one group: tied
        fully_shard(model, mp_policy=keep_inputs)

        # Global counts of the step; loss_scale undoes FSDP2's averaging over the ranks.
        norm = logitless.loss_normalizer(
            [labels_r != -100], process_group=dist.group.WORLD, loss_scale=world
        )
        hidden = model(input_ids)  # the backbone: [B, T, H]
        loss, metrics = model.head(hidden, labels_r, old_logprobs, advantages, normalizer=norm)
        loss.backward()  # sharded gradients
        # [/recipe]
        ref, _ = single.head(single(ids), labels, old, adv)
        ref.backward()
        ref = ref.detach()
        shares = loss.detach().clone() / world
        dist.all_reduce(shares)
        torch.testing.assert_close(shares, ref.detach(), rtol=1e-5, atol=1e-6)
        grad = model.embed_tokens.weight.grad.full_tensor()
        torch.testing.assert_close(grad, single.embed_tokens.weight.grad, rtol=1e-4, atol=1e-6)
        if rank == 0:
            print(f"FSDP2 over {world} ranks: loss {ref.item():.6f}, gradients = one process")
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
