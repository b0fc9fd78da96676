"""The scripts under ``benchmarks/`` run end to end on a tiny shape (their imports and argument
handling rot silently otherwise: nothing else calls them). The figures they print are not
checked here; only that each run finishes and reports both sides of its comparison."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs the [trl] extra")
def test_trl_step_runs(tmp_path):
    out = _run(
        "trl_step.py",
        *("--vocab", "512", "--batch", "2", "--seq", "32", "--prompt", "8", "--repeats", "1"),
        *("--csv", str(tmp_path / "trl_step.csv")),
    )
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert {"trl", "logitless"} <= rows.keys(), out
    assert rows["trl"][-1] == rows["logitless"][-1], "the two trainers' losses differ"
    assert (tmp_path / "trl_step.csv").read_text().count("\n") == 3  # header + 2 rows


def test_hf_vlm_step_runs():
    out = _run(
        "hf_vlm_step.py",
        *("--vocab", "512", "--batch", "2", "--seq", "80", "--prompt", "72", "--repeats", "1"),
    )
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert {"logits", "logitless"} <= rows.keys(), out
    assert rows["logits"][-1] == rows["logitless"][-1], "the two paths' losses differ"


def test_vocab_parallel_runs(tmp_path):
    csv = tmp_path / "vp.csv"
    out = _run(
        "vocab_parallel.py",
        *("--tokens", "64", "--hidden", "16", "--vocab", "300", "--tp", "1", "2"),
        *("--repeats", "1", "--csv", str(csv)),
    )
    assert "tp=1:" in out and "tp=2:" in out, out
    assert csv.exists()


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("trl") is None,
    reason="needs the [deepspeed] and [trl] extras",
)
def test_deepspeed_grpo_step_runs():
    out = _run("deepspeed_grpo_step.py", "--vocab", "300", "--batch", "2", "--completion", "8")
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (["trl"], ["logitless"])]
    losses = {(r[0], r[1]): r[-1] for r in rows}
    assert len(losses) == 4, out  # both trainers, both ranks
    for rank in ("0", "1"):
        assert losses["trl", rank] == losses["logitless", rank], out


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_megatron_head_distributed_optimizer_runs(tmp_path, dtype):
    """megatron_head.py --distributed-optimizer (the GRPO step with the entropy bonus under
    megatron-core's DistributedOptimizer): both ways give the same loss and, after Megatron's
    gradient sync, the same weight-gradient norm; the rows carry the mode. In bf16 Megatron's
    logits are rounded to bf16 and logitless's are not: the two agree to bf16's unit roundoff
    (2^-8), not to fp32's."""
    import re

    out = _run(
        "megatron_head.py",
        *("--seq", "64", "--hidden", "32", "--vocab", "500", "--tp", "2", "--repeats", "1"),
        *("--task", "loss", "--entropy", "--distributed-optimizer", "--dtype", dtype),
        *("--csv", str(tmp_path / "mh.csv")),
    )
    found = re.findall(
        r"optimizer(, bf16)?\): peak .* loss (-?[0-9.]+), weight gradient norm (\S+)", out
    )
    assert len(found) == 2 and all(bool(b) == (dtype == "bfloat16") for b, _, _ in found), out
    (loss, norm), (loss2, norm2) = [(float(a), float(b)) for _, a, b in found]
    if dtype == "float32":
        loss_tol, norm_tol = 1e-5, 1e-4 * norm
    else:
        loss_tol, norm_tol = 2.0**-8 * abs(loss), 2.0**-8 * norm
    assert abs(loss - loss2) <= loss_tol and abs(norm - norm2) <= norm_tol, out
    lines = (tmp_path / "mh.csv").read_text().splitlines()
    assert lines[0].endswith(",distributed_optimizer,peak_mb_per_rank_before_optimizer"), lines
    assert len(lines) == 3 and all(",True," in line for line in lines[1:]), lines
    assert all(f",{dtype},1000+rank," in line for line in lines[1:]), lines


def _gpu_sh(tmp_path: Path, **env: str) -> str:
    """Run ``benchmarks/gpu.sh`` into ``tmp_path`` with ``env``; return its log."""
    import os

    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return (tmp_path / "gpu.log").read_text()


def test_gpu_script_keeps_to_its_budget(tmp_path):
    """A lease is short: with GPU_BUDGET_S, a stage that would start with under 30 s of the
    budget left is skipped and logged, not run (here every stage, on a 1 s budget)."""
    log = _gpu_sh(tmp_path, GPU_BUDGET_S="1")
    script = (ROOT / "benchmarks" / "gpu.sh").read_text()
    stages = [line.split()[1] for line in script.splitlines() if line.startswith("stage ")]
    assert {"cuda-tests", "bench-bf16-16k", "bench-bf16-64k", "cpu-suite"} <= set(stages)
    skipped = [line.split()[1].rstrip(":") for line in log.splitlines() if "skipped" in line]
    assert skipped == stages, log
    assert "exit" not in log, log  # nothing ran


def test_gpu_script_runs_the_named_stages_only(tmp_path):
    """STAGES picks stages; the rest are passed over without a line."""
    log = _gpu_sh(tmp_path, STAGES="none-such")
    assert log == "", log
