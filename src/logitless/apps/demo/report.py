"""The demo's CSV: one row per (mode, seed, step), written by :func:`write_csv` and read back by
:func:`read_csv` (for a seeds summary of runs made in several processes)."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path

from .. import output
from .config import DemoConfig, DemoResult, StepMetrics


def read_csv(paths: Sequence[Path | str]) -> list[DemoResult]:
    """The runs of :func:`write_csv` files (per-step metrics, no policy), in file order; each
    (mode, seed) once. For a summary of runs made in several processes."""
    runs: dict[tuple[str, int], list[StepMetrics]] = {}
    kinds = {f.name: f.type for f in fields(StepMetrics)}
    for path in paths:
        with Path(path).open(newline="") as f:
            for rec in csv.DictReader(f):
                key = (rec["mode"], int(rec["seed"]))
                values = {k: (int if kinds[k] in (int, "int") else float)(rec[k]) for k in kinds}
                runs.setdefault(key, []).append(StepMetrics(**values))
    out = []
    for (mode, seed), rows in runs.items():
        config = DemoConfig(naive=mode == "naive", seed=seed, steps=len(rows))
        out.append(DemoResult(config, rows, "", None))
    return out


def write_csv(results: Sequence[DemoResult], path: Path | str) -> None:
    """One row per (mode, seed, step) with every :class:`StepMetrics` field; overwrites
    ``path``."""
    names = ["mode", "seed"] + [f.name for f in fields(StepMetrics)]
    records = (
        {"mode": result.config.mode, "seed": result.config.seed, **asdict(row)}
        for result in results
        for row in result.rows
    )
    output.write_csv(path, names, records)
