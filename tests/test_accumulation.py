"""StepAccumulator: fixed, document- and token-budgeted steps, on one process and 2 gloo ranks.

References kept obviously correct: per-micro-batch counts by a Python loop over tokens (a
document counts when it has a valid, non-padding token), step boundaries worked out by hand or
by a plain round-by-round simulation, and gradients from one process computing the whole step
at once (all its micro-batches, from all ranks, concatenated into one packed stream).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import spawn

from logitless import PolicyLossConfig, loss_normalizer, policy_loss
from logitless.accumulation import StepAccumulator

FEAT = 3
WORLD = 2
CONFIGS = {
    "token_mean": PolicyLossConfig(aggregation="token_mean"),
    "seq_mean_token_mean": PolicyLossConfig(aggregation="seq_mean_token_mean"),
}


# ---------------------------------------------------------------------------------------------
# data: packed micro-batches with prompts, fully masked documents and padding


def _micro_batch(g: torch.Generator, n_docs: int, uid: object, *, n_empty: int = 0, pad: int = 0):
    """``n_docs`` documents with trainable tokens, ``n_empty`` without any, ``pad`` padding.

    Each document: a prompt (masked) then a response (valid). Padding tokens have a true mask
    on purpose: they must still count for nothing.
    """
    docs, mask = [], []
    kinds = ["real"] * n_docs + ["empty"] * n_empty
    order = torch.randperm(len(kinds), generator=g).tolist()
    for d, i in enumerate(order):
        prompt = int(torch.randint(1, 4, (), generator=g))
        response = int(torch.randint(1, 6, (), generator=g))
        docs += [d] * (prompt + response)
        mask += [False] * prompt + [kinds[i] == "real"] * response
    docs += [-1] * pad
    mask += [True] * pad
    n = len(docs)
    doc = torch.tensor(docs, dtype=torch.int64)
    adv_doc = torch.randn(len(kinds) + 1, generator=g, dtype=torch.float64)
    return {
        "uid": uid,
        "x": torch.randn(n, FEAT, generator=g, dtype=torch.float64),
        "mask": torch.tensor(mask, dtype=torch.bool),
        "doc": doc,
        "old_noise": 0.2 * torch.randn(n, generator=g, dtype=torch.float64),
        "adv": adv_doc[doc],  # per token, constant within a document (padding: last entry)
    }


def _ref_counts(mb) -> tuple[int, int]:
    """(valid tokens, documents with >= 1 valid token), by a loop over tokens."""
    tokens, docs = 0, set()
    for m, d in zip(mb["mask"].tolist(), mb["doc"].tolist(), strict=True):
        if m and d >= 0:
            tokens += 1
            docs.add(d)
    return tokens, len(docs)


def _mask_of(mb):
    return mb["mask"]


def _ids_of(mb):
    return mb["doc"]


def _model() -> torch.nn.Linear:
    torch.manual_seed(1234)
    return torch.nn.Linear(FEAT, 1, dtype=torch.float64)


def _logprobs(model: torch.nn.Linear, mb) -> torch.Tensor:
    return F.logsigmoid(model(mb["x"]).squeeze(-1))  # [N]


def _mb_loss(model, mb, cfg, normalizer=None) -> torch.Tensor:
    lp = _logprobs(model, mb)
    old = lp.detach() + mb["old_noise"]
    return policy_loss(
        lp, old, mb["adv"], mb["mask"], config=cfg, document_ids=mb["doc"], normalizer=normalizer
    )[0]


def _concat(mbs):
    """All micro-batches of a step as one packed stream (document ids made distinct)."""
    docs, offset = [], 0
    for mb in mbs:
        docs.append(torch.where(mb["doc"] >= 0, mb["doc"] + offset, -1))
        offset += int(mb["doc"].max()) + 1
    cat = {k: torch.cat([mb[k] for mb in mbs]) for k in ("x", "mask", "old_noise", "adv")}
    return {"uid": "whole", "doc": torch.cat(docs), **cat}


def _whole_step_grads(mbs, cfg):
    """Loss and gradients of one process computing the whole step at once (own counts)."""
    model = _model()
    loss = _mb_loss(model, _concat(mbs), cfg)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


# ---------------------------------------------------------------------------------------------
# single process: step boundaries, overshoot, exhaustion, metrics, fixed count


def _mbs_with_docs(doc_counts, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    return [
        _micro_batch(g, n, uid=i, n_empty=i % 2, pad=i % 3, **kw) for i, n in enumerate(doc_counts)
    ]


def _uids(step):
    return [mb["uid"] for mb in step.micro_batches]


def test_reference_counts_match_loss_normalizer():
    for mb in _mbs_with_docs([1, 3, 2, 0, 4]):
        n = loss_normalizer([mb["mask"]], [mb["doc"]])
        assert (int(n.num_tokens), int(n.num_sequences)) == _ref_counts(mb)


def test_docs_budget_stops_at_target_and_counts_cumulatively():
    mbs = _mbs_with_docs([1, 3, 2, 2, 5, 1])  # odd micro-batches also hold a fully masked doc
    acc = StepAccumulator(_mask_of, _ids_of, docs_per_step=4)
    steps = list(acc.steps(mbs))
    # by hand: 1+3 = 4 | 2+2 = 4 | 5 >= 4 (one micro-batch) | 1 (data ran out: short)
    assert [_uids(s) for s in steps] == [[0, 1], [2, 3], [4], [5]]
    assert [s.num_documents for s in steps] == [4, 4, 5, 1]
    assert [s.documents_seen for s in steps] == [4, 8, 13, 14]
    assert [s.complete for s in steps] == [True, True, True, False]
    assert [s.index for s in steps] == [0, 1, 2, 3]
    assert [s.num_micro_batches for s in steps] == [2, 2, 1, 1]
    tokens = [sum(_ref_counts(mbs[u])[0] for u in _uids(s)) for s in steps]
    assert [s.num_tokens for s in steps] == tokens
    assert [s.tokens_seen for s in steps] == [sum(tokens[: i + 1]) for i in range(4)]
    assert acc.documents_seen == 14 and acc.tokens_seen == sum(tokens) and acc.num_steps == 4
    for s in steps:  # the shared normalizer holds the step's counts
        assert float(s.normalizer.num_sequences) == s.num_documents
        assert float(s.normalizer.num_tokens) == s.num_tokens
        assert s.normalizer.num_tokens.dtype == torch.float64
        assert s.metrics == {
            "num_documents": s.num_documents,
            "documents_seen": s.documents_seen,
            "num_tokens": s.num_tokens,
            "tokens_seen": s.tokens_seen,
            "num_micro_batches": s.num_micro_batches,
        }


def test_overshoot_takes_the_last_micro_batch_whole():
    mbs = _mbs_with_docs([2, 2, 2, 3])
    acc = StepAccumulator(_mask_of, _ids_of, docs_per_step=3)
    steps = list(acc.steps(mbs))
    # 2 < 3, 2+2 = 4 >= 3: the second micro-batch passes the target and is taken whole
    assert [_uids(s) for s in steps] == [[0, 1], [2, 3]]
    assert [s.num_documents for s in steps] == [4, 5]
    assert all(s.complete for s in steps)


def test_tokens_budget():
    mbs = _mbs_with_docs([2, 1, 3, 1, 2, 2, 1])
    tokens = [_ref_counts(mb)[0] for mb in mbs]
    target = 9
    expected, cur, total = [], [], 0  # plain simulation of the rule
    for i, t in enumerate(tokens):
        cur.append(i)
        total += t
        if total >= target:
            expected.append(cur)
            cur, total = [], 0
    if cur:
        expected.append(cur)
    steps = list(StepAccumulator(_mask_of, _ids_of, tokens_per_step=target).steps(mbs))
    assert [_uids(s) for s in steps] == expected
    assert [s.num_tokens for s in steps] == [sum(tokens[i] for i in e) for e in expected]
    assert len(expected) >= 3  # the data does exercise several steps
    assert [s.complete for s in steps[:-1]] == [True] * (len(steps) - 1)
    assert steps[-1].complete == (sum(tokens[i] for i in expected[-1]) >= target)


def test_documents_without_valid_tokens_do_not_count():
    g = torch.Generator().manual_seed(3)
    mbs = [_micro_batch(g, 0, uid=i, n_empty=3, pad=2) for i in range(3)]  # nothing to train on
    mbs.append(_micro_batch(g, 2, uid=3, n_empty=2))
    steps = list(StepAccumulator(_mask_of, _ids_of, docs_per_step=2).steps(mbs))
    assert [_uids(s) for s in steps] == [[0, 1, 2, 3]]
    assert steps[0].num_documents == 2 and steps[0].complete


def test_exhaustion_ends_cleanly_and_counters_carry_over_iterators():
    mbs = _mbs_with_docs([3, 1])
    acc = StepAccumulator(_mask_of, _ids_of, docs_per_step=10)
    it = iter(mbs)
    step = acc.next_step(it)
    assert _uids(step) == [0, 1] and not step.complete and step.num_documents == 4
    assert acc.next_step(it) is None  # nothing left: None, counters untouched
    assert acc.next_step(it) is None
    assert acc.documents_seen == 4 and acc.num_steps == 1
    assert acc.next_step(iter([])) is None
    # a new iterator (next RL iteration's rollouts): cumulative metrics continue
    step = acc.next_step(iter(_mbs_with_docs([6, 5], seed=1)))
    assert step.complete and step.num_documents == 11
    assert step.documents_seen == 15 and step.index == 1
    state = acc.state_dict()
    fresh = StepAccumulator(_mask_of, _ids_of, docs_per_step=10)
    fresh.load_state_dict(state)
    assert (
        fresh.state_dict()
        == state
        == {
            "documents_seen": 15,
            "tokens_seen": acc.tokens_seen,
            "num_steps": 2,
        }
    )


def test_fixed_count_is_the_default_and_matches_loss_normalizer():
    mbs = _mbs_with_docs([2, 1, 3, 1, 2])
    one = list(StepAccumulator(_mask_of, _ids_of).steps(mbs))  # default: 1 per step
    assert [_uids(s) for s in one] == [[i] for i in range(5)]
    steps = list(StepAccumulator(_mask_of, _ids_of, micro_batches_per_step=2).steps(mbs))
    assert [_uids(s) for s in steps] == [[0, 1], [2, 3], [4]]
    assert [s.complete for s in steps] == [True, True, False]
    for s in steps:  # the previous way: loss_normalizer over a fixed group of micro-batches
        before = loss_normalizer(
            [mb["mask"] for mb in s.micro_batches], [mb["doc"] for mb in s.micro_batches]
        )
        torch.testing.assert_close(s.normalizer.num_tokens, before.num_tokens, rtol=0, atol=0)
        torch.testing.assert_close(s.normalizer.num_sequences, before.num_sequences, rtol=0, atol=0)
    assert steps[-1].documents_seen == sum(_ref_counts(mb)[1] for mb in mbs)


def test_batched_rows_are_documents_by_default():
    masks = [
        torch.tensor([[True, False], [False, False], [True, True]]),  # 2 docs with valid tokens
        torch.tensor([[True, True]]),
        torch.tensor([[False, True], [True, False]]),
    ]
    steps = list(StepAccumulator(lambda m: m, docs_per_step=3).steps(masks))
    assert [len(s.micro_batches) for s in steps] == [2, 1]
    assert [(s.num_documents, s.num_tokens) for s in steps] == [(3, 5), (2, 2)]


@pytest.mark.parametrize("aggregation", list(CONFIGS))
def test_micro_batch_losses_sum_to_the_whole_step(aggregation):
    cfg = CONFIGS[aggregation]
    mbs = _mbs_with_docs([2, 1, 3, 1, 2, 2, 1])  # steps: 2+1+3 | 1+2+2 | 1 (short)
    acc = StepAccumulator(_mask_of, _ids_of, docs_per_step=4)
    n_steps = 0
    for step in acc.steps(mbs):
        model = _model()
        total = sum(_mb_loss(model, mb, cfg, step.normalizer) for mb in step.micro_batches)
        total.backward()
        loss, grads = _whole_step_grads(step.micro_batches, cfg)
        torch.testing.assert_close(total.detach(), loss, rtol=1e-12, atol=1e-14)
        for p, g in zip(model.parameters(), grads, strict=True):
            assert g.abs().max() > 0
            torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14)
        n_steps += 1
    assert n_steps == 3


# ---------------------------------------------------------------------------------------------
# bad input


def test_bad_budgets_and_arguments():
    cases = [
        (dict(docs_per_step=0), "docs_per_step must be an int >= 1"),
        (dict(tokens_per_step=-3), "tokens_per_step must be an int >= 1"),
        (dict(micro_batches_per_step=True), "micro_batches_per_step must be an int >= 1"),
        (dict(docs_per_step=2.0), "docs_per_step must be an int >= 1"),
        (dict(docs_per_step="8"), "docs_per_step must be an int >= 1"),
        (dict(docs_per_step=8, tokens_per_step=100), "at most one of"),
        (dict(docs_per_step=8, micro_batches_per_step=4), "at most one of"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            StepAccumulator(_mask_of, _ids_of, **kwargs)
    with pytest.raises(ValueError, match="mask_of must be a callable"):
        StepAccumulator("mask")
    with pytest.raises(ValueError, match="document_ids_of must be a callable"):
        StepAccumulator(_mask_of, "doc")
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        StepAccumulator(_mask_of, _ids_of, docs_per_step=2, process_group=object())
    acc = StepAccumulator(_mask_of, _ids_of, docs_per_step=2)
    with pytest.raises(ValueError, match="must be an iterator"):
        acc.next_step(_mbs_with_docs([1]))
    with pytest.raises(ValueError, match="state must be a dict with keys"):
        acc.load_state_dict({"documents_seen": 1})
    with pytest.raises(ValueError, match="must be an int >= 0"):
        acc.load_state_dict({"documents_seen": -1, "tokens_seen": 0, "num_steps": 0})


def test_bad_micro_batch_content():
    mb = _mbs_with_docs([2])[0]
    float_mask = StepAccumulator(lambda m: m["mask"].double(), _ids_of, docs_per_step=2)
    with pytest.raises(ValueError, match="mask_of must return a bool tensor, got torch.float64"):
        float_mask.next_step(iter([mb]))
    bad_ids = StepAccumulator(_mask_of, lambda m: m["doc"][:-1], docs_per_step=2)
    with pytest.raises(ValueError, match="document_ids must have"):
        bad_ids.next_step(iter([mb]))
    packed_without_ids = StepAccumulator(_mask_of, micro_batches_per_step=1)
    with pytest.raises(ValueError, match="document_ids is required"):
        packed_without_ids.next_step(iter([mb]))


# ---------------------------------------------------------------------------------------------
# two gloo ranks, uneven micro-batches

# Documents with valid tokens per micro-batch, per rank (rank 1 has one more micro-batch).
RANK_DOCS = {0: [1, 3, 2, 4], 1: [2, 1, 3, 1, 2]}
# docs_per_step=5 by hand, rounds of (rank 0 + rank 1): 1+2=3, +3+1=7 | 2+3=5 | 4+1=5 |
# rank 0 exhausted, 0+2=2, then nobody has data: a short last step
DOC_STEPS = [[0, 1], [2], [3], [4]]  # rounds per step
DOC_COMPLETE = [True, True, True, False]
TOKENS_PER_STEP = 14
RUNS = [  # (name, budget, aggregation, DDP-style gradient average with loss_scale=WORLD)
    ("docs_token_mean", dict(docs_per_step=5), "token_mean", False),
    ("docs_seq_mean", dict(docs_per_step=5), "seq_mean_token_mean", True),
    ("tokens_token_mean", dict(tokens_per_step=TOKENS_PER_STEP), "token_mean", True),
    ("tokens_seq_mean", dict(tokens_per_step=TOKENS_PER_STEP), "seq_mean_token_mean", False),
    ("fixed_2", dict(micro_batches_per_step=2), "token_mean", False),
]


def _rank_data():
    g = torch.Generator().manual_seed(7)
    return {
        r: [
            _micro_batch(g, n, uid=(r, k), n_empty=(k + r) % 2, pad=k % 3) for k, n in enumerate(ns)
        ]
        for r, ns in RANK_DOCS.items()
    }


def _simulate(per_rank, budget: str, target: int):
    """Rounds of each step by the rule: a round takes every rank's next micro-batch."""
    which = 0 if budget == "tokens_per_step" else 1
    n_rounds = max(len(v) for v in per_rank.values())
    steps, cur, total = [], [], 0
    for k in range(n_rounds):
        cur.append(k)
        total += sum(_ref_counts(v[k])[which] for v in per_rank.values() if k < len(v))
        if total >= target:
            steps.append(cur)
            cur, total = [], 0
    if cur:
        steps.append(cur)
    return steps


def _train(acc, micro_batches, cfg, *, average=False, context_group=None):
    """Each step: every micro-batch's loss backward, then the gradient reduction over ranks."""
    records = []
    for step in acc.steps(micro_batches):
        model = _model()
        total = torch.zeros((), dtype=torch.float64)
        for mb in step.micro_batches:
            lp = _logprobs(model, mb)
            loss = policy_loss(
                lp,
                lp.detach() + mb["old_noise"],
                mb["adv"],
                mb["mask"],
                config=cfg,
                document_ids=mb["doc"],
                normalizer=step.normalizer,
                context_group=context_group,
            )[0]
            loss.backward()
            total = total + loss.detach()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]
        for gr in grads:  # the data-parallel gradient reduction: SUM, or DDP's average
            dist.all_reduce(gr)
            gr /= WORLD if average else 1
        records.append(
            dict(
                uids=_uids(step),
                loss=total,
                grads=grads,
                complete=step.complete,
                metrics=step.metrics,
                index=step.index,
                norm=(step.normalizer.num_tokens, step.normalizer.num_sequences),
                loss_scale=step.normalizer.loss_scale,
            )
        )
    return records


def _shard(mb, rank: int):
    """Context parallelism: rank r holds the r-th contiguous half of the stream's tokens."""
    n = mb["doc"].numel()
    lo, hi = rank * n // WORLD, (rank + 1) * n // WORLD
    return {"uid": mb["uid"], **{k: v[lo:hi] for k, v in mb.items() if k != "uid"}}


def _worker(rank: int, world_size: int) -> dict:
    world = dist.group.WORLD
    data = _rank_data()
    mine = data[rank]
    results = {}
    for name, budget, aggregation, average in RUNS:
        scale = {"loss_scale": float(WORLD)} if average else {}
        acc = StepAccumulator(_mask_of, _ids_of, process_group=world, **budget, **scale)
        results[name] = _train(acc, mine, CONFIGS[aggregation], average=average)
    # context parallelism: both ranks hold halves of the same micro-batches
    shards = [_shard(mb, rank) for mb in data[0] + data[1]]
    for aggregation in CONFIGS:
        acc = StepAccumulator(_mask_of, _ids_of, docs_per_step=5, context_group=world)
        cfg = CONFIGS[aggregation]
        results[f"cp_{aggregation}"] = _train(acc, shards, cfg, context_group=world)
    # bad content on rank 1 only (its second micro-batch): every rank raises, none hangs
    errors = []
    for budget in (dict(docs_per_step=100), dict(micro_batches_per_step=3)):

        def mask_of(mb):
            return mb["mask"].double() if mb["uid"] == (1, 1) else mb["mask"]

        acc = StepAccumulator(mask_of, _ids_of, process_group=world, **budget)
        try:
            list(acc.steps(mine))
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    results["errors"] = errors
    return results


def test_two_ranks_uneven_micro_batches_match_the_whole_step():
    # a lockstep bug fails after 30 s instead of hanging
    per_rank = spawn(_worker, WORLD, timeout_s=30)
    data = _rank_data()
    by_uid = {mb["uid"]: mb for mbs in data.values() for mb in mbs}
    assert _simulate(data, "docs_per_step", 5) == DOC_STEPS  # the hand-worked boundaries
    for name, budget, aggregation, average in RUNS:
        (kind, target), cfg = next(iter(budget.items())), CONFIGS[aggregation]
        if kind == "micro_batches_per_step":
            n_rounds = max(len(v) for v in data.values())
            rounds = [list(range(k, min(k + target, n_rounds))) for k in range(0, n_rounds, target)]
        else:
            rounds = _simulate(data, kind, target)
        r0, r1 = per_rank[0][name], per_rank[1][name]
        assert len(r0) == len(r1) == len(rounds), name
        seen_docs = seen_tokens = 0
        for i, (a, b, step_rounds) in enumerate(zip(r0, r1, rounds, strict=True)):
            expected = {r: [(r, k) for k in step_rounds if k < len(data[r])] for r in data}
            assert a["uids"] == expected[0] and b["uids"] == expected[1], (name, i)
            if all(k < len(v) for k in step_rounds for v in data.values()):
                assert len(a["uids"]) == len(b["uids"])  # lockstep while both have data
            step_mbs = [by_uid[u] for u in a["uids"] + b["uids"]]
            tokens = sum(_ref_counts(mb)[0] for mb in step_mbs)
            docs = sum(_ref_counts(mb)[1] for mb in step_mbs)
            seen_docs, seen_tokens = seen_docs + docs, seen_tokens + tokens
            if kind == "micro_batches_per_step":
                complete = len(a["uids"]) == len(b["uids"]) == target
            else:
                complete = (docs if kind == "docs_per_step" else tokens) >= target
            want = {
                "num_documents": docs,
                "documents_seen": seen_docs,
                "num_tokens": tokens,
                "tokens_seen": seen_tokens,
                "num_micro_batches": len(step_mbs),
            }
            for rec in (a, b):  # every rank: the same global counts and flags
                assert rec["metrics"] == want, (name, i)
                assert rec["complete"] == complete and rec["index"] == i, (name, i)
                assert (float(rec["norm"][0]), float(rec["norm"][1])) == (tokens, docs)
                assert rec["loss_scale"] == (WORLD if average else 1.0)
            # the normalizer the existing function gives for these micro-batches
            ref_norm = loss_normalizer(
                [mb["mask"] for mb in step_mbs], [mb["doc"] for mb in step_mbs]
            )
            assert float(ref_norm.num_tokens) == tokens and float(ref_norm.num_sequences) == docs
            # gradients: micro-batches summed over ranks == the whole step in one process
            loss, grads = _whole_step_grads(step_mbs, cfg)
            shares = (a["loss"] + b["loss"]) / (WORLD if average else 1)
            torch.testing.assert_close(shares, loss, rtol=1e-12, atol=1e-14)
            for ga, gb, g in zip(a["grads"], b["grads"], grads, strict=True):
                assert g.abs().max() > 0
                torch.testing.assert_close(ga, g, rtol=1e-12, atol=1e-14)
                torch.testing.assert_close(gb, g, rtol=1e-12, atol=1e-14)
        if kind == "docs_per_step":
            assert [[k for k in rs] for rs in rounds] == DOC_STEPS
            assert [rec["complete"] for rec in r0] == DOC_COMPLETE

    # context parallelism: boundaries of the unsharded stream, documents split across ranks
    # counted once, and the shards' gradients summed == the whole step in one process
    everything = data[0] + data[1]
    rounds = _simulate({0: everything}, "docs_per_step", 5)
    assert len(rounds) >= 3

    def trained_docs(shard):
        return set(shard["doc"][shard["mask"] & (shard["doc"] >= 0)].tolist())

    split = [trained_docs(_shard(mb, 0)) & trained_docs(_shard(mb, 1)) for mb in everything]
    assert sum(map(len, split)) > 0  # some trained document does span both ranks
    for aggregation, cfg in CONFIGS.items():
        r0, r1 = per_rank[0][f"cp_{aggregation}"], per_rank[1][f"cp_{aggregation}"]
        assert len(r0) == len(r1) == len(rounds)
        for a, b, step_rounds in zip(r0, r1, rounds, strict=True):
            step_mbs = [everything[k] for k in step_rounds]
            assert a["uids"] == b["uids"] == [mb["uid"] for mb in step_mbs]
            docs = sum(_ref_counts(mb)[1] for mb in step_mbs)
            tokens = sum(_ref_counts(mb)[0] for mb in step_mbs)
            for rec in (a, b):
                assert (rec["metrics"]["num_documents"], rec["metrics"]["num_tokens"]) == (
                    docs,
                    tokens,
                )
            loss, grads = _whole_step_grads(step_mbs, cfg)
            torch.testing.assert_close(a["loss"] + b["loss"], loss, rtol=1e-12, atol=1e-14)
            for ga, g in zip(a["grads"], grads, strict=True):
                torch.testing.assert_close(ga, g, rtol=1e-12, atol=1e-14)

    # bad content on one rank: a ValueError on both, naming the cause where it happened
    for err0, err1 in zip(per_rank[0]["errors"], per_rank[1]["errors"], strict=True):
        assert err1 is not None and "mask_of must return a bool tensor" in err1
        assert err0 is not None and "another rank of process_group rejected" in err0
