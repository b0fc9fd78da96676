"""Smoke tests of ``logitless bench``: the real subprocess path at a tiny shape, CLI errors,
failure capture and ratio arithmetic."""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from logitless.apps.bench.harness import CSV_COLUMNS, Row, add_ratios, append_csv, run_method
from logitless.apps.bench.workload import Workload
from logitless.apps.cli import main

TINY = ["--tokens", "32", "--hidden", "32", "--vocab", "512", "--repeats", "1", "--threads", "1"]
METHODS = ["naive", "logitless", "floor3", "floor4"]


def _work(**overrides: object) -> Workload:
    """A tiny workload."""
    base = dict(
        task="logprobs",
        tokens=32,
        hidden=32,
        vocab=512,
        valid_frac=0.5,
        dtype="float32",
        device="cpu",
        threads=1,
        repeats=1,
    )
    return Workload(**{**base, **overrides})


def test_bench_end_to_end(tmp_path: Path) -> None:
    """Console path: every method runs in its own worker; table, progress, CSV and PNG."""
    out_csv, out_png = tmp_path / "r" / "bench.csv", tmp_path / "bench.png"
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    cmd = [sys.executable, "-m", "logitless", "bench", *TINY, "--valid-frac", "0.5"]
    cmd += ["--methods", ",".join(METHODS), "--csv", str(out_csv)]
    cmd += ["--plot", str(out_png)] if has_mpl else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr

    for i, name in enumerate(METHODS, 1):
        assert f"[{i}/{len(METHODS)}] tokens=32 {name}:" in proc.stderr
    table = proc.stdout.splitlines()
    assert table[0].split()[:4] == ["tokens", "method", "median", "s"]
    assert [ln.split()[1] for ln in table[2 : 2 + len(METHODS)]] == METHODS

    with out_csv.open(newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == CSV_COLUMNS
        rows = list(reader)
    assert [r["method"] for r in rows] == METHODS
    assert len({r["timestamp"] for r in rows}) == 1
    for r in rows:
        assert r["status"] == "ok" and r["task"] == "logprobs" and r["tokens"] == "32"
        assert float(r["time_p20_s"]) <= float(r["time_p50_s"]) <= float(r["time_p80_s"])
        assert float(r["time_p50_s"]) > 0 and float(r["peak_extra_mb"]) >= 0
        assert r["torch"] == torch.__version__ and r["valid_frac"] == "0.5"
    by = {r["method"]: r for r in rows}
    assert float(by["naive"]["time_vs_naive"]) == 1.0
    assert float(by["floor4"]["time_vs_floor4"]) == 1.0
    assert float(by["logitless"]["mem_floor_mb"]) == pytest.approx((512 + 32) * 32 * 4 / 2**20)
    if has_mpl:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "bad",
    [
        ["--tokens", "0"],
        ["--tokens", "many"],
        ["--valid-frac", "0"],
        ["--valid-frac", "1.5"],
        ["--methods", "bogus"],
        ["--methods", "naive,bogus"],
        ["--dtype", "float64"],
        ["--task", "bogus"],
        ["--device", "tpu"],
        ["--repeats", "0"],
    ],
)
def test_bad_input_exits_2(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Bad CLI input is an argparse error (exit code 2) with a message, before any work."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", *TINY, "--no-csv", *bad])
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """Asking for CUDA on a CPU-only torch is a clear CLI error."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", *TINY, "--no-csv", "--device", "cuda"])
    assert exc.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_worker_failure_is_a_row_not_a_crash() -> None:
    """An exception inside the worker comes back as a failed row with its reason."""
    row = run_method("no-such-method", _work())
    assert row.status == "failed" and "unknown method" in row.reason


def test_worker_timeout_is_a_row_not_a_crash() -> None:
    """A worker that outlives ``--timeout`` is recorded as failed."""
    row = run_method("naive", _work(), timeout_s=0.01)
    assert row.status == "failed" and "timed out" in row.reason


def _row(method: str, t: float, mb: float) -> Row:
    return Row(method, _work(), "ok", time_p50_s=t, time_p20_s=t, time_p80_s=t, peak_extra_mb=mb)


def test_ratios_and_csv_append(tmp_path: Path) -> None:
    """Ratios use the same run's naive/floor rows; missing references stay empty; the CSV
    header is written once."""
    rows = [_row("naive", 4.0, 100.0), _row("logitless", 2.0, 10.0), _row("floor4", 1.0, 5.0)]
    rows.append(Row("cce", _work(), "skipped", reason="not installed"))
    add_ratios(rows)
    q = rows[1].ratios
    assert q["time_vs_naive"] == 0.5 and q["mem_vs_naive"] == 0.1
    assert q["time_vs_floor4"] == 2.0 and q["time_vs_floor3"] is None
    assert q["mem_vs_floor"] == pytest.approx(10.0 / ((512 + 32) * 32 * 4 / 2**20))
    path = tmp_path / "b.csv"
    append_csv(path, rows, "t0")
    append_csv(path, rows[:1], "t1")
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(CSV_COLUMNS) and len(lines) == 1 + len(rows) + 1
    assert lines.count(lines[0]) == 1


def test_csv_with_other_columns_is_refused_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Appending to a CSV of another format would misalign columns: refuse up front."""
    path = tmp_path / "old.csv"
    path.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(SystemExit) as exc:
        main(["bench", *TINY, "--csv", str(path)])
    assert exc.value.code == 2
    assert "different columns" in capsys.readouterr().err
    assert path.read_text() == "a,b,c\n1,2,3\n"


@pytest.mark.skipif(
    importlib.util.find_spec("cut_cross_entropy") is None, reason="cut-cross-entropy absent"
)
def test_cce_fp32_on_cuda_is_unavailable_not_failed() -> None:
    """CCE's CUDA kernel has no fp32 backward: the bench lists it with a reason; its bf16 CUDA
    path and its CPU path (any dtype) stay available."""
    from logitless.apps.bench.methods import get_method

    cce = get_method("logprobs", "cce")
    reason = cce.unavailable(_work(device="cuda", dtype="float32"))
    assert reason is not None and "float32" in reason and "bfloat16" in reason
    assert cce.unavailable(_work(device="cuda", dtype="bfloat16")) is None
    assert cce.unavailable(_work(device="cpu", dtype="float32")) is None


def test_library_does_not_import_the_apps() -> None:
    """``import logitless`` loads nothing from ``logitless.apps``, and the demo nothing from the
    bench (both measure memory with ``logitless.apps.memory``). A fresh interpreter, since this
    one has imported them already."""
    code = (
        "import sys, logitless\n"
        "assert not [m for m in sys.modules if m.startswith('logitless.apps')], 'library'\n"
        "import logitless.apps.demo\n"
        "assert not [m for m in sys.modules if m.startswith('logitless.apps.bench')], 'demo'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_trl_peer_is_listed_and_computes_the_same_gradients(monkeypatch) -> None:
    """TRL's chunked head is a logprobs peer: unavailable with the reason without TRL; with it,
    its step (all rows on CPU, masked, as GRPOTrainer calls it) gives naive's gradients."""
    from logitless.apps.bench import methods as bench_methods
    from logitless.apps.bench.workload import make_inputs

    trl_method = bench_methods.get_method("logprobs", "trl")
    assert trl_method.role == "peer"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "trl" else real_find_spec(name, *a),
    )
    assert "logitless[trl]" in trl_method.unavailable(_work())
    monkeypatch.undo()
    if importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed (pip install 'logitless[trl]')")
    work = _work()
    grads = {}
    for name in ("naive", "trl"):
        inputs = make_inputs(work)
        bench_methods.get_method("logprobs", name).build(work, inputs)()
        grads[name] = (inputs.hidden.grad, inputs.weight.grad)
    for a, b in zip(grads["trl"], grads["naive"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
