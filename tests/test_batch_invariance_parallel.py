"""``batch_invariant=True`` under vocabulary parallelism (2 gloo ranks): for a fixed group size,
probe tokens get the same bits whatever else is in the call, with and without gradients, and
the fused loss's ratio on unchanged weights is exactly 1.0. (Another group size gives other
bits: the shards' statistics are merged in another grouping; docs/head.md says so.)"""

from __future__ import annotations

import pytest
import torch
from _dist import spawn

pytestmark = pytest.mark.slow

H, V, P = 32, 20000, 24


def _worker(rank: int, world: int):
    import logitless

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=g)
    probes, probe_labels = torch.randn(P, H, generator=g), torch.randint(0, V, (P,), generator=g)
    vp = logitless.VocabParallel.even(V)
    shard = vp.shard(weight)

    def logprobs(hidden, labels, grad=False):
        w = shard.clone().requires_grad_(grad)
        h = hidden.clone().requires_grad_(grad)
        out = logitless.linear_logprobs(
            h, w, labels, with_entropy=True, vocab_parallel=vp, backend="torch",
            batch_invariant=True,
        )  # fmt: skip
        return out.logprobs.detach(), out.entropy.detach()

    ref = logprobs(probes, probe_labels)
    same = []
    for n, grad in ((1, False), (150, True), (400, False)):
        others = torch.randn(n, H, generator=g)
        labels = torch.randint(0, V, (n,), generator=g)
        labels[torch.rand(n, generator=g) < 0.5] = -100
        hidden, all_labels = torch.cat([others, probes]), torch.cat([labels, probe_labels])
        lp, ent = logprobs(hidden, all_labels, grad)
        same.append(bool(torch.equal(lp[n:], ref[0]) and torch.equal(ent[n:], ref[1])))
    # the fused loss on micro-batches of the probes, old log-probs from the call with others
    seq = torch.cat([probes, probes]).view(2, P, H)
    old = logprobs(seq.view(-1, H), probe_labels.repeat(2))[0].view(2, P)
    _, metrics = logitless.fused_policy_loss(
        seq[:1], shard.clone().requires_grad_(True), probe_labels[None], old[:1],
        torch.ones(1), config=logitless.PolicyLossConfig(), vocab_parallel=vp,
        backend="torch", batch_invariant=True,
    )  # fmt: skip
    return same, float(metrics["ratio_min"]), float(metrics["ratio_max"])


def test_vocab_parallel_probe_bits_and_ratio():
    for same, low, high in spawn(_worker, 2):
        assert same == [True, True, True]
        assert low == 1.0 == high
