"""``LogitlessLoss`` against torchtitan 0.3.0's own ``ChunkedLossWrapper``, in one process.

Each case runs torchtitan's ``ChunkedLossWrapper`` (2 chunks) and ``LogitlessLoss`` with the
same inner loss config (torchtitan's ``CrossEntropyLoss``, ``GRPOLoss``, ``DAPOLoss``) on one
``lm_head`` (``nn.Linear``, no bias, as torchtitan's models build it), as torchtitan's trainer
calls them: ``set_lm_head``, then ``loss_fn(hidden, labels, global_valid_tokens, **inputs)``
and ``loss.backward()`` with a random upstream gradient. The loss and the gradients of the
hidden states and of ``lm_head.weight`` are held to 4x the wrapper's own error against a float64
truth (tests/_tolerance.py); DAPO's metrics must match the wrapper's. Labels with
``IGNORE_INDEX``, fp32 and bf16, a ``loss_mask``, a non-finite generator log-prob, log-ratios
beyond DAPO's cap of 10.

Also: ``LogitlessLoss`` is what the trainer wires (a ``ChunkedLossWrapper``, built from its
config), the forward-only call (validation), and the refusals.
"""

from __future__ import annotations

import pytest
import torch
from _tolerance import assert_no_worse_than_reference
from _torchtitan import (
    Case,
    ChunkedLossWrapper,
    CrossEntropyLoss,
    DAPOLoss,
    GRPOLoss,
    H,
    LogitlessLoss,
    V,
    data,
    losses,
    run_loss,
    truth,
)
from torchtitan.components.loss import MSELoss

CASES = [
    Case("cross-entropy", CrossEntropyLoss.Config()),
    Case("cross-entropy-bf16", CrossEntropyLoss.Config(), dtype=torch.bfloat16),
    Case("grpo", GRPOLoss.Config(clip_eps=0.2)),
    Case("dapo-far-ratios", DAPOLoss.Config(ratio_clip_low=0.2, ratio_clip_high=0.28), far=True),
    Case("dapo-bf16", DAPOLoss.Config(ratio_clip_high=0.28), dtype=torch.bfloat16),
]


def _head(d: dict, dtype: torch.dtype) -> torch.nn.Linear:
    lm_head = torch.nn.Linear(H, V, bias=False, dtype=dtype)
    with torch.no_grad():
        lm_head.weight.copy_(d["weight"])
    return lm_head


def _run(loss_fn, case: Case, d: dict, upstream: float | torch.Tensor = 1.0) -> dict:
    lm_head = _head(d, case.dtype)
    hidden = d["hidden"].to(case.dtype).requires_grad_()
    out = run_loss(loss_fn, lm_head, hidden, d["labels"], d["gvt"], d.get("inputs", {}), upstream)
    return out | {"hidden": hidden.grad, "weight": lm_head.weight.grad}


def _close_metrics(ours: dict, theirs: dict, dtype: torch.dtype) -> None:
    assert ours.keys() == theirs.keys()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, value in ours.items():
        ref = float(theirs[name])
        assert abs(float(value) - ref) <= tol * (1 + abs(ref)), (name, float(value), ref)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_chunked_loss_wrapper_and_float64(case: Case):
    d = data(case)
    chunked, ours = losses(case)
    want = truth(case, d)
    mine, ref = _run(ours, case, d), _run(chunked, case, d)
    for what in ("loss", "hidden", "weight"):
        assert_no_worse_than_reference(mine[what], ref[what], want[what], what)
    assert mine["hidden"].dtype == case.dtype and mine["weight"].dtype == case.dtype
    _close_metrics(mine["metrics"], ref["metrics"], case.dtype)
    if case.far:  # the dropped token gets no gradient
        assert float(mine["hidden"][1, 5].abs().sum()) == 0
    # a random upstream gradient scales LogitlessLoss's gradients (not the wrapper's: see
    # tests/torchtitan_backend/_torchtitan.py), within the same tolerance of the scaled truth
    scaled = _run(LogitlessLoss.Config(loss_fn=case.inner).build(), case, d, d["upstream"])
    want = truth(case, d, d["upstream"])
    for what in ("hidden", "weight"):
        ref_scaled = ref[what].double() * d["upstream"]
        assert_no_worse_than_reference(scaled[what], ref_scaled, want[what], f"{what} scaled")


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=lambda c: c.name)
def test_chunk_size(case: Case, monkeypatch):
    """``Config.chunk_size`` reaches the head's schedule (the rows of each pass) and leaves the
    loss and gradients where the default's are: against the wrapper and float64."""
    from logitless.backends.base import Schedule

    seen = []
    choose = Schedule.choose

    def spy(num_rows, vocab, device, chunk_size, **kw):
        seen.append(chunk_size)
        return choose(num_rows, vocab, device, chunk_size, **kw)

    monkeypatch.setattr(Schedule, "choose", staticmethod(spy))
    d = data(case)
    chunked, _ = losses(case)
    want = truth(case, d)
    mine = _run(LogitlessLoss.Config(loss_fn=case.inner, chunk_size=3).build(), case, d)
    assert seen and set(seen) == {3}, seen
    ref = _run(chunked, case, d)
    for what in ("loss", "hidden", "weight"):
        assert_no_worse_than_reference(mine[what], ref[what], want[what], what)
    with pytest.raises(ValueError, match="chunk_size"):
        LogitlessLoss.Config(loss_fn=case.inner, chunk_size=0).build()


def test_forward_only_call():
    """Validation: hidden states without gradient (the wrapper then runs forward only)."""
    case = Case("ce", CrossEntropyLoss.Config())
    d = data(case)
    chunked, ours = losses(case)
    lm_head = _head(d, torch.float32)
    hidden = d["hidden"].float()
    for loss_fn in (chunked, ours):
        loss_fn.set_lm_head(lm_head)
    mine, _ = ours(hidden, d["labels"], d["gvt"])
    ref, _ = chunked(hidden, d["labels"], d["gvt"])
    assert not mine.requires_grad
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)


def test_what_the_trainer_wires():
    """torchtitan's trainers call ``set_lm_head`` and skip the model's ``lm_head`` when the
    built loss ``isinstance(..., ChunkedLossWrapper)``; ``LogitlessLoss.Config`` builds it."""
    config = LogitlessLoss.Config(num_chunks=4, loss_fn=GRPOLoss.Config(clip_eps=0.3))
    loss_fn = config.build()
    assert isinstance(loss_fn, LogitlessLoss) and isinstance(loss_fn, ChunkedLossWrapper)
    assert isinstance(loss_fn.loss_fn, GRPOLoss)
    assert config.to_dict()["loss_fn"] == {"clip_eps": 0.3}


def test_refusals():
    with pytest.raises(ValueError, match=r"loss\.loss_fn: .*got MSELoss"):
        LogitlessLoss.Config(loss_fn=MSELoss.Config()).build()
    case = Case("grpo", GRPOLoss.Config())
    d = data(case)
    loss_fn = LogitlessLoss.Config(loss_fn=case.inner).build()
    hidden = d["hidden"].float()
    with pytest.raises(ValueError, match="set_lm_head"):
        loss_fn(hidden, d["labels"], d["gvt"], **d["inputs"])
    loss_fn.set_lm_head(_head(d, torch.float32))
    inputs = dict(d["inputs"])
    del inputs["loss_mask"]
    with pytest.raises(ValueError, match=r"loss inputs \['advantages', 'generator_logprobs', "):
        loss_fn(hidden, d["labels"], d["gvt"], **inputs)
    labels = d["labels"].clone()
    labels[0, 0] = V
    with pytest.raises(ValueError, match=r"labels"):
        loss_fn(hidden, labels, d["gvt"], **d["inputs"])


def test_refuses_spmd_typechecking():
    """Under ``debug.spmd_typechecking`` torchtitan's trainer runs the step inside
    ``spmd_types.checker.typecheck(local=False)``."""
    from spmd_types.checker import typecheck

    case = Case("ce", CrossEntropyLoss.Config())
    d = data(case)
    loss_fn = LogitlessLoss.Config(loss_fn=case.inner).build()
    loss_fn.set_lm_head(_head(d, torch.float32))
    with typecheck(local=False), pytest.raises(ValueError, match=r"debug\.spmd_typechecking"):
        loss_fn(d["hidden"].float(), d["labels"], d["gvt"])


def test_benchmark_script_runs(tmp_path):
    """benchmarks/torchtitan_loss.py end to end on a tiny shape (its full size is for a quiet
    machine: docs/torchtitan.md); both variants' rows reach the CSV."""
    import csv
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "bench.csv"
    args = ["--tokens", "64", "--hidden", "16", "--vocab", "50", "--repeats", "1"]
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "torchtitan_loss.py"), *args, "--loss", "grpo",
         "--csv", str(out)],
        capture_output=True, text=True, timeout=600, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    assert [r["variant"] for r in rows] == ["chunked", "logitless"]
    assert rows[1]["loss"] == "grpo" and float(rows[1]["time_median_s"]) > 0


def test_the_doc_page_snippet():
    """docs/torchtitan.md's Python block runs as written (the main suite, without torchtitan,
    skips it) and builds what it says."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "torchtitan.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", page, re.S)
    scope: dict = {}
    exec(compile(code, "docs/torchtitan.md", "exec"), scope)  # noqa: S102
    for name in ("loss", "rl_loss"):
        assert isinstance(scope[name].build(), LogitlessLoss)
    assert isinstance(scope["rl_loss"].build().loss_fn, GRPOLoss)
