"""benchmarks/nemo_rl_logprobs.py at a tiny shape: its methods run and write their rows (the
full-size figures are measured on a quiet machine: docs/nemo-rl.md)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core (the 3.12 layer, .ci/nemo_rl.sh)")
pytest.importorskip("ray", reason="NeMo RL's imports (.ci/nemo_rl.sh)")

ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_script_runs(tmp_path):
    out = tmp_path / "rows.csv"
    args = ["--seqs", "2", "--seq", "32", "--hidden", "32", "--vocab", "256", "--nemo-chunk", "8",
            "--repeats", "1", "--methods", "nemo_fused,logitless", "--csv", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "nemo_rl_logprobs.py"), *args],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "logitless / nemo_fused: memory" in run.stdout
    rows = list(csv.DictReader(out.open()))
    assert [r["method"] for r in rows] == ["nemo_fused", "logitless"]
    assert all(float(r["peak_mb_per_rank"]) >= 0 and float(r["time_s"]) > 0 for r in rows)
    # the same step on the same batch: NeMo RL's fused loss and logitless's agree
    nemo, ours = float(rows[0]["loss"]), float(rows[1]["loss"])
    assert abs(nemo - ours) <= 1e-4 * max(1.0, abs(nemo)), (nemo, ours)
