"""The scripts of the rollout-mismatch diagnostics on tiny shapes: the benchmark
(benchmarks/rollout_diagnostics.py, each variant in its subprocess) and the docs' run
(examples/rollout_mismatch.py, which draws docs/rollout_mismatch.png)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_runs(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import rollout_diagnostics
    finally:
        sys.path.pop(0)
    out = tmp_path / "bench.csv"
    rows = rollout_diagnostics.main(
        ["--tokens", "48", "--hidden", "16", "--vocab", "300", "--k", "5", "--repeats", "1",
         "--csv", str(out)]
    )  # fmt: skip
    assert [(r["tokens"], r["mode"]) for r in rows] == [(48, "forward"), (48, "train")]
    assert all(r["same_logprobs"] and r["time_ratio"] > 0 for r in rows)
    assert len(out.read_text().splitlines()) == 3  # the header and a row per mode


def test_docs_run_and_plot(tmp_path):
    """The docs page's run: an exact copy of the policy has no mismatch beyond rounding, a
    noisier engine a larger one, every step."""
    spec = importlib.util.spec_from_file_location(
        "rollout_mismatch", ROOT / "examples" / "rollout_mismatch.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--steps", "2", "--noise", "0", "0.05", "0.3", "--vocab", "300", "--length", "4"]
    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--plot", str(tmp_path / "plot.png")]
    results = module.main(argv)
    kl = [max(s["kl_rollout_trainer"] for s in results[n]["steps"]) for n in (0.0, 0.05, 0.3)]
    assert kl[0] < 1e-6 < kl[1] < kl[2]
    assert all(s["top1_agree"] == 1.0 for s in results[0.0]["steps"])
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "plot.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "script", ["benchmarks/rollout_diagnostics.py", "examples/rollout_mismatch.py"]
)
def test_help(script):
    proc = subprocess.run(
        [sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert ("--noise" if "examples" in script else "--tokens") in proc.stdout
