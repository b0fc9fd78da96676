"""linear_divergence against the naive reference and a float64 truth: outputs and gradients.

Three-way comparisons (tests/_tolerance.py): the op, ``logitless.reference.linear_divergence``
(full logits of both heads) in the same dtype, and a float64 truth written out below from the
definitions (TRL's beta convention; the top-k tail bucket). Gradients under random upstream
gradients of the divergence, the log-probs and the entropy, never ``.sum()``.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch
from _host_reads import HostRead, _Detector
from _tolerance import assert_no_worse_than_reference

import logitless
from logitless import TeacherTopK, reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}

# --------------------------------------------------------------------------------------------
# float64 truth, from the definitions
# --------------------------------------------------------------------------------------------


def truth_logprobs(hidden, weight, bias, scale, softcap, temperature):
    """``[..., V]`` float64 log-softmax of one head's transformed logits."""
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    if scale is not None:
        z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if isinstance(temperature, torch.Tensor):
        z = z / temperature.double()[..., None]
    else:
        z = z / temperature
    return torch.log_softmax(z, dim=-1)


def kl(lp_p, lp_q):
    """KL(p‖q) over the last dimension."""
    return (lp_p.exp() * (lp_p - lp_q)).sum(-1)


def truth_divergence(lp_s, lp_t, beta):
    """TRL's convention: KL(t‖s) at 0, KL(s‖t) at 1, else the generalized JSD."""
    if beta == 0:
        return kl(lp_t, lp_s)
    if beta == 1:
        return kl(lp_s, lp_t)
    log_m = torch.log((1 - beta) * lp_s.exp() + beta * lp_t.exp())
    return beta * kl(lp_t, log_m) + (1 - beta) * kl(lp_s, log_m)


def bucket_divergence(q, r, beta):
    """TRL's divergence between two probability vectors (0·log 0 = 0): the student's ``q``
    and the teacher's ``r`` over a row's buckets."""

    def kl_(a, b):
        has = a > 0
        return (a[has] * (a[has].log() - b[has].log())).sum()

    if beta == 0:
        return kl_(r, q)
    if beta == 1:
        return kl_(q, r)
    m = (1 - beta) * q + beta * r
    return beta * kl_(r, m) + (1 - beta) * kl_(q, m)


def truth_topk(lp_s, ids, lps, counts, beta=0.0):
    """The divergence over each row's ids plus the tail bucket (rows of ``lp_s`` ``[N, V]``;
    the CSR teacher as per-row lists): the student's buckets are its probabilities at the ids
    and its mass outside them, the teacher's its probabilities and ``1 - Σ`` of them."""
    out = []
    for i in range(lp_s.shape[0]):
        k = ids[i]
        p_t = lps[i].double().exp()
        p_s = lp_s[i].exp()
        outside = torch.ones_like(p_s, dtype=torch.bool)
        outside[k] = False
        tail_t = (1 - p_t.sum()).clamp(min=0) if counts[i] < lp_s.shape[1] else p_t.new_zeros(())
        q = torch.cat([p_s[k], p_s[outside].sum()[None]])
        r = torch.cat([p_t, tail_t[None]])
        out.append(bucket_divergence(q, r, beta))
    return torch.stack(out) if out else lp_s.new_zeros(0)


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    beta: float = 0.0
    dtype: str = "fp32"
    shape: tuple = (61,)
    H: int = 40
    Ht: int = 40
    V: int = 1003
    bias: bool = False
    t_bias: bool = False
    scale: float | None = None
    softcap: float | None = None
    t_scale: float | None = None
    t_softcap: float | None = None
    temperature: str = "one"  # one | scalar | tensor
    ignore: str = "some"  # none | some | all
    chunk: int | None = None
    extras: bool = False  # with_logprobs and with_entropy
    close: bool = False  # a teacher close to the student (small divergences)
    topk: int | None = None  # a sparse teacher with up to this many ids per row
    pad_s: int = 0  # padding rows of the student's head beyond V
    pad_t: int = 0
    small_tiles: bool = False

    @property
    def id(self) -> str:
        skip = {"dtype", "shape"}
        parts = [self.dtype, "x".join(map(str, self.shape))]
        for k, v in self.__dict__.items():
            if k not in skip and v != Case.__dataclass_fields__[k].default:
                parts.append(f"{k}={v}")
        return "-".join(parts)


CASES = [
    Case(),
    Case(beta=1.0),
    Case(beta=0.5),
    Case(beta=0.1, chunk=7, small_tiles=True),
    Case(beta=0.0, extras=True, chunk=1),
    Case(beta=1.0, extras=True, chunk=9, small_tiles=True, ignore="none"),
    Case(beta=0.7, extras=True, temperature="tensor", chunk=16),
    Case(beta=0.0, temperature="scalar", bias=True, t_bias=True, small_tiles=True, chunk=5),
    Case(beta=1.0, softcap=3.0, t_scale=0.6, temperature="scalar", chunk=11),
    Case(beta=0.25, scale=1.7, t_softcap=2.5, bias=True, small_tiles=True),
    Case(beta=0.0, softcap=4.0, scale=0.8, t_softcap=5.0, t_scale=1.3, extras=True),
    Case(beta=0.0, Ht=72, shape=(3, 19), t_bias=True),
    Case(beta=1.0, Ht=24, shape=(3, 19), small_tiles=True, chunk=13),
    Case(beta=0.6, Ht=24, temperature="tensor", shape=(2, 23)),
    Case(beta=0.0, close=True, extras=True),
    Case(beta=1.0, close=True, chunk=8),
    Case(beta=0.35, close=True, small_tiles=True),
    Case(beta=0.0, ignore="all"),
    Case(beta=0.5, ignore="all", extras=True, chunk=3),
    Case(beta=1.0, V=517, pad_t=128, pad_s=0),
    Case(beta=0.5, V=517, pad_s=19, pad_t=45, bias=True, t_bias=True),
    Case(beta=0.0, dtype="bf16", shape=(29,), V=389, extras=True),
    Case(beta=1.0, dtype="bf16", shape=(29,), V=389, softcap=3.0, small_tiles=True),
    Case(beta=0.8, dtype="bf16", shape=(29,), V=389, Ht=56, t_bias=True),
    # the sparse teacher: top-k log-probs and the tail bucket
    Case(topk=6),
    Case(topk=20, extras=True, chunk=7, small_tiles=True, temperature="scalar"),
    Case(topk=4, bias=True, softcap=3.0, scale=1.4, shape=(3, 17), chunk=5),
    Case(topk=9, close=True, temperature="tensor", small_tiles=True),
    Case(topk=5, ignore="all"),
    Case(topk=3, V=301, pad_s=33),
    Case(topk=8, dtype="bf16", shape=(29,), V=389),
    # ... for every beta: the reverse KL and the generalized JSD over the K+1 buckets
    Case(topk=6, beta=1.0),
    Case(topk=6, beta=0.5),
    Case(topk=20, beta=1.0, extras=True, chunk=7, small_tiles=True, temperature="scalar"),
    Case(topk=20, beta=0.3, extras=True, chunk=7, small_tiles=True, temperature="tensor"),
    Case(topk=4, beta=0.8, bias=True, softcap=3.0, scale=1.4, shape=(3, 17), chunk=5),
    Case(topk=9, beta=1.0, close=True, temperature="tensor", small_tiles=True),
    Case(topk=9, beta=0.1, close=True, extras=True),
    Case(topk=5, beta=0.6, ignore="all"),
    Case(topk=3, beta=1.0, V=301, pad_s=33, bias=True),
    Case(topk=8, beta=1.0, dtype="bf16", shape=(29,), V=389, extras=True),
    Case(topk=8, beta=0.5, dtype="bf16", shape=(29,), V=389, softcap=3.0),
]


@pytest.fixture
def small_tiles(monkeypatch):
    """One row chunk spans several vocab blocks (V not a multiple of the block)."""
    from logitless.backends import base

    monkeypatch.setattr(base, "_TILE_ELEMS", {"cpu": 1024}, raising=True)


def _topk(lp_t: torch.Tensor, case: Case, g: torch.Generator):
    """A TeacherTopK of each row's largest teacher log-probs (0 to ``case.topk`` ids, in a
    shuffled order; one row with the whole vocabulary when the case is small), and the rows
    as lists for the truth."""
    n, v = lp_t.shape
    counts = torch.randint(0, case.topk + 1, (n,), generator=g)
    if n > 2:
        counts[1] = case.topk  # at least one full top-k row
    ids, lps = [], []
    for i in range(n):
        top = lp_t[i].topk(int(counts[i]))
        perm = torch.randperm(top.indices.numel(), generator=g)
        ids.append(top.indices[perm])
        lps.append(top.values[perm].float())  # the server's fp32 log-probs
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    return TeacherTopK(torch.cat(ids), torch.cat(lps), offsets), ids, lps, counts


def make_inputs(case: Case) -> dict:
    """Random inputs; logits of std ~3 so the distributions are not flat."""
    g = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
    dt = DTYPES[case.dtype]
    v_s, v_t = case.V + case.pad_s, case.V + case.pad_t
    hidden = torch.randn(*case.shape, case.H, generator=g)
    weight = torch.randn(v_s, case.H, generator=g) * (3 / math.sqrt(case.H))
    if case.close:
        t_hidden = hidden.clone()
        t_weight = weight[: case.V] + 0.1 * torch.randn(case.V, case.H, generator=g) / case.H**0.5
        t_weight = torch.cat([t_weight, torch.randn(case.pad_t, case.H, generator=g)])
    else:
        t_hidden = torch.randn(*case.shape, case.Ht, generator=g)
        t_weight = torch.randn(v_t, case.Ht, generator=g) * (3 / math.sqrt(case.Ht))
    labels = torch.randint(0, case.V, case.shape, generator=g)
    if case.ignore == "some":
        labels[torch.rand(case.shape, generator=g) < 0.3] = -100
        labels.view(-1)[0] = -100
    elif case.ignore == "all":
        labels.fill_(-100)
    temperature = {
        "one": 1.0,
        "scalar": 0.7,
        "tensor": torch.rand(case.shape, generator=g) * 1.5 + 0.5,
    }[case.temperature]
    d = {
        "hidden": hidden.to(dt),
        "weight": weight.to(dt),
        "bias": torch.randn(v_s, generator=g).to(dt) if case.bias else None,
        "t_hidden": t_hidden.to(dt),
        "t_weight": t_weight.to(dt),
        "t_bias": torch.randn(v_t, generator=g).to(dt) if case.t_bias else None,
        "labels": labels,
        "temperature": temperature,
        "up": [torch.randn(case.shape, generator=g) for _ in range(3)],
    }
    if case.topk is not None:
        lp_t = truth_logprobs(
            d["t_hidden"].reshape(-1, case.Ht), d["t_weight"][: case.V], None, None, None, 1.0
        )
        d["topk"], d["ids"], d["lps"], d["counts"] = _topk(lp_t, case, g)
    return d


def _leaf(t, dtype=None):
    if t is None:
        return None
    return t.detach().to(dtype or t.dtype).clone().requires_grad_()


def _kwargs(case: Case, d: dict) -> dict:
    kw = dict(
        beta=case.beta,
        temperature=d["temperature"],
        logit_scale=case.scale,
        softcap=case.softcap,
        with_logprobs=case.extras,
        with_entropy=case.extras,
    )
    if case.pad_s != case.pad_t:
        kw["vocab_size"] = case.V
    if case.topk is not None:
        return kw | {"teacher_topk": d["topk"]}
    kw |= dict(teacher_logit_scale=case.t_scale, teacher_softcap=case.t_softcap)
    return kw | dict(teacher_bias=d["t_bias"])


def _backward(out, case: Case, d: dict) -> None:
    dt = out.divergence.dtype
    loss = (out.divergence * d["up"][0].to(dt)).sum()
    if case.extras:
        loss = loss + (out.logprobs * d["up"][1].to(dt)).sum()
        loss = loss + (out.entropy * d["up"][2].to(dt)).sum()
    loss.backward()


def run(fn, case: Case, d: dict, **extra) -> dict:
    """Forward and backward of the op or the reference; outputs and student gradients."""
    h, w, b = _leaf(d["hidden"]), _leaf(d["weight"]), _leaf(d["bias"])
    teacher = () if case.topk is not None else (d["t_hidden"], d["t_weight"])
    out = fn(h, w, d["labels"], *teacher, bias=b, **_kwargs(case, d), **extra)
    _backward(out, case, d)
    return _results(out, h, w, b)


def _results(out, h, w, b) -> dict:
    res = {"divergence": out.divergence.detach(), "grad_hidden": h.grad, "grad_weight": w.grad}
    if out.logprobs is not None:
        res |= {"logprobs": out.logprobs.detach(), "entropy": out.entropy.detach()}
    if b is not None:
        res["grad_bias"] = b.grad
    return res


def run_truth(case: Case, d: dict) -> dict:
    """The float64 truth (inputs as rounded to the case's dtype, then exact)."""
    f64 = torch.float64
    h, w, b = _leaf(d["hidden"], f64), _leaf(d["weight"], f64), _leaf(d["bias"], f64)
    V = case.V
    bias = None if b is None else b[:V]
    lp_s = truth_logprobs(h, w[:V], bias, case.scale, case.softcap, d["temperature"])
    if case.topk is not None:
        flat = truth_topk(lp_s.reshape(-1, V), d["ids"], d["lps"], d["counts"], case.beta)
        div = flat.reshape(case.shape)
    else:
        tb = None if d["t_bias"] is None else d["t_bias"].double()[:V]
        tw = d["t_weight"].double()[:V]
        lp_t = truth_logprobs(
            d["t_hidden"].double(), tw, tb, case.t_scale, case.t_softcap, d["temperature"]
        )
        div = truth_divergence(lp_s, lp_t, case.beta)
    valid = d["labels"] != -100
    zero = div.new_zeros(())
    logp = lp_s.gather(-1, torch.where(valid, d["labels"], 0)[..., None])[..., 0]
    ent = -(lp_s.exp() * lp_s).sum(-1)
    out = logitless.Divergence(
        torch.where(valid, div, zero),
        torch.where(valid, logp, zero) if case.extras else None,
        torch.where(valid, ent, zero) if case.extras else None,
    )
    _backward(out, case, d)
    return _results(out, h, w, b)


def compare(op: dict, ref: dict, truth: dict, labels: torch.Tensor) -> None:
    ignored = labels == -100
    assert set(op) == set(truth), (sorted(op), sorted(truth))
    for key in truth:
        if key in ("divergence", "logprobs", "entropy"):
            assert op[key].shape == labels.shape
            assert op[key].dtype == torch.float32
            assert bool((op[key][ignored] == 0).all()), f"{key}: not 0 at ignored rows"
        assert_no_worse_than_reference(op[key], ref[key], truth[key], key)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_reference_and_float64(case, request):
    if case.small_tiles:
        request.getfixturevalue("small_tiles")
    d = make_inputs(case)
    op = run(logitless.linear_divergence, case, d, chunk_size=case.chunk)
    ref = run(reference.linear_divergence, case, d)
    compare(op, ref, run_truth(case, d), d["labels"])


# --------------------------------------------------------------------------------------------
# Large logits: every term centred on the running maxima
# --------------------------------------------------------------------------------------------

# (student bias, teacher bias) around which each head's logits sit: a softmax-neutral shift
# of one head, of the other, of both, of opposite signs (|z| from 300 to 1000)
LARGE_SHIFTS = [(0.0, 750.0), (-1000.0, 0.0), (500.0, 1000.0), (-300.0, 640.0)]


def large_logit_inputs(case: Case, shift_s: float, shift_t: float) -> dict:
    """Inputs whose logits are exact in fp32 whatever the summation order (hidden entries in
    {-1, 0, 1}, weights and biases multiples of 1/64, |z| < 2^11): the naive fp32 code then
    errs by its softmax's rounding alone, and an op that adds and subtracts terms of the
    logits' size (~|z|·ulp) shows. Each head's bias is its shift plus a small dyadic spread."""
    d = make_inputs(case)
    g = torch.Generator().manual_seed(zlib.crc32(f"{case.id}/{shift_s}/{shift_t}".encode()))
    n, v = d["labels"].numel(), case.V

    def ternary(*shape):
        return torch.randint(-1, 2, shape, generator=g).float()

    def dyadic(*shape, spread=40):
        return torch.randint(-spread, spread + 1, shape, generator=g).float() / 64

    d["hidden"], d["t_hidden"] = ternary(n, case.H), ternary(n, case.Ht)
    d["weight"], d["t_weight"] = dyadic(v, case.H), dyadic(v, case.Ht)
    d["bias"], d["t_bias"] = shift_s + dyadic(v, spread=64), shift_t + dyadic(v, spread=64)
    if case.topk is not None:
        lp_t = torch.log_softmax(d["t_hidden"].double() @ d["t_weight"].double().t(), -1)
        d["topk"], d["ids"], d["lps"], d["counts"] = _topk(lp_t, case, g)
    return d


LARGE_CASES = [
    Case(beta=beta, shape=(37,), H=24, Ht=24, V=509, bias=True, t_bias=True, extras=True)
    for beta in (0.0, 1.0, 0.4)
] + [
    Case(beta=beta, shape=(37,), H=24, V=509, bias=True, extras=True, topk=7)
    for beta in (0.0, 1.0, 0.4)
]


@pytest.mark.parametrize("shift", LARGE_SHIFTS, ids=[f"{a:g},{b:g}" for a, b in LARGE_SHIFTS])
@pytest.mark.parametrize("case", LARGE_CASES, ids=[c.id for c in LARGE_CASES])
def test_large_logits_keep_the_naive_accuracy(case, shift, small_tiles):
    """Logits of |z| 300 to 1000 (a softmax-neutral bias on either head): the divergence, the
    student's log-probs, entropy and gradients stay at the naive fp32 code's error against
    float64 (several vocabulary blocks and row chunks: the maxima move mid-row)."""
    d = large_logit_inputs(case, *shift)
    op = run(logitless.linear_divergence, case, d, chunk_size=16)
    ref = run(reference.linear_divergence, case, d)
    compare(op, ref, run_truth(case, d), d["labels"])


# --------------------------------------------------------------------------------------------
# Properties and corner cases
# --------------------------------------------------------------------------------------------


def _small(n=9, h=8, ht=12, v=37, dtype=torch.float64):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(n, h, generator=g, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, h, generator=g, dtype=dtype) / 2).requires_grad_()
    t_hidden = torch.randn(n, ht, generator=g, dtype=dtype)
    t_weight = torch.randn(v, ht, generator=g, dtype=dtype) / 2
    labels = torch.randint(0, v, (n,), generator=g)
    labels[2] = -100
    return hidden, weight, t_hidden, t_weight, labels


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_gradcheck_float64(beta):
    hidden, weight, t_hidden, t_weight, labels = _small()
    bias = torch.randn(weight.shape[0], dtype=torch.float64, requires_grad=True)

    def f(h, w, b):
        out = logitless.linear_divergence(
            h, w, labels, t_hidden, t_weight, bias=b, beta=beta, softcap=2.5, temperature=0.8,
            with_logprobs=True, with_entropy=True, chunk_size=4,
        )  # fmt: skip
        return out.divergence, out.logprobs, out.entropy

    assert torch.autograd.gradcheck(f, (hidden, weight, bias), fast_mode=True)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_gradcheck_topk_float64(beta):
    hidden, weight, t_hidden, t_weight, labels = _small()
    bias = torch.randn(weight.shape[0], dtype=torch.float64, requires_grad=True)
    lp_t = torch.log_softmax(t_hidden @ t_weight.t(), -1)
    counts = torch.tensor([5, 0, 5, 3, 5, 1, 5, 5, 4])  # an all-tail row, short rows
    keep = torch.arange(5)[None] < counts[:, None]
    top = lp_t.topk(5)
    topk = TeacherTopK(top.indices[keep], top.values[keep], torch.cat([counts.new_zeros(1),
                       counts.cumsum(0)]))  # fmt: skip

    def f(h, w, b):
        out = logitless.linear_divergence(
            h, w, labels, teacher_topk=topk, bias=b, beta=beta, softcap=2.5, temperature=0.8,
            with_logprobs=True, with_entropy=True, chunk_size=4,
        )  # fmt: skip
        return out.divergence, out.logprobs, out.entropy

    assert torch.autograd.gradcheck(f, (hidden, weight, bias), fast_mode=True)


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_topk_of_the_whole_vocabulary_is_the_dense_divergence(beta):
    """Every id given (no tail): the sparse path computes the dense divergence."""
    hidden, weight, t_hidden, t_weight, labels = _small(dtype=torch.float32)
    v = weight.shape[0]
    lp_t = torch.log_softmax(t_hidden @ t_weight.t(), -1)
    perm = torch.stack([torch.randperm(v) for _ in range(labels.numel())])
    topk = TeacherTopK(perm.reshape(-1), lp_t.gather(1, perm).reshape(-1), torch.arange(10) * v)
    sparse = logitless.linear_divergence(hidden, weight, labels, teacher_topk=topk, beta=beta)
    dense = logitless.linear_divergence(hidden, weight, labels, t_hidden, t_weight, beta=beta)
    torch.testing.assert_close(sparse.divergence, dense.divergence, atol=2e-6, rtol=1e-5)
    g_sparse = torch.autograd.grad(sparse.divergence.sum(), (hidden, weight))
    g_dense = torch.autograd.grad(dense.divergence.sum(), (hidden, weight))
    for a, b in zip(g_sparse, g_dense, strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def test_hand_worked_values():
    """A uniform student against a teacher with logits (log 2, 0, 0, ...): each KL and the
    symmetric JSD in closed form; an empty top-k row is all tail (0); a teacher equal to the
    student gives 0 for every beta."""
    v = 4
    hidden = torch.ones(1, 1, dtype=torch.float64)
    weight = torch.zeros(v, 1, dtype=torch.float64)  # uniform student, p_s = 1/4
    t_bias = torch.tensor([math.log(2.0), 0.0, 0.0, 0.0], dtype=torch.float64)
    p_t = torch.tensor([0.4, 0.2, 0.2, 0.2], dtype=torch.float64)
    labels = torch.tensor([1])
    p_s = torch.full((v,), 0.25, dtype=torch.float64)
    m = (p_s + p_t) / 2
    expected = {
        0.0: (p_t * (p_t / p_s).log()).sum(),
        1.0: (p_s * (p_s / p_t).log()).sum(),
        0.5: 0.5 * (p_t * (p_t / m).log()).sum() + 0.5 * (p_s * (p_s / m).log()).sum(),
    }
    for beta, value in expected.items():
        out = logitless.linear_divergence(
            hidden, weight, labels, hidden, weight, teacher_bias=t_bias, beta=beta
        )
        torch.testing.assert_close(out.divergence, value.reshape(1), rtol=1e-12, atol=1e-15)
        same = logitless.linear_divergence(hidden, weight, labels, hidden, weight, beta=beta)
        assert float(same.divergence) == pytest.approx(0.0, abs=1e-15)
    empty = TeacherTopK(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float64),
                        torch.zeros(2, dtype=torch.long))  # fmt: skip
    out = logitless.linear_divergence(hidden, weight, labels, teacher_topk=empty)
    assert float(out.divergence) == 0.0
    # one id with the teacher's p = 0.4: 0.4·log(0.4/0.25) + 0.6·log(0.6/0.75)
    one = TeacherTopK(torch.tensor([0]), torch.tensor([math.log(0.4)], dtype=torch.float64),
                      torch.tensor([0, 1]))  # fmt: skip
    out = logitless.linear_divergence(hidden, weight, labels, teacher_topk=one)
    value = 0.4 * math.log(0.4 / 0.25) + 0.6 * math.log(0.6 / 0.75)
    assert float(out.divergence) == pytest.approx(value, rel=1e-12)
    # the same buckets (teacher 0.4 | 0.6, student 0.25 | 0.75), reverse KL and the JSD
    out = logitless.linear_divergence(hidden, weight, labels, teacher_topk=one, beta=1.0)
    value = 0.25 * math.log(0.25 / 0.4) + 0.75 * math.log(0.75 / 0.6)
    assert float(out.divergence) == pytest.approx(value, rel=1e-12)
    out = logitless.linear_divergence(hidden, weight, labels, teacher_topk=one, beta=0.5)
    m = (0.325, 0.675)
    value = 0.5 * (0.4 * math.log(0.4 / m[0]) + 0.6 * math.log(0.6 / m[1])) + 0.5 * (
        0.25 * math.log(0.25 / m[0]) + 0.75 * math.log(0.75 / m[1])
    )
    assert float(out.divergence) == pytest.approx(value, rel=1e-12)
    for beta in (0.0, 0.5, 1.0):  # an empty row is all tail, for every beta
        out = logitless.linear_divergence(hidden, weight, labels, teacher_topk=empty, beta=beta)
        assert float(out.divergence) == 0.0


def test_reverse_kl_refuses_a_teacher_without_tail_only_where_it_is_used():
    """Beta 1 where the teacher's top-k mass is 1 but its ids miss part of the vocabulary:
    KL(student‖teacher) is infinite there, a ValueError naming the position; the JSD stays
    finite; an ignored position is not looked at."""
    hidden, weight, _, _, labels = _small(dtype=torch.float32)
    n = labels.numel()
    counts = torch.zeros(n, dtype=torch.long)
    counts[[2, 4]] = 2  # position 2 is ignored
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    half = torch.full((4,), math.log(0.5))
    full = TeacherTopK(torch.tensor([1, 2, 3, 4]), half, offsets)
    with pytest.raises(ValueError, match="beta=1: KL.* infinite at position 4"):
        logitless.linear_divergence(hidden, weight, labels, teacher_topk=full, beta=1.0)
    jsd = logitless.linear_divergence(hidden, weight, labels, teacher_topk=full, beta=0.9)
    assert bool(torch.isfinite(jsd.divergence).all())
    (g,) = torch.autograd.grad(jsd.divergence.sum(), hidden)
    assert bool(torch.isfinite(g).all())
    # position 2 (ignored) keeps its empty tail; position 4 gets a tail of 1 - 2/e
    ignored_only = full._replace(logprobs=torch.tensor([math.log(0.5)] * 2 + [-1.0] * 2))
    out = logitless.linear_divergence(hidden, weight, labels, teacher_topk=ignored_only, beta=1.0)
    assert bool(torch.isfinite(out.divergence).all())


def test_chunk_size_changes_nothing_beyond_rounding(small_tiles):
    hidden, weight, t_hidden, t_weight, labels = _small(n=23, v=1003, dtype=torch.float32)
    results = []
    for chunk in (1, 5, None):
        out = logitless.linear_divergence(
            hidden, weight, labels, t_hidden, t_weight, beta=0.4, chunk_size=chunk
        )
        results.append((out.divergence, *torch.autograd.grad(out.divergence.sum(), weight)))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_no_grad_and_frozen_student():
    hidden, weight, t_hidden, t_weight, labels = _small()
    with torch.no_grad():
        out = logitless.linear_divergence(hidden, weight, labels, t_hidden, t_weight, beta=0.5)
    assert out.divergence.grad_fn is None
    frozen = logitless.linear_divergence(
        hidden.detach(), weight.detach(), labels, t_hidden, t_weight, beta=0.5
    )
    assert not frozen.divergence.requires_grad
    torch.testing.assert_close(frozen.divergence, out.divergence, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="first-order"):
        d = logitless.linear_divergence(hidden, weight, labels, t_hidden, t_weight).divergence
        (g,) = torch.autograd.grad(d.sum(), hidden, create_graph=True)
        g.sum().backward()


def test_results_shape_and_optional_fields():
    hidden, weight, t_hidden, t_weight, labels = _small()
    out = logitless.linear_divergence(
        hidden.reshape(3, 3, -1), weight, labels.reshape(3, 3), t_hidden.reshape(3, 3, -1),
        t_weight, with_entropy=True,
    )  # fmt: skip
    assert isinstance(out, logitless.Divergence)
    assert out.divergence.shape == (3, 3) and out.entropy.shape == (3, 3)
    assert out.logprobs is None
    assert out.divergence.reshape(-1)[2] == 0 and out.entropy.reshape(-1)[2] == 0


def _bad_cases():
    hidden, weight, t_hidden, t_weight, labels = _small(dtype=torch.float32)
    h, w = hidden.detach(), weight.detach()
    topk = TeacherTopK(
        torch.tensor([1, 2]), torch.tensor([-0.5, -1.0]), torch.tensor([0, 2] + [2] * 8)
    )
    base = dict(hidden=h, weight=w, labels=labels, teacher_hidden=t_hidden, teacher_weight=t_weight)
    sparse = dict(hidden=h, weight=w, labels=labels, teacher_topk=topk)
    v = w.shape[0]
    return {
        "no teacher": (dict(hidden=h, weight=w, labels=labels), "needs a teacher"),
        "both teachers": (base | {"teacher_topk": topk}, "not both"),
        "teacher requires grad": (
            base | {"teacher_weight": t_weight.clone().requires_grad_()},
            "frozen",
        ),
        "teacher bias requires grad": (
            base | {"teacher_bias": torch.zeros(v, requires_grad=True)},
            "teacher_bias requires grad",
        ),
        "beta": (base | {"beta": 1.5}, "beta must be a float in"),
        "beta bool": (base | {"beta": True}, "beta must be"),
        "triton top-k": (sparse | {"backend": "triton"}, "teacher_topk .* runs on the torch"),
        "vocab mismatch": (base | {"teacher_weight": torch.randn(v + 3, 12)}, "pass vocab_size="),
        "vocab_size too large": (
            base | {"teacher_weight": torch.randn(v + 3, 12), "vocab_size": v + 1},
            "larger than",
        ),
        "teacher width": (base | {"teacher_weight": torch.randn(v, 5)}, "teacher_weight must be"),
        "teacher rows": (base | {"teacher_hidden": t_hidden[:4]}, "teacher_hidden must have one"),
        "teacher bias shape": (base | {"teacher_bias": torch.zeros(v + 1)}, "bias must be"),
        "padded teacher bias shape": (
            base
            | {
                "teacher_weight": torch.randn(v + 3, 12),
                "vocab_size": v,
                "teacher_bias": torch.zeros(v),
            },
            "teacher_bias must be",
        ),  # fmt: skip
        "teacher dtype": (base | {"teacher_hidden": t_hidden.double()}, "must share a dtype"),
        "label range": (base | {"labels": labels.clone().fill_(v)}, "labels must be in"),
        "teacher softcap": (base | {"teacher_softcap": -1.0}, "teacher_softcap must be"),
        "topk type": (sparse | {"teacher_topk": (1, 2, 3)}, "TeacherTopK"),
        "topk offsets": (
            sparse | {"teacher_topk": topk._replace(offsets=topk.offsets[:5])},
            "offsets must have",
        ),
        "topk id range": (
            sparse | {"teacher_topk": topk._replace(token_ids=torch.tensor([1, v]))},
            "token ids",
        ),
        "topk duplicate": (
            sparse | {"teacher_topk": topk._replace(token_ids=torch.tensor([4, 4]))},
            "duplicate",
        ),
        "topk positive logprob": (
            sparse | {"teacher_topk": topk._replace(logprobs=torch.tensor([0.5, -1.0]))},
            "finite log-probabilities",
        ),
        "topk mass": (
            sparse | {"teacher_topk": topk._replace(logprobs=torch.tensor([-0.1, -0.2]))},
            "sum to at most 1",
        ),
        "topk bf16": (
            sparse | {"teacher_topk": topk._replace(logprobs=topk.logprobs.bfloat16())},
            "float32 or float64",
        ),
        "topk with teacher transform": (sparse | {"teacher_softcap": 3.0}, "given as they are"),
    }


BAD = _bad_cases()


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_raises_before_any_work(name):
    kwargs, message = BAD[name]
    with pytest.raises(ValueError, match=message):
        logitless.linear_divergence(**kwargs)


def test_bench_distill_methods_run_in_process():
    """Every method of ``logitless bench --task distill`` builds and steps on a tiny workload
    (TRL's when importable), leaving the student's gradients finite."""
    from logitless.apps.bench.methods import TASKS
    from logitless.apps.bench.workload import Workload
    from logitless.apps.bench.workload import make_inputs as bench_inputs

    work = Workload("distill", 24, 16, 211, 0.5, "float32", "cpu", 1, 1)
    for name, method in TASKS["distill"].items():
        if method.unavailable(work) is not None:
            continue
        inputs = bench_inputs(work)
        method.build(work, inputs)()
        if method.role != "floor":
            assert bool(torch.isfinite(inputs.weight.grad).all()), name


class _ReadCounter(_Detector):
    """Counts the host reads of tests/_host_reads.py (instead of raising on the first)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except HostRead as e:
            self.reads.append(str(e))
            return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("beta", [0.0, 0.4])
def test_a_dense_call_reads_the_device_once(beta, monkeypatch):
    """Both heads' checks (labels, temperature, the valid-row count) share one host read: the
    teacher's reuses the student's values; forward and backward read nothing more."""
    counter = _ReadCounter()
    tolist = torch.Tensor.tolist

    def counted_tolist(self, *args, **kwargs):
        counter.reads.append("tolist")
        with torch.utils._python_dispatch._disable_current_modes():
            return tolist(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    hidden, weight, t_hidden, t_weight, labels = _small(dtype=torch.float32)
    temperature = torch.rand(labels.shape) + 0.5
    with counter:
        out = logitless.linear_divergence(
            hidden, weight, labels, t_hidden, t_weight, beta=beta, temperature=temperature,
            with_entropy=True,
        )  # fmt: skip
        out.divergence.sum().backward()
    assert counter.reads == ["tolist"], counter.reads
