"""Packed streams through the fused head: labels from ``next_token_labels`` -> ``linear_logprobs``.

For random packings (flat ``cu_seqlens`` streams and ``[B, T]`` rows with ``position_ids``),
random extra ignored rows and random chunk sizes, the fused op must match the full-logits
reference (``logitless.reference.linear_logprobs``) in outputs and in gradients under random
upstream gradients, and must not depend on the chunk size beyond float reassociation.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from logitless import linear_logprobs
from logitless import reference as ref
from logitless.packing import (
    cu_seqlens_to_document_ids,
    next_token_labels,
    position_ids_to_document_ids,
    segment_sum,
)

IGN = -100
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
# fp32, H <= 16, V <= 50, N <= 40: the two paths differ only by rounding, ~1e-6
TOL = {"atol": 1e-5, "rtol": 1e-5}


@st.composite
def packed_batches(draw):
    """(input_ids, labels, document_ids, hidden, weight, seed) of a random packed batch."""
    vocab = draw(st.integers(2, 50))
    dim = draw(st.integers(1, 16))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    if draw(st.booleans()):
        # flat stream: documents (zero-length allowed) then tail padding, via cu_seqlens
        lengths = draw(st.lists(st.integers(0, 9), min_size=0, max_size=5))
        n = sum(lengths) + draw(st.integers(0, 4))
        n = min(max(n, 1), 40)
        cu = [0]
        for length in lengths:
            cu.append(min(cu[-1] + length, n))
        cu = torch.tensor(cu)
        ids = torch.randint(0, vocab, (n,), generator=gen)
        labels = next_token_labels(ids, cu_seqlens=cu)
        doc = cu_seqlens_to_document_ids(cu, total=n)
    else:
        # [B, T] rows, position_ids restarting at 0, padding (-1) anywhere in a row
        b = draw(st.integers(1, 3))
        width = draw(st.integers(1, 13))
        rows = []
        for _ in range(b):
            pos = []
            while len(pos) < width:
                k = draw(st.integers(1, width - len(pos)))
                pos += list(range(k)) if draw(st.booleans()) else [-1] * k
            rows.append(pos)
        pos = torch.tensor(rows)
        ids = torch.randint(0, vocab, (b, width), generator=gen)
        labels = next_token_labels(ids, position_ids=pos)
        doc = position_ids_to_document_ids(pos)
    # extra ignored rows (e.g. prompt tokens masked out of the loss)
    drop = torch.rand(labels.shape, generator=gen) < draw(st.sampled_from([0.0, 0.3]))
    labels = labels.masked_fill(drop, IGN)
    hidden = torch.randn(*labels.shape, dim, generator=gen)
    weight = torch.randn(vocab, dim, generator=gen) * 0.5
    return ids, labels, doc, hidden, weight, seed


def _run(fn, hidden, weight, labels, g_logp, g_ent, **kw):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    out = fn(h, w, labels, with_entropy=True, **kw)
    torch.autograd.backward([out.logprobs, out.entropy], [g_logp, g_ent])
    return out.logprobs.detach(), out.entropy.detach(), h.grad, w.grad


def _upstream(labels, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(labels.shape, generator=gen), torch.randn(labels.shape, generator=gen)


@SETTINGS
@given(packed_batches(), st.one_of(st.none(), st.integers(1, 45)))
def test_packed_fused_matches_reference(batch, chunk_size):
    ids, labels, doc, hidden, weight, seed = batch
    g_logp, g_ent = _upstream(labels, seed)
    got = _run(linear_logprobs, hidden, weight, labels, g_logp, g_ent, chunk_size=chunk_size)
    want = _run(ref.linear_logprobs, hidden, weight, labels, g_logp, g_ent)
    for name, a, b in zip(("logprobs", "entropy", "d hidden", "d weight"), got, want, strict=True):
        assert a.dtype == torch.float32, name
        assert_close(a, b, **TOL, msg=lambda m, name=name: f"{name}: {m}")

    # ignored rows (document ends, padding, dropped rows): exactly zero, no gradient
    ignored = labels == IGN
    logp, ent, dh, _ = got
    assert (logp[ignored] == 0).all() and (ent[ignored] == 0).all()
    assert (dh[ignored] == 0).all()
    assert (logp[~ignored] <= 0).all()


@SETTINGS
@given(packed_batches(), st.integers(1, 45), st.integers(1, 45))
def test_packed_chunk_size_invariance(batch, chunk_a, chunk_b):
    _, labels, _, hidden, weight, seed = batch
    g_logp, g_ent = _upstream(labels, seed)
    a = _run(linear_logprobs, hidden, weight, labels, g_logp, g_ent, chunk_size=chunk_a)
    b = _run(linear_logprobs, hidden, weight, labels, g_logp, g_ent, chunk_size=chunk_b)
    for name, x, y in zip(("logprobs", "entropy", "d hidden", "d weight"), a, b, strict=True):
        assert_close(x, y, atol=1e-5, rtol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@SETTINGS
@given(packed_batches(), st.one_of(st.none(), st.integers(1, 45)))
def test_packed_sequence_logprob_equals_per_document(batch, chunk_size):
    """segment_sum of packed log-probs == each document's log-likelihood computed alone."""
    ids, labels, doc, hidden, weight, _ = batch
    num_docs = int(doc.max()) + 1 if doc.numel() else 0
    logp = linear_logprobs(hidden, weight, labels, chunk_size=chunk_size).logprobs
    per_doc = segment_sum(logp, doc, num_docs)  # [D]

    flat_ids, flat_h, flat_doc = (
        ids.reshape(-1),
        hidden.reshape(-1, hidden.shape[-1]),
        doc.reshape(-1),
    )
    flat_lab = labels.reshape(-1)
    for d in range(num_docs):
        idx = (flat_doc == d).nonzero().squeeze(1)  # contiguous tokens of document d
        # the document alone: predict token k+1 from hidden k, keeping the rows the batch kept
        lab = flat_ids[idx[1:]].clone()
        lab[flat_lab[idx[:-1]] == IGN] = IGN
        alone = ref.linear_logprobs(flat_h[idx[:-1]], weight, lab).logprobs.sum()
        assert_close(per_doc[d], alone, **TOL)
