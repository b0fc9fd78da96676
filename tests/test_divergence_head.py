"""DivergenceHead: the module form of linear_divergence that holds the student's head weight.

Single process: equal to the functional form (outputs and the gradients of hidden, weight and
bias under random upstream gradients), with a tied embedding, a per-call temperature and a
sparse teacher; bad options refused. FSDP2 on 2 gloo ranks: ``fully_shard(head)``, each rank
its own rows; the gathered weight gradient equals one process's on all rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import spawn
from torch import nn

from logitless import TeacherTopK, linear_divergence
from logitless.modules import DivergenceHead

V, H, HT = 53, 12, 20


def _data(seed: int = 0, n: int = 9):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (n,), generator=g)
    labels[[1, 4]] = -100
    t_hidden = torch.randn(n, HT, generator=g)
    t_weight = torch.randn(V, HT, generator=g) / HT**0.5
    up = [torch.randn(n, generator=g) for _ in range(3)]
    return hidden, labels, t_hidden, t_weight, up


def _backward(out, up, tensors):
    total = sum((t * u).sum() for t, u in zip(out, up, strict=True) if t is not None)
    return torch.autograd.grad(total, tensors)


@pytest.mark.parametrize("tied", [False, True], ids=["linear", "tied_embedding"])
def test_module_equals_function(tied):
    torch.manual_seed(1)
    source = nn.Embedding(V, H) if tied else nn.Linear(H, V, bias=True)
    hidden, labels, t_hidden, t_weight, up = _data()
    opts = dict(beta=0.3, softcap=4.0, teacher_logit_scale=0.7, with_entropy=True)
    head = DivergenceHead(source, with_logprobs=True, **opts)
    assert head.weight is source.weight
    bias = getattr(source, "bias", None)
    params = [hidden, source.weight] + ([bias] if bias is not None else [])
    got = head(hidden, labels, t_hidden, t_weight, temperature=0.8)
    want = linear_divergence(
        hidden, source.weight, labels, t_hidden, t_weight, bias=bias, temperature=0.8,
        with_logprobs=True, **opts,
    )  # fmt: skip
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(_backward(got, up, params), _backward(want, up, params), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_module_with_a_sparse_teacher():
    source = nn.Linear(H, V, bias=False)
    hidden, labels, _, _, _ = _data(2)
    lp = torch.randn(hidden.shape[0], V).log_softmax(-1).topk(5)
    topk = TeacherTopK(lp.indices.reshape(-1), lp.values.reshape(-1), torch.arange(10) * 5)
    got = DivergenceHead(source)(hidden, labels, teacher_topk=topk)
    want = linear_divergence(hidden, source.weight, labels, teacher_topk=topk)
    torch.testing.assert_close(got.divergence, want.divergence, rtol=0, atol=0)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="no sampler settings"):
        DivergenceHead(nn.Linear(H, V), top_k=5)
    with pytest.raises(ValueError, match="beta must be"):
        DivergenceHead(nn.Linear(H, V), beta=1.5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'labels'"):
        DivergenceHead(nn.Linear(H, V), labels=3)


ROWS = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7, 8]}


def _fsdp_worker(rank: int, world: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    source = nn.Linear(H, V, bias=True)
    head = DivergenceHead(source, beta=0.5)
    fully_shard(head)
    hidden, labels, t_hidden, t_weight, up = _data()
    rows = ROWS[rank]
    out = head(hidden[rows].detach(), labels[rows], t_hidden[rows], t_weight)
    # FSDP2 averages over the ranks: each rank's sum times the world size
    ((out.divergence * up[0][rows]).sum() * world).backward()
    dist.barrier()
    return head.weight.grad.full_tensor(), head.bias.grad.full_tensor()


def test_fsdp2_gathers_and_reduces_the_weight():
    got = spawn(_fsdp_worker, 2, threads=1)
    torch.manual_seed(1)
    source = nn.Linear(H, V, bias=True)
    hidden, labels, t_hidden, t_weight, up = _data()
    out = linear_divergence(
        hidden.detach(), source.weight, labels, t_hidden, t_weight, bias=source.bias, beta=0.5
    )
    (out.divergence * up[0]).sum().backward()
    for weight_grad, bias_grad in got:
        torch.testing.assert_close(weight_grad, source.weight.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bias_grad, source.bias.grad, rtol=1e-5, atol=1e-6)
