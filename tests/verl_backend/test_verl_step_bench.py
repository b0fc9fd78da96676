"""benchmarks/verl_step.py runs end to end on a tiny shape (nothing else calls it), with two
micro-batches per step (its gradient-accumulation figure too). Its figures are not checked;
only that both sides ran and agree on the loss."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_verl_step_runs(tmp_path):
    csv = tmp_path / "verl_step.csv"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "verl_step.py"), "--tokens", "48", "--seqs",
         "3", "--hidden", "32", "--vocab", "300", "--intermediate", "32", "--repeats", "1",
         "--micro-batches", "2", "--variants", "torch", "logitless", "--csv", str(csv)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {ln.split()[0]: ln.split() for ln in proc.stdout.splitlines() if ln.strip()}
    variants = ("torch", "logitless")  # each variant is a process importing verl (~15 s)
    assert set(variants) <= rows.keys(), proc.stdout
    losses = [float(rows[v][-1]) for v in variants]
    assert all(float(rows[v][-3]) >= 0 for v in variants)  # accum extra MB: measured
    assert max(losses) - min(losses) <= 1e-3 * max(1.0, abs(losses[0])), proc.stdout
    assert csv.read_text().count("\n") == 3  # header + 2 rows
