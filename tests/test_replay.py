"""Sampling replay (issue 18): log-probs, entropy and gradients over each row's kept set.

Three-way comparisons as in test_head.py: the op, ``logitless.reference`` (a masked
log-softmax over full logits) in the same dtype, and a float64 truth written out below; the
op passes when its error is no worse than ``K`` times the reference's (``_tolerance.py``),
under random upstream gradients for log-probs and entropy.

The kept set itself is a discrete function of the logits: a token at the top-k / top-p
boundary can flip between dtypes. The random inputs here pick their sampler parameters per
row in the middle of a gap (``_safe_params``) and every case first checks that the
reference's kept sets equal the float64 ones; the op's ``kept_size`` and ``label_added`` must
then match the reference's exactly. Ties are tested on logits that are exact in fp32
(small integers), where every implementation sees the same values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from _tolerance import assert_no_worse_than_reference

import logitless
from logitless import PolicyLossConfig, SamplingMask, reference
from logitless.contract.replay import ReplayArgs
from logitless.ops.replay import topk_stream

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture
def small_tiles(monkeypatch):
    """Cut the vocabulary into many tiles (the streaming top-k merges across them)."""
    from logitless.backends import base

    monkeypatch.setattr(base, "_TILE_ELEMS", {"cpu": 1024}, raising=True)


@pytest.fixture
def few_candidates(monkeypatch):
    """A first guess of 8 candidates for rows without top-k: top-p sets get widened."""
    monkeypatch.setattr(topk_stream, "DEFAULT_CANDIDATES", 8, raising=True)


# --------------------------------------------------------------------------------------------
# float64 truth: plain torch, given the kept set as a [..., V] mask
# --------------------------------------------------------------------------------------------


def _logits64(hidden, weight, bias, temperature, softcap):
    """float64 sampler logits ``softcap(h·Wᵀ + b) / T`` [..., V] (autograd-tracked)."""
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if isinstance(temperature, torch.Tensor):
        return z / temperature.double()[..., None]
    return z / temperature


def truth_masked(z, labels, keep, ignore_index=-100):
    """float64 log-prob and entropy over each row's kept set ``keep`` [..., V]; 0 at ignored."""
    valid = labels != ignore_index
    zm = z.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(zm, -1, keepdim=True)
    logq = (zm - lse).masked_fill(~keep, 0.0)  # log p over K, 0 outside (no 0·inf)
    p = logq.exp() * keep
    y = torch.where(valid, labels, 0)
    logp = logq.gather(-1, y[..., None])[..., 0]
    ent = -(p * logq).sum(-1)
    zero = z.new_zeros(())
    return torch.where(valid, logp, zero), torch.where(valid, ent, zero)


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    mode: str  # mask | topk | topp | topk_topp | minp | all
    dtype: str = "fp32"
    shape: tuple = (53,)
    H: int = 24
    V: int = 257
    bias: bool = False
    temperature: str = "one"  # one | scalar | tensor
    softcap: float | None = None
    chunk: int | None = None
    ignore: float = 0.25
    per_row: bool = True  # sampler parameters as per-row tensors (else one scalar each)
    small_tiles: bool = False
    loss: str = "both"  # both | logp | ent
    with_entropy: bool = True
    seed: int = 0

    @property
    def id(self) -> str:
        parts = [self.mode, self.dtype, "x".join(map(str, self.shape)), f"V{self.V}"]
        parts += ["bias"] if self.bias else []
        parts += [f"T-{self.temperature}"] if self.temperature != "one" else []
        parts += [f"cap{self.softcap}"] if self.softcap else []
        parts += [f"chunk{self.chunk}"] if self.chunk else []
        parts += ["scalar"] if not self.per_row else []
        parts += ["smalltiles"] if self.small_tiles else []
        parts += [f"loss-{self.loss}"] if self.loss != "both" else []
        parts += ["noent"] if not self.with_entropy else []
        parts += [f"s{self.seed}"] if self.seed else []
        return "-".join(parts)


def _inputs(case: Case) -> dict:
    g = torch.Generator().manual_seed(100 + case.seed)
    dt = DTYPES[case.dtype]
    hidden = torch.randn(*case.shape, case.H, generator=g)
    weight = torch.randn(case.V, case.H, generator=g) * (3.0 / math.sqrt(case.H))
    bias = None
    if case.bias:
        bias = torch.randn(case.V, generator=g)
        bias[0] = bias[-1] = 4.0  # the vocabulary's first and last id are likely kept
    labels = torch.randint(0, case.V, case.shape, generator=g)
    labels[torch.rand(case.shape, generator=g) < case.ignore] = -100
    labels.view(-1)[0] = -100
    temperature = {
        "one": 1.0,
        "scalar": 0.7,
        "tensor": torch.rand(case.shape, generator=g) * 1.5 + 0.5,
    }[case.temperature]
    return {
        "hidden": hidden.to(dt),
        "weight": weight.to(dt),
        "bias": None if bias is None else bias.to(dt),
        "labels": labels,
        "temperature": temperature,
        "g": torch.randn(case.shape, generator=g),
        "e": torch.randn(case.shape, generator=g),
        "gen": g,
    }


def _safe_params(case: Case, z64: torch.Tensor, g: torch.Generator) -> dict:
    """Sampler parameters per row whose boundaries sit mid-gap in the float64 logits ``z64``
    [N, V], so rounding cannot move a token across them: the k-th value and the min-p cut
    where the gap between neighbours is widest, top-p halfway through one token's mass. A
    row without a wide enough gap is left untruncated by that parameter."""
    n, vocab = z64.shape
    tol = 0.15 if case.dtype == "bf16" else 1e-3  # logit error the boundaries must exceed
    sv = z64.sort(-1, descending=True).values
    out = {}
    kk = torch.full((n,), vocab, dtype=torch.int64)
    if case.mode in ("topk", "topk_topp", "all"):
        lo, hi = 2, min(40, vocab - 1)
        gaps = sv[:, lo - 1 : hi - 1] - sv[:, lo:hi]  # gap after the k-th value, k in [lo, hi)
        best, arg = gaps.max(1)
        kk = torch.where(best > 2 * tol, arg + lo, vocab)
        out["top_k"] = kk
    if case.mode in ("minp", "all"):
        gaps = sv[:, 2:24] - sv[:, 3:25]
        best, arg = gaps.max(1)
        j = arg + 3  # cut between the j-th and (j+1)-th value
        cut = (sv.gather(1, j[:, None] - 1) + sv.gather(1, j[:, None]))[:, 0] / 2
        min_p = torch.where(best > 2 * tol, (cut - sv[:, 0]).exp(), 0.0)
        out["min_p"] = min_p
        kk = torch.where(best > 2 * tol, torch.minimum(kk, j), kk)
    if case.mode in ("topp", "topk_topp", "all"):
        width = torch.arange(vocab)[None, :] < kk[:, None]
        mass = torch.where(width, (sv - sv[:, :1]).exp(), 0.0)
        mass = mass / mass.sum(1, keepdim=True)
        excl = mass.cumsum(1) - mass
        most = 2 if case.dtype == "bf16" else 6
        j = torch.randint(0, most, (n,), generator=g).clamp(max=(kk - 2).clamp(min=0))
        # p between the mass before token j and the mass through it: tokens 0..j kept, and
        # a logit gap after token j
        p = excl.gather(1, j[:, None])[:, 0] + 0.5 * mass.gather(1, j[:, None])[:, 0]
        gap = (sv.gather(1, j[:, None]) - sv.gather(1, j[:, None] + 1))[:, 0]
        out["top_p"] = torch.where((kk >= 2) & (gap > 2 * tol), p.clamp(1e-3, 1.0), 1.0)
    if not case.per_row:  # one value, the row median: checked for safety by the case
        out = {k: v.median() for k, v in out.items()}
        out = {k: int(v) if k == "top_k" else float(v) for k, v in out.items()}
    return out


def _mask(case: Case, g: torch.Generator, labels: torch.Tensor) -> SamplingMask:
    """A CSR mask: 0-12 distinct ids per position (20% empty: not truncated), usually the
    label among them, some positions keeping the first and last vocabulary ids."""
    n = labels.numel()
    ids = []
    for i in range(n):
        k = 0 if torch.rand((), generator=g) < 0.2 else int(torch.randint(1, 13, (), generator=g))
        row = torch.randperm(case.V, generator=g)[:k].tolist()
        y = int(labels.view(-1)[i])
        if k and y >= 0 and torch.rand((), generator=g) < 0.7 and y not in row:
            row[0] = y
        if k and i % 5 == 1:
            row[-1] = 0 if 0 not in row else row[-1]
            row[0] = case.V - 1 if case.V - 1 not in row else row[0]
        ids.append(torch.tensor(sorted(set(row)), dtype=torch.int64))
    counts = torch.tensor([t.numel() for t in ids])
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    return SamplingMask(torch.cat(ids), offsets)


def _replay_kwargs(case: Case, inp: dict) -> dict:
    z64 = _logits64(
        inp["hidden"], inp["weight"], inp["bias"], inp["temperature"], case.softcap
    ).reshape(-1, case.V)
    if case.mode == "mask":
        return {"sampling_mask": _mask(case, inp["gen"], inp["labels"])}
    params = _safe_params(case, z64, inp["gen"])
    shape = inp["labels"].shape
    return {k: v.reshape(shape) if isinstance(v, torch.Tensor) else v for k, v in params.items()}


def _leaf(t, dtype=None):
    if t is None:
        return None
    return t.detach().to(dtype or t.dtype).clone().requires_grad_()


def _loss(out_lp, out_ent, inp, which):
    terms = []
    if which in ("both", "logp"):
        terms.append((out_lp * inp["g"].to(out_lp.dtype)).sum())
    if which in ("both", "ent") and out_ent is not None:
        terms.append((out_ent * inp["e"].to(out_ent.dtype)).sum())
    return sum(terms)


def run(fn, case: Case, inp: dict, replay: dict, **extra) -> dict:
    leaves = {k: _leaf(inp[k]) for k in ("hidden", "weight", "bias")}
    out = fn(
        leaves["hidden"],
        leaves["weight"],
        inp["labels"],
        bias=leaves["bias"],
        temperature=inp["temperature"],
        softcap=case.softcap,
        with_entropy=case.with_entropy,
        chunk_size=case.chunk,
        with_kept_mass=True,
        **replay,
        **extra,
    )
    _loss(out.logprobs, out.entropy, inp, case.loss).backward()
    res = {"out": out, "logp": out.logprobs.detach()}
    res["ent"] = None if out.entropy is None else out.entropy.detach()
    for k, t in leaves.items():
        res[f"grad_{k}"] = None if t is None else t.grad
    return res


def _kept_mask(case, inp, replay, z):
    """The reference's [N, V] kept sets on logits ``z`` [N, V] (label included)."""
    args = _replay_args(case, inp, replay)
    y = inp["labels"].reshape(-1).clamp(min=0)
    return reference.kept_set(z, y, args)[0]


def _replay_args(case, inp, replay):
    from logitless.contract.head import check_head_call
    from logitless.contract.options import HeadOptions, SamplerOptions

    h, w = inp["hidden"].float(), inp["weight"].float()
    call = check_head_call(h, w, inp["labels"], None, HeadOptions(), SamplerOptions(**replay))
    return call.replay


def _to(obj, device: torch.device | str):
    """``obj`` with its tensors on ``device`` (a SamplingMask keeps its type)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, SamplingMask):
        return SamplingMask(*(t.to(device) for t in obj))
    return obj


def check_case(case: Case, backend: str = "auto", device: str = "cpu") -> None:
    """The op against the masked-log-softmax reference and a float64 truth on ``device`` (the
    inputs and kept sets are built on the CPU, then moved: the same case on every device)."""
    inp = _inputs(case)
    replay = _replay_kwargs(case, inp)
    inp = {k: v if k == "gen" else _to(v, device) for k, v in inp.items()}
    replay = {k: _to(v, device) for k, v in replay.items()}
    op_fn = logitless.linear_logprobs
    if backend != "auto":

        def op_fn(*a, **k):
            return logitless.linear_logprobs(*a, backend=backend, **k)

    op = run(op_fn, case, inp, replay)
    ref = run(reference.linear_logprobs, case, inp, replay)

    # The kept sets: float64 and the reference's dtype agree (the inputs are safe), and the
    # op reports the reference's sizes and added labels exactly.
    leaves64 = {k: _leaf(inp[k], torch.float64) for k in ("hidden", "weight", "bias")}
    z64 = _logits64(
        leaves64["hidden"], leaves64["weight"], leaves64["bias"], inp["temperature"], case.softcap
    )
    with torch.no_grad():
        dt = DTYPES[case.dtype]
        b = None if inp["bias"] is None else inp["bias"]
        z_ref = torch.nn.functional.linear(inp["hidden"], inp["weight"], b).float()
        if case.softcap is not None:
            z_ref = case.softcap * torch.tanh(z_ref / case.softcap)
        t = inp["temperature"]
        z_ref = z_ref / (t[..., None] if isinstance(t, torch.Tensor) else t)
        keep_ref = _kept_mask(case, inp, replay, z_ref.reshape(-1, case.V))
        keep64 = _kept_mask(case, inp, replay, z64.detach().reshape(-1, case.V))
    valid = (inp["labels"] != -100).reshape(-1)
    assert torch.equal(keep_ref[valid], keep64[valid]), (
        f"test input not safe in {dt}: a kept-set boundary lies within rounding"
    )
    o, r = op["out"], ref["out"]
    assert torch.equal(o.kept_size, r.kept_size), "kept_size differs from the reference"
    assert torch.equal(o.label_added, r.label_added), "label_added differs from the reference"
    assert o.kept_size.dtype == torch.int64 and o.label_added.dtype == torch.bool

    lp64, ent64 = truth_masked(z64, inp["labels"], keep64.reshape(z64.shape))
    (_loss(lp64, ent64 if case.with_entropy else None, inp, case.loss)).backward()
    truth = {"logp": lp64.detach(), "ent": ent64.detach()}
    for k, t_ in leaves64.items():
        truth[f"grad_{k}"] = None if t_ is None else t_.grad

    ignored = inp["labels"] == -100
    assert op["logp"].dtype == torch.float32 and bool((op["logp"][ignored] == 0).all())
    assert_no_worse_than_reference(op["logp"], ref["logp"], truth["logp"], "logprobs")
    if case.with_entropy:
        assert bool((op["ent"][ignored] == 0).all())
        assert_no_worse_than_reference(op["ent"], ref["ent"], truth["ent"], "entropy")
    else:
        assert op["ent"] is None
    for k in ("hidden", "weight", "bias"):
        name = f"grad_{k}"
        if inp[k] is None:
            continue
        assert op[name].dtype == inp[k].dtype, name
        assert_no_worse_than_reference(op[name], ref[name], truth[name], name)
    assert bool((op["grad_hidden"][ignored] == 0).all()), "ignored rows got a gradient"
    # the kept mass under the full softmax (no gradient): as close as the reference's
    with torch.no_grad():
        full = torch.logsumexp(z64, -1)
        masked = torch.logsumexp(z64.masked_fill(~keep64.reshape(z64.shape), -math.inf), -1)
        mass64 = torch.where(ignored, 0.0, masked - full)
    assert_no_worse_than_reference(
        o.log_kept_mass, r.log_kept_mass, mass64, "log_kept_mass", floor=1e-6
    )


_BF16 = Case("topk", dtype="bf16", shape=(29,), H=16, V=131)
CASES = [
    Case("mask"),
    Case("mask", bias=True, temperature="tensor", chunk=7),
    Case("mask", softcap=3.0, temperature="scalar", shape=(3, 17), loss="ent"),
    Case("mask", with_entropy=False, loss="logp", ignore=0.0),
    Case("topk", bias=True),
    Case("topk", temperature="tensor", chunk=5, small_tiles=True, V=1003),
    Case("topk", per_row=False, softcap=2.5, shape=(2, 19)),
    Case("topp", bias=True, temperature="scalar"),
    Case("topp", small_tiles=True, chunk=11, loss="logp"),
    Case("topk_topp", bias=True, temperature="tensor", small_tiles=True),
    Case("topk_topp", per_row=False, V=1003, shape=(37,)),
    Case("minp", chunk=3),
    Case("all", bias=True, temperature="tensor", softcap=4.0, small_tiles=True, V=700, seed=1),
    Case("all", shape=(4, 13), loss="ent"),
    Case("mask", dtype="bf16", shape=(29,), H=16, V=131, bias=True),
    _BF16,
    replace(_BF16, mode="topk_topp", temperature="tensor", chunk=7),
    replace(_BF16, mode="all", small_tiles=True, seed=2),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_reference(case, request):
    if case.small_tiles:
        request.getfixturevalue("small_tiles")
    check_case(case)


def test_top_p_wider_than_the_first_candidates(few_candidates, small_tiles):
    """Top-p sets larger than the first guess of candidates are streamed again, wider."""
    case = Case("topp", V=300, seed=3)
    check_case(case)
    inp = _inputs(case)
    out = logitless.linear_logprobs(
        inp["hidden"], inp["weight"], inp["labels"], top_p=0.97, with_kept_mass=True
    )
    ref = reference.linear_logprobs(
        inp["hidden"], inp["weight"], inp["labels"], top_p=0.97, with_kept_mass=True
    )
    assert int(out.kept_size.max()) > 8, "the case did not need wider candidates"
    assert torch.equal(out.kept_size, ref.kept_size)
    torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Ties, boundaries, degenerate parameters
# --------------------------------------------------------------------------------------------


def _integer_logits(n=23, vocab=700, h=6, seed=0):
    """Inputs whose logits are small integers, exact in fp32 in any summation order: many
    ties at every rank."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-1, 2, (n, h), generator=g).float()
    weight = torch.randint(-2, 3, (vocab, h), generator=g).float()
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::7] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("tiles", [False, True], ids=["one-tile", "small-tiles"])
@pytest.mark.parametrize(
    "params",
    [
        {"top_k": 5},
        {"top_k": 1},
        {"top_k": 20, "top_p": 0.5},
        {"top_p": 0.3},
        {"min_p": 0.1},
        {"top_k": 9, "min_p": 0.3, "top_p": 0.8},
    ],
    ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()),
)
def test_ties_at_the_boundary_are_kept(params, tiles, request):
    """Integer logits: the k-th value (and the top-p / min-p boundary) is shared by several
    tokens, more than fit in k candidates; all of them are kept, in the op as in the
    reference, and the results agree. With small tiles the vocabulary spans 3 tiles, so the
    ties are counted across the running candidates' merges."""
    if tiles:
        request.getfixturevalue("small_tiles")
    hidden, weight, labels = _integer_logits()
    z = hidden @ weight.t()
    if "top_k" in params:  # the setting really has ties at the k-th value
        kth = z.sort(-1, descending=True).values[:, params["top_k"] - 1 : params["top_k"]]
        assert int(((z == kth).sum(1) > 1).sum()) > 5
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = logitless.linear_logprobs(h, w, labels, with_entropy=True, **params)
    ref = reference.linear_logprobs(h2, w2, labels, with_entropy=True, **params)
    assert torch.equal(out.kept_size, ref.kept_size)
    assert torch.equal(out.label_added, ref.label_added)
    if "top_k" in params and "top_p" not in params and "min_p" not in params:
        valid = labels != -100
        ge = (z >= kth).sum(1)  # every token tied with the k-th value
        assert torch.equal(out.kept_size[valid], (ge + out.label_added.long())[valid])
    torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=4e-6, atol=2e-6)
    torch.testing.assert_close(out.entropy, ref.entropy, rtol=4e-6, atol=2e-6)
    g = torch.randn(labels.shape)
    (out.logprobs * g + out.entropy).sum().backward()
    (ref.logprobs * g + ref.entropy).sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("params", [{"top_k": 5}, {"top_k": 20, "top_p": 0.5}, {"top_p": 0.3}])
def test_accelerator_schedule_without_host_filter(params, monkeypatch, small_tiles):
    """The merge-every-tile schedule used on accelerators (no host read per tile), on CPU."""
    monkeypatch.setattr(topk_stream, "_host_filter", lambda device: False)
    hidden, weight, labels = _integer_logits()
    out = logitless.linear_logprobs(hidden, weight, labels, with_entropy=True, **params)
    ref = reference.linear_logprobs(hidden, weight, labels, with_entropy=True, **params)
    assert torch.equal(out.kept_size, ref.kept_size)
    torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=4e-6, atol=2e-6)
    if params == {"top_k": 5}:  # and gradients, on random logits
        check_case(Case("all", bias=True, small_tiles=True, V=700, seed=4))


def test_reference_kept_set_matches_vllm_semantics():
    """``reference.kept_set`` against the sampler's algorithm written the way vLLM writes it
    (ascending sort, top-k by the k-th value, top-p by the ascending cumulative sum, the last
    token always kept), on tie-free logits."""
    g = torch.Generator().manual_seed(5)
    n, vocab = 40, 50
    z = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2
    k = torch.randint(1, vocab + 3, (n,), generator=g)
    p = torch.rand(n, generator=g, dtype=torch.float64) * 0.9 + 0.05
    p[::5] = 1.0

    logits_sort, idx = z.sort(-1)
    kk = k.clamp(max=vocab)
    kth = logits_sort.gather(1, (vocab - kk)[:, None])
    ls = logits_sort.masked_fill(logits_sort < kth, -math.inf)
    probs_sum = ls.softmax(-1).cumsum(-1)
    drop = probs_sum <= 1 - p[:, None]
    drop[:, -1] = False
    ls = ls.masked_fill(drop, -math.inf)
    vllm_keep = torch.zeros_like(z, dtype=torch.bool).scatter(1, idx, ls > -math.inf)

    labels = z.argmax(1)  # always kept: no label is added
    args = ReplayArgs(vocab, top_k=k, top_p=p)
    keep, added = reference.kept_set(z, labels, args)
    assert not bool(added.any())
    assert torch.equal(keep, vllm_keep)


def test_top_p_one_and_top_k_at_least_v_are_the_full_vocabulary():
    inp = _inputs(Case("topk"))
    h, w, y = inp["hidden"], inp["weight"], inp["labels"]
    plain = logitless.linear_logprobs(h, w, y, with_entropy=True)
    for params in ({"top_p": 1.0}, {"top_k": 257}, {"top_k": 10**6}, {"min_p": 0.0}):
        out = logitless.linear_logprobs(h, w, y, with_entropy=True, with_kept_mass=True, **params)
        assert torch.equal(out.logprobs, plain.logprobs), params
        assert torch.equal(out.entropy, plain.entropy), params
        valid = y != -100
        assert bool((out.kept_size[valid] == 257).all()) and not bool(out.label_added.any())
        assert bool((out.log_kept_mass == 0).all())
    # top_k >= V with a top-p: top-p over the whole vocabulary
    a = logitless.linear_logprobs(h, w, y, top_k=300, top_p=0.7)
    b = logitless.linear_logprobs(h, w, y, top_p=0.7)
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.kept_size, b.kept_size)


@pytest.mark.parametrize("k", [2**62, 2**63, 2**200])
def test_top_k_beyond_int64_means_not_truncated(k):
    """Any top_k >= V keeps the whole row, also one that no int64 holds (issue 21: it raised
    torch's raw overflow error from deep inside)."""
    inp = _inputs(Case("topk"))
    h, w, y = inp["hidden"], inp["weight"], inp["labels"]
    got = logitless.linear_logprobs(h, w, y, top_k=k, with_entropy=True)
    want = logitless.linear_logprobs(h, w, y, with_entropy=True)
    assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.entropy, want.entropy)
    assert int(got.kept_size.max()) == w.shape[0]
    ref = reference.linear_logprobs(h, w, y, top_k=k)
    torch.testing.assert_close(ref.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)


def test_label_added_is_counted_and_changes_the_normalizer():
    """A label outside the kept set is added to it: logp = z_y - logsumexp(z[K ∪ {y}])."""
    hidden = torch.zeros(2, 1)
    weight = torch.zeros(4, 1)
    bias = torch.tensor([2.0, 1.0, 0.0, -1.0])
    labels = torch.tensor([3, 0])
    out = logitless.linear_logprobs(hidden, weight, labels, bias=bias, top_k=2, with_entropy=True)
    assert out.label_added.tolist() == [True, False]
    assert out.kept_size.tolist() == [3, 2]
    want0 = -1.0 - torch.logsumexp(torch.tensor([2.0, 1.0, -1.0]), 0)
    want1 = 2.0 - torch.logsumexp(torch.tensor([2.0, 1.0]), 0)
    torch.testing.assert_close(out.logprobs, torch.stack([want0, want1]))


def test_chunk_size_and_tiling_change_nothing_beyond_rounding(monkeypatch):
    case = Case("all", bias=True, temperature="tensor", softcap=3.0)
    inp = _inputs(case)
    replay = _replay_kwargs(case, inp)
    base = run(logitless.linear_logprobs, case, inp, replay)
    from logitless.backends import base as kernel_base

    for chunk, tile in ((1, None), (7, None), (200, None), (7, 1024), (None, 512)):
        if tile is not None:
            monkeypatch.setattr(kernel_base, "_TILE_ELEMS", {"cpu": tile})
        other = run(logitless.linear_logprobs, replace(case, chunk=chunk), inp, replay)
        assert torch.equal(other["out"].kept_size, base["out"].kept_size)
        for k in ("logp", "ent", "grad_hidden", "grad_weight", "grad_bias"):
            scale = max(1.0, float(base[k].abs().max()))
            torch.testing.assert_close(other[k], base[k], rtol=0, atol=1e-5 * scale, msg=k)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_same_outputs(mode):
    case = Case("topk_topp", bias=True)
    inp = _inputs(case)
    replay = _replay_kwargs(case, inp)
    kw = dict(bias=inp["bias"], with_entropy=True, with_kept_mass=True, **replay)
    h, w = inp["hidden"].requires_grad_(), inp["weight"].requires_grad_()
    want = logitless.linear_logprobs(h, w, inp["labels"], **kw)
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        got = logitless.linear_logprobs(h, w, inp["labels"], **kw)
    assert got.logprobs.grad_fn is None
    torch.testing.assert_close(got.logprobs, want.logprobs.detach(), rtol=0, atol=1e-6)
    assert torch.equal(got.kept_size, want.kept_size)


def test_backward_twice_with_retain_graph():
    # a mask with empty rows: the full rows keep their single tile for the first backward
    case = Case("mask", bias=True)
    inp = _inputs(case)
    replay = _replay_kwargs(case, inp)
    h, w = _leaf(inp["hidden"]), _leaf(inp["weight"])
    out = logitless.linear_logprobs(h, w, inp["labels"], with_entropy=True, **replay)
    loss = _loss(out.logprobs, out.entropy, inp, "both")
    loss.backward(retain_graph=True)
    first = h.grad.clone(), w.grad.clone()
    loss.backward()
    torch.testing.assert_close(h.grad, 2 * first[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(w.grad, 2 * first[1], rtol=0, atol=1e-5)


_FLOAT64_REPLAYS = {
    "mask": lambda n: {"sampling_mask": _distinct_ids(n, 4, 13, empty_row=5)},
    "topk_topp": lambda n: {"top_k": 5, "top_p": 0.9},
    "topp_minp": lambda n: {"top_p": 0.7, "min_p": 0.05},
    "topk_per_row": lambda n: {"top_k": torch.tensor([3, 100, 7, 2, 13, 4]).repeat(n)[:n]},
}


def _distinct_ids(n: int, k: int, vocab: int, *, empty_row: int) -> torch.Tensor:
    """[n, k] padded kept ids, distinct in each row, one row empty (not truncated)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)])
    ids[empty_row] = -1
    return ids


@pytest.mark.slow  # gradcheck: seconds per case
@pytest.mark.parametrize("kind", list(_FLOAT64_REPLAYS), ids=list(_FLOAT64_REPLAYS))
def test_float64_head_gradcheck(kind):
    """A float64 head with replay computes in float64 (issue 21: the replay buffers, the
    kept-entry logits and the streaming candidates were fp32, 5e-7 off), so finite differences
    hold at gradcheck's float64 tolerances, with bias, softcap, temperature, an ignored row
    and (for a mask) an untruncated row."""
    g = torch.Generator().manual_seed(3)
    n, vocab = 9, 13
    hidden = torch.randn(n, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(vocab, 5, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(vocab, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[2] = -100
    replay = _FLOAT64_REPLAYS[kind](n)

    def fn(h, w, b):
        out = logitless.linear_logprobs(
            h, w, labels, bias=b, softcap=3.0, temperature=0.7, with_entropy=True,
            with_kept_mass=True, chunk_size=4, **replay,
        )  # fmt: skip
        assert out.logprobs.dtype == out.entropy.dtype == out.log_kept_mass.dtype
        assert out.logprobs.dtype == torch.float64
        return out.logprobs, out.entropy

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))
    # the fused loss over the same kept sets: float64 loss, gradients equal to the composed
    old = torch.zeros(n, dtype=torch.float64).masked_fill(labels != -100, -2.0)
    adv = torch.randn(n, dtype=torch.float64, generator=g)
    cfg = PolicyLossConfig(entropy_coef=0.01)
    kw = dict(bias=bias, softcap=3.0, temperature=0.7, **replay)
    docs = torch.zeros(n, dtype=torch.int64)
    loss, _ = logitless.fused_policy_loss(
        hidden, weight, labels, old, adv, config=cfg, document_ids=docs, **kw
    )
    assert loss.dtype == torch.float64
    grads = torch.autograd.grad(loss, (hidden, weight, bias))
    out = logitless.linear_logprobs(hidden, weight, labels, with_entropy=True, **kw)
    want, _ = logitless.policy_loss(
        out.logprobs, old, adv, labels != -100, config=cfg, document_ids=docs,
        entropy=out.entropy,
    )  # fmt: skip
    for got, exp in zip(grads, torch.autograd.grad(want, (hidden, weight, bias)), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-12, atol=1e-13)


def test_unpacks_like_logprobs():
    inp = _inputs(Case("topk"))
    out = logitless.linear_logprobs(
        inp["hidden"], inp["weight"], inp["labels"], top_k=3, with_entropy=True
    )
    lp, ent = out  # two items, as before replay
    assert isinstance(out, logitless.LogProbs) and len(out) == 2
    assert lp is out.logprobs and ent is out.entropy
    plain = logitless.linear_logprobs(inp["hidden"], inp["weight"], inp["labels"])
    assert plain.label_added is None and plain.kept_size is None
    assert out._replace(entropy=None).kept_size is out.kept_size
    import pickle

    again = pickle.loads(pickle.dumps(out))
    assert torch.equal(again.kept_size, out.kept_size)


# --------------------------------------------------------------------------------------------
# Packed documents, the fused loss, modules
# --------------------------------------------------------------------------------------------


def test_packed_documents_match_each_document_alone():
    """Replay is per position: a packed stream gives each document's own results."""
    g = torch.Generator().manual_seed(7)
    vocab, h = 211, 16
    cu = torch.tensor([0, 9, 31, 32, 47])
    ids = torch.randint(0, vocab, (53,), generator=g)
    labels = logitless.next_token_labels(ids, cu_seqlens=cu)
    hidden = torch.randn(53, h, generator=g)
    weight = torch.randn(vocab, h, generator=g) * 0.8
    k = torch.randint(2, 30, (53,), generator=g)
    p = torch.rand(53, generator=g).double() * 0.5 + 0.45
    mask = _mask(Case("mask", V=vocab), g, labels)
    padded = mask.to_padded()
    for replay in ({"top_k": k, "top_p": p}, {"sampling_mask": mask}):
        packed = logitless.linear_logprobs(hidden, weight, labels, with_entropy=True, **replay)
        for d in range(4):
            s, e = int(cu[d]), int(cu[d + 1])
            if "sampling_mask" in replay:
                sub = {"sampling_mask": padded[s:e]}
            else:
                sub = {"top_k": k[s:e], "top_p": p[s:e]}
            alone = logitless.linear_logprobs(
                hidden[s:e], weight, labels[s:e], with_entropy=True, **sub
            )
            torch.testing.assert_close(packed.logprobs[s:e], alone.logprobs, rtol=0, atol=1e-6)
            torch.testing.assert_close(packed.entropy[s:e], alone.entropy, rtol=0, atol=1e-6)
            assert torch.equal(packed.kept_size[s:e], alone.kept_size)


_LOSSES = {
    "grpo_entropy": PolicyLossConfig(entropy_coef=0.01, kl_coef=0.05),
    "gspo": PolicyLossConfig(ratio_level="sequence", aggregation="seq_mean_token_mean"),
}


@pytest.mark.parametrize("config", list(_LOSSES), ids=list(_LOSSES))
@pytest.mark.parametrize("mode", ["mask", "all"])
def test_fused_loss_equals_composed(config, mode):
    cfg = _LOSSES[config]
    case = Case(mode, shape=(3, 17), bias=True, temperature="tensor")
    inp = _inputs(case)
    replay = _replay_kwargs(case, inp)
    labels = inp["labels"]
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        base = reference.linear_logprobs(
            inp["hidden"], inp["weight"], labels, bias=inp["bias"], **replay
        ).logprobs
    old = torch.where(labels != -100, base + 0.1 * torch.randn(labels.shape, generator=g), 0.0)
    adv = torch.randn(3, generator=g)
    results = []
    for kind in ("fused", "composed", "truth"):
        dt = torch.float64 if kind == "truth" else torch.float32
        leaves = {k: _leaf(inp[k], dt) for k in ("hidden", "weight", "bias")}
        head = dict(bias=leaves["bias"], temperature=inp["temperature"], **replay)
        if kind == "fused":
            loss, metrics = logitless.fused_policy_loss(
                leaves["hidden"],
                leaves["weight"],
                labels,
                old,
                adv,
                config=cfg,
                ref_logprobs=old,
                with_kept_mass=True,
                **head,
            )
        else:
            fn = logitless.linear_logprobs if kind == "composed" else reference.linear_logprobs
            out = fn(
                leaves["hidden"],
                leaves["weight"],
                labels,
                with_entropy=cfg.entropy_coef != 0,
                with_kept_mass=True,
                **head,
            )
            loss, metrics = logitless.policy_loss(
                out.logprobs,
                old.to(dt),
                adv.to(dt),
                labels != -100,
                config=cfg,
                ref_logprobs=old.to(dt),
                entropy=out.entropy,
            )
            valid = labels != -100
            metrics["replay_kept_size"] = out.kept_size[valid].double().mean()
            metrics["replay_label_added"] = out.label_added.sum().double()
            metrics["replay_log_kept_mass"] = out.log_kept_mass[valid].double().mean()
        (loss * 0.7).backward()
        res = {"loss": loss.detach()} | {k: v.detach() for k, v in metrics.items()}
        res |= {f"grad_{k}": t.grad for k, t in leaves.items()}
        results.append(res)
    fused, composed, truth = results
    for key in ("loss", "grad_hidden", "grad_weight", "grad_bias"):
        n_valid = int((labels != -100).sum())
        floor = 1.2e-7 * (n_valid if truth[key].dim() == 0 else 1)
        assert_no_worse_than_reference(fused[key], composed[key], truth[key], key, floor=floor)
    for key in ("replay_kept_size", "replay_label_added", "replay_log_kept_mass"):
        torch.testing.assert_close(
            fused[key].double(), composed[key].double(), rtol=1e-5, atol=1e-6, msg=key
        )


def test_modules_match_functions():
    from logitless.modules import LogprobHead, PolicyLossHead

    case = Case("topk_topp", shape=(2, 9), bias=True)
    inp = _inputs(case)
    replay = _replay_kwargs(case, inp)
    lin = torch.nn.Linear(case.H, case.V)
    with torch.no_grad():
        lin.weight.copy_(inp["weight"])
        lin.bias.copy_(inp["bias"])
    head = LogprobHead(lin, with_entropy=True, top_k=replay["top_k"], top_p=0.9)
    got = head(inp["hidden"], inp["labels"], top_p=replay["top_p"])
    want = logitless.linear_logprobs(
        inp["hidden"], lin.weight, inp["labels"], bias=lin.bias, with_entropy=True, **replay
    )
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0)
    assert torch.equal(got.kept_size, want.kept_size)
    mask = _mask(Case("mask", V=case.V), torch.Generator().manual_seed(1), inp["labels"])
    got = head(inp["hidden"], inp["labels"], sampling_mask=mask)
    want = logitless.linear_logprobs(
        inp["hidden"], lin.weight, inp["labels"], bias=lin.bias, with_entropy=True,
        sampling_mask=mask,
    )  # fmt: skip
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0)
    thin = logitless.LinearLogprobs(with_entropy=True, top_k=replay["top_k"], top_p=0.9)
    assert "top_k=" in repr(thin) and "top_p=0.9" in repr(thin)
    got = thin(inp["hidden"], lin.weight, inp["labels"], lin.bias, sampling_mask=mask)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0)
    got = thin(inp["hidden"], lin.weight, inp["labels"], lin.bias, top_p=replay["top_p"])
    want = logitless.linear_logprobs(
        inp["hidden"], lin.weight, inp["labels"], bias=lin.bias, with_entropy=True, **replay
    )
    torch.testing.assert_close(got.entropy, want.entropy, rtol=0, atol=0)
    assert torch.equal(got.label_added, want.label_added)

    cfg = PolicyLossConfig()
    old = torch.where(inp["labels"] != -100, -1.0, 0.0)
    adv = torch.tensor([1.0, -1.0])
    ploss = PolicyLossHead(lin, config=cfg, top_k=4)
    loss, metrics = ploss(inp["hidden"], inp["labels"], old, adv, top_p=0.8)
    want_loss, want_metrics = logitless.fused_policy_loss(
        inp["hidden"], lin.weight, inp["labels"], old, adv, config=cfg, bias=lin.bias,
        top_k=4, top_p=0.8,
    )  # fmt: skip
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    assert float(metrics["replay_kept_size"]) == float(want_metrics["replay_kept_size"])


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    torch.cuda.is_available() or not __import__("importlib").util.find_spec("triton"),
    reason="Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1 without a GPU)",
)
@pytest.mark.parametrize("case", [Case("mask", bias=True), Case("topk_topp", chunk=7)])
def test_triton_backend(case):
    """backend="triton": untruncated rows (empty mask rows) run the Triton kernels, replayed
    and masked rows the torch code; same contract."""
    check_case(replace(case, shape=(19,)), backend="triton")


# --------------------------------------------------------------------------------------------
# SamplingMask and bad input
# --------------------------------------------------------------------------------------------


def test_sampling_mask_converters_round_trip():
    g = torch.Generator().manual_seed(3)
    padded = torch.randint(0, 50, (4, 3, 6), generator=g)
    padded[torch.rand(4, 3, 6, generator=g) < 0.4] = -1
    padded[1, 2] = -1  # an empty position
    m = SamplingMask.from_padded(padded)
    assert m.num_positions == 12 and m.offsets[0] == 0
    assert m.counts().tolist() == (padded >= 0).sum(-1).reshape(-1).tolist()
    back = m.to_padded(width=6)
    # the same ids per position, in order, padding at the end
    for i in range(12):
        row = padded.reshape(12, 6)[i]
        assert back[i][back[i] >= 0].tolist() == row[row >= 0].tolist()
    other = SamplingMask.from_padded(back.masked_fill(back < 0, 99), pad_value=99)
    assert torch.equal(other.token_ids, m.token_ids) and torch.equal(other.offsets, m.offsets)
    assert SamplingMask.from_padded(torch.zeros(0, 4, dtype=torch.long)).offsets.tolist() == [0]
    with pytest.raises(ValueError, match="width"):
        m.to_padded(width=1)


def _bad_calls():
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(4, 8, generator=g), torch.randn(20, 8, generator=g)
    y = torch.tensor([1, 2, -100, 3])

    def mask(ids, off):
        return {"sampling_mask": SamplingMask(torch.tensor(ids), torch.tensor(off))}

    return (
        h,
        w,
        y,
        [
            (mask([1, 2], [1, 1, 2, 2, 2]), "offsets must start at 0"),
            (mask([1, 2], [0, 2, 1, 2, 2]), "non-decreasing"),
            (mask([1, 2], [0, 1, 2, 2]), r"labels.numel\(\) \+ 1 = 5"),
            (mask([1, 2], [0, 1, 1, 1, 1]), "must end at token_ids.numel"),
            (mask([1, 20], [0, 1, 2, 2, 2]), r"ids must be in \[0, 20\)"),
            (mask([1, -3], [0, 1, 2, 2, 2]), r"ids must be in \[0, 20\)"),
            (mask([1, 1], [0, 2, 2, 2, 2]), "duplicate id"),
            ({"sampling_mask": torch.zeros(4, dtype=torch.long)}, r"\[\*labels.shape, K\]"),
            ({"sampling_mask": torch.zeros(4, 2)}, "integer ids"),
            ({"sampling_mask": [1, 2]}, "SamplingMask"),
            ({"top_k": 0}, "top_k must be >= 1"),
            ({"top_k": torch.tensor([3, 0, 3, 3])}, "top_k must be >= 1"),
            ({"top_k": 2.5}, "top_k must be an int"),
            ({"top_k": True}, "top_k must be an int"),
            ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
            ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
            ({"top_p": float("nan")}, r"top_p must be in \(0, 1\]"),
            ({"top_p": torch.ones(3)}, "not broadcastable"),
            ({"top_p": torch.ones(4, requires_grad=True)}, "must not require grad"),
            ({"top_k": -(2**70)}, "top_k must be >= 1"),
            ({"min_p": 1.0}, r"min_p must be in \[0, 1\)"),
            ({"min_p": -0.1}, r"min_p must be in \[0, 1\)"),
            ({"top_k": 3, "sampling_mask": torch.zeros(4, 1, dtype=torch.long)}, "not both"),
            ({"with_kept_mass": True}, "with_kept_mass=True needs"),
        ],
    )


def test_bad_input_raises_before_any_work(monkeypatch):
    from logitless.ops.fused_loss import replay as fused_replay
    from logitless.ops.replay import op as replay_kernels

    def no_work(*a, **k):
        raise AssertionError("the kernels ran before the input was rejected")

    monkeypatch.setattr(replay_kernels, "replay_forward", no_work)
    monkeypatch.setattr(fused_replay, "replay_forward", no_work)
    monkeypatch.setattr(torch.nn.functional, "linear", no_work)
    h, w, y, calls = _bad_calls()
    old, adv = torch.zeros(4), torch.zeros(4)
    for kwargs, msg in calls:
        for fn in (logitless.linear_logprobs, reference.linear_logprobs):
            with pytest.raises(ValueError, match=msg):
                fn(h, w, y, **kwargs)
        with pytest.raises(ValueError, match=msg):
            logitless.fused_policy_loss(
                h, w, y, old, adv, config=PolicyLossConfig(), document_ids=torch.zeros(4).long(),
                **kwargs,
            )  # fmt: skip
    # ignored positions may hold a sampler value that would be invalid elsewhere
    ok = torch.tensor([3, 2, 0, 3])
    monkeypatch.undo()
    logitless.linear_logprobs(h, w, y, top_k=ok)


# --------------------------------------------------------------------------------------------
# HF transformers: against the model's own masked logits
# --------------------------------------------------------------------------------------------


def test_hf_against_the_models_masked_logits():
    transformers = pytest.importorskip("transformers")
    from logitless.integrations import hf

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=120,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 120, (2, 9))
    labels = hf.causal_lm_labels(ids)
    mask = _mask(Case("mask", V=120), torch.Generator().manual_seed(2), labels)
    for replay in ({"sampling_mask": mask}, {"top_k": 7, "top_p": 0.8}):
        model.zero_grad()
        out = hf.causal_lm_logprobs(model, ids, with_entropy=True, temperature=0.9, **replay)
        g = torch.randn(2, 9)
        (out.logprobs * g + out.entropy).sum().backward()
        ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

        model.zero_grad()
        logits = model(ids, use_cache=False).logits.float() / 0.9  # [2, 9, V]
        from logitless.contract.head import check_head_call
        from logitless.contract.options import HeadOptions, SamplerOptions

        rargs = check_head_call(
            torch.zeros(2, 9, 1), torch.zeros(120, 1), labels, None, HeadOptions(),
            SamplerOptions(**replay),
        ).replay  # fmt: skip
        flat_labels = labels.reshape(-1).clamp(min=0)
        keep, _ = reference.kept_set(logits.detach().reshape(-1, 120), flat_labels, rargs)
        lp, ent = truth_masked(logits.reshape(-1, 120), labels.reshape(-1), keep)
        lp, ent = lp.reshape(2, 9), ent.reshape(2, 9)
        (lp * g + ent).sum().backward()
        torch.testing.assert_close(out.logprobs, lp.float().detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(out.entropy, ent.float().detach(), rtol=0, atol=1e-5)
        for n, p in model.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(ours[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)


# --------------------------------------------------------------------------------------------
# The documented demonstration (examples/sampling_replay.py)
# --------------------------------------------------------------------------------------------


def test_example_ratio_is_biased_without_replay_and_one_with_it():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "sampling_replay.py"
    spec = importlib.util.spec_from_file_location("sampling_replay_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rows = example.run(seed=1, vocab=512, hidden_size=32, tokens=256)
    plain, mask, replayed = rows.values()
    # on policy, over the whole vocabulary: log ratio = log kept mass < 0, a constant bias
    assert plain["ratio_max"] < 1.0 and plain["log_ratio_mean"] < -0.1
    assert plain["clipped"] > 0.1
    for r in (mask, replayed):
        assert abs(r["ratio_min"] - 1) < 1e-5 and abs(r["ratio_max"] - 1) < 1e-5
        assert r["clipped"] == 0.0 and r["labels_added"] == 0
        # the bias it removed is the kept mass the first way carried
        assert abs(r["log_kept_mass"] - plain["log_ratio_mean"]) < 1e-4


def test_docs_examples_run():
    """The python blocks of docs/sampling-replay.md run as written."""
    import re
    from pathlib import Path

    doc = Path(__file__).resolve().parents[1] / "docs" / "sampling-replay.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    assert blocks
    for i, block in enumerate(blocks):
        exec(compile(block, f"sampling-replay.md[{i}]", "exec"), {})
