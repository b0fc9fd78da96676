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
    """PyTorch's chunked head takes 11x naive's time on a 2-core CPU: a default CPU run leaves
    it out (named, it runs); on CUDA it is a default method."""
    import argparse

    parser = argparse.ArgumentParser()
    cpu = cli._selected_methods(parser, argparse.Namespace(task="logprobs", device="cpu"))
    gpu = cli._selected_methods(parser, argparse.Namespace(task="logprobs", device="cuda"))
    assert "torch_lce" not in cpu and "torch_lce" in gpu and "naive" in cpu
    named = argparse.Namespace(task="logprobs", device="cpu", methods=["naive,torch_lce"])
    assert cli._selected_methods(parser, named) == ["naive", "torch_lce"]
