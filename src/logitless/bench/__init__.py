"""The ``logitless bench`` harness: each method measured in a fresh subprocess.

Layout: :mod:`.workload` (config + seeded inputs), :mod:`.methods` (task -> method registry,
peer adapters), :mod:`.worker` (the subprocess that times one method), :mod:`.harness`
(orchestration, ratios, table, CSV), :mod:`.plot` (``--plot``).
"""

from .harness import CSV_COLUMNS, Row, run_bench
from .methods import TASKS, Method
from .workload import Workload

__all__ = ["CSV_COLUMNS", "TASKS", "Method", "Row", "Workload", "run_bench"]
