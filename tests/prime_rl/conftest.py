"""The prime-rl tests run in a venv of their own (.ci/prime_rl.sh): prime-rl needs Python 3.12
and the packages its head and loss modules import. Elsewhere (the main suite's Python 3.11),
nothing here is collected; with them, the shared helpers (tests/_dist.py, tests/_tolerance.py)
are put on the path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

_NEEDS = ("loguru", "beartype", "jaxtyping", "pydantic_config", "transformers", "wandb")
_READY = sys.version_info[:2] == (3, 12) and all(importlib.util.find_spec(m) for m in _NEEDS)
collect_ignore = [] if _READY else ["test_prime_rl.py"]
