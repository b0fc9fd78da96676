"""The torchtitan tests run in a venv of their own (.ci/torchtitan.sh): torchtitan 0.3.0 from
PyPI without its dependencies (its full set would move the main suite's huggingface_hub, fsspec
and datasets under transformers and TRL), plus the three packages ``torchtitan.components.loss``
imports (tyro, spmd_types, and torch 2.13 from the shared Python 3.12 layer). Without torchtitan,
nothing here is collected (the main suite); the shared helpers (tests/_tolerance.py,
tests/_dist.py) are put on the path.

torchtitan's RL losses (``DAPOLoss``, ``GRPOLoss``) live in ``torchtitan.experiments.rl``, whose
package ``__init__`` imports vLLM (its generator), which cannot be installed on this CPU machine:
the package's ``__init__`` is not run (a module object with its ``__path__`` stands in for it),
so ``torchtitan.experiments.rl.losses`` imports from its own files, unchanged.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

_USABLE = importlib.util.find_spec("torchtitan") is not None
collect_ignore = [] if _USABLE else ["test_torchtitan.py", "test_torchtitan_distributed.py"]

if _USABLE:
    import _torchtitan  # noqa: F401  (the stand-in for torchtitan.experiments.rl's __init__)
