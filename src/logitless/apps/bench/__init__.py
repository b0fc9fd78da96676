"""The ``logitless bench`` harness: each method measured in a fresh subprocess.

Layout: :mod:`.workload` (config + seeded inputs), :mod:`.methods` (task -> method registry,
peer adapters), :mod:`.worker` (the subprocess that times one method), :mod:`.harness`
(orchestration, ratios, table, CSV), :mod:`.plot` (``--plot``).

Nothing is imported here, so ``python -m logitless.apps.bench.worker`` runs the worker module
fresh as ``__main__``.
"""
