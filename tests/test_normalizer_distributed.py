"""loss_normalizer over a real process group: 2 gloo processes on this machine.

Each rank holds different micro-batches of one optimizer step. With the all-reduced counts,
the losses summed over ranks and micro-batches must equal the whole step's loss computed in one
process, and so must the gradients.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from logitless import PolicyLossConfig, loss_normalizer, policy_loss

WORLD = 2
CONFIGS = [
    PolicyLossConfig(aggregation="token_mean", kl_coef=0.1),
    PolicyLossConfig(aggregation="seq_mean_token_mean", entropy_coef=0.01),
    PolicyLossConfig(ratio_level="sequence", aggregation="seq_mean_token_sum"),
]


def _step():
    """One step: 5 sequences of ragged length as a [5, 9] batch; rank r gets some of the rows."""
    g = torch.Generator().manual_seed(0)
    b, t = 5, 9
    lengths = torch.tensor([9, 3, 6, 1, 7])
    mask = torch.arange(t)[None, :] < lengths[:, None]  # [B, T]
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = logp + 0.1 * torch.randn(b, t, generator=g, dtype=torch.float64)
    ref = logp + 0.1 * torch.randn(b, t, generator=g, dtype=torch.float64)
    ent = torch.rand(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    # rank 0: micro-batches rows [0] and [1, 2]; rank 1: rows [3, 4] (uneven)
    shards = {0: [[0], [1, 2]], 1: [[3, 4]]}
    return dict(logp=logp, old=old, ref=ref, ent=ent, adv=adv, mask=mask), shards


def _loss(d, rows, cfg, logp, normalizer=None):
    return policy_loss(
        logp[rows],
        d["old"][rows],
        d["adv"][rows],
        d["mask"][rows],
        config=cfg,
        ref_logprobs=d["ref"][rows],
        entropy=d["ent"][rows],
        normalizer=normalizer,
    )[0]


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        d, shards = _step()
        my_rows = shards[rank]
        results = []
        for cfg in CONFIGS:
            norm = loss_normalizer([d["mask"][r] for r in my_rows], process_group=dist.group.WORLD)
            logp = d["logp"].clone().requires_grad_()
            total = sum(_loss(d, r, cfg, logp, norm) for r in my_rows)
            total.backward()
            results.append((total.detach(), logp.grad, norm.num_tokens, norm.num_sequences))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_normalizer_all_reduce_matches_single_process():
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(init_file, tmp), nprocs=WORLD, join=True)
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]
    d, _ = _step()
    everything = list(range(5))
    for i, cfg in enumerate(CONFIGS):
        logp = d["logp"].clone().requires_grad_()
        whole = _loss(d, everything, cfg, logp)
        whole.backward()
        summed_loss = sum(r[i][0] for r in per_rank)
        summed_grad = sum(r[i][1] for r in per_rank)
        torch.testing.assert_close(summed_loss, whole.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(summed_grad, logp.grad, rtol=1e-12, atol=1e-12)
        for rank_result in per_rank:  # every rank sees the global counts
            assert float(rank_result[i][2]) == float(d["mask"].sum())
            assert float(rank_result[i][3]) == 5.0
