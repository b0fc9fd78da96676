"""Context parallelism in the loss layer: real gloo groups against one process.

A packed stream (several documents, one spanning every rank boundary, padding in the middle
and at the end, masked prompts, a fully masked document) is split over 2 or 3 ranks,
``contiguous`` and ``zigzag``. Each rank calls ``policy_loss(..., context_group=...)`` on its
shard; the ranks' losses must sum to the single-process loss of the whole stream, each rank's
gradients (log-probs and entropy, merged back into stream order) must equal the single-process
gradients, and the metrics must equal the single-process metrics on every rank. float64 inputs
make the comparison tight (1e-12); float32 runs are held to the single-process float32 error
against a float64 truth (``_tolerance``).

Spawns cost seconds, so each one runs every case of a list and saves the results; the checks
run in the test process.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from _dist import spawn
from _host_reads import no_host_reads
from _tolerance import assert_no_worse_than_reference

from logitless import parallel
from logitless.losses import (
    DocumentStats,
    LossNormalizer,
    PolicyLossConfig,
    document_stats,
    loss_normalizer,
    policy_loss,
)

TIGHT = dict(rtol=1e-12, atol=1e-12)

# ---------------------------------------------------------------------------------------------
# the split of a stream (one process)


def _reference_split(x, rank, world, layout, dim):
    """Plain loop: cut into equal chunks, pick this rank's in its order."""
    chunks = world if layout == "contiguous" else 2 * world
    pieces = list(torch.chunk(x, chunks, dim))
    mine = [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]
    return torch.cat([pieces[i] for i in mine], dim)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shape, dim", [((12,), 0), ((12, 5), 0), ((2, 12), 1), ((2, 12, 3), -2)])
def test_split_matches_reference_and_merge_inverts_it(layout, world, shape, dim):
    x = torch.randn(shape, dtype=torch.float64)
    shards = [
        parallel.context_parallel_split(x, r, world, layout=layout, dim=dim) for r in range(world)
    ]
    for r, sh in enumerate(shards):
        assert torch.equal(sh, _reference_split(x, r, world, layout, dim))
        idx = parallel.context_parallel_indices(12, r, world, layout=layout)
        assert torch.equal(sh, x.index_select(dim, idx))
    assert torch.equal(parallel.context_parallel_merge(shards, layout=layout, dim=dim), x)


def test_split_hand_worked_and_padding():
    x = torch.arange(8)
    assert parallel.context_parallel_split(x, 0, 2, layout="zigzag").tolist() == [0, 1, 6, 7]
    assert parallel.context_parallel_split(x, 1, 2, layout="zigzag").tolist() == [2, 3, 4, 5]
    assert parallel.context_parallel_indices(12, 1, 3, layout="zigzag").tolist() == [2, 3, 8, 9]
    # 10 tokens over zigzag-2: padded to 12 with -1 (ids), False (masks), 0.0 (floats)
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2])
    s1 = parallel.context_parallel_split(ids, 1, 2, layout="zigzag", pad_value=-1)
    assert s1.tolist() == [1, 1, 1, 1, 2, 2]
    s0 = parallel.context_parallel_split(ids, 0, 2, layout="zigzag", pad_value=-1)
    assert s0.tolist() == [0, 0, 0, 2, -1, -1]
    merged = parallel.context_parallel_merge([s0, s1], layout="zigzag", length=10)
    assert torch.equal(merged, ids)
    m = parallel.context_parallel_split(torch.ones(10, dtype=torch.bool), 0, 4, pad_value=False)
    assert m.tolist() == [True, True, True]
    last = parallel.context_parallel_split(torch.ones(10, dtype=torch.bool), 3, 4, pad_value=False)
    assert last.tolist() == [True, False, False]


def test_split_is_differentiable_and_contiguous_is_a_view():
    x = torch.randn(8, 3, requires_grad=True)
    sh = parallel.context_parallel_split(x, 1, 2)
    assert sh.data_ptr() == x[4:].data_ptr()
    g = torch.randn(8, 3)
    parts = [parallel.context_parallel_split(x, r, 2, layout="zigzag") for r in range(2)]
    merged = parallel.context_parallel_merge(parts, layout="zigzag")
    (merged * g).sum().backward()
    assert torch.equal(x.grad, g)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: parallel.context_parallel_split(torch.zeros(10), 0, 4), "pad_value"),
        (lambda: parallel.context_parallel_split(torch.zeros(6), 0, 2, layout="zigzag"), "4"),
        (lambda: parallel.context_parallel_split(torch.zeros(8), 2, 2), "rank"),
        (lambda: parallel.context_parallel_split(torch.zeros(8), -1, 2), "rank"),
        (lambda: parallel.context_parallel_split(torch.zeros(8), 0, 0), "world_size"),
        (lambda: parallel.context_parallel_split(torch.zeros(8), 0, 2, layout="ring"), "layout"),
        (lambda: parallel.context_parallel_split(torch.zeros(8), 0, 2, dim=1), "dim"),
        (lambda: parallel.context_parallel_split([1, 2], 0, 2), "tensor"),
        (
            lambda: parallel.context_parallel_split(
                torch.ones(5, dtype=torch.bool), 0, 2, pad_value=-1
            ),
            "pad_value",
        ),
        (
            lambda: parallel.context_parallel_split(
                torch.zeros(5, dtype=torch.long), 0, 2, pad_value=0.5
            ),
            "pad_value",
        ),
        (lambda: parallel.context_parallel_merge([]), "shards"),
        (lambda: parallel.context_parallel_merge([torch.zeros(2), torch.zeros(3)]), "same shape"),
        (lambda: parallel.context_parallel_merge([torch.zeros(3)] * 2, layout="zigzag"), "even"),
        (lambda: parallel.context_parallel_merge([torch.zeros(2)] * 2, length=5), "length"),
        (lambda: parallel.context_parallel_indices(7, 0, 2), "pad"),
    ],
)
def test_split_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# the streams


def _stream(name: str, dtype: torch.dtype) -> dict:
    """Per-token inputs of one packed stream (same values in every process)."""
    g = torch.Generator().manual_seed(1234)
    if name == "packed":
        # doc 0: 0-4, pad: 5, doc 1: 6-14, doc 2: 15-20, doc 3: 21-22 (fully masked), pad: 23
        ids = torch.tensor([0] * 5 + [-1] + [1] * 9 + [2] * 6 + [3] * 2 + [-1])
        mask = torch.ones(24, dtype=torch.bool)
        mask[[0, 6, 7, 15, 21, 22, 23]] = False  # prompts, doc 3, the last padding token
        shape = (24,)
    elif name == "sparse":
        # valid tokens in [0, 6) only: under contiguous-2 rank 1 holds only padding (no
        # document at all); under zigzag-2 it holds doc 1 (fully masked) and padding
        ids = torch.tensor([0] * 6 + [1] * 6 + [-1] * 12)
        mask = torch.zeros(24, dtype=torch.bool)
        mask[1:6] = True
        shape = (24,)
    elif name == "rows":
        # [B, T] batch, one document per row, right padding by the mask; split along T
        ids = None
        lengths = torch.tensor([8, 5, 2])
        mask = torch.arange(8)[None, :] < lengths[:, None]
        mask[:, 0] = False  # a prompt token per row
        shape = (3, 8)
    else:
        raise AssertionError(name)
    lp = -torch.rand(shape, generator=g, dtype=torch.float64) * 2
    old = lp + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
    ref = lp + 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)
    rollout = old + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
    ent = torch.rand(shape, generator=g, dtype=torch.float64)
    num_docs = shape[0] if ids is None else int(ids.max()) + 1
    adv_seq = torch.randn(num_docs, generator=g, dtype=torch.float64)
    adv_tok = torch.randn(shape, generator=g, dtype=torch.float64)
    if ids is not None:  # garbage where nothing counts: it must never reach a number
        pad = ids < 0
        lp[pad], old[pad], rollout[pad] = float("nan"), float("nan"), float("-inf")
    else:
        lp[~mask] = float("-inf")
    out = dict(lp=lp, old=old, ref=ref, rollout=rollout, ent=ent, adv_tok=adv_tok, mask=mask)
    out = {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}
    out["adv_seq"] = adv_seq.to(dtype)
    out["ids"] = ids
    return out


# ---------------------------------------------------------------------------------------------
# the cases: (stream, config, advantages, which optional inputs, normalizer)

FULL = ("ref", "rollout", "ent")
CASES = {
    "ppo_token_kl_entropy": (
        "packed",
        PolicyLossConfig(dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01),
        "adv_tok",
        ("ref", "ent"),
    ),
    "gspo_seq_mean_token_mean": (
        "packed",
        PolicyLossConfig(ratio_level="sequence", aggregation="seq_mean_token_mean"),
        "adv_seq",
        FULL,
    ),
    "cispo_ratio_masks": (
        "packed",
        PolicyLossConfig(
            surrogate="cispo",
            ratio_token_mask=(0.6, 1.6),
            ratio_seq_mask="geometric",
            ratio_seq_mask_range=(0.9, 1.2),
        ),
        "adv_seq",
        ("ent",),
    ),
    "gmpo_sum_norm": (
        "packed",
        PolicyLossConfig(surrogate="gmpo", aggregation="seq_mean_token_sum_norm", norm_length=10),
        "adv_seq",
        FULL,
    ),
    "sapo_sequence_tis_masks": (
        "packed",
        PolicyLossConfig(
            surrogate="sapo",
            aggregation="seq_mean_token_sum",
            mismatch_is="sequence",
            mismatch_is_cap=1.5,
            mismatch_token_mask=(0.6, 1.8),
            mismatch_seq_mask="product",
            mismatch_seq_mask_range=(0.5, 2.0),
        ),
        "adv_seq",
        FULL,
    ),
    "gspo_ratio_seq_mask_product_token_tis": (
        "packed",
        PolicyLossConfig(
            ratio_level="sequence",
            surrogate="reinforce",
            aggregation="token_sum",
            ratio_seq_mask="product",
            ratio_seq_mask_range=(0.5, 3.0),
            mismatch_is="token",
            kl_coef=0.1,
            kl_estimator="k3+",
        ),
        "adv_tok",
        FULL,
    ),
    "normalizer_scaled": (
        "packed",
        PolicyLossConfig(aggregation="seq_mean_token_mean", ratio_level="sequence"),
        "adv_seq",
        FULL,
    ),
    "sparse_gspo": (
        "sparse",
        PolicyLossConfig(ratio_level="sequence", aggregation="seq_mean_token_mean", kl_coef=0.1),
        "adv_seq",
        FULL,
    ),
    "gspo_mean_token_adv_tis_opsm": (
        "packed",
        PolicyLossConfig(
            ratio_level="sequence_mean",
            aggregation="seq_mean_token_mean",
            mismatch_is="token",
            opsm_delta=0.0,
        ),
        "adv_tok",
        FULL,
    ),
    "sparse_gspo_mean": (
        "sparse",
        PolicyLossConfig(ratio_level="sequence_mean", kl_coef=0.1, clip_high=0.28),
        "adv_tok",
        FULL,
    ),
    "sparse_token_mean_seq_tis": (
        "sparse",
        PolicyLossConfig(mismatch_is="sequence", entropy_coef=0.02),
        "adv_tok",
        FULL,
    ),
    "rows_gspo_sum_norm": (
        "rows",
        PolicyLossConfig(
            ratio_level="sequence", aggregation="seq_mean_token_sum_norm", norm_length=8
        ),
        "adv_seq",
        FULL,
    ),
    "rows_seq_mean_token_mean_seq_mask": (
        "rows",
        PolicyLossConfig(
            aggregation="seq_mean_token_mean",
            mismatch_seq_mask="geometric",
            mismatch_seq_mask_range=(0.8, 1.25),
            entropy_coef=0.01,
        ),
        "adv_seq",
        FULL,
    ),
}
NORMALIZER = LossNormalizer(num_tokens=40.0, num_sequences=7.0, loss_scale=3.0)


def _dim(stream: str) -> int:
    return 1 if stream == "rows" else 0


def _run_case(name, dtype, rank, world, layout, group, capturable=False):
    """This rank's loss share, gradients and metrics (single process when group is None);
    ``capturable``: in that mode, under tests/_host_reads.py's detector."""
    stream, cfg, adv_key, optional = CASES[name]
    d = _stream(stream, dtype)
    dim = _dim(stream)

    def shard(t):
        if t is None or group is None:
            return t
        return parallel.context_parallel_split(t, rank, world, layout=layout, dim=dim)

    lp = shard(d["lp"]).clone().requires_grad_()
    ent = shard(d["ent"]).clone().requires_grad_()
    adv = d[adv_key] if adv_key == "adv_seq" else shard(d[adv_key])
    with no_host_reads() if capturable else contextlib.nullcontext():
        return _loss_and_grads(name, d, shard, lp, ent, adv, group, capturable)


def _loss_and_grads(name, d, shard, lp, ent, adv, group, capturable):
    _, cfg, _, optional = CASES[name]
    loss, metrics = policy_loss(
        lp,
        shard(d["old"]),
        adv,
        shard(d["mask"]),
        config=cfg,
        document_ids=shard(d["ids"]),
        ref_logprobs=shard(d["ref"]) if "ref" in optional else None,
        rollout_logprobs=shard(d["rollout"]) if "rollout" in optional else None,
        entropy=ent if "ent" in optional else None,
        normalizer=NORMALIZER if name == "normalizer_scaled" else None,
        context_group=group,
        capturable=capturable,
    )
    upstream = 0.7  # a non-unit upstream gradient
    (loss * upstream).backward()
    g_ent = ent.grad if ent.grad is not None else torch.zeros_like(ent)
    return dict(loss=loss.detach(), g_lp=lp.grad, g_ent=g_ent, metrics=metrics)


def _chunked_with_stats(name, rank, world, layout, group):
    """The loss evaluated chunk by chunk with precomputed document stats (no collective per
    chunk, as the fused loss needs): per-chunk gradients of the rows of the chunk."""
    stream, cfg, adv_key, optional = CASES[name]
    d = _stream(stream, torch.float64)
    dim = _dim(stream)

    def shard(t):
        return (
            None
            if t is None
            else parallel.context_parallel_split(t, rank, world, layout=layout, dim=dim)
        )

    lp_all = shard(d["lp"])
    adv = d[adv_key] if adv_key == "adv_seq" else shard(d[adv_key])
    kw = dict(
        config=cfg,
        document_ids=shard(d["ids"]),
        rollout_logprobs=shard(d["rollout"]) if "rollout" in optional else None,
    )
    stats = document_stats(
        lp_all, shard(d["old"]), adv, shard(d["mask"]), context_group=group, **kw
    )
    n = lp_all.shape[0]
    grads, shares = [], []
    for a in range(0, n, 5):  # chunks of 5 rows, the other rows held at their values
        b = min(a + 5, n)
        chunk = lp_all[a:b].clone().requires_grad_()
        full = torch.cat([lp_all[:a], chunk, lp_all[b:]])
        loss, m = policy_loss(
            full,
            shard(d["old"]),
            adv,
            shard(d["mask"]),
            ref_logprobs=shard(d["ref"]) if "ref" in optional else None,
            entropy=shard(d["ent"]) if "ent" in optional else None,
            document_stats=stats,
            **kw,
        )
        (g,) = torch.autograd.grad(loss * 0.7, chunk)
        grads.append(g)
        shares.append(m["loss"])
    fields = {
        k: getattr(stats, k)
        for k in ("size", "tokens", "log_ratio", "clipped_log_ratio", "log_rho")
    }
    return dict(
        g_lp=torch.cat(grads),
        stats=fields,
        share=shares[0],
        is_stats=isinstance(stats, DocumentStats),
    )


# ---------------------------------------------------------------------------------------------
# the spawned worker


def _expect_value_error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def _errors(rank, group):
    """Bad input on one rank must raise on every rank (and not hang the others)."""
    d = _stream("packed", torch.float64)
    lp, old, mask, ids = (
        parallel.context_parallel_split(d[k], rank, 2) for k in ("lp", "old", "mask", "ids")
    )
    cfg = PolicyLossConfig(ratio_level="sequence")
    out = {}
    bad_adv = torch.zeros(2, 2, dtype=torch.float64) if rank == 1 else d["adv_seq"]
    out["bad_shape"] = _expect_value_error(
        lambda: policy_loss(
            lp, old, bad_adv, mask, config=cfg, document_ids=ids, context_group=group
        )
    )
    # rank 0 holds ids 0..1 only: 2 advantages are enough locally, not for the group's 4
    short = d["adv_seq"][:2]
    out["short_adv"] = _expect_value_error(
        lambda: policy_loss(lp, old, short, mask, config=cfg, document_ids=ids, context_group=group)
    )
    other = PolicyLossConfig(ratio_level="sequence", clip_high=0.3) if rank == 1 else cfg
    out["config"] = _expect_value_error(
        lambda: policy_loss(
            lp, old, d["adv_seq"], mask, config=other, document_ids=ids, context_group=group
        )
    )
    masks = [mask] * (1 + rank)
    out["normalizer_k"] = _expect_value_error(
        lambda: loss_normalizer(masks, [ids] * len(masks), context_group=group)
    )
    # a [B, T] shard cannot default norm_length to its own row length
    rows = _stream("rows", torch.float64)
    r_lp = parallel.context_parallel_split(rows["lp"], rank, 2, dim=1)
    r_mask = parallel.context_parallel_split(rows["mask"], rank, 2, dim=1)
    out["norm_length"] = _expect_value_error(
        lambda: policy_loss(
            r_lp,
            r_lp,
            rows["adv_seq"],
            r_mask,
            config=PolicyLossConfig(aggregation="seq_mean_token_sum_norm"),
            context_group=group,
        )
    )
    # the group still works after all of that
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    out["alive"] = float(t)
    return out


def _worker(rank, world, plan):
    group = dist.group.WORLD
    results = {}
    for layout, names, dtypes in plan["cases"]:
        for dtype in dtypes:
            for name in names:
                results[(layout, name, str(dtype))] = _run_case(
                    name, dtype, rank, world, layout, group
                )
    for layout, name in plan.get("chunked", []):
        results[("chunked", layout, name)] = _chunked_with_stats(name, rank, world, layout, group)
    for layout, name in plan.get("capturable", []):
        results[("capturable", layout, name)] = _run_case(
            name, torch.float64, rank, world, layout, group, capturable=True
        )
    for layout, capturable in plan.get("normalizer", []):
        norms = {}
        for stream in ("packed", "sparse", "rows"):
            d = _stream(stream, torch.float64)
            dim = _dim(stream)
            masks = [
                parallel.context_parallel_split(d["mask"], rank, world, layout=layout, dim=dim)
            ]
            ids = None
            if d["ids"] is not None:
                ids = [parallel.context_parallel_split(d["ids"], rank, world, layout=layout)]
            with no_host_reads() if capturable else contextlib.nullcontext():
                n = loss_normalizer(
                    masks * 2,
                    None if ids is None else ids * 2,
                    context_group=group,
                    capturable=capturable,
                )
            norms[stream] = (float(n.num_tokens), float(n.num_sequences))
        results[("normalizer", layout, capturable)] = norms
    if plan.get("errors"):
        results["errors"] = _errors(rank, group)
    return results


def _spawn(world, plan):
    return spawn(_worker, world, plan)


# ---------------------------------------------------------------------------------------------
# checks


def _merge(per_rank, key, layout, stream):
    return parallel.context_parallel_merge(
        [r[key] for r in per_rank], layout=layout, dim=_dim(stream)
    )


def _check_case(per_rank, layout, name, dtype):
    stream = CASES[name][0]
    key = (layout, name, str(dtype))
    ranks = [r[key] for r in per_rank]
    single = _run_case(name, dtype, 0, 1, layout, None)
    summed = sum(r["loss"] for r in ranks)
    g_lp = _merge(ranks, "g_lp", layout, stream)
    g_ent = _merge(ranks, "g_ent", layout, stream)
    if dtype == torch.float64:
        torch.testing.assert_close(summed, single["loss"], **TIGHT)
        torch.testing.assert_close(g_lp, single["g_lp"], **TIGHT)
        torch.testing.assert_close(g_ent, single["g_ent"], **TIGHT)
    else:
        truth = _run_case(name, torch.float64, 0, 1, layout, None)
        for what, got, ref, tru in (
            ("loss", summed, single["loss"], truth["loss"]),
            ("g_lp", g_lp, single["g_lp"], truth["g_lp"]),
            ("g_ent", g_ent, single["g_ent"], truth["g_ent"]),
        ):
            assert_no_worse_than_reference(got, ref, tru, f"{key} {what}")
    # metrics: the group's values on every rank, equal to the single-process metrics
    assert set(ranks[0]["metrics"]) == set(single["metrics"])
    for k, v in single["metrics"].items():
        for r in ranks:
            assert torch.equal(r["metrics"][k], ranks[0]["metrics"][k]), (key, k)
        if dtype == torch.float64:
            torch.testing.assert_close(ranks[0]["metrics"][k], v, **TIGHT, msg=f"{key} {k}")
        else:
            tru = _run_case(name, torch.float64, 0, 1, layout, None)["metrics"][k]
            assert_no_worse_than_reference(
                ranks[0]["metrics"][k].reshape(1), v.reshape(1), tru.reshape(1), f"{key} {k}"
            )
    return single


@pytest.fixture(scope="module")
def two_ranks():
    plan = dict(
        cases=[
            ("contiguous", list(CASES), [torch.float64]),
            ("zigzag", list(CASES), [torch.float64]),
            (
                "zigzag",
                ["gspo_seq_mean_token_mean", "sapo_sequence_tis_masks", "ppo_token_kl_entropy"],
                [torch.float32],
            ),
        ],
        chunked=[
            ("zigzag", "gspo_seq_mean_token_mean"),
            ("contiguous", "cispo_ratio_masks"),
            ("zigzag", "sapo_sequence_tis_masks"),
        ],
        capturable=CAPTURABLE_RUNS,
        normalizer=NORMALIZER_RUNS,
        errors=True,
    )
    return _spawn(2, plan)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_process_fp64(two_ranks, layout, name):
    single = _check_case(two_ranks, layout, name, torch.float64)
    # the case exercises its masks and weights (a test that cannot fail is no test)
    cfg, m = CASES[name][1], single["metrics"]
    assert float(m["num_tokens"]) > 0
    if cfg.ratio_seq_mask is not None or cfg.ratio_token_mask is not None:
        assert 0 < float(m["ratio_masked_frac"]) < 1, float(m["ratio_masked_frac"])
    if cfg.mismatch_seq_mask is not None or cfg.mismatch_token_mask is not None:
        assert 0 < float(m["is_masked_frac"]) < 1, float(m["is_masked_frac"])
    if cfg.mismatch_is is not None:
        assert float(m["is_weight_max"]) <= cfg.mismatch_is_cap
        if CASES[name][0] == "packed":  # several documents: the weights differ
            assert float(m["is_weight_min"]) < float(m["is_weight_max"])


@pytest.mark.parametrize(
    "name", ["gspo_seq_mean_token_mean", "sapo_sequence_tis_masks", "ppo_token_kl_entropy"]
)
def test_two_ranks_fp32_no_worse_than_one_process(two_ranks, name):
    _check_case(two_ranks, "zigzag", name, torch.float32)


def test_document_split_across_ranks_and_empty_ranks_are_exercised():
    """The streams hold what the tests above claim: a document on both ranks of each layout,
    and a rank with no valid token (under contiguous-2 with no document at all)."""
    packed, sparse = _stream("packed", torch.float64), _stream("sparse", torch.float64)
    sparse_valid = sparse["mask"] & (sparse["ids"] >= 0)
    for layout in ("contiguous", "zigzag"):
        a, b = (parallel.context_parallel_split(packed["ids"], r, 2, layout=layout) for r in (0, 1))
        assert (set(a.tolist()) & set(b.tolist())) - {-1}, layout
        assert not parallel.context_parallel_split(sparse_valid, 1, 2, layout=layout).any()
    for layout in ("zigzag",):
        shards = [
            parallel.context_parallel_split(packed["ids"], r, 3, layout=layout) for r in range(3)
        ]
        assert sum(1 for s in shards if 2 in s.tolist()) == 3  # doc 2 on all three ranks
    assert (parallel.context_parallel_split(sparse["ids"], 1, 2) == -1).all()


@pytest.mark.parametrize(
    "layout, name",
    [
        ("zigzag", "gspo_seq_mean_token_mean"),
        ("contiguous", "cispo_ratio_masks"),
        ("zigzag", "sapo_sequence_tis_masks"),
    ],
)
def test_precomputed_document_stats_chunk_by_chunk(two_ranks, layout, name):
    """Per-chunk calls with stats from ``document_stats`` (no collective) give the gradients of
    the collective call, and the stats equal the single-process ones."""
    stream = CASES[name][0]
    chunked = [r[("chunked", layout, name)] for r in two_ranks]
    full = [r[(layout, name, str(torch.float64))] for r in two_ranks]
    for c, f in zip(chunked, full, strict=True):
        torch.testing.assert_close(c["g_lp"], f["g_lp"], **TIGHT)
        torch.testing.assert_close(c["share"], f["loss"], **TIGHT)
    s0, s1 = chunked[0]["stats"], chunked[1]["stats"]
    assert chunked[0]["is_stats"] and s0["size"] == s1["size"] == 4 - (stream == "sparse") * 2
    d = _stream(stream, torch.float64)
    _, cfg, adv_key, optional = CASES[name]
    single = document_stats(
        d["lp"],
        d["old"],
        d[adv_key],
        d["mask"],
        config=cfg,
        document_ids=d["ids"],
        rollout_logprobs=d["rollout"] if "rollout" in optional else None,
    )
    for field in ("tokens", "log_ratio", "clipped_log_ratio", "log_rho"):
        a, b = s0[field], getattr(single, field)
        assert (a is None) == (b is None), field
        if a is not None:
            torch.testing.assert_close(a, b, **TIGHT)
            torch.testing.assert_close(s1[field], b, **TIGHT)


NORMALIZER_RUNS = [("contiguous", False), ("zigzag", False), ("zigzag", True)]


@pytest.mark.parametrize("layout,capturable", NORMALIZER_RUNS)
def test_normalizer_counts_split_documents_once(two_ranks, layout, capturable):
    got = two_ranks[0][("normalizer", layout, capturable)]
    assert got == two_ranks[1][("normalizer", layout, capturable)]
    for stream, counts in got.items():
        d = _stream(stream, torch.float64)
        ids = None if d["ids"] is None else [d["ids"]] * 2
        n = loss_normalizer([d["mask"]] * 2, ids)
        assert counts == (float(n.num_tokens), float(n.num_sequences)), stream
    assert got["packed"] == (2 * 16.0, 2 * 3.0)  # 16 valid tokens, docs 0-2 (doc 3 masked)


CAPTURABLE_RUNS = [
    ("zigzag", "ppo_token_kl_entropy"),
    ("zigzag", "gspo_seq_mean_token_mean"),
    ("zigzag", "sapo_sequence_tis_masks"),
    ("zigzag", "sparse_token_mean_seq_tis"),
    ("zigzag", "rows_gspo_sum_norm"),
    ("contiguous", "sparse_gspo"),
]


@pytest.mark.parametrize("layout,name", CAPTURABLE_RUNS)
def test_capturable_two_ranks_equal_one_process(two_ranks, layout, name):
    """The capturable mode on the group (no host read on any rank): the same shares,
    gradients and metrics as one process in the default mode."""
    stream = CASES[name][0]
    ranks = [r[("capturable", layout, name)] for r in two_ranks]
    single = _run_case(name, torch.float64, 0, 1, layout, None)
    torch.testing.assert_close(sum(r["loss"] for r in ranks), single["loss"], **TIGHT)
    for key in ("g_lp", "g_ent"):
        merged = _merge(ranks, key, layout, stream)
        torch.testing.assert_close(merged, single[key], **TIGHT)
    for k, v in single["metrics"].items():
        for r in ranks:
            torch.testing.assert_close(r["metrics"][k], v, **TIGHT, msg=f"{name} {k}")


def test_bad_input_on_one_rank_raises_on_every_rank(two_ranks):
    e0, e1 = two_ranks[0]["errors"], two_ranks[1]["errors"]
    assert "advantages must have" in e1["bad_shape"]
    assert "another rank" in e0["bad_shape"]
    short = e0["short_adv"] + e1["short_adv"]
    assert "per-sequence values for 4 documents" in short or "advantages for the 4" in short
    assert all(e["short_adv"] != "no error" for e in (e0, e1))
    assert "different calls" in e0["config"] and "different calls" in e1["config"]
    assert "same number of micro-batches" in e0["normalizer_k"]
    assert "same number of micro-batches" in e1["normalizer_k"]
    assert "norm_length" in e0["norm_length"] and "norm_length" in e1["norm_length"]
    assert e0["alive"] == e1["alive"] == 2.0


def test_three_ranks_zigzag():
    names = ["gspo_seq_mean_token_mean", "sapo_sequence_tis_masks", "gmpo_sum_norm", "sparse_gspo"]
    per_rank = _spawn(3, dict(cases=[("zigzag", names, [torch.float64])]))
    for name in names:
        _check_case(per_rank, "zigzag", name, torch.float64)
