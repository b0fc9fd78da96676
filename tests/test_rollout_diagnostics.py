"""The rollout-mismatch diagnostics (``rollout_topk=``, docs/rollout-mismatch.md) on the torch
tiles: every output against a float64 truth written from the definitions (tests/_rollout.py)
and held to the naive full-logits reference's own error; the log-probs, entropy and gradients
the same bits with the option on; exact top-1 ties; sampling replay (the kept set); the batch-
invariant mode; the reductions; bad input. The Triton kernels: test_rollout_diagnostics_triton.py;
vocabulary parallelism: test_rollout_diagnostics_parallel.py; the trainers:
test_rollout_diagnostics_integrations.py."""

from __future__ import annotations

import math

import pytest
import torch
from _rollout import BOOL_FIELDS, FLOAT_FIELDS, problem, run, transformed, truth
from _tolerance import assert_no_worse_than_reference

import logitless
from logitless import RolloutTopK
from logitless.losses import rollout_mismatch_metrics
from logitless.types import RolloutLogProbs, RolloutMismatch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

CASES = [
    dict(dtype="fp32"),
    dict(dtype="bf16"),
    dict(dtype="fp32", temperature=0.7, bias=True),
    dict(dtype="fp32", temperature="tensor", softcap=4.0, logit_scale=1.3),
    dict(dtype="bf16", temperature="tensor", bias=True, chunk_size=5),
    dict(dtype="fp32", chunk_size=4, small_tiles=True, with_entropy=True),
]


def _ids(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


def check_against_truth(p, dtype, options: dict, backend="torch", keep=None, found=None):
    """The op's diagnostics (``found``: already computed) against the float64 truth, each
    held to the naive reference's error; the booleans exactly in fp32 (these problems have no
    near-ties), no more wrong than the reference's in bf16."""
    temp = options.get("temperature", 1.0)
    z = transformed(p, dtype, temperature=temp, softcap=options.get("softcap"),
                    logit_scale=options.get("logit_scale"))  # fmt: skip
    want = truth(z, p.labels, p.topk, keep)
    ref = run(p, dtype, logitless.reference.linear_logprobs, **options).mismatch
    got = found if found is not None else run(p, dtype, backend=backend, **options).mismatch
    for name in FLOAT_FIELDS:
        assert getattr(got, name).dtype == torch.float32, name
        assert_no_worse_than_reference(getattr(got, name), getattr(ref, name), want[name], name)
    for name in BOOL_FIELDS:  # a bf16 projection rounds the logits to bf16: ties, as in the
        wrong = int((getattr(got, name) != want[name]).sum())  # reference (F.linear's rounding)
        wrong_ref = int((getattr(ref, name) != want[name]).sum())
        assert wrong <= (wrong_ref if dtype == torch.bfloat16 else 0), (name, wrong, wrong_ref)
    assert want["compared"].sum() >= 20 and (~want["top1_agree"] & want["compared"]).any()
    return got


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_matches_float64(case, monkeypatch):
    case = dict(case)
    dtype = DTYPES[case.pop("dtype")]
    if case.pop("small_tiles", False):  # several vocabulary blocks per row
        from logitless.backends import base

        monkeypatch.setattr(base, "_TILE_ELEMS", {"cpu": 1024})
    p = problem(bias=case.pop("bias", False))
    if case.get("temperature") == "tensor":
        case["temperature"] = torch.rand(p.labels.shape) + 0.5
    check_against_truth(p, dtype, case)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_option_changes_no_bit_of_the_rest(dtype):
    """Log-probs, entropy and every gradient are the same bits with ``rollout_topk`` on; an id
    that is the label gets the label's log-prob bits; the diagnostics carry no gradient."""
    p = problem()
    dt = DTYPES[dtype]
    hidden = p.hidden.to(dt).requires_grad_()
    weight = p.weight.to(dt).requires_grad_()
    g = torch.randn(p.labels.shape)
    e = torch.randn(p.labels.shape)
    results = []
    for topk in (None, p.topk):
        out = logitless.linear_logprobs(
            hidden, weight, p.labels, with_entropy=True, rollout_topk=topk
        )
        gh, gw = torch.autograd.grad((out.logprobs * g + out.entropy * e).sum(), (hidden, weight))
        results.append((out, gh, gw))
    (off, gh0, gw0), (on, gh1, gw1) = results
    assert isinstance(on, RolloutLogProbs) and type(off) is logitless.LogProbs
    assert torch.equal(off.logprobs, on.logprobs) and torch.equal(off.entropy, on.entropy)
    assert torch.equal(gh0, gh1) and torch.equal(gw0, gw1)
    assert not any(t.requires_grad for t in on.mismatch)
    lp, ent = on  # still unpacks as two values
    ids = p.topk.token_ids
    is_label = (ids == p.labels[..., None]) & on.mismatch.compared[..., None]
    assert is_label.sum() >= 20
    label_lp = on.logprobs[..., None].expand_as(ids)
    assert torch.equal(on.mismatch.logprobs[is_label], label_lp[is_label])


def test_no_grad_and_a_row_chunk_per_row():
    p = problem(shape=(17,), V=120)
    with torch.no_grad():
        a = run(p, torch.float32, chunk_size=1).mismatch
    b = run(p, torch.float32).mismatch
    for name in FLOAT_FIELDS:
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-6)


def _integer_head():
    """Logits that are exact integers in fp32 (one-hot hidden states, integer weights: column
    ``i`` of the weight is row ``i``'s logits), so ties are exact whatever the summation order.
    Row 0: tokens 3 and 7 tie for the maximum; row 1: 7 alone; row 2: 5 and 1 tie."""
    h = torch.eye(3)
    w = torch.zeros(10, 3)
    w[3] = torch.tensor([4.0, 1.0, 0.0])
    w[7] = torch.tensor([4.0, 7.0, 0.0])
    w[5] = torch.tensor([3.0, 0.0, 3.0])
    w[1] = torch.tensor([0.0, 0.0, 3.0])
    return h, w


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_top1_ties_are_exact(backend):
    h, w = _integer_head()
    labels = torch.tensor([3, 7, 5])
    ids = torch.tensor([[7, 3, -1], [3, 7, -1], [5, 1, 3]])
    # row 0: the engine's top-1 is 7, tied with 3 for the trainer's maximum: agree
    # row 1: the engine's top-1 is 3 (trainer's is 7): disagree
    # row 2: the engine's top two tie (5 and 1), both trainer maxima: agree
    lps = torch.tensor([[-0.1, -3.0, 0.0], [-0.2, -2.0, 0.0], [-1.0, -1.0, -3.0]])
    fn = (
        logitless.reference.linear_logprobs if backend == "reference" else logitless.linear_logprobs
    )
    out = fn(h, w, labels, rollout_topk=RolloutTopK(ids, lps))
    assert out.mismatch.top1_agree.tolist() == [True, False, True]
    lps[2, 0] = -0.8  # the engine's top-1 alone is 5: still a trainer maximum
    lps[0] = torch.tensor([-3.0, -0.1, 0.0])  # now 3, the other trainer maximum
    ids[1, 1], lps[1] = 0, torch.tensor([-2.0, -0.5, 0.0])  # id 0 first: not the trainer's top
    out = fn(h, w, labels, rollout_topk=RolloutTopK(ids, lps))
    assert out.mismatch.top1_agree.tolist() == [True, False, True]


def test_the_partition_bounds_the_full_divergence():
    """Data processing: the partition's KLs and TV never exceed their full-vocabulary values
    (the engine's full distribution known here), and equal them when the ids cover the
    vocabulary."""
    p = problem(shape=(40,), V=80, k=5)
    engine = transformed(p, torch.float64) + 0.6 * torch.randn(40, 80, dtype=torch.float64)
    engine = engine.log_softmax(-1)
    top = engine.topk(5)
    found = logitless.linear_logprobs(
        p.hidden.double(), p.weight.double(), p.labels,
        rollout_topk=RolloutTopK(top.indices, top.values),
    ).mismatch  # fmt: skip
    trainer = transformed(p, torch.float64).log_softmax(-1)
    full_rt = (engine.exp() * (engine - trainer)).sum(-1)
    full_tr = (trainer.exp() * (trainer - engine)).sum(-1)
    full_tv = 0.5 * (engine.exp() - trainer.exp()).abs().sum(-1)
    on = found.compared
    assert on.sum() == 38
    assert (found.kl_rollout_trainer[on] <= full_rt[on] + 1e-12).all()
    assert (found.kl_trainer_rollout[on] <= full_tr[on] + 1e-12).all()
    assert (found.total_variation[on] <= full_tv[on] + 1e-12).all()
    assert (found.kl_rollout_trainer[on] < 0.9 * full_rt[on]).any()  # a strict bound here
    everything = engine.topk(80)
    whole = logitless.linear_logprobs(
        p.hidden.double(), p.weight.double(), p.labels,
        rollout_topk=RolloutTopK(everything.indices, everything.values),
    ).mismatch  # fmt: skip
    torch.testing.assert_close(whole.kl_rollout_trainer[on], full_rt[on])
    torch.testing.assert_close(whole.kl_trainer_rollout[on], full_tr[on])
    torch.testing.assert_close(whole.total_variation[on], full_tv[on])


def test_kept_set_under_a_sampling_mask():
    """With sampling replay the trainer's distribution is the kept-set one: the diagnostics
    against the softmax over each kept set (the mask holds the engine's ids and more); an id
    outside the kept set has log-prob -inf and KL(rollout‖trainer) = inf there."""
    p = problem(shape=(31,), V=200)
    g = torch.Generator().manual_seed(3)
    extra = torch.randint(0, 200, (31, 12), generator=g)
    ids = p.topk.token_ids
    mask_ids = _dedup(torch.cat([ids, extra], 1))  # the engine's ids and 12 more
    keep = torch.zeros(31, 200, dtype=torch.bool)
    rows = torch.arange(31)[:, None].expand_as(mask_ids)
    keep[rows[mask_ids >= 0], mask_ids[mask_ids >= 0]] = True
    keep[(mask_ids < 0).all(1)] = True  # an empty mask row: not truncated
    keep[torch.arange(31), p.labels.clamp(min=0)] = True
    found = check_against_truth(p, torch.float32, dict(sampling_mask=mask_ids), keep=keep)
    assert isinstance(run(p, torch.float32, sampling_mask=mask_ids), logitless.types.ReplayLogProbs)
    assert found.compared.sum() >= 20
    # an engine id outside the kept set
    lps = p.topk.logprobs.clone()
    ids2 = ids.clone()
    row = int(torch.nonzero(found.compared & (ids[:, 2] >= 0))[0, 0])
    outside = int(torch.nonzero(~keep[row])[0, 0])
    ids2[row, 2] = outside
    out = logitless.linear_logprobs(
        p.hidden, p.weight, p.labels, sampling_mask=mask_ids, rollout_topk=RolloutTopK(ids2, lps)
    ).mismatch
    assert out.logprobs[row, 2] == -math.inf and out.kl_rollout_trainer[row] == math.inf
    assert math.isfinite(out.kl_trainer_rollout[row]) and out.topk_mass[row] < 1


def _dedup(ids: torch.Tensor) -> torch.Tensor:
    """-1 in place of an id repeated earlier in its row."""
    out = ids.clone()
    for i in range(ids.shape[0]):
        seen = set()
        for j, v in enumerate(ids[i].tolist()):
            if v >= 0 and v in seen:
                out[i, j] = -1
            seen.add(v)
    return out


def test_kept_set_under_top_k_replay():
    """Replayed top-k: the trainer's kept set is its own top ``k_s`` tokens."""
    p = problem(shape=(29,), V=150, k=4, noise=0.3)
    z = transformed(p, torch.float32)
    kth = z.sort(-1, descending=True).values[:, 24:25]
    keep = z >= kth
    keep[torch.arange(29), p.labels.clamp(min=0)] = True
    check_against_truth(p, torch.float32, dict(top_k=25), keep=keep)
    with torch.no_grad():  # the forward-only path gives the same
        check_against_truth(p, torch.float32, dict(top_k=25, with_entropy=True), keep=keep)


def test_batch_invariant_bits():
    """A position's diagnostics are the same bits whatever else is in the call."""
    p = problem(shape=(40,), V=500)
    whole = run(p, torch.float32, batch_invariant=True).mismatch
    for lo, hi in ((0, 1), (3, 11), (17, 40)):
        part = logitless.linear_logprobs(
            p.hidden[lo:hi], p.weight, p.labels[lo:hi], batch_invariant=True,
            rollout_topk=RolloutTopK(p.topk.token_ids[lo:hi], p.topk.logprobs[lo:hi]),
        ).mismatch  # fmt: skip
        for name in RolloutMismatch._fields:
            assert torch.equal(getattr(part, name), getattr(whole, name)[lo:hi]), (name, lo)


def test_reductions_per_sequence_and_batch():
    """``rollout_mismatch_metrics`` on a packed stream (document ids) and on ``[B, T]`` rows:
    the means over each sequence's compared tokens under the response mask, the batch's token
    means, the worst sequence."""
    p = problem(shape=(2, 15))
    m = run(p, torch.float32).mismatch
    mask = torch.ones(2, 15, dtype=torch.bool)
    mask[1, 10:] = False
    rows = rollout_mismatch_metrics(m, mask)
    flat = RolloutMismatch(*(t.reshape(30, *t.shape[2:]) for t in m))
    doc = torch.tensor([0] * 15 + [1] * 10 + [-1] * 5)  # the same sequences, packed, padded
    packed = rollout_mismatch_metrics(flat, mask.reshape(-1), document_ids=doc)
    counted = m.compared & mask
    for name in ("kl_rollout_trainer", "total_variation", "top1_agree"):
        x = getattr(m, name).float()
        per_seq = torch.stack([x[i][counted[i]].mean() for i in range(2)])
        torch.testing.assert_close(rows.per_sequence[name], per_seq)
        torch.testing.assert_close(packed.per_sequence[name], per_seq)
        want = x[counted].mean()
        torch.testing.assert_close(rows.metrics[f"rollout_mismatch/{name}"], want)
        torch.testing.assert_close(packed.metrics[f"rollout_mismatch/{name}"], want)
    torch.testing.assert_close(
        rows.metrics["rollout_mismatch/kl_rollout_trainer_seq_max"],
        rows.per_sequence["kl_rollout_trainer"].max(),
    )
    assert rows.metrics["rollout_mismatch/tokens"] == counted.sum()
    with pytest.raises(ValueError, match="mask must have"):
        rollout_mismatch_metrics(m, mask[0])


def test_module_forward_and_the_fused_loss():
    """``LogprobHead`` takes the engine's top-k per call; the fused loss refuses it by name."""
    p = problem(shape=(2, 9))
    head = logitless.LogprobHead(torch.nn.Linear(24, 300, bias=False))
    with torch.no_grad():
        head.weight.copy_(p.weight)
    out = head(p.hidden, p.labels, rollout_topk=p.topk)
    torch.testing.assert_close(
        out.mismatch.total_variation, run(p, torch.float32).mismatch.total_variation
    )
    with pytest.raises(ValueError, match="rollout_topk is not taken by the fused policy loss"):
        logitless.PolicyLossHead(torch.nn.Linear(24, 300), config=logitless.PolicyLossConfig())(
            p.hidden, p.labels, torch.zeros(2, 9), torch.ones(2), rollout_topk=p.topk
        )


def _filled(t: torch.Tensor, value) -> torch.Tensor:
    """``t`` with its first slot of every position set to ``value``."""
    return t.clone().index_fill_(-1, torch.tensor([0]), value)


# (what changes in the problem's RolloutTopK, or another rollout_topk value; what is matched)
BAD = [
    (lambda t: t._replace(token_ids=_filled(t.token_ids, 50)), r"token ids must be in \[0, 50\)"),
    (lambda t: t._replace(token_ids=_filled(t.token_ids, -7)), r"token ids must be in \[0, 50\)"),
    (lambda t: t._replace(logprobs=_filled(t.logprobs, 0.5)), r"logprobs must be log-probabil"),
    (lambda t: t._replace(logprobs=_filled(t.logprobs, math.nan)), r"logprobs must be log-probab"),
    (lambda t: t._replace(logprobs=torch.full_like(t.logprobs, -0.3)), r"sum to at most 1"),
    (
        lambda t: t._replace(token_ids=t.token_ids[:, :4]),
        r"token_ids must have shape .* \[2, 5, k\]",
    ),
    (lambda t: t._replace(token_ids=t.token_ids.reshape(10, -1)), r"token_ids must have shape"),
    (
        lambda t: t._replace(logprobs=t.logprobs[..., :2]),
        r"logprobs must be a floating tensor shaped",
    ),
    (lambda t: t._replace(token_ids=t.token_ids.float()), r"token_ids must be an integer tensor"),
    (lambda t: t._replace(logprobs=t.logprobs.half()), r"logprobs must be float32 or float64"),
    (lambda t: t._replace(pad_id=None), r"rollout_topk.pad_id must be an int"),
    (lambda t: RolloutTopK(t.token_ids[..., [0, 0]], t.logprobs[..., :2] - 1), r"duplicate id"),
    (lambda t: (t.token_ids, t.logprobs), r"rollout_topk must be a logitless.RolloutTopK"),
]


@pytest.mark.parametrize("change, match", BAD, ids=[m for _, m in BAD])
def test_bad_input_names_the_argument(change, match):
    p = problem(shape=(2, 5), V=50, k=3)
    with pytest.raises(ValueError, match=match):
        logitless.linear_logprobs(p.hidden, p.weight, p.labels, rollout_topk=change(p.topk))


def test_checked_in_blocks(monkeypatch):
    """The engine's top-k is checked a block of positions at a time (its temporaries bounded):
    the same diagnostics bit for bit as one block, and an error past the first block names the
    position in the whole call."""
    import logitless.contract.rollout as checked

    p = problem(shape=(3, 13), V=50, k=3)
    whole = run(p, torch.float32)
    monkeypatch.setattr(checked, "_CHECK_ROWS", 4)
    blocks = run(p, torch.float32)
    for name in FLOAT_FIELDS + BOOL_FIELDS:
        assert torch.equal(getattr(blocks.mismatch, name),
                           getattr(whole.mismatch, name)), name  # fmt: skip
    ids = p.topk.token_ids.clone()
    ids[2, 5, 1] = ids[2, 5, 0]  # position 2 * 13 + 5 = 31 keeps an id twice
    with pytest.raises(ValueError, match=r"duplicate id: position 31 keeps"):
        logitless.linear_logprobs(
            p.hidden, p.weight, p.labels, rollout_topk=p.topk._replace(token_ids=ids)
        )
    lps = p.topk.logprobs.clone()
    lps[1, 9] = -0.3  # position 22 sums to 3 x 0.74
    with pytest.raises(ValueError, match=r"position 22 sums to"):
        logitless.linear_logprobs(
            p.hidden, p.weight, p.labels, rollout_topk=p.topk._replace(logprobs=lps)
        )


def test_what_is_not_bad_input():
    """A padded slot may hold anything, -inf is a probability of 0; not capturable."""
    p = problem(shape=(2, 5), V=50, k=3)
    ids, lps = p.topk.token_ids, p.topk.logprobs.clone()
    lps[ids < 0] = math.nan
    lps[0, 1, 0] = -math.inf
    ok = logitless.linear_logprobs(p.hidden, p.weight, p.labels, rollout_topk=RolloutTopK(ids, lps))
    assert torch.isfinite(ok.mismatch.kl_rollout_trainer).all()
    with pytest.raises(ValueError, match="rollout_topk is not capturable"):
        logitless.linear_logprobs(
            p.hidden, p.weight, p.labels, rollout_topk=p.topk, capturable=True
        )


def test_empty_and_all_ignored():
    p = problem(shape=(4,), V=30, k=2)
    none = RolloutTopK(torch.empty(4, 0, dtype=torch.int64), torch.empty(4, 0))
    out = logitless.linear_logprobs(p.hidden, p.weight, p.labels, rollout_topk=none).mismatch
    assert (
        out.logprobs.shape == (4, 0) and not out.compared.any() and (out.total_variation == 0).all()
    )
    ignored = torch.full((4,), -100)
    out = logitless.linear_logprobs(p.hidden, p.weight, ignored, rollout_topk=p.topk).mismatch
    assert not out.compared.any() and (out.logprobs == 0).all()
