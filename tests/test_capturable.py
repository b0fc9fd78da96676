"""The capturable mode (docs/capturable.md): no host read, shapes from the input shapes only,
the default mode's numbers, and the value checks as device-side assertions.

- Without data: every entry point runs forward and backward under ``FakeTensorMode`` (tensors
  with no storage: a host read or a data-dependent shape raises), and the same calls in the
  default mode raise there (the harness can fail).
- Compiled: a training step under ``torch.compile(fullgraph=True, dynamic=False)`` runs on
  inputs with different masks and valid-row counts without recompiling, and equals eager.
- Numbers: the head's test matrix (tests/test_head.py, the Triton cases) and the fused loss's
  configs (tests/test_fused_loss.py) with ``capturable=True``, with and without
  ``row_capacity``, held to the same tolerances; ``policy_loss`` and ``loss_normalizer``
  against the default mode.
- Errors: bad values raise ``RuntimeError`` from the device-side assertion, with the default
  mode's message; what shapes reveal still raises ``ValueError`` before any work.

The distributed forms (vocab and context parallel, the normalizer's groups) are in
tests/test_vocab_parallel.py, tests/test_losses_cp.py and
tests/test_normalizer_distributed.py, run under tests/_host_reads.py's detector.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import pytest
import torch
from _host_reads import HostRead, no_host_reads
from _tolerance import FLOOR, assert_no_worse_than_reference
from test_fused_loss import CONFIGS, _compare, _problem, _run
from test_head import CASES, _ids, check_against_reference, make_inputs, small_tiles  # noqa: F401
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

import logitless
from logitless import (
    LogprobHead,
    LossNormalizer,
    PolicyLossConfig,
    PolicyLossHead,
    fused_policy_loss,
    linear_logprobs,
    loss_normalizer,
    policy_loss,
)
from logitless.losses import document_stats

HOST_READ = (DataDependentOutputException, DynamicOutputShapeException)
N, H, V = 12, 8, 20


# --------------------------------------------------------------------------------------------
# Without data: FakeTensorMode
# --------------------------------------------------------------------------------------------


def _head(shape=(N,), bias=True):
    """Head inputs with ignored rows (made inside the fake mode: no values exist)."""
    hidden = torch.randn(*shape, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    b = torch.randn(V, requires_grad=True) if bias else None
    labels = torch.randint(0, V, shape)
    labels.view(-1)[:3] = -100
    return hidden, weight, b, labels


def _capacity(cap: bool, c: int = 10) -> dict:
    return {"capturable": cap, "row_capacity": c if cap else None}


def _op(cap, shape=(N,), capacity=False):
    hidden, weight, bias, labels = _head(shape)
    temp = torch.rand(shape) + 0.5
    kw = _capacity(cap) if capacity else {"capturable": cap}
    out = linear_logprobs(
        hidden, weight, labels, bias=bias, temperature=temp, with_entropy=True, **kw
    )
    (out.logprobs * torch.randn(shape) + out.entropy * torch.randn(shape)).sum().backward()


def _loss_inputs(shape=(N,)):
    old = -torch.rand(shape) * 3
    return dict(old=old, ref=old + 0.1, rollout=old - 0.1)


def _fused(cap, cfg, packed, capacity=False):
    hidden, weight, bias, labels = _head()
    d = _loss_inputs()
    ids = torch.arange(3).repeat_interleave(4) if packed else None
    if not packed:
        hidden, labels = hidden.reshape(3, 4, H), labels.reshape(3, 4)
        d = {k: v.reshape(3, 4) for k, v in d.items()}
    norm = LossNormalizer(torch.tensor(9.0), torch.tensor(3.0))
    loss, _ = fused_policy_loss(
        hidden, weight, labels, d["old"], torch.randn(3), config=cfg, bias=bias,
        document_ids=ids, ref_logprobs=d["ref"], rollout_logprobs=d["rollout"],
        normalizer=norm, **(_capacity(cap) if capacity else {"capturable": cap}),
    )  # fmt: skip
    loss.backward()


def _policy(cap, cfg, packed, per_token):
    shape = (N,) if packed else (3, 4)
    lp = -torch.rand(shape, requires_grad=True) * 2
    ent = torch.rand(shape, requires_grad=True)
    d = _loss_inputs(shape)
    mask = torch.rand(shape) > 0.3
    ids = torch.arange(3).repeat_interleave(4) if packed else None
    adv = torch.randn(shape) if per_token else torch.randn(3)
    norm = LossNormalizer(torch.tensor(12.0), torch.tensor(3.0))
    loss, metrics = policy_loss(
        lp, d["old"], adv, mask, config=cfg, document_ids=ids, ref_logprobs=d["ref"],
        rollout_logprobs=d["rollout"], entropy=ent, normalizer=norm, capturable=cap,
    )  # fmt: skip
    (loss + sum(metrics.values())).backward()


def _stats_then_loss(cap):
    lp = -torch.rand(N, requires_grad=True)
    d = _loss_inputs()
    ids, adv, mask = torch.arange(3).repeat_interleave(4), torch.randn(3), torch.rand(N) > 0.3
    cfg = PolicyLossConfig(ratio_level="sequence", mismatch_is="sequence")
    kw = dict(config=cfg, document_ids=ids, rollout_logprobs=d["rollout"], capturable=cap)
    stats = document_stats(lp.detach(), d["old"], adv, mask, **kw)
    loss, _ = policy_loss(lp, d["old"], adv, mask, document_stats=stats, **kw)
    loss.backward()


def _normalizer(cap):
    masks = [torch.rand(N) > 0.3, torch.rand(3, 4) > 0.5]
    ids = [torch.arange(3).repeat_interleave(4), None]
    loss_normalizer(masks, ids, capturable=cap, loss_scale=2.0).num_sequences.sum()


def _modules(cap):
    hidden, _, _, labels = _head()
    lm_head = torch.nn.Linear(H, V, bias=False)
    out = LogprobHead(lm_head, with_entropy=True, capturable=cap)(hidden, labels)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    cfg = PolicyLossConfig(clip_high=0.28, aggregation="token_mean")
    head = PolicyLossHead(lm_head, config=cfg, **_capacity(cap))
    loss, _ = head(hidden.reshape(3, 4, H), labels.reshape(3, 4), -torch.rand(3, 4), torch.randn(3))
    loss.backward()


def _hf_model():
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _hf(cap, packing):
    from logitless.integrations.hf import causal_lm_logprobs, causal_lm_policy_loss

    model = _hf_model()
    ids = torch.randint(0, V, (2, 8))
    response = torch.zeros(2, 8, dtype=torch.bool)
    response[:, 3:] = True
    kw: dict = {"response_mask": response, "capturable": cap}
    if packing == "attention_mask":
        kw["attention_mask"] = torch.ones(2, 8, dtype=torch.long)
        adv = torch.randn(2)
    else:  # two documents in each row
        kw["position_ids"] = torch.arange(4).repeat(2, 2)
        adv = torch.randn(4)
    out = causal_lm_logprobs(model, ids, with_entropy=True, **kw)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    cfg = PolicyLossConfig(ratio_level="sequence")
    loss, _ = causal_lm_policy_loss(model, ids, -torch.rand(2, 8), adv, config=cfg, **kw)
    loss.backward()


_DAPO = PolicyLossConfig(clip_high=0.28, aggregation="token_mean", kl_coef=0.1, entropy_coef=0.01)
_GSPO = PolicyLossConfig(
    ratio_level="sequence", aggregation="seq_mean_token_mean", mismatch_is="sequence",
    mismatch_seq_mask="geometric", mismatch_seq_mask_range=(0.5, 2.0),
)  # fmt: skip
WITHOUT_DATA = {
    "op": _op,
    "op_row_capacity": functools.partial(_op, capacity=True),
    "op_rows_row_capacity": functools.partial(_op, shape=(3, 4), capacity=True),
    "fused_token_local_rows": functools.partial(_fused, cfg=_DAPO, packed=False),
    "fused_token_local_packed_capacity": functools.partial(
        _fused, cfg=_DAPO, packed=True, capacity=True
    ),
    "fused_sequence_level_packed": functools.partial(_fused, cfg=_GSPO, packed=True),
    "fused_sequence_level_rows_capacity": functools.partial(
        _fused, cfg=_GSPO, packed=False, capacity=True
    ),
    "policy_loss_token_rows": functools.partial(_policy, cfg=_DAPO, packed=False, per_token=True),
    "policy_loss_sequence_packed": functools.partial(
        _policy, cfg=_GSPO, packed=True, per_token=False
    ),
    "policy_loss_gmpo_packed_per_token": functools.partial(
        _policy, cfg=PolicyLossConfig(surrogate="gmpo"), packed=True, per_token=True
    ),
    "document_stats_then_loss": _stats_then_loss,
    "loss_normalizer": _normalizer,
    "modules": _modules,
}
if importlib.util.find_spec("transformers") is not None:
    WITHOUT_DATA["hf_attention_mask"] = functools.partial(_hf, packing="attention_mask")
    WITHOUT_DATA["hf_position_ids"] = functools.partial(_hf, packing="position_ids")


@pytest.mark.parametrize("name", list(WITHOUT_DATA))
def test_runs_forward_and_backward_without_data(name):
    with FakeTensorMode():
        WITHOUT_DATA[name](True)


@pytest.mark.parametrize("name", list(WITHOUT_DATA))
def test_default_mode_reads_the_host(name):
    """The harness can fail: the same call in the default mode reads data."""
    with FakeTensorMode(), pytest.raises(HOST_READ):
        WITHOUT_DATA[name](False)


@pytest.mark.parametrize("name", ["op_row_capacity", "fused_sequence_level_packed", "modules"])
def test_no_host_read_on_real_tensors(name):
    """tests/_host_reads.py's detector (used by the distributed tests) sees the same: the
    capturable calls pass it, the default ones do not."""
    with no_host_reads():
        WITHOUT_DATA[name](True)
    with pytest.raises(HostRead), no_host_reads():
        WITHOUT_DATA[name](False)


# --------------------------------------------------------------------------------------------
# A compiled step: fullgraph, static shapes, no recompile
# --------------------------------------------------------------------------------------------

_STEP_CFG = PolicyLossConfig(ratio_level="sequence", aggregation="seq_mean_token_mean")
STEP_N, STEP_DOCS = 24, 4


def _step(hidden, weight, labels, old, adv, ids, normalizer_tokens, capturable=True):
    """The head and the loss of one training step (the loss mask from the labels)."""
    cap = {"capturable": True, "row_capacity": 16} if capturable else {}
    out = linear_logprobs(hidden, weight, labels, with_entropy=True, **cap)
    norm = LossNormalizer(normalizer_tokens, torch.tensor(4.0, dtype=torch.float64))
    loss, metrics = policy_loss(
        out.logprobs, old, adv, labels != -100, config=_STEP_CFG, document_ids=ids,
        normalizer=norm, capturable=capturable,
    )  # fmt: skip
    return loss + 0.01 * (out.entropy * (labels != -100)).sum(), metrics["clip_frac_low"]


def _step_inputs(seed: int, n_valid: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(STEP_N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    labels = torch.randint(0, V, (STEP_N,), generator=g)
    labels[torch.randperm(STEP_N, generator=g)[n_valid:]] = -100
    old = torch.randn(STEP_N, generator=g) - 3
    ids = torch.arange(STEP_DOCS).repeat_interleave(STEP_N // STEP_DOCS)
    adv = torch.randn(STEP_DOCS, generator=g)
    tokens = torch.tensor(float(n_valid), dtype=torch.float64)
    return hidden, weight, labels, old, adv, ids, tokens


def _grads(fn, args):
    h, w = (t.clone().requires_grad_() for t in args[:2])
    loss, clip = fn(h, w, *args[2:])
    loss.backward()
    return [loss.detach(), clip, h.grad, w.grad]


def _no_recompile():
    """Dynamo raises on a recompile inside. Its own patch, not ``monkeypatch.setattr``: the
    config module keeps its values outside its ``__dict__``, so pytest 9.2 records no old
    value and its undo deletes the option (the test fails at teardown, and later ones find
    no ``error_on_recompile``)."""
    return torch._dynamo.config.patch(error_on_recompile=True)


def test_compiled_step_runs_twice_without_recompiling_and_equals_eager():
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True, dynamic=False, backend="aot_eager")
    with _no_recompile():
        for seed, n_valid in ((0, 10), (1, 16), (2, 3)):  # valid rows vary, shapes do not
            args = _step_inputs(seed, n_valid)
            for got, want in zip(_grads(compiled, args), _grads(_step, args), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _head_step(hidden, weight, labels, temp, up, **mode):
    out = linear_logprobs(hidden, weight, labels, temperature=temp, with_entropy=True, **mode)
    return (out.logprobs * up[0]).sum() + (out.entropy * up[1]).sum(), out.logprobs.detach()


@pytest.mark.parametrize("row_capacity", [None, 9, 30])
def test_compiled_head_with_random_upstream_at_ignored_rows(row_capacity):
    """The compiled op's backward gathers the upstream gradient, which is random at the
    ignored rows too: they must not count."""
    torch._dynamo.reset()
    mode = {"capturable": True, "row_capacity": row_capacity}
    step = functools.partial(_head_step, **mode)
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="aot_eager")
    with _no_recompile():
        _compare_head_steps(compiled)


def _compare_head_steps(compiled):
    for seed, n_valid in ((0, 9), (1, 4)):
        g = torch.Generator().manual_seed(seed)
        hidden, weight = torch.randn(STEP_N, H, generator=g), torch.randn(V, H, generator=g)
        labels = torch.randint(0, V, (STEP_N,), generator=g)
        labels[torch.randperm(STEP_N, generator=g)[n_valid:]] = -100
        args = (labels, torch.rand(STEP_N, generator=g) + 0.5, torch.randn(2, STEP_N, generator=g))
        got = _grads(compiled, (hidden, weight, *args))
        want = _grads(_head_step, (hidden, weight, *args))  # eager, default mode
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_every_registered_backend_is_loaded_by_an_import_statement():
    """backend_for / divergence_backend_for load a backend by a plain import statement (what
    Dynamo can trace), not by importlib: each module the registry names, for every op of every
    backend, has its loader, which returns that module."""
    from logitless.backends import LOADERS
    from logitless.contract.backend import BACKENDS, OPS

    assert all(set(spec.modules) == set(OPS) for spec in BACKENDS.values())
    assert set(LOADERS) == {m for spec in BACKENDS.values() for m in spec.modules.values()}
    for name in BACKENDS["torch"].modules.values():
        assert LOADERS[name]().__name__ == name


def test_compiled_step_of_the_default_mode_breaks_the_graph():
    """The compile test can fail: the default mode's host read is a graph break."""
    torch._dynamo.reset()
    default = functools.partial(_step, capturable=False)
    compiled = torch.compile(default, fullgraph=True, dynamic=False, backend="aot_eager")
    with pytest.raises(torch._dynamo.exc.Unsupported):
        _grads(compiled, _step_inputs(0, 10))


# --------------------------------------------------------------------------------------------
# The default mode's numbers
# --------------------------------------------------------------------------------------------


def _valid_rows(labels: torch.Tensor, ignore_index: int) -> int:
    return max(1, int((labels != ignore_index).sum()))


def _capturable_op(hidden, weight, labels, *, capacity: str, backend="auto", **kw):
    """``linear_logprobs`` in the capturable mode: every row, or a row capacity of exactly
    the valid rows, or a few more."""
    rows = None
    if capacity != "all":
        rows = _valid_rows(labels, kw["ignore_index"]) + (3 if capacity == "spare" else 0)
    return linear_logprobs(
        hidden, weight, labels, capturable=True, row_capacity=rows, backend=backend, **kw
    )


@pytest.mark.parametrize("capacity", ["all", "exact", "spare"])
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_head_matches_reference_like_the_default_mode(case, capacity, request):
    if case.small_tiles:
        request.getfixturevalue("small_tiles")
    op = functools.partial(_capturable_op, capacity=capacity)
    check_against_reference(case, make_inputs(case), op_fn=op)


_TRITON = importlib.util.find_spec("triton") is not None and not torch.cuda.is_available()
_SMALL = [c for c in CASES if c.chunk in (None, 7) and not c.small_tiles]
TRITON_CASES = [c for c in _SMALL if c.dtype == "fp32"][:6] + [
    c for c in _SMALL if c.dtype == "bf16"
][:2]


@pytest.mark.skipif(not _TRITON, reason="Triton's interpreter runs where there is no GPU")
@pytest.mark.parametrize("capacity", ["all", "exact"])
@pytest.mark.parametrize("case", TRITON_CASES, ids=_ids(TRITON_CASES))
def test_triton_head_matches_reference(case, capacity, request):
    if case.small_tiles:
        request.getfixturevalue("small_tiles")
    op = functools.partial(_capturable_op, capacity=capacity, backend="triton")
    check_against_reference(case, make_inputs(case), op_fn=op)


@pytest.mark.parametrize("capacity", ["all", "exact"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_loss_matches_reference_like_the_default_mode(name, packed, capacity):
    p, cfg = _problem(packed, torch.float32), CONFIGS[name]
    head = {"capturable": True}
    if capacity == "exact":
        head["row_capacity"] = _valid_rows(p["labels"], -100)
    num_tokens = int((p["labels"] != -100).sum())
    fused = _run("fused", p, cfg, **head)
    _compare(fused, _run("naive", p, cfg), _run("truth", p, cfg), num_tokens)


@pytest.mark.parametrize("name", ["dapo", "gspo", "token_sum_kl_k3_entropy"])
def test_fused_loss_bf16_and_chunks(name):
    p, cfg = _problem(True, torch.bfloat16), CONFIGS[name]
    num_tokens = int((p["labels"] != -100).sum())
    fused = _run("fused", p, cfg, chunk_size=7, capturable=True, row_capacity=40)
    _compare(fused, _run("naive", p, cfg), _run("truth", p, cfg), num_tokens)


def _composed(p, cfg, dtype, **mode):
    """``policy_loss`` on fixed log-probs (those of the head, in ``dtype``)."""
    with torch.no_grad():
        out = logitless.reference.linear_logprobs(
            p["hidden"].double(), p["weight"].double(), p["labels"], with_entropy=True
        )
    lp = out.logprobs.to(dtype).requires_grad_()
    ent = out.entropy.to(dtype).requires_grad_()
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    per_token = torch.randn(p["labels"].shape, generator=torch.Generator().manual_seed(3))
    adv = cast(per_token if cfg.surrogate == "gmpo" else p["adv"])
    norm = LossNormalizer(float((p["labels"] != -100).sum()) + 5.0, 7.0, loss_scale=2.0)
    loss, metrics = policy_loss(
        lp, cast(p["old"]), adv, p["labels"] != -100, config=cfg, document_ids=p["doc"],
        ref_logprobs=cast(p["ref"]), rollout_logprobs=cast(p["rollout"]), entropy=ent,
        normalizer=norm, **mode,
    )  # fmt: skip
    (loss * 0.7).backward()
    return loss.detach(), metrics, lp.grad, ent.grad


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_policy_loss_matches_the_default_mode(name, packed):
    """fp32 capturable vs fp32 default (the reference) vs float64 default (the truth)."""
    p, cfg = _problem(packed, torch.float32), CONFIGS[name]
    got = _composed(p, cfg, torch.float32, capturable=True)
    ref = _composed(p, cfg, torch.float32)
    truth = _composed(p, cfg, torch.float64)
    (lg, mg, *gg), (lr, mr, *gr), (lt, mt, *gt) = got, ref, truth
    floor = int((p["labels"] != -100).sum()) * torch.finfo(torch.float32).eps
    assert set(mg) == set(mr)
    for key in mt:
        assert_close = functools.partial(_assert_no_worse, floor=floor, name=f"{name} metric {key}")
        assert_close(mg[key], mr[key], mt[key])
    _assert_no_worse(lg, lr, lt, floor=floor, name="loss")
    for a, r, t, what in zip(gg, gr, gt, ("logprobs.grad", "entropy.grad"), strict=True):
        assert (a is None) == (r is None), what  # entropy.grad: None when entropy_coef == 0
        if r is not None:
            _assert_no_worse(a, r, t, name=what)


def _assert_no_worse(a, r, t, name, floor=FLOOR):
    assert_no_worse_than_reference(a.reshape(-1), r.reshape(-1), t.reshape(-1), name, floor=floor)


def test_policy_loss_float64_equals_default_exactly():
    """In float64 the two modes add the same numbers in the same order per document."""
    p, cfg = _problem(True, torch.float64), CONFIGS["gspo_entropy_kl"]
    got = _composed(p, cfg, torch.float64, capturable=True)
    want = _composed(p, cfg, torch.float64)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=0)
    for k in want[1]:
        torch.testing.assert_close(got[1][k], want[1][k], rtol=1e-12, atol=1e-15, msg=k)
    torch.testing.assert_close(got[2], want[2], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("layout", ["packed", "rows", "mixed", "all_masked", "one_token_docs"])
def test_loss_normalizer_equals_default_mode(layout):
    g = torch.Generator().manual_seed(5)
    packed_ids = torch.tensor([0, 0, 0, -1, 1, 1, 2, 2, 2, 2, -1, 3])
    masks, ids = {
        "packed": ([torch.rand(12, generator=g) > 0.3], [packed_ids]),
        "rows": ([torch.rand(3, 5, generator=g) > 0.5] * 2, None),
        "mixed": ([torch.rand(12, generator=g) > 0.2, torch.rand(2, 6, generator=g) > 0.5],
                  [packed_ids, None]),
        "all_masked": ([torch.zeros(12, dtype=torch.bool)], [packed_ids]),
        "one_token_docs": ([torch.ones(5, dtype=torch.bool)], [torch.arange(5)]),
    }[layout]  # fmt: skip
    got = loss_normalizer(masks, ids, capturable=True, loss_scale=4.0)
    want = loss_normalizer(masks, ids, loss_scale=4.0)
    assert float(got.num_tokens) == float(want.num_tokens)
    assert float(got.num_sequences) == float(want.num_sequences)
    assert got.loss_scale == 4.0


# --------------------------------------------------------------------------------------------
# Errors: device-side assertions with the default mode's messages; shape errors stay ValueError
# --------------------------------------------------------------------------------------------


def _bad_head(change: str, capturable: bool):
    hidden, weight, _, labels = (t.detach() if t is not None else t for t in _head())
    kw: dict = {"capturable": capturable}
    if change == "label":
        labels[4] = V
    elif change == "temperature":
        kw["temperature"] = torch.full((N,), 0.5).index_fill(0, torch.tensor([5]), -1.0)
    elif change == "capacity":
        kw["row_capacity"] = 8  # 9 valid rows
    return linear_logprobs(hidden, weight, labels, **kw)


def _bad_loss(change: str, capturable: bool):
    lp, old = -torch.rand(N), -torch.rand(N)
    ids, adv, mask = torch.arange(3).repeat_interleave(4), torch.randn(3), torch.ones(N).bool()
    kw: dict = {"document_ids": ids, "config": PolicyLossConfig(), "capturable": capturable}
    if change == "nan_old":
        old[2] = float("nan")
    elif change == "probabilities":
        old = old.exp()
    elif change == "nan_advantage":
        adv[1] = float("nan")
    elif change == "split_document":
        kw["document_ids"] = torch.tensor([0, 0, 1, 1, 0, 0, 2, 2, 2, 2, 2, 2])
    elif change == "id_beyond_advantages":
        kw["document_ids"] = torch.tensor([0] * 4 + [1] * 4 + [3] * 4)
        adv = torch.randn(3)
    elif change == "normalizer_small":
        kw["normalizer"] = LossNormalizer(torch.tensor(5.0), torch.tensor(3.0))
    elif change == "normalizer_nan":
        kw["normalizer"] = LossNormalizer(torch.tensor(math.nan), torch.tensor(3.0))
    return policy_loss(lp, old, adv, mask, **kw)


def _bad_hf(change: str, capturable: bool):
    from logitless.integrations.hf import causal_lm_logprobs

    kw: dict = {"capturable": capturable}
    if change == "attention_mask":
        kw["attention_mask"] = torch.tensor([[1, 1, 2, 1, 1, 1, 1, 1]] * 2)
    else:
        kw["position_ids"] = torch.tensor([[0, 1, 3, 4, 0, 1, 2, 3]] * 2)
    return causal_lm_logprobs(_hf_model(), torch.randint(0, V, (2, 8)), **kw)


def _bad_normalizer(change: str, capturable: bool):
    ids = torch.tensor([0, 0, 1, 1, 0, 0])
    return loss_normalizer([torch.ones(6, dtype=torch.bool)], [ids], capturable=capturable)


DEVICE_ERRORS = [
    (_bad_head, "label", r"labels must be in \[0, 20\) or equal ignore_index=-100"),
    (_bad_head, "temperature", "temperature must be finite and > 0 everywhere"),
    (_bad_loss, "nan_old", "old_logprobs must be log-probabilities: NaN or"),
    (_bad_loss, "probabilities", "old_logprobs look like probabilities"),
    (_bad_loss, "nan_advantage", "advantages must be finite"),
    (_bad_loss, "split_document", "document_ids must keep each document's tokens contiguous"),
    (_bad_loss, "normalizer_small", "normalizer.num_tokens .*smaller than this call's own"),
    (_bad_loss, "normalizer_nan", "normalizer.num_tokens must be finite and >= 0"),
    (_bad_normalizer, "split", "document_ids must keep each document's tokens contiguous"),
]
if importlib.util.find_spec("transformers") is not None:
    DEVICE_ERRORS += [
        (_bad_hf, "attention_mask", "attention_mask must hold only 0 and 1"),
        (_bad_hf, "position_ids", "position_ids must restart at 0 for each document"),
    ]


@pytest.mark.parametrize(
    "make,change,match", DEVICE_ERRORS, ids=[f"{m.__name__}-{c}" for m, c, _ in DEVICE_ERRORS]
)
def test_bad_values_raise_on_the_device_with_the_default_message(make, change, match):
    with pytest.raises(RuntimeError, match=match) as caught:
        make(change, True)
    assert not isinstance(caught.value, ValueError)
    with pytest.raises(ValueError, match=match):
        make(change, False)


@pytest.mark.parametrize(
    "make,change,match",
    [
        (_bad_head, "capacity", r"more valid rows than row_capacity=8"),
        (_bad_loss, "id_beyond_advantages", r"document_ids must be < 3 in the capturable mode"),
    ],
)
def test_capturable_only_errors_raise_on_the_device(make, change, match):
    with pytest.raises(RuntimeError, match=match):
        make(change, True)


def test_row_capacity_above_the_rows_projects_every_row():
    """A capacity above the row count is accepted and projects every row: the default mode's
    numbers, to the reference's own error. Not its bits: the two calls project different row
    counts (12 rows here, the 9 valid ones there), and the BLAS may pick another kernel or
    thread split for another row count (one ulp apart on a 2-thread machine)."""
    hidden, weight, _, labels = (t.detach() if t is not None else t for t in _head())
    got = linear_logprobs(hidden, weight, labels, capturable=True, row_capacity=N + 5)
    default = linear_logprobs(hidden, weight, labels)
    ref = logitless.reference.linear_logprobs(hidden, weight, labels)
    truth = logitless.reference.linear_logprobs(hidden.double(), weight.double(), labels)
    for name, out in (("capturable", got), ("default", default)):
        _assert_no_worse(out.logprobs, ref.logprobs, truth.logprobs, name=f"{name} logprobs")
    ignored = labels == -100
    assert (got.logprobs[ignored] == 0).all(), "an ignored row's log-prob is not 0"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"row_capacity": 4}, "row_capacity needs capturable=True"),
        ({"capturable": True, "row_capacity": 0}, "row_capacity"),
        ({"capturable": "yes"}, "capturable"),
        ({"capturable": True, "top_k": 5}, "sampling replay is not capturable"),
    ],
)
def test_bad_options_raise_value_error(kwargs, match):
    hidden, weight, _, labels = (t.detach() if t is not None else t for t in _head())
    with pytest.raises(ValueError, match=match):
        linear_logprobs(hidden, weight, labels, **kwargs)


def test_bad_capturable_flag_of_the_losses_raises_value_error():
    lp = -torch.rand(3, 4)
    with pytest.raises(ValueError, match="capturable"):
        policy_loss(lp, lp, torch.randn(3), lp < 0, config=PolicyLossConfig(), capturable=1)
    with pytest.raises(ValueError, match="capturable"):
        loss_normalizer([lp < 0], capturable=None)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_hf_cu_seqlens_is_refused_in_the_capturable_mode():
    from logitless.integrations.hf import causal_lm_logprobs

    with pytest.raises(ValueError, match="cu_seqlens is not supported with capturable=True"):
        causal_lm_logprobs(
            _hf_model(), torch.randint(0, V, (1, 8)), cu_seqlens=torch.tensor([0, 3, 8]),
            capturable=True,
        )  # fmt: skip
