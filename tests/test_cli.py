"""``logitless --version`` (and ``python -m logitless --version``): the package version, exit 0."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

import logitless
from logitless.apps import cli


def _expected() -> str:
    try:
        return importlib.metadata.version("logitless")
    except importlib.metadata.PackageNotFoundError:
        return logitless.__version__


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"logitless {_expected()}"


def test_version_falls_back_to_the_module_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from a source tree without package metadata: ``logitless.__version__``."""

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert cli.package_version() == logitless.__version__


def test_python_dash_m_version() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "logitless", "--version"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"logitless {_expected()}"


def test_module_version_matches_pyproject() -> None:
    """The version is written twice (pyproject for the metadata, ``__version__`` for a source
    tree without it): they must agree."""
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["project"]["version"]
    assert logitless.__version__ == declared


def test_bench_help_lists_every_task_and_its_methods(capsys: pytest.CaptureFixture[str]) -> None:
    from logitless.apps.bench.methods import TASK_SUMMARY, TASKS

    assert set(TASK_SUMMARY) == set(TASKS)  # a new task needs its line of help
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for task, methods in TASKS.items():
        assert f"{task}: {' '.join(TASK_SUMMARY[task].split())}" in text
        assert f"{task}: {', '.join(methods)}" in text


def test_bench_default_methods_leave_out_torch_lce_on_cpu() -> None:
    """PyTorch's chunked head takes 11x naive's time on a 2-core CPU: a full CPU run leaves it
    out (named, it runs); on CUDA it is one of the full run's peers."""
    import argparse

    parser = argparse.ArgumentParser()
    cpu = cli._selected_methods(parser, argparse.Namespace(task="logprobs", device="cpu", full=1))
    gpu = cli._selected_methods(parser, argparse.Namespace(task="logprobs", device="cuda", full=1))
    assert "torch_lce" not in cpu and "torch_lce" in gpu and "naive" in cpu
    named = argparse.Namespace(task="logprobs", device="cpu", methods=["naive,torch_lce"])
    assert cli._selected_methods(parser, named) == ["naive", "torch_lce"]


def _bench_in_process(monkeypatch: pytest.MonkeyPatch, busy: bool = False) -> dict:
    """``logitless bench`` run here with the measurement replaced: what it would run (methods,
    rounds) and the warning it hands the plot go into the dict returned."""
    from logitless.apps.bench import harness, load, plot

    seen: dict = {}

    def run_bench(methods, workloads, *, log, timeout_s, progress, rounds):
        seen.update(methods=list(methods), rounds=rounds)
        return [harness.Row(m, workloads[0], "ok", "", 1.0, 1.0, 1.0, 1.0) for m in methods]

    class Monitor:
        def report(self) -> load.LoadReport:
            return load.LoadReport(others=0.5 if busy else 0.0, steal=0.0)

    monkeypatch.setattr(harness, "run_bench", run_bench)
    monkeypatch.setattr(load, "LoadMonitor", Monitor)
    monkeypatch.setattr(
        plot, "plot_rows", lambda rows, path, machine, warning: seen.update(warning=warning)
    )
    return seen


def test_bench_default_is_a_first_look_that_names_the_full_table(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``logitless bench`` alone: logitless, naive and the floors (no peers) in one round, the
    first stdout lines say what runs and where the progress goes, the last how to get the
    full table; ``--full``: the installed peers too and, on CPU, 3 rounds."""
    seen = _bench_in_process(monkeypatch)
    assert cli.main(["bench", "--no-csv"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert seen == {
        "methods": ["naive", "logitless", "logitless_torch", "floor3", "floor4"],
        "rounds": 1,
    }
    assert out[0].startswith("logitless bench: task=logprobs H=896 V=151936 float32 cpu")
    assert "repeats=3 rounds=1 tokens=1024" in out[0]
    assert out[1].startswith("methods: naive, logitless, logitless_torch, floor3, floor4; ")
    assert "progress goes to stderr" in out[1] and out[2].startswith("tokens")
    assert out[-1].startswith("a first look: logitless against naive and the bare-matmul floors")
    assert "The full table: logitless bench --full" in out[-1]

    assert cli.main(["bench", "--no-csv", "--full"]) == 0
    assert "a first look" not in capsys.readouterr().out
    assert {"liger", "cce", "trl"} <= set(seen["methods"]) and seen["rounds"] == 3
    assert "torch_lce" not in seen["methods"]  # 11x naive's time on a CPU: named to run
    assert cli.main(["bench", "--no-csv", "--rounds", "2"]) == 0 and seen["rounds"] == 2
    assert "the peers left out, 2 rounds. The full table" in capsys.readouterr().out
    assert cli.main(["bench", "--no-csv", "--methods", "naive", "cce"]) == 0
    assert seen["methods"] == ["naive", "cce"] and "a first look" not in capsys.readouterr().out


def test_bench_puts_the_busy_warning_on_the_plot(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    """The warning that ends the table of a busy run goes on the plot too."""
    pytest.importorskip("matplotlib")
    seen = _bench_in_process(monkeypatch, busy=True)
    assert cli.main(["bench", "--no-csv", "--plot", str(tmp_path / "p.png")]) == 0
    table_warning = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warn")]
    assert table_warning == [f"warning: {seen['warning']}"]
    assert seen["warning"].startswith("machine busy during the run: other processes used 50%")
