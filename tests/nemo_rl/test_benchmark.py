"""benchmarks/nemo_rl_logprobs.py at a tiny shape: its methods run and write their rows (the
full-size figures are measured on a quiet machine: docs/nemo-rl.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core (the 3.12 layer, .ci/nemo_rl.sh)")
pytest.importorskip("ray", reason="NeMo RL's imports (.ci/nemo_rl.sh)")


def test_benchmark_script_runs(tmp_path):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "nemo_rl_logprobs.py"
    spec = importlib.util.spec_from_file_location("nemo_rl_logprobs", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.csv"
    rows = bench.main([
        "--seqs", "2", "--seq", "32", "--hidden", "32", "--vocab", "256", "--nemo-chunk", "8",
        "--repeats", "1", "--methods", "nemo_fused,logitless,logitless_cp2", "--csv", str(out),
    ])  # fmt: skip
    assert [r["method"] for r in rows] == ["nemo_fused", "logitless", "logitless_cp2"]
    assert all(r["peak_mb_per_rank"] >= 0 and r["time_s"] > 0 for r in rows)
    # the same step on the same batch: NeMo RL's fused loss and logitless's agree
    assert abs(rows[0]["loss"] - rows[1]["loss"]) <= 1e-4 * max(1.0, abs(rows[0]["loss"]))
    assert len(out.read_text().splitlines()) == 4  # header + 3 rows
