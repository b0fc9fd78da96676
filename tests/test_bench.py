"""Smoke tests of ``logitless bench``: the real subprocess path at a tiny shape, CLI errors,
failure capture and ratio arithmetic."""

from __future__ import annotations

import csv
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from logitless.apps.bench.harness import CSV_COLUMNS, Row, add_ratios, append_csv, run_method
from logitless.apps.bench.progress import BenchProgress, format_duration, format_step
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
        # progress: method i of n, repeat j of r, elapsed and time left, on stderr only
        assert f"method {i}/{len(METHODS)} {name} (tokens=32): repeat 1/1 " in proc.stderr
    assert "elapsed 0:" in proc.stderr and " left" in proc.stderr
    head, second, *table = proc.stdout.splitlines()  # what runs, where its progress goes
    assert head.startswith("logitless bench: task=logprobs H=32 V=512 float32 cpu threads=1")
    assert second == (
        f"methods: {', '.join(METHODS)}; progress goes to stderr, the table comes here when "
        "they are done"
    )
    assert table[0].split()[:4] == ["tokens", "method", "median", "s"]
    assert [ln.split()[1] for ln in table[2 : 2 + len(METHODS)]] == METHODS
    assert not [ln for ln in table if "elapsed" in ln or ln.startswith(("[", "  method"))]

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


def test_bench_quiet_keeps_one_line_per_method() -> None:
    """``--quiet``: stderr has the run line and one result line per method, nothing else; stdout
    is the same table as with progress."""
    cmd = [sys.executable, "-m", "logitless", "bench", *TINY, "--no-csv", "--quiet"]
    cmd += ["--methods", "naive", "floor3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # The busy-machine warning, when other processes ran meanwhile, is the table's last line
    # on stdout (test_load_monitor_flags_other_processes_and_steal), never repeated on stderr.
    err = proc.stderr.splitlines()
    assert len(err) == 2 and err[0].startswith("[1/2] tokens=32 naive: ")
    assert err[1].startswith("[2/2] tokens=32 floor3:")
    assert "elapsed" not in proc.stderr
    table = proc.stdout.splitlines()[2:]  # under the run's two lines
    assert table[0].split()[:2] == ["tokens", "method"] and table[1].startswith("------")
    assert [ln.split()[1] for ln in table[2:4]] == ["naive", "floor3"]
    assert table[4].startswith("memfloor = ")


def test_stdout_says_at_once_where_the_progress_goes(tmp_path: Path) -> None:
    """A stdout redirected to a file or a pipe gets the run's first lines at once (flushed),
    saying that the progress goes to stderr, before the run ends; the table follows."""
    cmd = [sys.executable, "-m", "logitless", "bench", *TINY, "--no-csv", "--quiet"]
    cmd += ["--methods", "naive", "floor3"]
    log = tmp_path / "stderr.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as users run it
    with (
        log.open("w") as err,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env) as proc,
    ):
        assert proc.stdout is not None
        first, second = proc.stdout.readline(), proc.stdout.readline()
        progress_then = log.read_text()  # a block-buffered stdout gives nothing before exit
        rest = proc.stdout.read()
        assert proc.wait(timeout=120) == 0
    assert first.startswith("logitless bench: task=logprobs")
    assert second.startswith("methods: naive, floor3; progress goes to stderr")
    assert "[2/2]" not in progress_then and "[2/2]" in log.read_text()
    assert rest.splitlines()[0].split()[:2] == ["tokens", "method"]


@pytest.mark.parametrize("rounds", [3, 1])
def test_rounds_order_the_workers(rounds: int) -> None:
    """--rounds 3: each method's 3 repeats run in 3 rounds, a fresh worker per method and round
    (a warm-up each), in alternating order; --rounds 1: one method after the other. The row
    merges a method's rounds."""
    cmd = [sys.executable, "-m", "logitless", "bench", *TINY[:-4], "--repeats", "3"]
    cmd += ["--threads", "1", "--no-csv", "--methods", "naive", "floor3", "--rounds", str(rounds)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    steps = [
        (ln.split()[2], ln.split(": ")[1].split(" |")[0].rsplit(" ", 2)[0])
        for ln in proc.stderr.splitlines()
        if ln.startswith("  method ") and (": warm-up " in ln or ": repeat " in ln)
    ]
    if rounds == 3:
        want = [("naive", "warm-up"), ("naive", "repeat 1/3")]
        want += [("floor3", "warm-up"), ("floor3", "repeat 1/3")]
        want += [("floor3", "warm-up"), ("floor3", "repeat 2/3")]
        want += [("naive", "warm-up"), ("naive", "repeat 2/3")]
        want += [("naive", "warm-up"), ("naive", "repeat 3/3")]
        want += [("floor3", "warm-up"), ("floor3", "repeat 3/3")]
    else:
        want = [
            (m, s)
            for m in ("naive", "floor3")
            for s in ("warm-up", "repeat 1/3", "repeat 2/3", "repeat 3/3")
        ]
    assert steps == want
    assert f"repeats=3 rounds={rounds} " in proc.stdout.splitlines()[0]
    assert "[1/2] tokens=32 naive: " in proc.stderr and "[2/2] tokens=32 floor3: " in proc.stderr


def test_split_repeats_and_merge_rounds() -> None:
    from logitless.apps.bench.harness import merge_rounds, split_repeats

    assert split_repeats(5, 3) == [2, 2, 1] and split_repeats(2, 3) == [1, 1]
    assert split_repeats(3, 1) == [3]
    parts = [
        Row("a", _work(repeats=2), "ok", time_p50_s=1.5, time_p20_s=1, time_p80_s=2,
            peak_extra_mb=5.0, times=[1.0, 2.0]),
        Row("a", _work(repeats=1), "ok", time_p50_s=9, time_p20_s=9, time_p80_s=9,
            peak_extra_mb=7.0, times=[9.0]),
    ]  # fmt: skip
    row = merge_rounds(parts)
    assert row.time_p50_s == 2.0 and row.peak_extra_mb == 7.0 and row.work.repeats == 3
    assert row.times == [1.0, 2.0, 9.0]
    failed = Row("a", _work(), "failed", reason="boom")
    assert merge_rounds([parts[0], failed]) is failed


def test_load_monitor_flags_other_processes_and_steal() -> None:
    """Busy = other processes' CPU time (the machine's busy time minus this process tree's)
    or steal above their limits; the note goes to the table's last line."""
    from logitless.apps.bench.harness import format_table
    from logitless.apps.bench.load import LoadMonitor

    def monitor(stat1: list[int], own1: float) -> LoadMonitor:
        stats = iter([[0] * 8, stat1])
        owns = iter([0.0, own1])
        clock = iter([0.0, 10.0])
        return LoadMonitor(
            read_stat=lambda: next(stats),
            own_cpu=lambda: next(owns),
            clock=lambda: next(clock),
            cpus=2,
            ticks_per_s=100,
        )

    # 10 s on 2 cpus = 2000 ticks; user 1000 + system 200 ticks = 12 s busy, 11 s of it ours
    quiet = monitor([1000, 0, 200, 800, 0, 0, 0, 0], own1=11.0).report()
    assert quiet.others == pytest.approx(0.05) and quiet.steal == 0.0
    assert not quiet.busy and quiet.note() == ""
    busy = monitor([1600, 0, 200, 200, 0, 0, 0, 0], own1=11.0).report()
    assert busy.others == pytest.approx(0.35) and busy.busy
    assert "other processes used 35% of the CPU time" in busy.note()
    stolen = monitor([1000, 0, 200, 600, 0, 0, 0, 200], own1=12.0).report()
    assert stolen.others == 0.0 and stolen.steal == pytest.approx(0.1) and stolen.busy
    assert format_table([], warning=busy.note()).splitlines()[-1] == f"warning: {busy.note()}"
    off_linux = LoadMonitor(read_stat=lambda: None).report()
    assert off_linux.others is None and not off_linux.busy


def _plan(methods: str, tokens: tuple[int, ...]) -> list[tuple[str, Workload]]:
    return [(m, _work(tokens=n, repeats=2)) for n in tokens for m in methods]


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_progress_lines_and_time_left_by_hand() -> None:
    """The estimate: a method's steps cost what they cost so far (per token when measured at
    another size), an unmeasured method the mean per-token cost, every subprocess the overhead
    (all but the steps) of the finished ones."""
    clock, log = _Clock(), io.StringIO()
    bar = BenchProgress(_plan("ab", (100, 200)), log, live=False, clock=clock)
    assert bar.remaining() is None  # nothing timed yet
    bar.start(0)
    clock.t = 2.0
    bar.event({"event": "ready"})
    for clock.t, event in (
        (3.0, {"event": "warmup", "seconds": 1.0}),
        (4.0, {"event": "repeat", "index": 1, "of": 2, "seconds": 1.0}),
        (5.0, {"event": "repeat", "index": 2, "of": 2, "seconds": 1.0}),
    ):
        bar.event(event)
    clock.t = 6.0
    bar.finish(0, Row("a", _work(tokens=100, repeats=2), "skipped", reason="r"))
    # overhead 6 - 3 = 3 s; a costs 0.01 s/token per step, b unmeasured: the same
    # b@100: 3 + 3 * 1 = 6; a@200: 3 + 3 * 2 = 9; b@200: 9
    assert bar.remaining() == pytest.approx(24.0)
    bar.start(1)
    clock.t = 8.0
    bar.event({"event": "ready"})
    clock.t = 8.5
    bar.event({"event": "warmup", "seconds": 0.5})
    # b@100 now: 3 + 3 * 0.5 - 2.5 spent = 2; a@200: 9; b@200: 3 + 3 * 1.0 = 6
    assert bar.remaining() == pytest.approx(17.0)
    lines = log.getvalue().splitlines()
    assert lines[0] == "  method 1/4 a (tokens=100): starting | elapsed 0:00, estimating time left"
    # no method finished yet: overhead = start to ready (2 s); a@100: 2 + 3 - 3 spent = 2,
    # b@100: 2 + 3 = 5, a@200 and b@200: 2 + 3 * 2 = 8 each
    assert lines[1] == "  method 1/4 a (tokens=100): warm-up 1 s | elapsed 0:03, about 0:23 left"
    assert lines[3].startswith("  method 1/4 a (tokens=100): repeat 2/2 1 s | elapsed 0:05, about")
    assert lines[4] == "[1/4] tokens=100 a: skipped -- r | elapsed 0:06, about 0:24 left"
    assert lines[-1].startswith("  method 2/4 b (tokens=100): warm-up 500 ms | elapsed 0:08, ")


def test_progress_counts_a_method_that_cannot_run_as_overhead_only() -> None:
    clock = _Clock()
    bar = BenchProgress(
        _plan("ab", (100,)), io.StringIO(), runs=lambda m, w: m == "a", live=False, clock=clock
    )
    bar.start(0)
    clock.t = 1.0
    bar.event({"event": "ready"})
    clock.t = 11.0
    bar.event({"event": "warmup", "seconds": 10.0})
    # a: 1 s overhead (start to ready) + 3 steps of 10 s, 11 s spent; b: overhead only
    assert bar.remaining() == pytest.approx(20.0 + 1.0)


def test_progress_counts_a_slow_warmup_once() -> None:
    """A warm-up slower than the repeats (compilation) is a one-off, not a per-token cost."""
    clock = _Clock()
    bar = BenchProgress(_plan("a", (100, 200)), io.StringIO(), live=False, clock=clock)
    bar.start(0)
    for clock.t, event in (
        (1.0, {"event": "ready"}),
        (6.0, {"event": "warmup", "seconds": 5.0}),
        (7.0, {"event": "repeat", "index": 1, "of": 2, "seconds": 1.0}),
        (8.0, {"event": "repeat", "index": 2, "of": 2, "seconds": 1.0}),
    ):
        bar.event(event)
    clock.t = 9.0
    bar.finish(0, Row("a", _work(tokens=100, repeats=2), "skipped", reason="r"))
    # overhead 9 - 7 = 2; a@200: 2 + (5 - 1) once + 3 steps of 1 s * 200/100
    assert bar.remaining() == pytest.approx(2.0 + 4.0 + 6.0)


def test_progress_live_line_is_redrawn_and_cleared() -> None:
    """On a terminal the status is one line redrawn in place, cleared before each result line
    and at the end, so the table printed after it starts on a clean line."""
    clock, log = _Clock(), io.StringIO()
    bar = BenchProgress(_plan("a", (100,)), log, live=True, clock=clock)
    bar.start(0)
    clock.t = 1.5
    bar.tick()
    bar.event({"event": "ready"})
    text = log.getvalue()
    assert "\n" not in text and text.count("\r\x1b[K") == 3
    assert text.endswith("method 1/1 a (tokens=100): warm-up | elapsed 0:02, estimating time left")
    bar.finish(0, Row("a", _work(tokens=100, repeats=2), "failed", reason="boom"))
    bar.close()
    tail = log.getvalue()[len(text) :]
    assert tail == "\r\x1b[K[1/1] tokens=100 a: failed -- boom | elapsed 0:02, done\n"


def test_format_duration_and_step() -> None:
    assert [format_duration(s) for s in (0, 59.4, 75.4, 3600, 3725)] == [
        "0:00",
        "0:59",
        "1:15",
        "1:00:00",
        "1:02:05",
    ]
    assert (format_step(0.0123), format_step(2.5)) == ("12.3 ms", "2.5 s")


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


def test_output_csv_overwrites_or_appends_with_one_header(tmp_path: Path) -> None:
    """``apps.output.write_csv``, the CSV writer of the bench and the demo: a new file (its
    folder created) gets the header; ``append`` adds rows under it, else the file is
    replaced."""
    from logitless.apps.output import write_csv

    path = tmp_path / "new" / "t.csv"
    write_csv(path, ["a", "b"], [{"a": 1, "b": 2}], append=True)
    write_csv(path, ["a", "b"], [{"a": 3, "b": 4}], append=True)
    assert path.read_text().splitlines() == ["a,b", "1,2", "3,4"]
    write_csv(path, ["a", "b"], [{"a": 5, "b": 6}])
    assert path.read_text().splitlines() == ["a,b", "5,6"]


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
    assert "'.[trl]'" in trl_method.unavailable(_work())
    monkeypatch.undo()
    if importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed (pip install -e '.[trl]' in a logitless checkout)")
    work = _work()
    grads = {}
    for name in ("naive", "trl"):
        inputs = make_inputs(work)
        bench_methods.get_method("logprobs", name).build(work, inputs)()
        grads[name] = (inputs.hidden.grad, inputs.weight.grad)
    for a, b in zip(grads["trl"], grads["naive"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_capturable_task_methods_compute_the_default_gradients() -> None:
    """The capturable task's methods (every row; a row capacity of the valid rows) give the
    default mode's gradients on the same inputs."""
    from logitless.apps.bench import methods as bench_methods
    from logitless.apps.bench.workload import make_inputs

    work = _work(task="capturable", valid_frac=0.3)
    grads = {}
    for name in ("logitless", "capturable", "capacity"):
        inputs = make_inputs(work)
        bench_methods.get_method("capturable", name).build(work, inputs)()
        grads[name] = (inputs.hidden.grad, inputs.weight.grad)
    assert "row_capacity=10" in bench_methods.get_method("capturable", "capacity").note(work)
    for name in ("capturable", "capacity"):
        for a, b in zip(grads[name], grads["logitless"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_an_unavailable_method_is_skipped_without_a_worker(monkeypatch) -> None:
    """Liger on a CPU workload is known unavailable in the parent: no subprocess is started
    (a worker's start-up alone took ~10 s on a busy 2-core machine)."""

    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started for an unavailable method")

    monkeypatch.setattr(subprocess, "Popen", no_worker)
    row = run_method("liger", _work(device="cpu"))
    assert row.status == "skipped", row
    assert "GPU" in row.reason or "not installed" in row.reason, row.reason


@pytest.mark.skipif(
    not hasattr(torch.nn.functional, "linear_cross_entropy"),
    reason=f"torch {torch.__version__} has no F.linear_cross_entropy (added in 2.13)",
)
def test_torch_linear_cross_entropy_peer_gives_the_log_prob_gradients() -> None:
    """``torch_lce`` (PyTorch's chunked ``F.linear_cross_entropy``) is a logprobs peer: its step
    gives the gradients of the masked full-logits log-probs under the same upstream."""
    from logitless.apps.bench import methods as bench_methods
    from logitless.apps.bench.workload import IGNORE_INDEX, make_inputs

    method = bench_methods.get_method("logprobs", "torch_lce")
    assert method.role == "peer" and method.unavailable(_work()) is None  # torch 2.13 has it
    work = _work()
    inputs = make_inputs(work)
    method.build(work, inputs)()
    got = (inputs.hidden.grad, inputs.weight.grad)
    h = inputs.hidden.detach().requires_grad_()
    w = inputs.weight.detach().requires_grad_()
    valid = inputs.labels != IGNORE_INDEX
    logp = torch.log_softmax(h @ w.T, dim=-1).gather(-1, inputs.labels.clamp(min=0)[:, None])
    ((logp[:, 0] * valid) * inputs.grad_logprobs).sum().backward()
    for a, b in zip(got, (h.grad, w.grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
