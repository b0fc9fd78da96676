"""loss_normalizer over real process groups: gloo processes on this machine.

Each rank holds different micro-batches of one optimizer step. With the all-reduced counts,
the losses summed over ranks and micro-batches must equal the whole step's loss computed in one
process, and so must the gradients: by hand, under real DDP (whose gradient average
``loss_scale`` undoes), and on a 2 x 2 mesh of data- and context-parallel ranks.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from _dist import spawn
from _host_reads import no_host_reads

from logitless import PolicyLossConfig, loss_normalizer, parallel, policy_loss

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


def _manual_results(rank: int) -> list:
    d, shards = _step()
    my_rows = shards[rank]
    results = []
    for cfg in CONFIGS:
        norm = loss_normalizer([d["mask"][r] for r in my_rows], process_group=dist.group.WORLD)
        logp = d["logp"].clone().requires_grad_()
        total = sum(_loss(d, r, cfg, logp, norm) for r in my_rows)
        total.backward()
        results.append((total.detach(), logp.grad, norm.num_tokens, norm.num_sequences))
    return results


def _worker(rank: int, world: int) -> dict:
    # DDP's reducer sits in a reference cycle: the harness frees it (and the gloo work it
    # holds) after both ranks are done, while the interpreter is alive (tests/_dist.py)
    return {"manual": _manual_results(rank), "ddp": _ddp_results(rank)}


@pytest.fixture(scope="module")
def two_ranks() -> list:
    """One 2-process run for both tests below (each spawn costs seconds)."""
    return spawn(_worker, WORLD, threads=1)


def test_normalizer_all_reduce_matches_single_process(two_ranks):
    per_rank = [r["manual"] for r in two_ranks]
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


# ---------------------------------------------------------------------------------------------
# Real DDP (gloo, CPU): gradient averaging undone with loss_scale. A toy "LM head" (one linear
# layer over per-token features, float64) makes every token independent, so a stream can be
# split across context-parallel ranks too.

F, V = 6, 11
DOC_LENGTHS = [7, 3, 6, 2, 9, 5]
DDP_CONFIGS = [
    PolicyLossConfig(aggregation="token_mean", kl_coef=0.1, clip_high=0.28),
    PolicyLossConfig(ratio_level="sequence", aggregation="seq_mean_token_mean", entropy_coef=0.01),
    PolicyLossConfig(
        surrogate="cispo",
        aggregation="seq_mean_token_sum_norm",
        norm_length=10,
        ratio_seq_mask="geometric",
        ratio_seq_mask_range=(0.9, 1.1),
        kl_coef=0.05,
    ),
]


def _head_init() -> torch.Tensor:
    return torch.randn(V, F, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _documents():
    """Per-document token features, labels, mask, old/ref log-probs, one advantage each."""
    g = torch.Generator().manual_seed(3)
    w0 = _head_init()
    docs = []
    for n in DOC_LENGTHS:
        x = torch.randn(n, F, generator=g, dtype=torch.float64)
        y = torch.randint(0, V, (n,), generator=g)
        lp0 = torch.log_softmax(x @ w0.T, -1).gather(1, y[:, None]).squeeze(1)
        mask = torch.ones(n, dtype=torch.bool)
        mask[0] = False  # the prompt token
        docs.append(
            dict(
                x=x,
                y=y,
                mask=mask,
                old=lp0 + 0.2 * torch.randn(n, generator=g, dtype=torch.float64),
                ref=lp0 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64),
                adv=torch.randn((), generator=g, dtype=torch.float64),
            )
        )
    return docs


def _pack(docs, indices, multiple=1):
    """One packed micro-batch of the given documents (ids 0..k-1), padded to ``multiple``."""
    parts = [docs[i] for i in indices]
    ids = torch.cat([torch.full((len(p["y"]),), k) for k, p in enumerate(parts)])
    mb = {k: torch.cat([p[k] for p in parts]) for k in ("x", "y", "mask", "old", "ref")}
    mb["ids"] = ids
    mb["adv"] = torch.stack([p["adv"] for p in parts])
    pad = -len(ids) % multiple
    if pad:
        fill = {"x": 0.0, "y": 0, "mask": False, "old": 0.0, "ref": 0.0, "ids": -1}
        for k, v in fill.items():
            mb[k] = torch.cat([mb[k], mb[k].new_full((pad, *mb[k].shape[1:]), v)])
    return mb


def _mb_loss(model, mb, cfg, normalizer=None, context_group=None, capturable=False):
    logp = torch.log_softmax(model(mb["x"]), -1)  # [N, V]
    lp = logp.gather(1, mb["y"][:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    return policy_loss(
        lp,
        mb["old"],
        mb["adv"],
        mb["mask"],
        config=cfg,
        document_ids=mb["ids"],
        ref_logprobs=mb["ref"],
        entropy=ent,
        normalizer=normalizer,
        context_group=context_group,
        capturable=capturable,
    )


def _model():
    model = torch.nn.Linear(F, V, bias=False, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(_head_init())
    return model


def _whole_batch_grads():
    docs = _documents()
    whole = _pack(docs, range(len(docs)))
    out = []
    for cfg in DDP_CONFIGS:
        model = _model()
        loss, _ = _mb_loss(model, whole, cfg)
        loss.backward()
        out.append((loss.detach(), model.weight.grad.clone()))
    return out


def _accumulate(model, micro_batches, cfg, normalizer, context_group=None, capturable=False):
    """Gradient accumulation over micro-batches, then the data-parallel gradient reduction.

    ``model`` is a DDP module (no_sync on all but the last micro-batch; DDP averages in the
    last backward), or a plain module with ``average_over``: a manual all-reduce average over
    the world after the last backward, which is what DDP does (it spares the 4-process test
    DDP's multi-second import of torch._dynamo in every process).
    """
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    model.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for i, mb in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last or not ddp else model.no_sync():
            loss, metrics = _mb_loss(model, mb, cfg, normalizer, context_group, capturable)
            loss.backward()
        loss_sum = loss_sum + metrics["loss"]
    weight = model.module.weight if ddp else model.weight
    grad = weight.grad.clone()
    if not ddp:
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        grad /= dist.get_world_size()
    return loss_sum, grad


def _ddp_results(rank: int) -> list:
    docs = _documents()
    # uneven: rank 0 has two micro-batches (1 and 2 documents), rank 1 one of 3 documents
    plan = {0: [[0], [1, 2]], 1: [[3, 4, 5]]}[rank]
    mbs = [_pack(docs, ix) for ix in plan]
    masks, ids = [mb["mask"] for mb in mbs], [mb["ids"] for mb in mbs]
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    results = []
    for cfg in DDP_CONFIGS:
        norm = loss_normalizer(masks, ids, process_group=dist.group.WORLD, loss_scale=WORLD)
        results.append(_accumulate(ddp, mbs, cfg, norm))
    # without loss_scale DDP's average divides the gradient by the world size
    norm = loss_normalizer(masks, ids, process_group=dist.group.WORLD)
    results.append(_accumulate(ddp, mbs, DDP_CONFIGS[-1], norm))
    return results


def test_ddp_with_loss_scale_gives_the_whole_batch_gradient(two_ranks):
    per_rank = [r["ddp"] for r in two_ranks]
    whole = _whole_batch_grads()
    for i, (loss, grad) in enumerate(whole):
        summed = sum(r[i][0] for r in per_rank)  # unscaled loss metrics sum to the step's loss
        torch.testing.assert_close(summed, loss, rtol=1e-12, atol=1e-12)
        for r in per_rank:  # DDP leaves the same (averaged) gradient on every rank
            torch.testing.assert_close(r[i][1], grad, rtol=1e-12, atol=1e-12)
    unscaled = per_rank[0][len(DDP_CONFIGS)][1]
    torch.testing.assert_close(unscaled * WORLD, whole[-1][1], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(unscaled, whole[-1][1])


# ---------------------------------------------------------------------------------------------
# 4 ranks: 2 data-parallel replicas x 2 context-parallel ranks, gradients averaged over all four
# (as DDP or FSDP over a mesh that folds the context-parallel ranks in would)


def _mesh_worker(rank: int, world: int, capturable: bool) -> list:
    dp_rank, cp_rank = divmod(rank, 2)
    # every rank creates every group, in the same order
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    cp_group, dp_group = cp_groups[dp_rank], dp_groups[cp_rank]
    docs = _documents()
    # replica 0: two micro-batches, replica 1: one; the zigzag split cuts documents
    plan = {0: [[0, 1], [2]], 1: [[3, 4, 5]]}[dp_rank]
    mbs = [
        {
            k: v if k == "adv" else parallel.context_parallel_split(v, cp_rank, 2, layout="zigzag")
            for k, v in _pack(docs, ix, multiple=4).items()
        }
        for ix in plan
    ]
    model = _model()
    results = []
    for cfg in DDP_CONFIGS:
        # capturable: no host read in the normalizer and the losses (tests/_host_reads.py)
        with no_host_reads() if capturable else contextlib.nullcontext():
            norm = loss_normalizer(
                [mb["mask"] for mb in mbs],
                [mb["ids"] for mb in mbs],
                process_group=dp_group,
                context_group=cp_group,
                loss_scale=world,  # the gradient average runs over all 4 ranks
                capturable=capturable,
            )
            loss, grad = _accumulate(model, mbs, cfg, norm, cp_group, capturable)
        results.append((loss, grad, norm.num_tokens, norm.num_sequences))
    return results


@pytest.mark.parametrize("capturable", [False, True], ids=["default", "capturable"])
def test_data_and_context_parallel_gives_the_whole_batch_gradient(capturable):
    per_rank = spawn(_mesh_worker, 4, capturable, threads=1)
    whole = _whole_batch_grads()
    valid_tokens = sum(len(n) - 1 for n in (range(k) for k in DOC_LENGTHS))
    for i, (loss, grad) in enumerate(whole):
        # metrics["loss"] is the context group's loss: sum over the replicas (ranks 0 and 2)
        torch.testing.assert_close(
            per_rank[0][i][0] + per_rank[2][i][0], loss, rtol=1e-12, atol=1e-12
        )
        for r in per_rank:
            torch.testing.assert_close(r[i][1], grad, rtol=1e-12, atol=1e-12)
            assert (float(r[i][2]), float(r[i][3])) == (valid_tokens, len(DOC_LENGTHS))
