"""linear_divergence with both heads vocab-parallel, on real gloo groups (2 ranks even, 3
uneven), against one process and the float64 truth of tests/test_divergence.py.

Each rank holds rows [start, end) of the student's and the teacher's heads (and biases);
labels and the sparse teacher's ids are global. Outputs must be identical on every rank, the
hidden gradient (all-reduced) too, and the weight / bias gradients, concatenated in rank
order, must match the truth within the tolerance derived from the naive reference's error.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from _dist import spawn
from _tolerance import assert_no_worse_than_reference
from test_divergence import Case, make_inputs, run, run_truth

import logitless
from logitless import VocabParallel, reference
from logitless.parallel import even_vocab_range

pytestmark = pytest.mark.slow

CASES = {
    "forward kl, both biases, extras": Case(beta=0.0, bias=True, t_bias=True, extras=True),
    "reverse kl, softcap, teacher scale, per-token T": Case(
        beta=1.0, softcap=3.0, t_scale=0.6, temperature="tensor", chunk=7
    ),
    "jsd, wider teacher, small tiles": Case(beta=0.3, Ht=56, extras=True, small_tiles=True),
    "jsd 0.5 close teacher": Case(beta=0.5, close=True, ignore="none"),
    "all ignored": Case(beta=0.7, ignore="all"),
    "top-k tail": Case(topk=6, extras=True),
    "top-k small tiles chunk": Case(topk=4, chunk=5, temperature="scalar", small_tiles=True),
    "top-k reverse kl": Case(topk=6, beta=1.0, extras=True, chunk=7),
    "top-k jsd small tiles": Case(topk=5, beta=0.4, temperature="tensor", small_tiles=True),
    "bf16 jsd": Case(beta=0.6, dtype="bf16", shape=(29,), V=389, t_bias=True),
}


def _ranges(vocab: int, world: int) -> list[tuple[int, int]]:
    if world == 3:  # uneven: 10%, 40%, 50%
        a, b = vocab // 10, vocab // 2
        return [(0, a), (a, b), (b, vocab)]
    return [even_vocab_range(vocab, r, world) for r in range(world)]


def _shard(d: dict, start: int, end: int) -> dict:
    """This rank's rows of both heads (weights and biases)."""
    out = dict(d)
    for k in ("weight", "bias", "t_weight", "t_bias"):
        if d[k] is not None:
            out[k] = d[k][start:end]
    return out


def _run_case(case: Case, rank: int, world: int) -> dict:
    from logitless.backends import base

    start, end = _ranges(case.V, world)[rank]
    vp = VocabParallel(dist.group.WORLD, start, end, vocab_size=case.V)
    saved = base._TILE_ELEMS
    if case.small_tiles:
        base._TILE_ELEMS = {"cpu": 1024}
    try:
        d = _shard(make_inputs(case), start, end)
        kw = dict(chunk_size=case.chunk, vocab_parallel=vp)
        return run(logitless.linear_divergence, case, d, **kw)
    finally:
        base._TILE_ELEMS = saved


def _expect_error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "<no error>"


def _error_checks(rank: int, world: int) -> dict[str, str]:
    """A bad input on one rank: every rank raises ValueError (none hangs)."""
    case = Case(beta=0.0, topk=None)
    start, end = _ranges(case.V, world)[rank]
    vp = VocabParallel(dist.group.WORLD, start, end, vocab_size=case.V)
    d = _shard(make_inputs(case), start, end)
    h, w, th, tw, y = d["hidden"], d["weight"], d["t_hidden"], d["t_weight"], d["labels"]

    def call(**kw):
        args = dict(vocab_parallel=vp) | kw
        return logitless.linear_divergence(
            args.pop("h", h), w, y, th, args.pop("tw", tw), **args
        ).divergence

    msgs = {
        "teacher shard": _expect_error(lambda: call(tw=tw if rank == 0 else tw[:-1])),
        "teacher requires grad": _expect_error(
            lambda: call(tw=tw.clone().requires_grad_(rank == 1))
        ),
        "vocab_size": _expect_error(lambda: call(vocab_size=case.V - 1)),
    }
    ids = torch.tensor([5, case.V if rank == 1 else 7])
    offsets = torch.tensor([0] + [2] * y.numel())  # both ids at position 0
    topk = logitless.TeacherTopK(ids, torch.tensor([-1.0, -2.0]), offsets)
    msgs["top-k id on one rank"] = _expect_error(
        lambda: logitless.linear_divergence(h, w, y, teacher_topk=topk, vocab_parallel=vp)
    )
    msgs["triton"] = _expect_error(lambda: call(backend="triton"))  # refused on every rank
    out = call()  # still usable: no collective left half-done
    msgs["after"] = "finite" if bool(torch.isfinite(out).all()) else "non-finite"
    return msgs


def _worker(rank: int, world: int) -> dict:
    torch.manual_seed(rank)  # the ranks must not rely on shared RNG state
    results = {name: _run_case(case, rank, world) for name, case in CASES.items()}
    results["errors"] = _error_checks(rank, world)
    return results


@functools.cache
def _spawned(world: int):
    return spawn(_worker, world)


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks even", "3 ranks uneven"])
def spawned(request):
    return request.param, _spawned(request.param)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process_and_float64(spawned, name):
    world, per_rank = spawned
    case = CASES[name]
    results = [r[name] for r in per_rank]
    d = make_inputs(case)
    truth = run_truth(case, d)
    ref = run(reference.linear_divergence, case, d)
    for key in truth:
        if key in ("grad_weight", "grad_bias"):
            got = torch.cat([r[key] for r in results])  # each rank's shard, in rank order
        else:
            got = results[0][key]
            for r in range(1, world):  # the same on every rank, bit for bit
                assert torch.equal(results[r][key], got), f"{key} differs on rank {r}"
        assert_no_worse_than_reference(got, ref[key], truth[key], key)


def test_bad_input_on_one_rank_raises_on_every_rank(spawned):
    world, per_rank = spawned
    for rank, result in enumerate(per_rank):
        msgs = result["errors"]
        assert msgs.pop("after") == "finite"
        for name, msg in msgs.items():
            assert msg != "<no error>", f"{name}: rank {rank} did not raise"
    first = per_rank[0]["errors"]
    assert "requires grad" in per_rank[1]["errors"]["teacher requires grad"]
    assert "another rank" in first["teacher requires grad"]
    assert "vocab_parallel vocabulary" in first["vocab_size"]
    assert "token ids must be in" in per_rank[1]["errors"]["top-k id on one rank"]
    assert "another rank" in first["top-k id on one rank"]
    assert "vocab_parallel runs on the torch tiles" in first["triton"]
