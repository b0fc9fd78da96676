"""Sampling replay under vocabulary parallelism, on real gloo groups of 2 and 3 ranks.

Mask ids are global: each rank gathers and differentiates the kept ids of its own shard, and
the per-row statistics are combined over the group. Top-k / top-p replay streams each shard
and merges the candidates with ``[rows, C]``-sized all-gathers. Every rank must get the same
outputs and hidden gradient, the shards' weight gradients concatenated must be the whole
one, and all of it must match the single-process reference within the tolerance derived
from its own error against float64 (``_tolerance.py``), with the same kept sets.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from _dist import spawn
from _tolerance import FLOOR, assert_no_worse_than_reference
from test_replay import Case, _inputs, _logits64, _replay_kwargs, truth_masked

import logitless
from logitless import PolicyLossConfig, VocabParallel, reference
from logitless.parallel import even_vocab_range
from logitless.parallel.context import context_parallel_split

V = 257


@dataclass(frozen=True)
class PCase:
    name: str
    case: Case
    loss: PolicyLossConfig | None = None  # None: linear_logprobs
    few_candidates: bool = False
    integer: bool = False  # exact integer logits: ties across shards
    shard_ties: bool = False  # the k-th value tied on rank 0's shard only, beyond its k


CASES = [
    PCase("mask", Case("mask", bias=True, temperature="tensor", chunk=7, V=V)),
    PCase("topk_topp", Case("topk_topp", bias=True, V=V, seed=1)),
    PCase("minp_topp widened", Case("all", V=V, seed=2), few_candidates=True),
    PCase("ties top_k=5", Case("topk", V=V), integer=True),
    PCase("ties left out on one shard", Case("topk", V=V, bias=True), shard_ties=True),
    PCase("bf16 mask", Case("mask", dtype="bf16", shape=(17,), H=16, V=V, seed=3)),
    PCase(
        "fused mask",
        Case("mask", shape=(3, 11), bias=True, V=V, seed=4),
        loss=PolicyLossConfig(entropy_coef=0.01, kl_coef=0.05),
    ),
    PCase(
        "fused topk_topp gspo",
        Case("topk_topp", shape=(3, 11), V=V, seed=5),
        loss=PolicyLossConfig(ratio_level="sequence", aggregation="seq_mean_token_mean"),
    ),
]


def _problem(pc: PCase) -> dict:
    """Inputs and replay arguments of a case, identical in every process."""
    inp = _inputs(pc.case)
    if pc.integer:
        g = torch.Generator().manual_seed(9)
        inp["hidden"] = torch.randint(-1, 2, inp["hidden"].shape, generator=g).float()
        inp["weight"] = torch.randint(-2, 3, inp["weight"].shape, generator=g).float()
        replay = {"top_k": 5}
    elif pc.shard_ties:
        # logits = bias: ids 1..7 share the top value 5.0 (all on rank 0's shard), the rest is
        # lower: rank 0 keeps 4 of them as candidates and leaves 3 out, which only its own
        # tie count tells the merge.
        g = torch.Generator().manual_seed(8)
        inp["weight"] = torch.zeros_like(inp["weight"])
        inp["bias"] = torch.rand(V, generator=g) * 6 - 3
        inp["bias"][1:8] = 5.0
        replay = {"top_k": 4}
    else:
        replay = _replay_kwargs(pc.case, inp)
    inp.pop("gen")
    if pc.loss is not None:
        g = torch.Generator().manual_seed(13)
        labels = inp["labels"]
        inp["old"] = torch.where(labels != -100, -2.0 * torch.rand(labels.shape, generator=g), 0.0)
        inp["adv"] = torch.randn(labels.shape[0], generator=g)
    return {"inp": inp, "replay": replay}


def _run(pc: PCase, prob: dict, rows=slice(None), vp=None, dtype=None) -> dict:
    """Forward + backward of the case in one process (``rows``: this rank's weight rows)."""
    inp, replay = prob["inp"], prob["replay"]
    dt = dtype or inp["hidden"].dtype

    def leaf(t):
        return None if t is None else t.detach().to(dt).clone().requires_grad_()

    h, w = leaf(inp["hidden"]), leaf(inp["weight"][rows])
    b = None if inp["bias"] is None else leaf(inp["bias"][rows])
    kw = dict(bias=b, temperature=inp["temperature"], softcap=pc.case.softcap, **replay)
    if vp is not None:
        kw["vocab_parallel"] = vp
    if pc.loss is None:
        out = logitless.linear_logprobs(
            h, w, inp["labels"], with_entropy=True, chunk_size=pc.case.chunk, with_kept_mass=True,
            **kw,
        )  # fmt: skip
        ((out.logprobs * inp["g"]).sum() + (out.entropy * inp["e"]).sum()).backward()
        res = {
            "logprobs": out.logprobs,
            "entropy": out.entropy,
            "log_kept_mass": out.log_kept_mass,
            "kept_size": out.kept_size,
            "label_added": out.label_added,
        }
    else:
        loss, metrics = logitless.fused_policy_loss(
            h, w, inp["labels"], inp["old"], inp["adv"], config=pc.loss, ref_logprobs=inp["old"],
            with_kept_mass=True, **kw,
        )  # fmt: skip
        (loss * 0.5).backward()
        res = dict(metrics) | {"loss": loss}
    res |= {"hidden": h.grad, "weight": w.grad}
    if b is not None:
        res["bias"] = b.grad
    return {k: v.detach().clone() for k, v in res.items()}


def _reference(pc: PCase, prob: dict, as_float64: bool) -> dict:
    """The reference in the case's dtype, or (``as_float64``) the float64 truth over the same
    kept sets."""
    inp, replay = prob["inp"], prob["replay"]
    dt = torch.float64 if as_float64 else inp["hidden"].dtype
    leaves = {
        k: None if inp[k] is None else inp[k].detach().to(dt).clone().requires_grad_()
        for k in ("hidden", "weight", "bias")
    }
    labels = inp["labels"]
    ref = reference.linear_logprobs(
        *(inp[k].detach() for k in ("hidden", "weight")),
        labels,
        bias=inp["bias"],
        temperature=inp["temperature"],
        softcap=pc.case.softcap,
        with_entropy=True,
        with_kept_mass=True,
        **replay,
    )
    if as_float64:
        z = _logits64(
            leaves["hidden"], leaves["weight"], leaves["bias"], inp["temperature"], pc.case.softcap
        )
        keep = _kept(pc, prob, z.detach())
        lp, ent = truth_masked(z, labels, keep.reshape(z.shape))
    else:
        out = reference.linear_logprobs(
            leaves["hidden"],
            leaves["weight"],
            labels,
            bias=leaves["bias"],
            temperature=inp["temperature"],
            softcap=pc.case.softcap,
            with_entropy=True,
            **replay,
        )
        lp, ent = out.logprobs, out.entropy
    if pc.loss is None:
        ((lp * inp["g"].to(dt)).sum() + (ent * inp["e"].to(dt)).sum()).backward()
        res = {"logprobs": lp, "entropy": ent}
    else:
        loss, metrics = logitless.policy_loss(
            lp, inp["old"].to(dt), inp["adv"].to(dt), labels != -100, config=pc.loss,
            ref_logprobs=inp["old"].to(dt), entropy=ent if pc.loss.entropy_coef else None,
        )  # fmt: skip
        (loss * 0.5).backward()
        res = {"loss": loss} | {k: v for k, v in metrics.items() if v.is_floating_point()}
    res |= {k: t.grad for k, t in leaves.items() if t is not None}
    res = {k: v.detach().double() for k, v in res.items()}
    res["kept_size"], res["label_added"] = ref.kept_size, ref.label_added
    return res


def _kept(pc: PCase, prob: dict, z: torch.Tensor) -> torch.Tensor:
    from logitless.contract.head import check_head_call
    from logitless.contract.options import HeadOptions, SamplerOptions

    inp = prob["inp"]
    labels = inp["labels"]
    rargs = check_head_call(
        torch.zeros(*labels.shape, 1), torch.zeros(V, 1), labels, None, HeadOptions(),
        SamplerOptions(**prob["replay"]),
    ).replay  # fmt: skip
    return reference.kept_set(z.reshape(-1, V), labels.reshape(-1).clamp(min=0), rargs)[0]


# --- the distributed part ----------------------------------------------------------------


def _ranges(world: int) -> list[tuple[int, int]]:
    """Shards of the 3-rank group (uneven) and of the 2-rank subgroup (even)."""
    if world == 3:
        return [(0, 40), (40, 200), (200, V)]  # uneven: the last shard holds the last id
    return [even_vocab_range(V, r, world) for r in range(world)]


def _few_candidates(on: bool) -> None:
    from logitless.ops.replay import topk_stream

    topk_stream.DEFAULT_CANDIDATES = 8 if on else 1024


def _errors(vp: VocabParallel, rank: int) -> dict:
    """A bad mask on one rank only: every rank raises (none hangs), then still works."""
    prob = _problem(CASES[0])
    inp = prob["inp"]
    w = inp["weight"][vp.vocab_start : vp.vocab_end]
    mask = prob["replay"]["sampling_mask"]
    bad = logitless.SamplingMask(mask.token_ids.clone(), mask.offsets)
    if rank == 1:
        bad.token_ids[0] = V  # outside the global vocabulary
    msgs = {}
    try:
        logitless.linear_logprobs(
            inp["hidden"], w, inp["labels"], sampling_mask=bad, vocab_parallel=vp
        )
    except ValueError as e:
        msgs["bad mask"] = str(e)
    out = logitless.linear_logprobs(inp["hidden"], w, inp["labels"], top_k=3, vocab_parallel=vp)
    msgs["after"] = "finite" if bool(torch.isfinite(out.logprobs).all()) else "non-finite"
    return msgs


# --- context parallelism: the fused loss with replay on a packed stream split over 2 ranks ---

CP_DOCS = [0] * 7 + [1] * 9 + [-1] * 2 + [2] * 4 + [-1] * 2  # doc 1 spans the split point


def _cp_stream() -> dict:
    g = torch.Generator().manual_seed(21)
    n, h = len(CP_DOCS), 16
    doc = torch.tensor(CP_DOCS)
    labels = logitless.next_token_labels(torch.randint(0, V, (n,), generator=g), document_ids=doc)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(V, h, generator=g) * 0.5
    with torch.no_grad():
        cur = logitless.linear_logprobs(hidden, weight, labels, top_k=8).logprobs
    old = torch.where(labels != -100, cur + 0.2 * torch.randn(n, generator=g), 0.0)
    top_k = torch.randint(3, 12, (n,), generator=g)
    adv = torch.randn(3, generator=g)
    return dict(doc=doc, labels=labels, hidden=hidden, weight=weight, old=old, top_k=top_k, adv=adv)


CP_CONFIG = PolicyLossConfig(kl_coef=0.05, entropy_coef=0.01, aggregation="seq_mean_token_mean")


def _cp_run(s: dict, group=None) -> dict:
    h = s["hidden"].clone().requires_grad_()
    w = s["weight"].clone().requires_grad_()
    loss, metrics = logitless.fused_policy_loss(
        h, w, s["labels"], s["old"], s["adv"], config=CP_CONFIG, document_ids=s["doc"],
        ref_logprobs=s["old"], top_k=s["top_k"], top_p=0.9, with_kept_mass=True,
        context_group=group,
    )  # fmt: skip
    loss.backward()
    # (after the metrics: metrics["loss"] is the group's loss, this rank's share is `loss`)
    return dict(metrics) | {"loss": loss.detach(), "hidden": h.grad, "weight": w.grad}


def _cp_shard(s: dict, rank: int) -> dict:

    out = {k: s[k] for k in ("weight", "adv")}
    for k in ("doc", "labels", "hidden", "old", "top_k"):
        out[k] = context_parallel_split(s[k], rank, 2, layout="contiguous")
    return out


def _worker(rank: int, world_size: int) -> dict:
    """Three processes: every case on the 3-rank group (uneven shards), then on a 2-rank
    subgroup of ranks 0 and 1 (even shards) while rank 2 waits: one spawn for both."""
    torch.manual_seed(rank)
    pair = dist.new_group([0, 1])
    results = {2: {}, 3: {}}
    for world, group in ((3, dist.group.WORLD), (2, pair)):
        if rank >= world:
            continue
        start, end = _ranges(world)[rank]
        vp = VocabParallel(group, start, end, vocab_size=V)
        for pc in CASES:
            _few_candidates(pc.few_candidates)
            results[world][pc.name] = _run(pc, _problem(pc), slice(start, end), vp)
        _few_candidates(False)
        if world == 2:
            results[2]["errors"] = _errors(vp, rank)
            results[2]["context"] = _cp_run(_cp_shard(_cp_stream(), rank), pair)
    return results


@functools.cache
def _spawned_all():
    return spawn(_worker, 3)


def _spawned(world: int):
    return [r[world] for r in _spawned_all()[:world]]


@functools.cache
def _expected(name: str) -> tuple[dict, dict, dict]:
    """(single-process op, reference, float64 truth) of a case, computed once."""
    pc = next(c for c in CASES if c.name == name)
    prob = _problem(pc)
    _few_candidates(pc.few_candidates)
    try:
        single = _run(pc, prob)
    finally:
        _few_candidates(False)
    return single, _reference(pc, prob, as_float64=False), _reference(pc, prob, as_float64=True)


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks even", "3 ranks uneven"])
def spawned(request):
    return request.param, _spawned(request.param)


@pytest.mark.parametrize("pc", CASES, ids=[c.name for c in CASES])
def test_matches_single_process(spawned, pc):
    world, per_rank = spawned
    prob = _problem(pc)
    single, ref, truth = _expected(pc.name)
    results = [r[pc.name] for r in per_rank]
    for key, value in results[0].items():
        for r in range(1, world):
            if key not in ("weight", "bias"):
                assert torch.equal(results[r][key], value), f"{key} differs on rank {r}"
    if pc.loss is None:
        for key in ("kept_size", "label_added"):
            assert torch.equal(results[0][key], ref[key]), key
            assert torch.equal(single[key], ref[key]), f"single {key}"
        scale = max(1.0, float(single["log_kept_mass"].abs().max()))
        torch.testing.assert_close(
            results[0]["log_kept_mass"], single["log_kept_mass"], rtol=0, atol=1e-5 * scale
        )
    else:
        for key in ("replay_kept_size", "replay_label_added", "replay_log_kept_mass"):
            torch.testing.assert_close(results[0][key], single[key], rtol=1e-6, atol=1e-6)
    n_valid = int((prob["inp"]["labels"] != -100).sum())
    for key in truth:
        if key in ("kept_size", "label_added") or key not in results[0]:
            continue
        got = results[0][key].double()
        if key in ("weight", "bias"):
            got = torch.cat([results[r][key] for r in range(world)]).double()
        floor = FLOOR * (max(8, n_valid) if truth[key].dim() == 0 else 1)
        assert_no_worse_than_reference(got, ref[key], truth[key], key, floor=floor)
        assert_no_worse_than_reference(
            single[key].double(), ref[key], truth[key], f"single {key}", floor=floor
        )


def test_bad_mask_on_one_rank_raises_on_every_rank():
    for rank, res in enumerate(_spawned(2)):
        msgs = res["errors"]
        if rank == 1:
            assert f"[0, {V})" in msgs["bad mask"], msgs
        else:
            assert "another rank" in msgs["bad mask"], msgs
        assert msgs["after"] == "finite"


def test_fused_loss_with_replay_under_context_parallelism():
    """Two context-parallel ranks, each with half of a packed stream (a document spans the
    split): the losses sum to the single-process one, the metrics (replay's included) are the
    whole stream's on both ranks, the gradients match."""
    ranks = [r["context"] for r in _spawned(2)]
    whole = _cp_run(_cp_stream())
    close = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ranks[0]["loss"] + ranks[1]["loss"], whole["loss"], **close)
    for key in ("replay_kept_size", "replay_label_added", "replay_log_kept_mass", "kl_ref"):
        for r in ranks:
            torch.testing.assert_close(r[key], whole[key], **close, msg=key)
    torch.testing.assert_close(torch.cat([r["hidden"] for r in ranks]), whole["hidden"], **close)
    torch.testing.assert_close(ranks[0]["weight"] + ranks[1]["weight"], whole["weight"], **close)
