"""fused_policy_loss under context parallelism, and under tensor x context parallelism.

A packed stream (a document spanning the rank boundary, padding, masked prompts) is split over
the context-parallel ranks (contiguous and zigzag); with tensor parallelism the head weight is
also split over the vocab. Each rank calls ``fused_policy_loss(..., context_group=...,
vocab_parallel=...)`` on its shard with a small chunk size, so ranks run different numbers of
chunks (a per-chunk collective would deadlock). Against the single-process fused loss on the
whole stream: the ranks' losses sum to it, the metrics equal it on every rank, the hidden
gradients (merged back into stream order) and the weight gradients (summed over the context
group, concatenated over the vocab shards) equal it.

The head's log-probs are fp32 whatever the input dtype, so sharded and whole runs differ by fp32
reassociation (a few ulps; measured <= 3e-7 relative); ``CLOSE`` allows ~100 ulps. A wiring
mistake (rank-local document statistics, a missing reduction, stale rows in a chunk) moves the
numbers by 1e-3 or more. The loss layer itself is checked at 1e-12 in test_losses_cp.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import spawn

from logitless import (
    PolicyLossConfig,
    VocabParallel,
    fused_policy_loss,
    linear_logprobs,
    next_token_labels,
    parallel,
    policy_loss,
)
from logitless.parallel import even_vocab_range

CLOSE = dict(rtol=1e-5, atol=1e-6)
N, H, V = 24, 16, 97
DOCS = [0] * 7 + [1] * 9 + [-1] * 2 + [2] * 4 + [-1] * 2  # doc 1 spans every split point
CONFIGS = {
    "dapo kl entropy": PolicyLossConfig(
        clip_low=0.2, clip_high=0.28, kl_coef=0.05, entropy_coef=0.01
    ),
    "gspo seq mean": PolicyLossConfig(ratio_level="sequence", aggregation="seq_mean_token_mean"),
    "ratio seq mask": PolicyLossConfig(ratio_seq_mask="geometric", ratio_seq_mask_range=(0.9, 1.1)),
    "gmpo": PolicyLossConfig(surrogate="gmpo", aggregation="seq_mean_token_sum"),
    "seq tis": PolicyLossConfig(mismatch_is="sequence", mismatch_is_cap=1.5, entropy_coef=0.02),
}


def _stream():
    """The whole stream, float64, identical in every process."""
    g = torch.Generator().manual_seed(7)
    doc = torch.tensor(DOCS)
    ids = torch.randint(0, V, (N,), generator=g)
    labels = next_token_labels(ids, document_ids=doc)
    first = torch.ones(N, dtype=torch.bool)
    first[1:] = doc[1:] != doc[:-1]
    labels[first] = -100  # the first token of every document is a "prompt"
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5 * 2
    with torch.no_grad():
        cur = linear_logprobs(hidden, weight, labels).logprobs
    old = cur + 0.2 * torch.randn(N, generator=g, dtype=torch.float64)
    ref = cur + 0.2 * torch.randn(N, generator=g, dtype=torch.float64)
    rollout = old + 0.1 * torch.randn(N, generator=g, dtype=torch.float64)
    adv = torch.randn(3, generator=g, dtype=torch.float64)  # per document
    return dict(
        doc=doc,
        labels=labels,
        hidden=hidden,
        weight=weight,
        old=old,
        ref=ref,
        rollout=rollout,
        adv=adv,
    )


def _call(s, hidden, weight, cfg, **kw):
    return fused_policy_loss(
        hidden,
        weight,
        s["labels"],
        s["old"],
        s["adv"],
        config=cfg,
        document_ids=s["doc"],
        ref_logprobs=s["ref"],
        rollout_logprobs=s["rollout"],
        chunk_size=4,
        **kw,
    )


def _shard(s, rank, world, layout):
    out = {k: v for k, v in s.items() if k in ("weight", "adv")}
    for k in ("doc", "labels", "hidden", "old", "ref", "rollout"):
        out[k] = parallel.context_parallel_split(s[k], rank, world, layout=layout)
    return out


def _worker(rank, world, tp):
    cp = world // tp
    tp_rank, cp_rank = rank % tp, rank // tp
    # every rank creates every group, in the same order
    tp_groups = [dist.new_group([c * tp + t for t in range(tp)]) for c in range(cp)]
    cp_groups = [dist.new_group([c * tp + t for c in range(cp)]) for t in range(tp)]
    vp = None
    if tp > 1:
        vp = VocabParallel.even(V, tp_groups[cp_rank])
    results = {}
    for layout in ("contiguous", "zigzag"):
        s = _shard(_stream(), cp_rank, cp, layout)
        w_rows = slice(*even_vocab_range(V, tp_rank, tp))
        for name, cfg in CONFIGS.items():
            hidden = s["hidden"].clone().requires_grad_()
            weight = s["weight"][w_rows].clone().requires_grad_()
            loss, metrics = _call(
                s, hidden, weight, cfg, vocab_parallel=vp, context_group=cp_groups[tp_rank]
            )
            (loss * 1.5).backward()
            results[layout, name] = dict(
                loss=loss.detach(), metrics=metrics, hidden=hidden.grad, weight=weight.grad
            )
        with torch.no_grad():  # loss only, no gradient pass: still collective-consistent
            results[layout, "no_grad"] = _call(
                s,
                s["hidden"],
                s["weight"][w_rows],
                CONFIGS["gspo seq mean"],
                vocab_parallel=vp,
                context_group=cp_groups[tp_rank],
            )[0]
    return results


def _spawn(world, tp):
    return spawn(_worker, world, tp)


def _single(cfg):
    s = _stream()
    hidden = s["hidden"].clone().requires_grad_()
    weight = s["weight"].clone().requires_grad_()
    loss, metrics = _call(s, hidden, weight, cfg)
    (loss * 1.5).backward()
    return dict(loss=loss.detach(), metrics=metrics, hidden=hidden.grad, weight=weight.grad)


@pytest.fixture(scope="module", params=[(2, 1), (4, 2)], ids=["cp2", "tp2 x cp2"])
def spawned(request):
    world, tp = request.param
    return world, tp, _spawn(world, tp)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_sharded_stream_matches_one_process(spawned, layout, name):
    world, tp, per_rank = spawned
    cp = world // tp
    single = _single(CONFIGS[name])
    res = [r[layout, name] for r in per_rank]
    # rank = cp_rank * tp + tp_rank
    for t in range(tp):
        cp_ranks = [c * tp + t for c in range(cp)]
        total = sum(res[r]["loss"] for r in cp_ranks)
        torch.testing.assert_close(total, single["loss"], **CLOSE)
        for r in cp_ranks:
            for key, value in single["metrics"].items():
                torch.testing.assert_close(res[r]["metrics"][key], value, **CLOSE, msg=key)
        merged = parallel.context_parallel_merge(
            [res[r]["hidden"] for r in cp_ranks], layout=layout
        )
        torch.testing.assert_close(merged, single["hidden"], **CLOSE)
    # weight: summed over the context group, concatenated over the vocab shards
    shards = [sum(res[c * tp + t]["weight"] for c in range(cp)) for t in range(tp)]
    torch.testing.assert_close(torch.cat(shards), single["weight"], **CLOSE)
    assert single["loss"].abs() > 1e-6  # the data is not degenerate


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_no_grad_call_matches_one_process(spawned, layout):
    world, tp, per_rank = spawned
    s = _stream()
    with torch.no_grad():
        single, _ = _call(s, s["hidden"], s["weight"], CONFIGS["gspo seq mean"])
    cp_ranks = [c * tp for c in range(world // tp)]
    total = sum(per_rank[r][layout, "no_grad"] for r in cp_ranks)
    torch.testing.assert_close(total, single, **CLOSE)


def test_single_process_fused_equals_composed():
    """The oracle of this file (single-process fused) equals the naive composition here."""
    s = _stream()
    for cfg in CONFIGS.values():
        fused = _single(cfg)
        hidden = s["hidden"].clone().requires_grad_()
        weight = s["weight"].clone().requires_grad_()
        out = linear_logprobs(hidden, weight, s["labels"], with_entropy=cfg.entropy_coef != 0)
        loss, _ = policy_loss(
            out.logprobs,
            s["old"],
            s["adv"],
            s["labels"] != -100,
            config=cfg,
            document_ids=s["doc"],
            ref_logprobs=s["ref"],
            rollout_logprobs=s["rollout"],
            entropy=out.entropy,
        )
        (loss * 1.5).backward()
        torch.testing.assert_close(fused["loss"], loss.detach(), **CLOSE)
        torch.testing.assert_close(fused["hidden"], hidden.grad, **CLOSE)
        torch.testing.assert_close(fused["weight"], weight.grad, **CLOSE)
