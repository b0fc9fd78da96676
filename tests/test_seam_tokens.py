"""Two additions the Fast-LLM and torchtitan integrations need (issue 50):

- ``seam.policy_loss_and_logprobs``: the fused policy loss and the per-token log-probs (and
  entropy) of its own pass, for a trainer's per-token metrics without a second head pass.
  The loss, its gradients and the metrics are those of ``seam.policy_loss``; the log-probs and
  entropy those of ``linear_logprobs`` (0 at ignored tokens), token-local and
  sequence-level (GSPO) losses, with and without gradients, entropy asked by the call
  (``Prepared.with_entropy``) while the loss does not use it.
- A standalone process group (a ``torch.distributed`` backend object built over a store
  without ``init_process_group``, as Fast-LLM builds its groups) as ``VocabParallel``'s
  group: the same numbers as the registered group gives, on 2 gloo ranks; one process with
  torch.distributed not initialized at all.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from _dist import spawn

import logitless
from logitless import PolicyLossConfig, VocabParallel
from logitless.contract.options import SamplerOptions
from logitless.integrations import seam

N, H, V = 37, 16, 50

CONFIGS = [
    PolicyLossConfig(aggregation="token_sum", clip_low=0.1, clip_high=0.3),
    PolicyLossConfig(ratio_level="sequence", aggregation="seq_mean_token_sum"),
]


def _data(dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(N, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype) * 0.5
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = -100
    old = torch.randn(N, generator=g) * 0.3 - 3.0
    adv = torch.randn(N, generator=g)
    doc = torch.arange(N) // 10
    return hidden, weight, labels, old, adv, doc


@pytest.mark.parametrize("config", CONFIGS, ids=["token", "sequence"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_policy_loss_and_logprobs(config, grad):
    hidden, weight, labels, old, adv, doc = _data()
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    inputs = seam.LossInputs(old, adv, document_ids=doc)
    prepared = seam.prepare(labels, seam.Head(w)).with_loss(inputs, config).with_entropy(True)
    upstream = torch.tensor(0.7)
    with torch.set_grad_enabled(grad):
        loss, metrics, tokens = seam.policy_loss_and_logprobs(
            prepared, seam.Tokens(h, labels), seam.Head(w)
        )
        ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        ref_loss, ref_metrics = seam.policy_loss(
            prepared, seam.Tokens(ref_h, labels), seam.Head(ref_w)
        )
    assert torch.equal(loss.detach(), ref_loss.detach())
    assert metrics.keys() == ref_metrics.keys()
    out = logitless.linear_logprobs(hidden, weight, labels, with_entropy=True)
    torch.testing.assert_close(tokens.logprobs, out.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(tokens.entropy, out.entropy, rtol=0, atol=1e-5)
    assert not tokens.logprobs.requires_grad and not tokens.entropy.requires_grad
    assert bool((tokens.logprobs[labels == -100] == 0).all())
    if grad:
        loss.backward(upstream)
        ref_loss.backward(upstream)
        torch.testing.assert_close(h.grad, ref_h.grad, rtol=0, atol=0)
        torch.testing.assert_close(w.grad, ref_w.grad, rtol=0, atol=0)
        assert float(h.grad.abs().sum()) > 0


def test_policy_loss_and_logprobs_without_entropy():
    hidden, weight, labels, old, adv, doc = _data()
    prepared = seam.prepare(labels, seam.Head(weight)).with_loss(
        seam.LossInputs(old, adv, document_ids=doc), CONFIGS[0]
    )
    _, _, tokens = seam.policy_loss_and_logprobs(
        prepared, seam.Tokens(hidden, labels), seam.Head(weight)
    )
    assert tokens.entropy is None
    out = logitless.linear_logprobs(hidden, weight, labels)
    torch.testing.assert_close(tokens.logprobs, out.logprobs, rtol=0, atol=1e-5)


def test_policy_loss_and_logprobs_refuses_replay():
    hidden, weight, labels, old, adv, doc = _data()
    sampler = SamplerOptions(top_k=5)
    prepared = seam.prepare(labels, seam.Head(weight), sampler=sampler)
    prepared = prepared.with_loss(seam.LossInputs(old, adv, document_ids=doc), CONFIGS[0])
    with pytest.raises(ValueError, match="sampling replay"):
        seam.policy_loss_and_logprobs(prepared, seam.Tokens(hidden, labels), seam.Head(weight))


# --- a standalone group as the vocabulary group ---------------------------------------------


def _standalone_worker(rank: int, world: int, store_path: str):
    """The same vocab-parallel call through the registered default group and through a
    standalone gloo backend object of the same ranks."""
    store = dist.FileStore(store_path, world)
    own = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=60))
    assert not isinstance(own, dist.ProcessGroup)
    hidden, weight, labels, *_ = _data()
    results = []
    for group in (None, own):
        vp = VocabParallel.even(V, group)
        h = hidden.clone().requires_grad_()
        w = vp.shard(weight).clone().requires_grad_()
        out = logitless.linear_logprobs(h, w, labels, vocab_parallel=vp, with_entropy=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        results.append((vp.rank, vp.world_size, out.logprobs, out.entropy, h.grad, w.grad))
    return results


def test_standalone_group_matches_the_registered_one(tmp_path):
    for rank, (registered, standalone) in enumerate(
        spawn(_standalone_worker, 2, str(tmp_path / "store"))
    ):
        assert registered[:2] == standalone[:2] == (rank, 2)
        for a, b in zip(registered[2:], standalone[2:], strict=True):
            assert torch.equal(a, b)


def test_standalone_group_without_init_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    own = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    hidden, weight, labels, *_ = _data()
    vp = VocabParallel(own, 0, V)
    assert (vp.rank, vp.world_size, vp.vocab_size) == (0, 1, V)
    out = logitless.linear_logprobs(hidden, weight, labels, vocab_parallel=vp)
    ref = logitless.linear_logprobs(hidden, weight, labels)
    torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="init_process_group"):
        VocabParallel(None, 0, V)
