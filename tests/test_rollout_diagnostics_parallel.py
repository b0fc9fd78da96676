"""The rollout-mismatch diagnostics under vocabulary (tensor) parallelism, on 2 gloo ranks
(one launch runs every check): each rank holds half the vocabulary (an uneven split), the
engine's ids are gathered from the rank that owns each; every rank gets the same values,
held to the naive reference's error against the float64 truth, on both backends (fp32; bf16 on
the torch tiles), with sampling replay (a mask, top-k), the log-probs and entropy the same bits
as without the option, and bit for bit across batchings in the batch-invariant mode; a bad id
on one rank raises on both."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _dist import spawn
from _rollout import problem
from test_rollout_diagnostics import _dedup, check_against_truth

import logitless
from logitless import RolloutTopK
from logitless.types import RolloutMismatch

TRITON = importlib.util.find_spec("triton") is not None and not torch.cuda.is_available()


def _sharded(p, vp):
    """The problem with this rank's rows of the head (the op's call on them)."""

    def op(hidden, weight, labels, *, bias=None, **options):
        shard_bias = None if bias is None else vp.shard(bias)
        return logitless.linear_logprobs(
            hidden, vp.shard(weight), labels, bias=shard_bias, vocab_parallel=vp, **options
        )

    return op


def _worker(rank: int, world: int) -> dict:
    vp = logitless.VocabParallel.even(301)
    p = problem(shape=(2, 13), V=301, bias=True)
    op = _sharded(p, vp)
    results = {}
    for backend in ("torch", "triton") if TRITON else ("torch",):
        found = op(p.hidden, p.weight, p.labels, bias=p.bias, rollout_topk=p.topk,
                   backend=backend, temperature=0.9, with_entropy=True).mismatch  # fmt: skip
        check_against_truth(p, torch.float32, dict(temperature=0.9), found=found)
        results[backend] = found
    bf16 = op(p.hidden.bfloat16(), p.weight.bfloat16(), p.labels, bias=p.bias.bfloat16(),
              rollout_topk=p.topk, temperature=0.9).mismatch  # fmt: skip
    check_against_truth(p, torch.bfloat16, dict(temperature=0.9), found=bf16)
    results["bf16"] = bf16
    plain = op(p.hidden, p.weight, p.labels, bias=p.bias, temperature=0.9, with_entropy=True)
    with_it = op(p.hidden, p.weight, p.labels, bias=p.bias, temperature=0.9, with_entropy=True,
                 rollout_topk=p.topk)  # fmt: skip
    assert torch.equal(plain.logprobs, with_it.logprobs)
    assert torch.equal(plain.entropy, with_it.entropy)
    _replay(vp, results)
    _invariant(vp)
    _bad_id_on_one_rank(vp, rank)
    return {name: found._asdict() for name, found in results.items()}  # torch.load-able


def _replay(vp, results: dict) -> None:
    """A sampling mask (the engine's ids and others, split over the ranks) and top-k replay."""
    p = problem(shape=(27,), V=301, k=4, seed=4)
    mask = torch.cat([p.topk.token_ids, (p.topk.token_ids + 150) % 301], 1)
    mask = _dedup(torch.where(p.topk.token_ids.repeat(1, 2) >= 0, mask, -1))
    keep = torch.zeros(27, 301, dtype=torch.bool)
    rows = torch.arange(27)[:, None].expand_as(mask)
    keep[rows[mask >= 0], mask[mask >= 0]] = True
    keep[(mask < 0).all(1)] = True
    keep[torch.arange(27), p.labels.clamp(min=0)] = True
    op = _sharded(p, vp)
    found = op(p.hidden, p.weight, p.labels, sampling_mask=mask, rollout_topk=p.topk).mismatch
    check_against_truth(p, torch.float32, dict(sampling_mask=mask), keep=keep, found=found)
    results["mask"] = found
    results["top_k"] = op(p.hidden, p.weight, p.labels, top_k=20, rollout_topk=p.topk).mismatch


def _invariant(vp) -> None:
    p = problem(shape=(30,), V=301, seed=5)
    op = _sharded(p, vp)
    whole = op(p.hidden, p.weight, p.labels, rollout_topk=p.topk, batch_invariant=True).mismatch
    lo, hi = 7, 19
    part_topk = RolloutTopK(p.topk.token_ids[lo:hi], p.topk.logprobs[lo:hi])
    part = op(p.hidden[lo:hi], p.weight, p.labels[lo:hi], rollout_topk=part_topk,
              batch_invariant=True).mismatch  # fmt: skip
    for name in RolloutMismatch._fields:
        assert torch.equal(getattr(part, name), getattr(whole, name)[lo:hi]), name


def _bad_id_on_one_rank(vp, rank: int) -> None:
    p = problem(shape=(6,), V=301, k=3)
    ids = p.topk.token_ids.clone()
    if rank == 1:
        ids[2, 0] = 301
    with pytest.raises(ValueError, match=r"rollout_topk token ids must be in|another rank"):
        _sharded(p, vp)(p.hidden, p.weight, p.labels,
                        rollout_topk=RolloutTopK(ids, p.topk.logprobs))  # fmt: skip


def test_vocab_parallel_two_ranks():
    ranks = spawn(_worker, 2)
    for name, found in ranks[0].items():  # every rank has the same values
        for field in RolloutMismatch._fields:
            assert torch.equal(found[field], ranks[1][name][field]), (name, field)
    single = problem(shape=(27,), V=301, k=4, seed=4)
    alone = logitless.linear_logprobs(
        single.hidden, single.weight, single.labels, top_k=20, rollout_topk=single.topk
    ).mismatch
    for field in ("logprobs", "kl_rollout_trainer", "total_variation"):
        torch.testing.assert_close(
            ranks[0]["top_k"][field], getattr(alone, field), rtol=1e-5, atol=1e-6
        )
    assert torch.equal(ranks[0]["top_k"]["top1_agree"], alone.top1_agree)
