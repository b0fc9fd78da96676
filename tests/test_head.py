"""The fused head op against the naive reference and a float64 ground truth: outputs and gradients.

Every comparison is three-way (Cut Cross-Entropy habit): the op, ``logitless.reference`` in the
same dtype, and a float64 truth written out below. The op passes when its error is no worse than
``K`` times the reference's (see ``_tolerance.py``). Gradients are taken under random upstream
gradients for both outputs, ``(logp * g).sum() + (entropy * e).sum()`` (flash-linear-attention
habit), never ``.sum()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from _tolerance import assert_no_worse_than_reference, error_report

import logitless
from logitless import reference

DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


# --------------------------------------------------------------------------------------------
# float64 ground truth: plain torch, obviously correct, independent of reference.py (which rounds
# logits to fp32 by contract, so it is not a float64 truth even on float64 inputs).
# --------------------------------------------------------------------------------------------


def truth_logprobs(
    hidden, weight, labels, bias, temperature, softcap, ignore_index, logit_scale=None
):
    """float64 log-prob of each label and entropy of each row; 0.0 at ignored rows. [...]"""
    logits = hidden.double() @ weight.double().t()  # [..., V]
    if bias is not None:
        logits = logits + bias.double()
    if logit_scale is not None:
        logits = logits * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if isinstance(temperature, torch.Tensor):
        logits = logits / temperature.double().expand(labels.shape)[..., None]
    else:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)  # [..., V]
    valid = labels != ignore_index
    picked = logp_all.gather(-1, torch.where(valid, labels, 0)[..., None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    zero = logits.new_zeros(())
    return torch.where(valid, picked, zero), torch.where(valid, ent, zero)


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    dtype: str = "fp32"
    weight_dtype: str | None = None  # weight and bias dtype when it differs from hidden's
    shape: tuple = (123,)  # labels' shape: (N,) or (B, T)
    H: int = 67
    V: int = 1003
    bias: bool = False
    temperature: str = "one"  # one | scalar | tensor | tensor_b1 (3-D, [B, 1]) | tensor0d
    softcap: float | None = None
    logit_scale: float | None = None
    ignore: str = "some"  # none | some | all
    ignore_index: int = -100
    chunk: object = None  # None | int | "N" | "N+5"
    with_entropy: bool = True
    loss: str = "both"  # both | logp | ent
    frozen: str = "none"  # none | weight | hidden
    head_dtype: str | None = None
    small_tiles: bool = False  # shrink the op's tile budget so V is cut into several blocks

    @property
    def id(self) -> str:
        parts = [self.dtype] + ([f"w{self.weight_dtype}"] if self.weight_dtype else [])
        parts += ["x".join(map(str, self.shape)), f"H{self.H}", f"V{self.V}"]
        parts += ["bias"] if self.bias else []
        parts += [f"T-{self.temperature}"] if self.temperature != "one" else []
        parts += [f"cap{self.softcap}"] if self.softcap is not None else []
        parts += [f"scale{self.logit_scale}"] if self.logit_scale is not None else []
        parts += [f"ign-{self.ignore}", f"chunk-{self.chunk}"]
        parts += ["ent" if self.with_entropy else "noent", f"loss-{self.loss}"]
        parts += [f"frozen-{self.frozen}"] if self.frozen != "none" else []
        parts += [f"hd-{self.head_dtype}"] if self.head_dtype else []
        parts += ["smalltiles"] if self.small_tiles else []
        parts += [f"ii{self.ignore_index}"] if self.ignore_index != -100 else []
        return "-".join(parts)


_BF16 = Case(dtype="bf16", shape=(37,), H=67, V=1003)
CASES = [
    # fp32, odd sizes, the chunk-size ladder
    Case(),
    Case(chunk=1),
    Case(chunk=7),
    Case(chunk="N"),
    Case(chunk="N+5"),
    Case(ignore="none", chunk=7),
    Case(ignore="all"),
    Case(ignore="all", chunk=7, bias=True),
    # bias, temperature, softcap
    Case(bias=True),
    Case(bias=True, chunk=7, temperature="scalar"),
    Case(temperature="tensor"),
    Case(temperature="tensor", chunk=7, softcap=5.0, bias=True),
    Case(softcap=2.0),
    Case(softcap=3.0, temperature="scalar", chunk=1),
    Case(temperature="tensor0d", chunk="N+5"),
    # a logit scale (Cohere: x s, Granite: / s), alone and before softcap and temperature
    Case(logit_scale=0.37, bias=True),
    Case(logit_scale=2.5, softcap=3.0, temperature="tensor", chunk=7, bias=True),
    Case(logit_scale=0.5, loss="ent", small_tiles=True, chunk=7),
    # which outputs are used
    Case(with_entropy=False, loss="logp"),
    Case(with_entropy=False, loss="logp", chunk=7, bias=True, softcap=4.0),
    Case(loss="logp", chunk=7),
    Case(loss="ent", chunk=7, temperature="tensor"),
    Case(loss="ent", bias=True, softcap=2.5),
    # frozen parameters
    Case(frozen="weight", bias=True),
    Case(frozen="weight", chunk=7, temperature="tensor"),
    Case(frozen="hidden", chunk=7, bias=True, softcap=3.0),
    # 3-D inputs
    Case(shape=(3, 41), chunk=7, bias=True),
    Case(shape=(3, 41), temperature="tensor_b1", softcap=2.0, ignore="none"),
    Case(shape=(2, 17), temperature="tensor", chunk="N", loss="ent"),
    # a non-default ignore_index (label 0 is then "ignored", -100 would be out of range)
    Case(ignore_index=0, chunk=7),
    # several vocab blocks per tile (online log-sum-exp across blocks, partial last block)
    Case(small_tiles=True),
    Case(small_tiles=True, chunk=7, bias=True, softcap=2.0, temperature="tensor"),
    Case(small_tiles=True, chunk=1, loss="ent", ignore="none"),
    # bf16 (small: bf16 matmuls are slow on this CPU)
    _BF16,
    replace(_BF16, chunk=7, bias=True, temperature="tensor"),
    replace(_BF16, softcap=3.0, chunk=1, loss="logp"),
    replace(_BF16, logit_scale=1.7, softcap=3.0, chunk=7, bias=True, temperature="tensor"),
    replace(_BF16, shape=(2, 19), chunk="N+5", with_entropy=False, loss="logp"),
    replace(_BF16, frozen="weight", chunk=7),
    # fp16
    replace(_BF16, dtype="fp16", chunk=7, bias=True, softcap=3.0, temperature="tensor"),
    # bf16 activations, fp32 master weight, bf16 projection (weight/bias grads land in fp32)
    replace(_BF16, shape=(61,), weight_dtype="fp32", head_dtype="bf16", bias=True),
    replace(_BF16, shape=(61,), weight_dtype="fp32", head_dtype="bf16", bias=True, chunk=7),
    # bf16 model, fp32 head (vLLM's fp32 LM head): weight grad lands in the bf16 .grad
    replace(_BF16, head_dtype="fp32"),
    replace(_BF16, head_dtype="fp32", chunk=7, bias=True, softcap=3.0, temperature="scalar"),
]


def _ids(cases):
    return [c.id for c in cases]


@pytest.fixture
def small_tiles(monkeypatch):
    """Shrink the op's per-tile element budget so one row chunk spans several vocab blocks."""
    from logitless.backends import base as _chunked

    monkeypatch.setattr(_chunked, "_TILE_ELEMS", {"cpu": 1024}, raising=True)


def make_inputs(case: Case) -> dict:
    """Random inputs for ``case``; logits have std ~3 so the distributions are not flat."""
    dtype = DTYPES[case.dtype]
    w_dtype = DTYPES[case.weight_dtype or case.dtype]
    hidden = torch.randn(*case.shape, case.H)
    weight = torch.randn(case.V, case.H) * (3.0 / math.sqrt(case.H))
    bias = torch.randn(case.V) if case.bias else None
    labels = torch.randint(0, case.V, case.shape)
    if case.ignore == "some":
        labels[torch.rand(case.shape) < 0.3] = case.ignore_index
        labels.view(-1)[0] = case.ignore_index  # at least one, and the first row
    elif case.ignore == "all":
        labels.fill_(case.ignore_index)
    if case.ignore_index == 0 and case.ignore == "none":
        labels.clamp_(min=1)
    temperature = {
        "one": lambda: 1.0,
        "scalar": lambda: 0.7,
        "tensor": lambda: torch.rand(case.shape) * 1.5 + 0.5,
        "tensor_b1": lambda: torch.rand(case.shape[0], 1) * 1.5 + 0.5,
        "tensor0d": lambda: torch.tensor(1.3),
    }[case.temperature]()
    n = labels.numel()
    chunk = {"N": n, "N+5": n + 5}.get(case.chunk, case.chunk)
    return {
        "hidden": hidden.to(dtype),
        "weight": weight.to(w_dtype),
        "bias": None if bias is None else bias.to(w_dtype),
        "labels": labels,
        "temperature": temperature,
        "chunk": chunk,
        "g": torch.randn(case.shape),
        "e": torch.randn(case.shape),
    }


def _leaf(t, requires_grad, dtype=None):
    if t is None:
        return None
    if dtype is None:  # an independent copy with the same strides, gaps included
        src = t.detach()
        t = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device=src.device)
        t.copy_(src)
    else:
        t = t.detach().to(dtype)
    return t.requires_grad_(requires_grad)


def _loss(logp, ent, g, e, which):
    terms = []
    if which in ("both", "logp"):
        terms.append((logp * g).sum())
    if which in ("both", "ent"):
        terms.append((ent * e).sum())
    return sum(terms)


def run_case(fn, case: Case, inp: dict, *, as_float64: bool = False) -> dict:
    """Run ``fn`` (op, reference, or truth when ``as_float64``) forward and backward."""
    need = {"hidden": case.frozen != "hidden", "weight": case.frozen != "weight", "bias": True}
    dt = torch.float64 if as_float64 else None
    leaves = {k: _leaf(inp[k], need[k], dt) for k in ("hidden", "weight", "bias")}
    if as_float64:
        # The projection's inputs are rounded to head_dtype (a straight-through cast for autograd).
        hd = DTYPES[case.head_dtype] if case.head_dtype else None
        cast = {
            k: None if t is None or hd is None else t.to(hd).double() for k, t in leaves.items()
        }
        logp, ent = truth_logprobs(
            cast["hidden"] if hd else leaves["hidden"],
            cast["weight"] if hd else leaves["weight"],
            inp["labels"],
            cast["bias"] if hd else leaves["bias"],
            inp["temperature"],
            case.softcap,
            case.ignore_index,
            case.logit_scale,
        )
        if not case.with_entropy:
            ent = None
    else:
        out = fn(
            leaves["hidden"],
            leaves["weight"],
            inp["labels"],
            bias=leaves["bias"],
            temperature=inp["temperature"],
            softcap=case.softcap,
            logit_scale=case.logit_scale,
            with_entropy=case.with_entropy,
            ignore_index=case.ignore_index,
            chunk_size=inp["chunk"],
            head_dtype=DTYPES[case.head_dtype] if case.head_dtype else None,
        )
        logp, ent = out.logprobs, out.entropy
    g, e = inp["g"].to(logp.dtype), inp["e"].to(logp.dtype)
    _loss(logp, ent, g, e, case.loss).backward()
    res = {"logp": logp.detach(), "ent": None if ent is None else ent.detach()}
    for k, t in leaves.items():
        res[f"grad_{k}"] = None if t is None else t.grad
    return res


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_matches_reference(case, request):
    if case.small_tiles:
        request.getfixturevalue("small_tiles")
    check_against_reference(case, make_inputs(case))


def check_against_reference(case: Case, inp: dict, op_fn=logitless.linear_logprobs) -> None:
    """Op vs reference vs float64 truth on ``inp`` (whatever device it is on); ``op_fn`` is
    the op under test (e.g. ``linear_logprobs`` with a given ``backend``)."""
    op = run_case(op_fn, case, inp)
    ref = run_case(reference.linear_logprobs, case, inp)
    truth = run_case(None, case, inp, as_float64=True)

    # Outputs: fp32, labels' shape, exactly 0 at ignored rows; entropy only when asked for.
    ignored = inp["labels"] == case.ignore_index
    assert op["logp"].dtype == torch.float32
    assert op["logp"].shape == inp["labels"].shape
    assert bool((op["logp"][ignored] == 0).all())
    assert_no_worse_than_reference(op["logp"], ref["logp"], truth["logp"], "logprobs")
    if case.with_entropy:
        assert op["ent"].dtype == torch.float32
        assert bool((op["ent"][ignored] == 0).all())
        assert_no_worse_than_reference(op["ent"], ref["ent"], truth["ent"], "entropy")
    else:
        assert op["ent"] is None

    # Gradients: in each input's own dtype; None for frozen inputs.
    for k in ("hidden", "weight", "bias"):
        if inp[k] is None:
            continue
        name = f"grad_{k}"
        if (k, case.frozen) in (("hidden", "hidden"), ("weight", "weight")):
            assert op[name] is None, f"{k} is frozen but got a .grad"
            continue
        assert op[name] is not None, f"no gradient reached {k}"
        assert op[name].dtype == inp[k].dtype, f"{name} dtype {op[name].dtype}"
        assert_no_worse_than_reference(op[name], ref[name], truth[name], name)
    if op["grad_hidden"] is not None:
        assert bool((op["grad_hidden"][ignored] == 0).all()), "ignored rows got a gradient"


# --------------------------------------------------------------------------------------------
# The check itself can fail
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tolerance_check_rejects_perturbed_results(dtype):
    case = Case(dtype=dtype, shape=(37,), bias=True, temperature="tensor")
    inp = make_inputs(case)
    op = run_case(logitless.linear_logprobs, case, inp)
    ref = run_case(reference.linear_logprobs, case, inp)
    truth = run_case(None, case, inp, as_float64=True)
    assert_no_worse_than_reference(op["logp"], ref["logp"], truth["logp"])  # baseline passes

    if dtype == "fp32":
        # A 1e-3 shift of the log-probs, and a 0.1 % error in a gradient.
        with pytest.raises(AssertionError, match="max error too large"):
            assert_no_worse_than_reference(op["logp"] + 1e-3, ref["logp"], truth["logp"])
        with pytest.raises(AssertionError, match="max error too large"):
            bad = op["grad_weight"] * 1.001
            assert_no_worse_than_reference(bad, ref["grad_weight"], truth["grad_weight"])
        # A uniform offset below the reference's worst error (so the max test lets it through)
        # is still caught by the rms test.
        rep = error_report(op["grad_weight"], ref["grad_weight"], truth["grad_weight"])
        bad = op["grad_weight"] + 0.5 * rep["k"] * rep["max_ref"]
        with pytest.raises(AssertionError, match="rms error too large"):
            assert_no_worse_than_reference(bad, ref["grad_weight"], truth["grad_weight"])
    # bf16: a 5 % wrong temperature is caught despite bf16's coarse rounding.
    bad = run_case(
        reference.linear_logprobs, case, dict(inp, temperature=inp["temperature"] * 1.05)
    )
    with pytest.raises(AssertionError):
        assert_no_worse_than_reference(bad["logp"], ref["logp"], truth["logp"])
    with pytest.raises(AssertionError):
        assert_no_worse_than_reference(bad["grad_hidden"], ref["grad_hidden"], truth["grad_hidden"])


# --------------------------------------------------------------------------------------------
# Hand-worked cases
# --------------------------------------------------------------------------------------------


def test_uniform_distribution_hand_worked():
    # Zero weight: every logit is 0, p = 1/V, logp = -log V, entropy = log V.
    V = 5
    hidden = torch.randn(4, 3)
    weight = torch.zeros(V, 3)
    labels = torch.tensor([0, 4, -100, 2])
    out = logitless.linear_logprobs(hidden, weight, labels, with_entropy=True)
    expect = torch.tensor([-math.log(V), -math.log(V), 0.0, -math.log(V)])
    torch.testing.assert_close(out.logprobs, expect)
    torch.testing.assert_close(out.entropy, -expect)


def test_two_class_hand_worked():
    # Logits [0, a] (bias), label 1, temperature 2: logp = -log(1 + exp(-a/2)).
    a = 3.0
    weight = torch.zeros(2, 1)
    bias = torch.tensor([0.0, a])
    hidden = torch.zeros(1, 1)
    out = logitless.linear_logprobs(
        hidden, weight, torch.tensor([1]), bias=bias, temperature=2.0, with_entropy=True
    )
    p1 = 1 / (1 + math.exp(-a / 2))
    torch.testing.assert_close(out.logprobs, torch.tensor([math.log(p1)]))
    ent = -(p1 * math.log(p1) + (1 - p1) * math.log(1 - p1))
    torch.testing.assert_close(out.entropy, torch.tensor([ent]))


def test_empty_input():
    hidden = torch.randn(0, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    out = logitless.linear_logprobs(
        hidden, weight, torch.zeros(0, dtype=torch.long), with_entropy=True
    )
    assert out.logprobs.shape == (0,) and out.entropy.shape == (0,)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert hidden.grad.shape == (0, 8)
    assert bool((weight.grad == 0).all())


# --------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_chunk_size_changes_nothing_beyond_rounding(softcap):
    case = Case(bias=True, temperature="tensor", softcap=softcap)
    inp = make_inputs(case)
    base = run_case(logitless.linear_logprobs, replace(case, chunk=None), dict(inp, chunk=None))
    for chunk in (1, 7, 200):
        other = run_case(
            logitless.linear_logprobs, replace(case, chunk=chunk), dict(inp, chunk=chunk)
        )
        for k, v in base.items():
            scale = max(1.0, float(v.abs().max()))
            torch.testing.assert_close(
                other[k], v, rtol=0, atol=1e-5 * scale, msg=lambda m, k=k, c=chunk: f"{k} c{c}: {m}"
            )


def test_vocab_blocking_changes_nothing_beyond_rounding(monkeypatch):
    from logitless.backends import base as _chunked

    case = Case(bias=True, temperature="tensor", softcap=3.0, chunk=7)
    inp = make_inputs(case)
    base = run_case(logitless.linear_logprobs, case, inp)
    monkeypatch.setattr(_chunked, "_TILE_ELEMS", {"cpu": 1024}, raising=True)
    blocked = run_case(logitless.linear_logprobs, case, inp)
    for k, v in base.items():
        scale = max(1.0, float(v.abs().max()))
        torch.testing.assert_close(blocked[k], v, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("chunk", [None, 7])
def test_no_grad_modes_same_outputs_no_graph(mode, chunk):
    case = Case(bias=True, temperature="tensor", softcap=3.0, chunk=chunk)
    inp = make_inputs(case)
    hidden = inp["hidden"].requires_grad_()
    weight = inp["weight"].requires_grad_()
    kwargs = dict(
        bias=inp["bias"].requires_grad_(),
        temperature=inp["temperature"],
        softcap=case.softcap,
        with_entropy=True,
        chunk_size=chunk,
    )
    with_grad = logitless.linear_logprobs(hidden, weight, inp["labels"], **kwargs)
    assert with_grad.logprobs.grad_fn is not None and with_grad.entropy.grad_fn is not None
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        out = logitless.linear_logprobs(hidden, weight, inp["labels"], **kwargs)
    for got, want in zip(out, with_grad, strict=True):
        assert got.grad_fn is None and not got.requires_grad
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "case",
    [
        Case(chunk=None, bias=True, softcap=3.0, temperature="tensor"),  # one tile, kept for bwd
        Case(chunk=7, bias=True, softcap=3.0, temperature="tensor"),  # recompute backward
        replace(_BF16, chunk=None, bias=True),
    ],
    ids=["one-tile", "chunk7", "bf16"],
)
def test_backward_twice_with_retain_graph(case):
    inp = make_inputs(case)
    leaves = {k: _leaf(inp[k], True) for k in ("hidden", "weight", "bias")}
    out = logitless.linear_logprobs(
        leaves["hidden"],
        leaves["weight"],
        inp["labels"],
        bias=leaves["bias"],
        temperature=inp["temperature"],
        softcap=case.softcap,
        with_entropy=True,
        chunk_size=inp["chunk"],
    )
    loss = _loss(out.logprobs, out.entropy, inp["g"], inp["e"], "both")
    loss.backward(retain_graph=True)
    first = {k: t.grad.clone() for k, t in leaves.items()}
    loss.backward()
    for k, t in leaves.items():
        # 2·x is exact in floating point, so the second pass must reproduce the first closely.
        scale = max(1.0, float(first[k].abs().max()))
        tol = 1e-6 if case.dtype == "fp32" else 1e-2
        torch.testing.assert_close(t.grad, 2 * first[k], rtol=0, atol=tol * scale, msg=k)


@pytest.mark.parametrize("dtype,head_dtype", [("fp32", None), ("bf16", "fp32")])
def test_weight_grad_accumulates_into_existing_grad(dtype, head_dtype):
    case = replace(_BF16, dtype=dtype, head_dtype=head_dtype, bias=True, chunk=7)
    inp = make_inputs(case)
    fresh = run_case(logitless.linear_logprobs, case, inp)
    hidden = _leaf(inp["hidden"], True)
    weight = _leaf(inp["weight"], True)
    bias = _leaf(inp["bias"], True)
    prior_w = torch.randn_like(weight)
    prior_b = torch.randn_like(bias)
    weight.grad, bias.grad = prior_w.clone(), prior_b.clone()
    out = logitless.linear_logprobs(
        hidden,
        weight,
        inp["labels"],
        bias=bias,
        with_entropy=True,
        chunk_size=inp["chunk"],
        head_dtype=DTYPES[head_dtype] if head_dtype else None,
    )
    _loss(out.logprobs, out.entropy, inp["g"], inp["e"], "both").backward()
    assert weight.grad.dtype == weight.dtype and bias.grad.dtype == bias.dtype
    for got, prior, new in (
        (weight.grad, prior_w, fresh["grad_weight"]),
        (bias.grad, prior_b, fresh["grad_bias"]),
    ):
        want = (prior.double() + new.double()).to(got.dtype)  # one rounding of the sum
        scale = max(1.0, float(want.abs().max()))
        tol = 1e-6 if dtype == "fp32" else 2**-7
        torch.testing.assert_close(got, want, rtol=0, atol=tol * scale)


@pytest.mark.parametrize("chunk", [None, 7])
def test_large_logits_stay_finite_and_accurate(chunk):
    # Logits of scale ~1e3: a naive exp overflows; the log-sum-exp must not.
    case = Case(shape=(61,), bias=True, softcap=None, chunk=chunk, temperature="tensor")
    inp = make_inputs(case)
    inp["weight"] = inp["weight"] * 300.0
    inp["bias"] = inp["bias"] * 500.0
    op = run_case(logitless.linear_logprobs, case, inp)
    ref = run_case(reference.linear_logprobs, case, inp)
    truth = run_case(None, case, inp, as_float64=True)
    assert float(truth["logp"].abs().max()) > 100, "inputs did not produce large logits"
    for k, v in op.items():
        if v is not None:
            assert bool(torch.isfinite(v).all()), f"{k} is not finite"
            assert_no_worse_than_reference(v, ref[k], truth[k], k)


def test_layout_and_label_dtype_do_not_matter():
    # Non-contiguous hidden (a strided slice) and weight (a transposed [H, V] view, as a tied
    # embedding stored the other way round), int32 labels: same numbers as contiguous int64.
    case = Case(bias=True, temperature="tensor", softcap=3.0, chunk=7)
    inp = make_inputs(case)
    base = run_case(logitless.linear_logprobs, case, inp)
    wide = torch.zeros(*inp["hidden"].shape[:-1], 2 * case.H)
    wide[..., ::2] = inp["hidden"]
    strided = dict(
        inp,
        hidden=wide[..., ::2],
        weight=inp["weight"].t().contiguous().t(),
        labels=inp["labels"].int(),
    )
    assert not strided["hidden"].is_contiguous() and not strided["weight"].is_contiguous()
    assert not _leaf(strided["hidden"], True).is_contiguous()
    got = run_case(logitless.linear_logprobs, case, strided)
    for k, v in base.items():
        scale = max(1.0, float(v.abs().max()))
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-5 * scale, msg=k)


def test_module_form_matches_function():
    inp = make_inputs(Case(temperature="tensor"))
    mod = logitless.LinearLogprobs(softcap=3.0, with_entropy=True, chunk_size=7)
    got = mod(inp["hidden"], inp["weight"], inp["labels"], temperature=inp["temperature"])
    want = logitless.linear_logprobs(
        inp["hidden"],
        inp["weight"],
        inp["labels"],
        temperature=inp["temperature"],
        softcap=3.0,
        with_entropy=True,
        chunk_size=7,
    )
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# gradcheck
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 2])
def test_gradcheck_float64(chunk):
    """Finite differences on a tiny float64 problem: logprobs + entropy, bias, per-token
    temperature, softcap, one ignored row. A float64 head computes its statistics and returns
    its outputs in float64, so gradcheck holds at its default (float64) tolerances."""
    hidden = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([1, -100, 5, 0])
    temperature = torch.tensor([0.7, 1.0, 1.6, 1.1], dtype=torch.float64)

    def fn(h, w, b):
        out = logitless.linear_logprobs(
            h,
            w,
            labels,
            bias=b,
            temperature=temperature,
            softcap=2.5,
            with_entropy=True,
            chunk_size=chunk,
            head_dtype=torch.float64,
        )
        assert out.logprobs.dtype == out.entropy.dtype == torch.float64
        return out.logprobs, out.entropy

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


@pytest.mark.parametrize("chunk", [None, 2], ids=["one-tile", "chunk2"])
def test_double_backward_is_refused(chunk):
    """create_graph=True through the op (Hessian-vector products, gradient penalties) raises a
    RuntimeError saying the op is first-order, instead of a silently zero second derivative
    (the reference, which autograd differentiates twice, shows one exists)."""
    hidden = torch.randn(6, 4)
    weight = torch.randn(7, 4)
    labels = torch.tensor([1, 6, -100, 0, 3, 3])
    g, v = torch.randn(6), torch.randn(6, 4)

    def second_derivative(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp = fn(h, w, labels, chunk_size=chunk).logprobs
        (gh,) = torch.autograd.grad((logp * g).sum(), h, create_graph=True)
        (ggw,) = torch.autograd.grad((gh * v).sum(), w)
        return ggw

    assert float(second_derivative(reference.linear_logprobs).abs().max()) > 0
    with pytest.raises(RuntimeError, match="first-order"):
        second_derivative(logitless.linear_logprobs)
