"""Vocab-parallel head on real gloo process groups (2 and 3 ranks) vs one process.

Each rank holds rows [start, end) of the head weight (and bias); labels are global ids. The
outputs must be the same on every rank, the hidden gradient (all-reduced) the same on every
rank, and, gathered, everything must match the single-process result within the tolerance
derived from the naive reference's error against float64 (tests/_tolerance.py).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from _dist import spawn
from _host_reads import no_host_reads
from _tolerance import FLOOR, assert_no_worse_than_reference

from logitless import PolicyLossConfig, VocabParallel, fused_policy_loss, linear_logprobs
from logitless import policy_loss as compose_loss
from logitless.parallel import even_vocab_range
from logitless.reference import linear_logprobs as ref_logprobs

N_TOK, H, V = (3, 41), 67, 1003


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype = torch.float32
    head_dtype: torch.dtype | None = None
    bias: bool = True
    entropy: bool = True
    temperature: str = "scalar"  # "scalar" | "tensor"
    softcap: float | None = None
    logit_scale: float | None = None
    ignored: float = 0.3
    chunk_size: int | None = None
    reduce_hidden_grad: bool = True
    loss: PolicyLossConfig | None = None  # None: linear_logprobs; else fused_policy_loss
    seed: int = 0
    backend: str = "auto"
    capture: str = "off"  # capturable mode: "off" | "all" (every row) | "capacity" (row_capacity)


HEAD_CASES = [
    Case("fp32 entropy bias temp", temperature="scalar"),
    Case(
        "fp32 per-token temp softcap chunk7",
        temperature="tensor",
        softcap=30.0,
        chunk_size=7,
        bias=False,
        seed=1,
    ),
    Case("fp32 nothing ignored no entropy", entropy=False, ignored=0.0, seed=2),
    Case("bf16", dtype=torch.bfloat16, seed=3),
    Case("bf16 weights, fp32 head", dtype=torch.bfloat16, head_dtype=torch.float32, seed=4),
    Case("hidden grad left to caller", reduce_hidden_grad=False, seed=5),
    Case("all ignored", ignored=1.0, seed=6),
    Case("logit scale softcap", logit_scale=0.6, softcap=3.0, temperature="tensor", seed=13),
    Case("capturable every row", capture="all", temperature="tensor", seed=16),
    Case("capturable row capacity bf16", capture="capacity", dtype=torch.bfloat16, seed=17),
    Case("capturable all ignored", capture="capacity", ignored=1.0, seed=18),
]
LOSS_CASES = [
    Case(
        "fused dapo kl entropy",
        loss=PolicyLossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.05, entropy_coef=0.01),
        seed=7,
    ),
    Case(
        "fused gspo",
        loss=PolicyLossConfig(ratio_level="sequence", aggregation="seq_mean_token_mean"),
        entropy=False,
        seed=8,
        chunk_size=16,
    ),
    Case(
        "fused bf16 fp32-head",
        dtype=torch.bfloat16,
        head_dtype=torch.float32,
        loss=PolicyLossConfig(kl_coef=0.1),
        entropy=False,
        seed=9,
    ),
    Case(
        "fused dapo logit scale",
        loss=PolicyLossConfig(clip_low=0.2, clip_high=0.28, entropy_coef=0.01),
        logit_scale=1.8,
        seed=14,
    ),
    Case(
        "capturable fused gspo row capacity",
        loss=PolicyLossConfig(ratio_level="sequence", aggregation="seq_mean_token_mean"),
        entropy=False,
        capture="capacity",
        chunk_size=16,
        seed=19,
    ),
    Case(
        "capturable fused dapo kl entropy",
        loss=PolicyLossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.05, entropy_coef=0.01),
        capture="all",
        seed=20,
    ),
]


# The Triton kernels' shard statistics through the same combine, in Triton's interpreter (CPU
# tensors; conftest.py sets TRITON_INTERPRET=1 and the spawned ranks inherit it). With a GPU
# present the interpreter is off and these CPU cases do not apply.
if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    HEAD_CASES += [
        Case("triton fp32 entropy bias temp", backend="triton", seed=10),
        Case(
            "triton bf16 per-token temp softcap chunk7",
            dtype=torch.bfloat16,
            temperature="tensor",
            softcap=30.0,
            chunk_size=7,
            backend="triton",
            seed=11,
        ),
        Case("triton logit scale", logit_scale=0.6, backend="triton", seed=15),
        Case("triton capturable row capacity", capture="capacity", backend="triton", seed=21),
    ]
    LOSS_CASES += [
        Case(
            "triton fused dapo kl entropy",
            loss=PolicyLossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.05, entropy_coef=0.01),
            backend="triton",
            seed=12,
        ),
    ]


def _inputs(case: Case):
    """Inputs of one case, identical in every process (seeded); float64 masters."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    hidden = torch.randn(*N_TOK, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5 * 3
    bias = torch.randn(V, generator=g, dtype=torch.float64) if case.bias else None
    labels = torch.randint(0, V, N_TOK, generator=g)
    labels[torch.rand(N_TOK, generator=g) < case.ignored] = -100
    if case.temperature == "tensor":
        temperature = 0.5 + torch.rand(N_TOK, generator=g, dtype=torch.float64)
    else:
        temperature = 0.7
    d = dict(hidden=hidden, weight=weight, bias=bias, labels=labels, temperature=temperature)
    d["g_logp"] = torch.randn(N_TOK, generator=g, dtype=torch.float64)
    d["g_ent"] = torch.randn(N_TOK, generator=g, dtype=torch.float64)
    if case.loss is not None:
        d["old"] = -torch.rand(N_TOK, generator=g, dtype=torch.float64) * 5
        d["ref"] = d["old"] + 0.1 * torch.randn(N_TOK, generator=g, dtype=torch.float64)
        d["adv"] = torch.randn(N_TOK[0], generator=g, dtype=torch.float64)
        d["scale"] = float(torch.randn((), generator=g, dtype=torch.float64))
    return d


def _backward_head(out, d: dict, case: Case) -> dict:
    """Backpropagate the case's random upstream gradients through the head's outputs."""
    upstream = (out.logprobs * d["g_logp"].to(out.logprobs.dtype)).sum()
    if case.entropy:
        upstream = upstream + (out.entropy * d["g_ent"].to(out.entropy.dtype)).sum()
    upstream.backward()
    return {"logprobs": out.logprobs} | ({"entropy": out.entropy} if case.entropy else {})


def _leaf(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh leaf copy in ``dtype`` that requires grad (never the shared master tensor)."""
    return t.detach().to(dtype).clone().requires_grad_()


def _run(case: Case, d: dict, dtype: torch.dtype, weight_rows=slice(None), vp=None):
    """One forward+backward of the case; returns outputs and gradients (float64 copies).

    ``weight_rows`` selects this process's rows of weight/bias; ``vp`` the vocab parallelism.
    """
    hidden = _leaf(d["hidden"], dtype)
    weight = _leaf(d["weight"][weight_rows], dtype)
    bias = None if d["bias"] is None else _leaf(d["bias"][weight_rows], dtype)
    temp = d["temperature"]
    temp = temp.float() if isinstance(temp, torch.Tensor) and dtype != torch.float64 else temp
    head_dtype = case.head_dtype if dtype != torch.float64 else None
    kw = dict(bias=bias, temperature=temp, softcap=case.softcap, head_dtype=head_dtype)
    kw["logit_scale"] = case.logit_scale
    kw["backend"] = case.backend if dtype != torch.float64 else "torch"
    if vp is not None:
        kw["vocab_parallel"] = vp
    if case.capture != "off":
        kw["capturable"] = True
        if case.capture == "capacity":
            kw["row_capacity"] = max(1, int((d["labels"] != -100).sum())) + 2
    # The capturable mode: no host read anywhere in forward and backward (tests/_host_reads.py)
    with no_host_reads() if case.capture != "off" else contextlib.nullcontext():
        outputs, grads = _forward_backward(case, d, dtype, hidden, weight, bias, kw)
    as64 = {k: v.detach().double() for k, v in {**outputs, **grads}.items() if v is not None}
    return as64


def _forward_backward(case, d, dtype, hidden, weight, bias, kw):
    if case.loss is None:
        out = linear_logprobs(
            hidden, weight, d["labels"], with_entropy=case.entropy, chunk_size=case.chunk_size, **kw
        )
        outputs = _backward_head(out, d, case)
    else:
        loss, metrics = _loss(case, d, hidden, weight, dtype, kw)
        (loss * d["scale"]).backward()
        outputs = {"loss": loss, **{k: v for k, v in metrics.items() if v.is_floating_point()}}
    grads = {"hidden": hidden.grad, "weight": weight.grad}
    if bias is not None:
        grads["bias"] = bias.grad
    return outputs, grads


def _loss(case, d, hidden, weight, dtype, kw):
    """The fused policy loss of the case; ``kw`` holds the head options."""
    f = torch.float32 if dtype != torch.float64 else torch.float64
    adv = d["adv"][:, None].expand(N_TOK).to(f)
    return fused_policy_loss(
        hidden,
        weight,
        d["labels"],
        d["old"].to(f),
        adv,
        config=case.loss,
        ref_logprobs=d["ref"].to(f),
        chunk_size=case.chunk_size,
        **kw,
    )


def _reference(case: Case, d: dict, dtype: torch.dtype):
    """Naive full-logits path in ``dtype`` (float64: the ground truth)."""
    hidden = _leaf(d["hidden"], dtype)
    weight = _leaf(d["weight"], dtype)
    bias = None if d["bias"] is None else _leaf(d["bias"], dtype)
    temp = d["temperature"]
    temp = temp.float() if isinstance(temp, torch.Tensor) and dtype != torch.float64 else temp
    head_dtype = case.head_dtype if dtype != torch.float64 else None
    with_entropy = case.entropy if case.loss is None else case.loss.entropy_coef != 0
    out = ref_logprobs(
        hidden,
        weight,
        d["labels"],
        bias=bias,
        temperature=temp,
        softcap=case.softcap,
        logit_scale=case.logit_scale,
        with_entropy=with_entropy,
        head_dtype=head_dtype,
    )
    if case.loss is None:
        outputs = _backward_head(out, d, case)
    else:
        f = out.logprobs.dtype
        adv = d["adv"][:, None].expand(N_TOK).to(f)
        loss, metrics = compose_loss(
            out.logprobs,
            d["old"].to(f),
            adv,
            d["labels"] != -100,
            config=case.loss,
            ref_logprobs=d["ref"].to(f),
            entropy=out.entropy,
        )
        (loss * d["scale"]).backward()
        outputs = {"loss": loss, **{k: v for k, v in metrics.items() if v.is_floating_point()}}
    grads = {"hidden": hidden.grad, "weight": weight.grad}
    if bias is not None:
        grads["bias"] = bias.grad
    return {k: v.detach().double() for k, v in {**outputs, **grads}.items() if v is not None}


# --- the distributed part ----------------------------------------------------------------


def _ranges(world: int, uneven: bool) -> list[tuple[int, int]]:
    if uneven:
        assert world == 3
        return [(0, 100), (100, 650), (650, V)]
    return [even_vocab_range(V, r, world) for r in range(world)]


def _error_checks(rank: int, world: int) -> dict[str, str]:
    """Bad inputs: every rank must raise ValueError (none may hang). Returns the messages."""
    group = dist.group.WORLD
    msgs: dict[str, str] = {}

    def expect(name, fn):
        try:
            fn()
        except ValueError as e:
            msgs[name] = str(e)
        else:
            msgs[name] = "<no error>"

    start, end = even_vocab_range(V, rank, world)
    expect("overlap", lambda: VocabParallel(group, max(0, start - 5), end))
    expect("gap", lambda: VocabParallel(group, start, end - (3 if rank == 0 else 0)))
    expect("vocab_size", lambda: VocabParallel(group, start, end, vocab_size=V + 1))
    expect("empty", lambda: VocabParallel(group, start, start if rank == 1 else end))
    vp = VocabParallel.even(V, group)
    d = _inputs(Case("errors", ignored=0.0))
    w = vp.shard(d["weight"]).float()
    h = d["hidden"].float()
    labels = d["labels"].clone()
    bad = labels.clone()
    bad[0, 0] = V  # outside every shard
    expect("label", lambda: linear_logprobs(h, w, bad, vocab_parallel=vp))
    expect(
        "rows",
        lambda: linear_logprobs(h[:, : 41 - rank], w, labels[:, : 41 - rank], vocab_parallel=vp),
    )
    other = labels.clone()
    other[1, 3] = (other[1, 3] + 1 + rank) % V
    expect("labels differ", lambda: linear_logprobs(h, w, other, vocab_parallel=vp))
    wrong_w = w if rank == 0 else w[:-1]
    expect("weight shape", lambda: linear_logprobs(h, wrong_w, labels, vocab_parallel=vp))
    expect("not a VocabParallel", lambda: linear_logprobs(h, w, labels, vocab_parallel=(0, 5)))
    # DTensors (e.g. an FSDP2-sharded weight, a sequence-sharded hidden): plain tensors only
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    w_full = d["weight"].float()
    expect(
        "dtensor weight",
        lambda: linear_logprobs(h, distribute_tensor(w_full, mesh, [Shard(0)]), labels),
    )
    expect(
        "dtensor hidden",
        lambda: linear_logprobs(distribute_tensor(h, mesh, [Shard(0)]), w_full, labels),
    )
    # still usable after all that (no collective left half-done)
    out = linear_logprobs(h, w, labels, vocab_parallel=vp)
    msgs["after"] = "finite" if bool(torch.isfinite(out.logprobs).all()) else "non-finite"
    return msgs


def _worker(rank: int, world: int, uneven: bool) -> dict:
    torch.manual_seed(rank)  # ranks must not rely on shared RNG state
    start, end = _ranges(world, uneven)[rank]
    results = {}
    for case in HEAD_CASES + LOSS_CASES:
        vp = VocabParallel(
            dist.group.WORLD,
            start,
            end,
            vocab_size=V,
            reduce_hidden_grad=case.reduce_hidden_grad,
        )
        results[case.name] = _run(case, _inputs(case), case.dtype, slice(start, end), vp)
    if world == 2:
        results["errors"] = _error_checks(rank, world)
    return results


@functools.cache
def _spawned(world: int, uneven: bool):
    return world, _ranges(world, uneven), spawn(_worker, world, uneven)


@pytest.fixture(
    scope="module", params=[(2, False), (3, True)], ids=["2 ranks even", "3 ranks uneven"]
)
def spawned(request):
    return _spawned(*request.param)


@pytest.mark.parametrize("case", HEAD_CASES + LOSS_CASES, ids=lambda c: c.name)
def test_matches_single_process(spawned, case):
    world, ranges, per_rank = spawned
    d = _inputs(case)
    truth = _reference(case, d, torch.float64)
    ref = _reference(case, d, case.dtype)
    single = _run(case, d, case.dtype)  # the single-process op: same numbers expected
    results = [r[case.name] for r in per_rank]
    outputs = [k for k in truth if k not in ("hidden", "weight", "bias")]
    for key in outputs:
        for r in range(1, world):  # identical on every rank, bit for bit
            assert torch.equal(results[r][key], results[0][key]), f"{key} differs on rank {r}"
        # A 0-dim loss or metric is one sample of the reference's error, which may be 0 by
        # chance: as in test_fused_loss, its floor is the fp32 bound of a sum (or max) over
        # the valid tokens, num_tokens ulps of its scale, instead of one.
        n_valid = int((d["labels"] != -100).sum())
        floor = FLOOR * (max(8, n_valid) if truth[key].dim() == 0 else 1)
        assert_no_worse_than_reference(results[0][key], ref[key], truth[key], key, floor=floor)
        assert_no_worse_than_reference(
            single[key], ref[key], truth[key], f"single {key}", floor=floor
        )
    # weight / bias: each rank's shard gradient, concatenated in rank order
    for key in ("weight", "bias"):
        if key in truth:
            gathered = torch.cat([results[r][key] for r in range(world)])
            assert gathered.shape == truth[key].shape
            assert_no_worse_than_reference(gathered, ref[key], truth[key], key)
    if case.reduce_hidden_grad:
        for r in range(1, world):
            assert torch.equal(results[r]["hidden"], results[0]["hidden"])
        dh = results[0]["hidden"]
    else:  # each rank holds its shard's contribution: the caller's reduction sums them
        dh = sum(results[r]["hidden"] for r in range(world))
        assert not torch.allclose(results[0]["hidden"], dh)
    assert_no_worse_than_reference(dh, ref["hidden"], truth["hidden"], "hidden")


def test_bad_inputs_raise_on_every_rank():
    _, _, per_rank = _spawned(2, False)
    for rank, res in enumerate(per_rank):
        msgs = res["errors"]
        assert "tile the vocabulary" in msgs["overlap"], msgs["overlap"]
        assert "tile the vocabulary" in msgs["gap"], msgs["gap"]
        assert f"vocab_size={V + 1}" in msgs["vocab_size"], msgs["vocab_size"]
        assert "empty range" in msgs["empty"], msgs["empty"]
        assert f"[0, {V})" in msgs["label"] and "global vocabulary" in msgs["label"]
        assert "row counts" in msgs["rows"], msgs["rows"]
        assert "same labels" in msgs["labels differ"], msgs["labels differ"]
        if rank == 1:
            assert "this rank's shard" in msgs["weight shape"], msgs["weight shape"]
        else:
            assert "another rank" in msgs["weight shape"], msgs["weight shape"]
        assert "VocabParallel" in msgs["not a VocabParallel"]
        assert (
            "LogprobHead" in msgs["dtensor weight"] and "vocab_parallel" in msgs["dtensor weight"]
        )
        assert "DTensor" in msgs["dtensor hidden"] and "to_local" in msgs["dtensor hidden"]
        assert msgs["after"] == "finite"


def test_even_vocab_range():
    assert [even_vocab_range(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [even_vocab_range(8, r, 2) for r in range(2)] == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="non-empty"):
        even_vocab_range(2, 0, 3)
    with pytest.raises(ValueError, match="rank"):
        even_vocab_range(10, 3, 3)


def test_needs_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(ValueError, match="init_process_group"):
        VocabParallel(None, 0, 10)
